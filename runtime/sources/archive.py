"""Open a bundle archive safely: check every member, extract to a temporary folder, check sums.

Accepted: ``.tar.gz`` / ``.tgz`` / ``.tar`` / ``.zip`` archives written by
``higgs-pack package`` (one top-level folder holding the bundle and a
``SHA256SUMS`` file), and bundle wheels (``.whl``: one package folder holding the
bundle, checked against the wheel's ``RECORD``).

Every member is validated *before* anything is extracted: absolute paths, ``..``
or ``.`` components, backslashes, drive letters, symbolic and hard links,
devices, FIFOs, encrypted zip members, duplicate names (also case-insensitive),
a file shadowing a folder and more than one top-level folder are refused.
Extraction streams each member (1 MiB chunks) into a fresh
``tempfile.TemporaryDirectory`` (never the working directory), creating only
plain files and folders, then checks the sums of what was written.

Runtime code: imports only the standard library and ``higgs_pack.manifests``.
"""

from __future__ import annotations

import base64
import csv
import gzip
import hashlib
import io
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from higgs_pack.errors import PackagingError
from higgs_pack.manifests.manifest import CHUNK

CHECKSUMS_NAME = "SHA256SUMS"
#: Archive suffix -> kind.
SUFFIXES: dict[str, str] = {".tar.gz": "tar", ".tgz": "tar", ".tar": "tar", ".zip": "zip", ".whl": "wheel"}
#: Errors that mean the archive bytes are bad (truncated, not this format, corrupt).
_CORRUPT = (tarfile.TarError, gzip.BadGzipFile, zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError,
            NotImplementedError, UnicodeDecodeError)
_SUMS_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


@dataclass(frozen=True)
class Entry:
    """One archive member as the checks see it.

    Attributes:
        name: member path without a trailing ``/``.
        kind: ``file``, ``dir``, ``symlink``, ``hardlink``, ``device``, ``fifo``,
            ``encrypted`` or ``other``.
        size: uncompressed size in bytes (0 for folders).
        handle: the ``TarInfo`` / ``ZipInfo`` used to read it.
    """

    name: str
    kind: str
    size: int
    handle: object


def archive_kind(path: Path) -> str:
    """``tar``, ``zip`` or ``wheel`` from the file name.

    Raises:
        PackagingError: the suffix is none of :data:`SUFFIXES`.
    """
    name = path.name.lower()
    for suffix, kind in SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    raise PackagingError(
        f"{path}: not a bundle archive (expected a bundle directory, an installed bundle name, "
        f"or a file ending in {', '.join(SUFFIXES)})"
    )


def _corrupt(path: Path, detail: object) -> PackagingError:
    return PackagingError(
        f"{path}: is truncated or not a bundle archive ({detail}); download it again or "
        "re-create it with `higgs-pack package`"
    )


def _refuse(path: Path, name: str, reason: str) -> PackagingError:
    return PackagingError(
        f"{path}: refusing to extract: member {name!r} {reason}. A bundle archive holds one folder "
        "of plain files and folders (as written by `higgs-pack package`); nothing was extracted"
    )


@contextmanager
def extracted_archive(path: str | Path) -> Iterator[Path]:
    """Extract a bundle archive or wheel into a temporary folder and yield the bundle folder.

    Args:
        path: ``.tar.gz``, ``.tgz``, ``.tar``, ``.zip`` or ``.whl`` file.

    Yields:
        The extracted bundle directory (inside a ``tempfile.TemporaryDirectory``,
        removed when the ``with`` block ends).

    Raises:
        PackagingError: unknown suffix; the archive is truncated or corrupt ("… is
            truncated or not a bundle archive …"); a member is unsafe (absolute,
            ``..``, link, device, FIFO, duplicate, second top-level folder); not
            enough free space; ``SHA256SUMS`` (or a wheel's ``RECORD``) is missing
            or disagrees with the extracted files.
    """
    path = Path(path)
    kind = archive_kind(path)
    if not path.is_file():
        raise PackagingError(f"{path}: no such archive file")
    tmp: tempfile.TemporaryDirectory[str] | None = None
    try:
        try:
            with _open(path, kind) as (entries, reader):
                top, wanted, dist_info = _validate(path, entries, wheel=kind == "wheel")
                # Only now, with every member checked, does anything touch the disk.
                tmp = tempfile.TemporaryDirectory(prefix="higgs-pack-archive-")
                root = Path(tmp.name)
                _check_space(path, wanted, root)
                hashes = _extract(path, wanted, reader, root)
                sums = _wheel_record(reader, entries, top, dist_info) if kind == "wheel" else None
        except _CORRUPT as exc:
            raise _corrupt(path, exc) from exc
        bundle = root / top
        if sums is None:
            sums = _read_sums(path, bundle, hashes)
        _compare_sums(path, top, hashes, sums, source="RECORD" if kind == "wheel" else CHECKSUMS_NAME)
        yield bundle
    finally:
        if tmp is not None:
            tmp.cleanup()


