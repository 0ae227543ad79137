"""Read, write and validate ``manifest.json`` and the files it lists.

The manifest is strict: the JSON Schema (``manifest.schema.json``, published
beside this module) rejects unknown keys, and every path must stay inside the
bundle.  File checks stream in 1 MiB chunks, so a multi-GB decoder never sits
in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema

from higgs_pack.errors import BundleError, ManifestError, UnsupportedFormatVersion

MANIFEST_NAME = "manifest.json"
CHUNK = 1 << 20

#: Version of the manifest format this higgs-pack writes and the newest it reads.  2 added the
#: optional sub-part ``audio_tokenizer_stream`` (the stateful streaming codec); a format-1 bundle
#: (without it) still reads, and streams with windows of its one-shot codec.
FORMAT_VERSION = 2



@cache
def schema() -> dict[str, Any]:
    """The manifest JSON Schema (draft 2020-12) as a dict."""
    text = resources.files("higgs_pack.manifests").joinpath("manifest.schema.json").read_text()
    return json.loads(text)


def validate(data: Any, *, source: str = MANIFEST_NAME) -> dict[str, Any]:
    """Check a manifest dict against the format version and the schema.

    Args:
        data: The parsed JSON.
        source: Where it came from, for messages.

    Returns:
        ``data`` itself, now known to be valid.

    Raises:
        UnsupportedFormatVersion: ``format_version`` is newer than :data:`FORMAT_VERSION`.
        ManifestError: anything else the schema rejects (the first error, with its JSON path).
    """
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: expected a JSON object, found {type(data).__name__}")
    version = data.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UnsupportedFormatVersion(
            f"{source}: format_version {version} is newer than this higgs-pack reads "
            f"(up to {FORMAT_VERSION}); upgrade higgs-pack (git pull in its clone, then pip install it again) "
            "or rebuild the bundle with this version"
        )
    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path) or "(top level)"
        if first.validator == "not" and first.schema.get("not", {}).get("anyOf"):
            first.message = (f"{first.instance!r} is not a relative path inside the bundle (no leading '/', "
                             "drive letter, backslash, '.' or '..' components)")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise ManifestError(f"{source}: invalid at {where}: {first.message}{more}")
    return data


def read_manifest(bundle: Path) -> dict[str, Any]:
    """Read and validate ``<bundle>/manifest.json``.

    Raises:
        BundleError: ``bundle`` is not a directory or has no manifest.
        ManifestError / UnsupportedFormatVersion: see :func:`validate`.
    """
    bundle = Path(bundle)
    path = bundle / MANIFEST_NAME
    if bundle.is_file():
        raise BundleError(f"{bundle}: a file, not a bundle directory (an archive is unpacked by load and the "
                          "commands that run a bundle; extract it to inspect it)")
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a bundle directory (no such directory)")
    if not path.is_file():
        raise BundleError(
            f"{bundle}: not a bundle ({MANIFEST_NAME} is missing); build one with "
            "`higgs-pack build --target …`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not readable JSON: {exc}") from exc
    return validate(data, source=str(path))


def write_manifest(bundle: Path, data: dict[str, Any]) -> Path:
    """Validate then write ``<bundle>/manifest.json`` (sorted keys, stable bytes)."""
    validate(data, source="manifest being written")
    path = Path(bundle) / MANIFEST_NAME
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(bundle: Path, relpath: str) -> dict[str, Any]:
    """The manifest's ``files`` entry for one file: path, size in bytes, sha256."""
    path = Path(bundle) / relpath
    return {"path": relpath, "size": path.stat().st_size, "sha256": sha256_file(path)}


def hub_cache_blobs(bundle: Path) -> Path | None:
    """The ``blobs/`` folder of the Hugging Face cache repository holding ``bundle``, if any.

    huggingface_hub stores a download as ``<cache>/models--<org>--<repo>/`` with the
    file contents in ``blobs/`` (named by their etag) and each revision as
    ``snapshots/<commit>/<path>`` symlinks into ``blobs/``.  A bundle is in that layout
    when it is ``snapshots/<commit>/`` (or a folder below it) of a folder that also
    holds ``blobs/``.

    Returns:
        The resolved ``blobs`` folder, or None when ``bundle`` is not in a cache snapshot.
    """
    bundle = Path(bundle).resolve()
    for parent in bundle.parents:
        if parent.name == "snapshots" and parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
            blobs = parent.parent / "blobs"
            if blobs.is_dir() and bundle != parent:
                return blobs
            return None
    return None


