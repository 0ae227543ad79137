"""Bundles from the Hugging Face Hub: ``higgs-pack pull ORG/REPO[@REV]`` and ``load("hf://ORG/REPO@REV")``.

Downloads go through huggingface_hub's ``snapshot_download`` into its cache
(``$HF_HUB_CACHE``): resumable (an interrupted file continues from its
``.incomplete`` part), pinned (the revision is resolved to a commit once, and
every file comes from that commit), authenticated by ``HF_TOKEN`` /
``huggingface-cli login``, and offline with ``HF_HUB_OFFLINE=1`` (then only the
cache is read).  The cache stores each file once in ``blobs/`` and links it from
``snapshots/<commit>/``; :func:`higgs_pack.manifests.manifest.resolve_inside` accepts
exactly those links, and every file's sha256 is checked against the bundle's
manifest before the bundle is used.

A repository holds one bundle at its root, or several (one folder per variant,
``higgs-audio-v3-tiny-cpu-int4/``, ``…-openvino-int4-npu/``).  Only the manifests are
fetched first; the variant is then picked by
:func:`higgs_pack.runtime.machine.choice.choose` for this machine (or named with
``--variant`` / ``variant=``), and only its folder is downloaded.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from higgs_pack.errors import HiggsPackError, HubError, disk_full, disk_full_message
from higgs_pack.manifests.manifest import MANIFEST_NAME, read_manifest

log = logging.getLogger(__name__)

SCHEME = "hf://"
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[^/\s]+))?(?:/(?P<sub>[\w.-]+))?$")


@dataclass(frozen=True)
class HubRef:
    """A parsed ``[hf://]ORG/REPO[@REVISION][/VARIANT]``.

    Attributes:
        repo_id: ``ORG/REPO``.
        revision: branch, tag or commit (None: the default branch).
        variant: folder of one bundle inside the repository (None: choose).
    """

    repo_id: str
    revision: str | None = None
    variant: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        sub = f"/{self.variant}" if self.variant else ""
        return f"{SCHEME}{self.repo_id}{rev}{sub}"


def is_hub_ref(source: str) -> bool:
    """True for ``hf://…`` sources."""
    return str(source).startswith(SCHEME)


def parse_ref(text: str) -> HubRef:
    """Parse ``hf://ORG/REPO[@REV][/VARIANT]`` (the ``hf://`` is optional).

    Raises:
        HubError: not of that form (the message shows the form and an example).
    """
    body = text[len(SCHEME):] if text.startswith(SCHEME) else text
    match = _REF.fullmatch(body)
    if not match:
        raise HubError(
            f"{text!r} is not a hub reference; the form is [hf://]ORG/REPO[@REVISION][/VARIANT], "
            "for example hf://my-org/higgs-audio-v3-bundles@v1.0 or my-org/higgs-audio-v3-bundles"
        )
    return HubRef(match["repo"], match["rev"], match["sub"])


@dataclass(frozen=True)
class Pulled:
    """A bundle fetched from the hub and verified.

    Attributes:
        path: the bundle folder (inside ``snapshots/<commit>/`` of the HF cache).
        repo_id, commit: where it came from (the commit the revision resolved to).
        variant: the folder inside the repository (None: the bundle is the repository root).
        reason: why this variant (named by the caller, the only one, or chosen for this machine).
        device: provider/device the choice placed it on (None: the bundle's own).
        files_checked: files whose sha256 matched the manifest.
    """

    path: Path
    repo_id: str
    commit: str
    variant: str | None
    reason: str
    device: str | None
    files_checked: int


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _download(ref: HubRef, revision: str | None, patterns: list[str] | None, cache_dir: str | Path | None,
              token: str | None) -> Path:
    """``snapshot_download`` with every hub failure turned into a :class:`HubError` that says what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    local = ("pass a local bundle instead: higgs_pack.load('path/to/bundle') or "
             "`higgs-pack synthesize path/to/bundle …` (a folder, an archive or an installed bundle name)")
    at = f"{ref.repo_id}@{revision or 'main'}"
    try:
        return Path(snapshot_download(ref.repo_id, revision=revision, allow_patterns=patterns,
                                      cache_dir=cache_dir, token=token))
    except LocalEntryNotFoundError as exc:
        cache = cache_dir or constants.HF_HUB_CACHE
        if _offline():
            why, fix = "HF_HUB_OFFLINE=1 is set, so only the local cache is read", "unset HF_HUB_OFFLINE to download it"
        else:
            why, fix = "the hub could not be reached (no network?)", "connect to download it"
        raise HubError(f"{at}: not in the Hugging Face cache ({cache}), and {why}; {fix} (higgs-pack pull "
                       f"{ref.repo_id}{'@' + revision if revision else ''}), point HF_HUB_CACHE at a cache that "
                       f"holds it, or {local}") from exc
    except GatedRepoError as exc:
        raise HubError(f"{ref.repo_id}: gated repository; accept its terms on the hub and set HF_TOKEN "
                       f"(or run `hf auth login`), or {local}") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{ref.repo_id}: revision {revision!r} not found (a branch, tag or commit of the "
                       f"repository); check it on the hub, or {local}") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"{ref.repo_id}: repository not found on the hub, or private (set HF_TOKEN for "
                       f"private repositories); check the name, or {local}") from exc
    except HfHubHTTPError as exc:
        raise HubError(f"{at}: the hub refused the download ({str(exc).splitlines()[0]}); {local}") from exc
    except Exception as exc:
        if disk_full(exc) is None:
            raise
        cache = cache_dir or constants.HF_HUB_CACHE
        raise HubError(disk_full_message(cache, f"downloading {at}", "free space there or point HF_HUB_CACHE "
                                         "(cache_dir=) at a disk with room; the partial download is resumed "
                                         "next time")) from exc


def _bundle_folders(snapshot: Path) -> dict[str | None, Path]:
    """Variant folder (None = the root) -> bundle folder, in one snapshot of manifests."""
    if (snapshot / MANIFEST_NAME).is_file():
        return {None: snapshot}
    return {p.name: p for p in sorted(snapshot.iterdir()) if (p / MANIFEST_NAME).is_file()}


def pull(source: str | HubRef, *, variant: str | None = None, cache_dir: str | Path | None = None,
         token: str | None = None, inventory=None, bench: dict[str, float] | None = None) -> Pulled:
    """Download (or find in the cache) one bundle of a hub repository and verify it.

    Args:
        source: ``[hf://]ORG/REPO[@REVISION][/VARIANT]`` or a :class:`HubRef`.
        variant: the bundle folder to take (overrides one in ``source``); None: the only
            one, or the best for this machine (:func:`higgs_pack.runtime.machine.choice.choose`).
        cache_dir: Hugging Face cache (default ``$HF_HUB_CACHE``).
        token: hub token (default ``$HF_TOKEN`` or the saved login).
        inventory: a :class:`~higgs_pack.runtime.machine.choice.Inventory` (default: probe this machine).
        bench: measured frames/s per system for the choice (default: ``dist/bench.json`` if any).

    Returns:
        :class:`Pulled` with the verified bundle folder.

    Raises:
        HubError: offline without the files cached, unknown repository/revision/variant,
            no access, or no bundle in the repository.
        BundleError: a downloaded file does not match the manifest.
    """
    from higgs_pack.runtime.sources.bundle import open_bundle

    ref = parse_ref(source) if isinstance(source, str) else source
    want = variant or ref.variant
    manifests = _download(ref, ref.revision, [MANIFEST_NAME, f"*/{MANIFEST_NAME}"], cache_dir, token)
    commit = manifests.name
    folders = _bundle_folders(manifests)
    if not folders:
        raise HubError(f"{ref.repo_id}@{commit[:12]}: holds no bundle (no manifest.json at its root or in a "
                       "folder below it); upload a folder written by `higgs-pack package --format hub`")
    device = None
    if want is not None:
        if want not in folders:
            names = ", ".join(str(k) for k in folders if k) or "(one bundle at the root)"
            raise HubError(f"{ref.repo_id}@{commit[:12]}: no variant {want!r}; it holds: {names}. "
                           "Choose one with --variant / variant=")
        reason = f"variant {want} as asked"
    elif len(folders) == 1:
        want = next(iter(folders))
        reason = "the repository's only bundle"
    else:
        from higgs_pack.runtime.machine.choice import candidate_of, choose, require
        from higgs_pack.runtime.machine.inventory import bench_speeds
        from higgs_pack.runtime.machine.inventory import inventory as probe

        candidates = [candidate_of(read_manifest(p), p, f"hub {ref.repo_id}") for p in folders.values()]
        inv = inventory if inventory is not None else probe()
        choice = choose(candidates, inv, bench=bench if bench is not None else bench_speeds(cpu=inv.cpu))
        for note in choice.notes:
            log.warning("%s", note)
        placement = require(choice, f"{ref.repo_id}@{commit[:12]}")
        want = next(k for k, p in folders.items() if str(p) == placement.candidate.source)
        reason, device = choice.reason, placement.device
    patterns = None if want is None else [f"{want}/*", f"{want}/**"]
    snapshot = _download(ref, commit, patterns, cache_dir, token)
    path = snapshot / want if want else snapshot
    try:
        bundle = open_bundle(path, check_hashes=True)
    except HiggsPackError as exc:
        raise type(exc)(f"{exc} (downloaded from {ref.repo_id}@{commit[:12]}: delete "
                        f"{snapshot.parent.parent} and pull again)") from exc
    return Pulled(path, ref.repo_id, commit, want, reason, device, len(bundle.manifest["files"]))
