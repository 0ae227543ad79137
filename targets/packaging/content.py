"""What a package holds: the verified bundle's files as members that are hashed again while
they are streamed (a file that changes during packaging aborts it), and the shared
reproducibility settings (epoch, modes, deflate level).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from higgs_pack.errors import HiggsPackError, PackagingError
from higgs_pack.manifests.manifest import CHUNK, MANIFEST_NAME, sha256_file
from higgs_pack.runtime.sources.archive import CHECKSUMS_NAME

log = logging.getLogger(__name__)

#: Member time when ``$SOURCE_DATE_EPOCH`` is not set: 1980-01-01T00:00:00Z,
#: the earliest time a zip file can record (seconds since the Unix epoch).
DEFAULT_EPOCH = 315532800
#: Deflate level of ``.tar.gz`` archives and of deflated zip/wheel members.
#: Measured on 2 cores (tiny bundle's weights, tokenizer.json): level 1 deflates
#: at 20-57 MB/s to 0.52/0.22 of the size, level 6 at 3-16 MB/s to 0.47/0.19.
DEFLATE_LEVEL = 1
#: zip/wheel members of this size (bytes) or more are stored, not deflated:
#: real weights shrink by < 10 % for ~13-25 MB/s of one core (minutes per GB).
STORE_AT_BYTES = 64 << 20
FILE_MODE = 0o644
DIR_MODE = 0o755


@dataclass(frozen=True)
class Member:
    """One file to package, relative to the bundle root.

    Attributes:
        relpath: POSIX path inside the bundle (``llm_decoder/model.onnx``).
        size: size in bytes.
        sha256: hex sha256 the content must have (from the verified manifest).
        source: file to stream from, or None when ``data`` holds the content.
        data: small generated content (``SHA256SUMS``, ``__init__.py``).
    """

    relpath: str
    size: int
    sha256: str
    source: Path | None = None
    data: bytes | None = None

    @classmethod
    def generated(cls, relpath: str, data: bytes) -> Member:
        return cls(relpath, len(data), hashlib.sha256(data).hexdigest(), data=data)

    @contextmanager
    def open(self) -> Iterator[_HashingReader]:
        """A reader that hashes what it returns; checked against ``sha256`` by :meth:`check`."""
        if self.source is None:
            yield _HashingReader(io.BytesIO(self.data or b""))
            return
        with open(self.source, "rb") as handle:
            yield _HashingReader(handle)

    def check(self, reader: _HashingReader) -> None:
        """Raise if the streamed bytes differ from the verified size and sha256.

        Raises:
            PackagingError: the file changed while it was being packaged.
        """
        if reader.size != self.size or reader.sha.hexdigest() != self.sha256:
            raise PackagingError(
                f"{self.source or self.relpath} changed while it was being packaged (read "
                f"{reader.size} bytes, expected {self.size} with the manifest's sha256); "
                "nothing was written. Stop whatever writes to the bundle and package again"
            )


class _HashingReader:
    """File-like ``read(n)`` that feeds sha256 and counts bytes (for tarfile/copyfileobj)."""

    def __init__(self, handle: IO[bytes]):
        self._handle = handle
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._handle.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


@dataclass(frozen=True)
class BundleContent:
    """What goes into every output: the verified bundle, its name and its files.

    Attributes:
        path: the bundle directory (resolved).
        manifest: the validated manifest.
        members: ``manifest.json`` and every listed file, sorted by path.
    """

    path: Path
    manifest: dict[str, Any]
    members: tuple[Member, ...]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def checksums(self) -> Member:
        """``SHA256SUMS``: ``<sha256>  <path>`` per member, sorted, as ``sha256sum`` writes it."""
        lines = "".join(f"{m.sha256}  {m.relpath}\n" for m in self.members)
        return Member.generated(CHECKSUMS_NAME, lines.encode("utf-8"))


def source_date_epoch() -> int:
    """Member time of every output, in seconds since the Unix epoch.

    ``$SOURCE_DATE_EPOCH`` when set (clamped to 1980-01-01, the earliest time a
    zip records), else :data:`DEFAULT_EPOCH`.

    Raises:
        PackagingError: ``$SOURCE_DATE_EPOCH`` is not an integer.
    """
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return DEFAULT_EPOCH
    try:
        value = int(raw)
    except ValueError:
        raise PackagingError(
            f"SOURCE_DATE_EPOCH={raw!r} is not an integer number of seconds; unset it or set it "
            "to e.g. $(git log -1 --format=%ct)"
        ) from None
    return max(value, DEFAULT_EPOCH)


def collect(bundle: str | Path) -> BundleContent:
    """Open and fully verify a bundle; list what will be packaged.

    Raises:
        PackagingError: the bundle is not valid; the message names the first problem.
    """
    from higgs_pack.runtime.sources.bundle import open_bundle

    try:
        opened = open_bundle(bundle, check_hashes=True)
    except HiggsPackError as exc:
        raise PackagingError(f"cannot package {bundle}: {exc}") from exc
    manifest = opened.manifest
    members = [Member(e["path"], e["size"], e["sha256"], source=opened.path / e["path"]) for e in manifest["files"]]
    manifest_path = opened.path / MANIFEST_NAME
    members.append(Member(MANIFEST_NAME, manifest_path.stat().st_size, sha256_file(manifest_path),
                          source=manifest_path))
    members.sort(key=lambda m: m.relpath.split("/"))
    listed = {m.relpath for m in members}
    if CHECKSUMS_NAME in listed:
        raise PackagingError(
            f"cannot package {opened.path}: the manifest lists a file named {CHECKSUMS_NAME}, which "
            "archives reserve for their checksums; rename it and rebuild the bundle"
        )
    extra = sorted(
        p.relative_to(opened.path).as_posix() for p in opened.path.rglob("*")
        if p.is_file() and p.relative_to(opened.path).as_posix() not in listed
    )
    if extra:
        log.warning("not packaged (not listed in manifest.json): %s%s", ", ".join(extra[:10]),
                    f" and {len(extra) - 10} more" if len(extra) > 10 else "")
    return BundleContent(opened.path, manifest, tuple(members))


@contextmanager
def _atomic_output(final: Path) -> Iterator[Path]:
    """Yield a path with ``final``'s name in a temporary folder beside it; rename on success."""
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    try:
        tmp = tmp_dir / final.name
        yield tmp
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _tree(members: tuple[Member, ...]) -> list[str]:
    """Every folder (POSIX, relative, without the root) that holds a member, sorted."""
    dirs = set()
    for member in members:
        parts = member.relpath.split("/")[:-1]
        dirs.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(dirs, key=lambda d: d.split("/"))


def _entries(content: BundleContent) -> list[tuple[str, Member | None]]:
    """Archive entries ``(relpath, member or None for a folder)``, sorted by path components."""
    members = (*content.members, content.checksums())
    entries: list[tuple[str, Member | None]] = [(d, None) for d in _tree(members)]
    entries += [(m.relpath, m) for m in members]
    return sorted(entries, key=lambda e: e[0].split("/"))


def _copy(reader: _HashingReader, out: IO[bytes] | BinaryIO) -> None:
    while chunk := reader.read(CHUNK):
        out.write(chunk)
