"""Reproducible ``.tar.gz`` and ``.zip`` archives of a bundle (one top folder plus ``SHA256SUMS``).
"""

from __future__ import annotations

import gzip
import logging
import stat
import tarfile
import time
import zipfile
from pathlib import Path

from higgs_pack.manifests.manifest import CHUNK
from higgs_pack.targets.packaging.content import (
    DEFLATE_LEVEL,
    DIR_MODE,
    FILE_MODE,
    STORE_AT_BYTES,
    BundleContent,
    Member,
    _copy,
    _entries,
)

log = logging.getLogger(__name__)


def write_tar_gz(content: BundleContent, dest: Path, epoch: int) -> None:
    """Write ``<name>/…`` + ``<name>/SHA256SUMS`` as a reproducible PAX ``.tar.gz`` (streamed)."""
    top = content.name

    def info(relpath: str, member: Member | None) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(f"{top}/{relpath}" if relpath else top)
        ti.mtime = epoch
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        if member is None:
            ti.type, ti.mode = tarfile.DIRTYPE, DIR_MODE
        else:
            ti.type, ti.mode, ti.size = tarfile.REGTYPE, FILE_MODE, member.size
        return ti

    with open(dest, "xb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=DEFLATE_LEVEL, mtime=epoch) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT, copybufsize=CHUNK) as tar:
        tar.addfile(info("", None))
        for relpath, member in _entries(content):
            if member is None:
                tar.addfile(info(relpath, None))
                continue
            with member.open() as reader:
                try:
                    tar.addfile(info(relpath, member), reader)  # reads exactly member.size bytes
                except OSError:
                    member.check(reader)  # the file shrank: say so
                    raise
                reader.read(1)  # a file that grew shows up as a size mismatch
                member.check(reader)


def _zipinfo(arcname: str, epoch: int, *, is_dir: bool = False, size: int = 0) -> zipfile.ZipInfo:
    zi = zipfile.ZipInfo(arcname, date_time=time.gmtime(epoch)[:6])
    zi.create_system = 3  # Unix, whatever the packaging OS (reproducible, keeps the modes)
    if is_dir:
        zi.external_attr = (stat.S_IFDIR | DIR_MODE) << 16 | 0x10  # MS-DOS directory bit
        zi.compress_type = zipfile.ZIP_STORED
    else:
        zi.external_attr = (stat.S_IFREG | FILE_MODE) << 16
        zi.compress_type = zipfile.ZIP_STORED if size >= STORE_AT_BYTES else zipfile.ZIP_DEFLATED
        zi._compresslevel = DEFLATE_LEVEL  # read by ZipFile.open(…, "w") (a property from 3.13 on)
        zi.file_size = size  # lets zipfile choose zip64 headers before streaming
    return zi


def _zip_member(zf: zipfile.ZipFile, arcname: str, member: Member, epoch: int) -> str:
    """Stream one member into ``zf``; return its sha256 (hex).  zip64 when >= 2 GiB."""
    zi = _zipinfo(arcname, epoch, size=member.size)
    force_zip64 = member.size * 1.05 >= zipfile.ZIP64_LIMIT
    with member.open() as reader, zipfile.ZipFile.open(zf, zi, "w", force_zip64=force_zip64) as out:
        _copy(reader, out)
        member.check(reader)
    return reader.sha.hexdigest()


def write_zip(content: BundleContent, dest: Path, epoch: int) -> None:
    """Write the same tree as :func:`write_tar_gz` as a reproducible ``.zip`` (streamed, zip64)."""
    top = content.name
    with zipfile.ZipFile(dest, "x", allowZip64=True) as zf:
        zf.writestr(_zipinfo(f"{top}/", epoch, is_dir=True), b"")
        for relpath, member in _entries(content):
            if member is None:
                zf.writestr(_zipinfo(f"{top}/{relpath}/", epoch, is_dir=True), b"")
            else:
                _zip_member(zf, f"{top}/{relpath}", member, epoch)