def resolve_inside(bundle: Path, relpath: str) -> Path:
    """Resolve a manifest path and prove it stays inside the bundle.

    Rejects absolute paths, ``..`` components, backslashes and symlinks whose
    target leaves the bundle.  One exception: a bundle in the Hugging Face cache
    layout (:func:`hub_cache_blobs`) may hold symlinks into its own repository's
    ``blobs/`` folder (that is how huggingface_hub stores every download); a
    symlink leaving both the bundle and that folder is still refused.

    Returns:
        The resolved path.

    Raises:
        BundleError: naming the path and why it is refused.
    """
    bundle = Path(bundle).resolve()
    pure = PurePosixPath(relpath)
    if (
        not relpath
        or pure.is_absolute()
        or "\\" in relpath
        or ".." in pure.parts
        or (len(relpath) > 1 and relpath[1] == ":")
    ):
        raise BundleError(
            f"path {relpath!r} in the manifest points outside the bundle; bundle paths must be "
            "relative, without '..'. The bundle is damaged or was tampered with: rebuild it"
        )
    target = (bundle / relpath).resolve()
    blobs = hub_cache_blobs(bundle)
    if blobs is not None and target.parent == blobs:
        return target
    if target != bundle and bundle not in target.parents:
        where = (f"outside the bundle {bundle} and outside its Hugging Face cache repository's {blobs}"
                 if blobs is not None else f"outside the bundle {bundle}")
        raise BundleError(
            f"path {relpath!r} resolves to {target}, {where} (a symlink leaving the bundle?); "
            "rebuild the bundle, or download it again"
        )
    return target


@dataclass
class FileReport:
    """The result of checking a bundle's files against its manifest.

    Attributes:
        missing: listed but absent.
        mismatched: present with another size or sha256 (path -> reason).
        extra: present in the bundle but not listed (not an error by itself).
        unlisted: used by a sub-part, the tokenizer or the reference but absent from
            ``files``, so never hashed (an error: the manifest must cover every file it uses).
        checked: number of files whose hash matched.
    """

    missing: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)
    extra: list[str] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing is missing or mismatched."""
        return not self.missing and not self.mismatched and not self.unlisted

    def raise_for_problems(self, bundle: Path) -> None:
        """Raise :class:`BundleError` naming the first problems, if any."""
        if self.ok:
            return
        parts = []
        if self.unlisted:
            parts.append(f"used but not listed (so not hashed): {', '.join(self.unlisted[:5])}")
        if self.missing:
            parts.append(f"missing: {', '.join(self.missing[:5])}")
        if self.mismatched:
            shown = "; ".join(f"{p} ({why})" for p, why in list(self.mismatched.items())[:5])
            parts.append(f"changed since build: {shown}")
        raise BundleError(
            f"{bundle}: files do not match manifest.json ({'; '.join(parts)}). The bundle is "
            "incomplete or was modified: rebuild it or re-download it"
        )


def check_files(bundle: Path, manifest: dict[str, Any], *, hashes: bool = True) -> FileReport:
    """Compare every file listed in the manifest with the bundle on disk.

    Args:
        bundle: Bundle directory.
        manifest: A validated manifest.
        hashes: Also compare sha256 (streamed); sizes are always compared.

    Returns:
        A :class:`FileReport`; never raises for a bad file, only for a path
        outside the bundle (:class:`BundleError`), which is checked first for all.
    """
    bundle = Path(bundle)
    report = FileReport()
    entries = manifest["files"]
    for entry in entries:
        resolve_inside(bundle, entry["path"])
    listed_files = {e["path"] for e in entries}
    for ref in _referenced_paths(manifest):
        resolve_inside(bundle, ref)
        if ref not in listed_files and ref not in report.unlisted:
            report.unlisted.append(ref)
    for entry in entries:
        path = bundle / entry["path"]
        if not path.is_file():
            report.missing.append(entry["path"])
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            report.mismatched[entry["path"]] = f"size {size} bytes, expected {entry['size']}"
            continue
        if hashes and sha256_file(path) != entry["sha256"]:
            report.mismatched[entry["path"]] = "sha256 differs"
            continue
        report.checked += 1
    listed = {e["path"] for e in entries} | {MANIFEST_NAME}
    for root, _dirs, files in os.walk(bundle):
        for name in files:
            rel = (Path(root) / name).relative_to(bundle).as_posix()
            if rel not in listed:
                report.extra.append(rel)
    return report


def _referenced_paths(manifest: dict[str, Any]) -> list[str]:
    refs = [manifest["tokenizer"]["file"], manifest["reference"]["file"]]
    for sub in manifest["subparts"].values():
        refs.append(sub["entry"])
        refs.extend(sub["files"])
    return refs