@contextmanager
def _open(path: Path, kind: str) -> Iterator[tuple[list[Entry], object]]:
    if kind == "tar":
        with tarfile.open(path, "r:*") as tar:
            yield [_tar_entry(m) for m in tar.getmembers()], tar
    else:
        with zipfile.ZipFile(path) as zf:
            yield [_zip_entry(z) for z in zf.infolist()], zf


def _tar_entry(info: tarfile.TarInfo) -> Entry:
    if info.isreg():
        kind = "file"
    elif info.isdir():
        kind = "dir"
    elif info.issym():
        kind = f"symlink (to {info.linkname!r})"
    elif info.islnk():
        kind = f"hardlink (to {info.linkname!r})"
    elif info.ischr() or info.isblk():
        kind = "device"
    elif info.isfifo():
        kind = "fifo"
    else:
        kind = "other"
    return Entry(info.name.rstrip("/"), kind, info.size if info.isreg() else 0, info)


def _zip_entry(info: zipfile.ZipInfo) -> Entry:
    mode = info.external_attr >> 16
    fmt = stat.S_IFMT(mode) if info.create_system == 3 else 0
    if info.flag_bits & 0x1:
        kind = "encrypted"
    elif info.is_dir():
        kind = "dir" if fmt in (0, stat.S_IFDIR) else "other"
    elif fmt in (0, stat.S_IFREG):
        kind = "file"
    elif fmt == stat.S_IFLNK:
        kind = "symlink"
    elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
        kind = "device"
    elif fmt == stat.S_IFIFO:
        kind = "fifo"
    else:
        kind = "other"
    return Entry(info.filename.rstrip("/"), kind, info.file_size if kind == "file" else 0, info)


_KIND_REASONS = {
    "symlink": "is a symbolic link",
    "hardlink": "is a hard link",
    "device": "is a device file",
    "fifo": "is a FIFO (named pipe)",
    "encrypted": "is encrypted",
    "other": "is not a plain file or folder",
}


def _name_problem(name: str) -> str | None:
    if not name:
        return "has an empty name"
    if "\x00" in name:
        return "has a NUL character in its name"
    if "\\" in name:
        return "has a backslash in its path"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "has an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component (path traversal)"
    if "." in parts or "" in parts:
        return "has an empty or '.' path component"
    return None


def _validate(path: Path, entries: list[Entry], *, wheel: bool) -> tuple[str, list[Entry], str | None]:
    """Check every member; return the top-level folder, the members to extract, and a wheel's dist-info.

    Raises:
        PackagingError: the first unsafe member, or not exactly one top-level folder.
    """
    if not entries:
        raise _corrupt(path, "it has no members")
    seen: dict[str, str] = {}
    for entry in entries:
        problem = _name_problem(entry.name)
        if problem is None and entry.kind.split(" ")[0] in _KIND_REASONS:
            base = entry.kind.split(" ")[0]
            problem = _KIND_REASONS[base] + entry.kind[len(base):]
        if problem is None:
            folded = entry.name.casefold()
            if folded in seen:
                same = seen[folded] == entry.name
                problem = "appears twice" if same else f"clashes with {seen[folded]!r} (names differ only in case)"
            seen[folded] = entry.name
        if problem:
            raise _refuse(path, entry.name, problem)
    dist_info = None
    if wheel:
        infos = {e.name.split("/")[0] for e in entries if e.name.split("/")[0].endswith(".dist-info")}
        if len(infos) != 1:
            raise _corrupt(path, f"a wheel has exactly one .dist-info folder, found {len(infos)}")
        dist_info = infos.pop()
    wanted = [e for e in entries if e.name.split("/")[0] != dist_info]
    tops = sorted({e.name.split("/")[0] for e in wanted})
    if not tops:
        raise _corrupt(path, "it holds no bundle folder")
    if len(tops) != 1:
        shown = ", ".join(repr(t) for t in tops[:5])
        raise _refuse(path, tops[1], f"is a second top-level entry (top level: {shown})")
    top = tops[0]
    files = {e.name for e in wanted if e.kind == "file"}
    if top in files:
        raise _refuse(path, top, "is a file at the top level")
    for entry in wanted:
        parents = PurePosixPath(entry.name).parents
        clash = next((str(p) for p in parents if str(p) in files), None)
        if clash:
            raise _refuse(path, entry.name, f"is inside {clash!r}, which is a file")
    return top, wanted, dist_info


def _check_space(path: Path, entries: list[Entry], root: Path) -> None:
    need = sum(e.size for e in entries)
    free = shutil.disk_usage(root).free
    if need > free:
        raise PackagingError(
            f"{path}: extracting needs {need} bytes but {root} has {free} bytes free; "
            "point TMPDIR at a larger disk"
        )


def _extract(path: Path, entries: list[Entry], reader: object, root: Path) -> dict[str, str]:
    """Create the folders and stream the files; return relpath (inside the top folder) -> sha256."""
    hashes: dict[str, str] = {}
    for entry in entries:
        dest = root.joinpath(*entry.name.split("/"))
        if entry.kind == "dir":
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        written = 0
        with _member_stream(reader, entry) as src, open(dest, "xb") as out:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                written += len(chunk)
                out.write(chunk)
        if written != entry.size:
            raise _corrupt(path, f"member {entry.name!r} has {written} bytes, its header says {entry.size}")
        hashes[entry.name.split("/", 1)[1] if "/" in entry.name else ""] = digest.hexdigest()
    return hashes


@contextmanager
def _member_stream(reader: object, entry: Entry) -> Iterator[IO[bytes]]:
    if isinstance(reader, tarfile.TarFile):
        stream = reader.extractfile(entry.handle)  # type: ignore[arg-type]
        if stream is None:  # pragma: no cover - only regular files reach here
            raise tarfile.ReadError(f"cannot read member {entry.name!r}")
        with stream:
            yield stream
    else:
        with reader.open(entry.handle) as stream:  # type: ignore[attr-defined]
            yield stream


def _read_sums(path: Path, bundle: Path, hashes: dict[str, str]) -> dict[str, str]:
    """Parse ``<bundle>/SHA256SUMS`` (``<hex>  <path>`` lines).

    Raises:
        PackagingError: missing or malformed.
    """
    if CHECKSUMS_NAME not in hashes:
        raise _corrupt(path, f"{CHECKSUMS_NAME} is missing from its top folder")
    sums: dict[str, str] = {}
    text = (bundle / CHECKSUMS_NAME).read_bytes().decode("utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        match = _SUMS_LINE.match(line)
        if not match or _name_problem(match.group(2)):
            raise _corrupt(path, f"{CHECKSUMS_NAME} line {number} is not '<sha256>  <relative path>': {line[:80]!r}")
        sums[match.group(2)] = match.group(1)
    return sums


def _wheel_record(reader: object, entries: list[Entry], top: str, dist_info: str | None) -> dict[str, str]:
    """A wheel's ``RECORD`` sha256 for the bundle package's files, relative to the package."""
    record = f"{dist_info}/RECORD"
    if record not in {e.name for e in entries}:
        raise zipfile.BadZipFile(f"the wheel has no {record}")
    with reader.open(record) as raw:  # type: ignore[attr-defined]
        rows = list(csv.reader(io.TextIOWrapper(raw, encoding="utf-8", newline="")))
    sums: dict[str, str] = {}
    for row in rows:
        if len(row) != 3 or not row[0].startswith(f"{top}/"):
            continue
        algorithm, _, value = row[1].partition("=")
        if algorithm != "sha256":
            raise zipfile.BadZipFile(f"RECORD entry {row[0]!r} has no sha256")
        digest = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).hex()
        sums[row[0][len(top) + 1:]] = digest
    return sums


def _compare_sums(path: Path, top: str, hashes: dict[str, str], sums: dict[str, str], *, source: str) -> None:
    """Every extracted file must be listed with the same sha256, and every listed file present.

    Raises:
        PackagingError: naming the first file missing, unlisted or with another sha256.
    """
    files = {k: v for k, v in hashes.items() if k not in ("", CHECKSUMS_NAME)}
    missing = sorted(set(sums) - set(files))
    if missing:
        raise _corrupt(path, f"{len(missing)} file(s) listed in {source} are not in it, e.g. {missing[0]!r}")
    unlisted = sorted(set(files) - set(sums))
    if unlisted:
        raise PackagingError(
            f"{path}: {top}/{unlisted[0]} is not listed in {source}; the archive was modified after "
            "packaging: re-create it with `higgs-pack package`"
        )
    changed = sorted(name for name, digest in files.items() if sums[name] != digest)
    if changed:
        raise PackagingError(
            f"{path}: sha256 of {top}/{changed[0]} differs from {source} ({len(changed)} file(s) differ); "
            "the archive is corrupt or was modified: download it again or re-create it with "
            "`higgs-pack package`"
        )
