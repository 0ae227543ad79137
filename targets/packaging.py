"""Package a bundle as a per-hardware wheel and/or a reproducible archive.

Three formats, one bundle tree inside each:

* ``archive``: ``<out_dir>/<bundle-name>.tar.gz``, the bundle under a top-level
  folder ``<bundle-name>/`` with a ``SHA256SUMS`` file (``sha256sum -c`` format)
  at the top of that folder.
* ``zip``: the same tree as ``<out_dir>/<bundle-name>.zip``.
* ``wheel``: ``<out_dir>/<dist>-<version>-py3-none-any.whl``, the bundle tree in
  the package ``<dist>/`` (plus a tiny ``__init__.py``), registered in the
  ``higgs_pack.bundles`` entry-point group, so ``higgs-pack list``,
  ``higgs-pack synthesize <bundle-name>`` and ``load("<bundle-name>")`` find it
  once installed.  It requires ``higgs-pack[<target extra>]`` (with the target's
  platform marker, e.g. Windows only for ``dml``).

Only ``manifest.json`` and the files the manifest lists are packaged (extra files
such as an OpenVINO ``.ov_cache`` are left out and logged).  The bundle is checked
(schema, every path, every sha256) before anything is written, and every file is
hashed again while it is streamed into the output: a file that changes during
packaging aborts it.  Files are streamed in 1 MiB chunks, never read whole, so
multi-GB decoders package in constant memory; zip and wheel members of 2 GiB
and more are written with zip64 headers.

Outputs are reproducible: members sorted, times set to ``$SOURCE_DATE_EPOCH``
(default 1980-01-01, :data:`DEFAULT_EPOCH`), owner 0/0 with empty names, modes
0o644 (files) / 0o755 (folders), gzip header without file name and with the same
fixed time.  Each output is written to a temporary folder beside it and renamed
into place, so a failed run never leaves a half-written file under the final name.

Wheel version: the higgs-pack version that *built* the bundle
(``manifest.build.higgs_pack_version``, public part only), with
``Requires-Dist: higgs-pack[<extra>]>=<that version>``.  No ``+local`` label:
PyPI and most indexes refuse local versions, and a label (checkpoint or manifest
digest) has no meaningful order for upgrades.  The bundle's identity (checkpoint
sha256, manifest sha256) is in the wheel's description and the manifest itself.
Consequence: replacing an installed bundle wheel by a rebuild under the same
higgs-pack version needs ``pip install --force-reinstall``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any, BinaryIO

from higgs_pack.manifests.errors import HiggsPackError, PackagingError, unknown_choice
from higgs_pack.manifests.manifest import CHUNK, MANIFEST_NAME, read_manifest, sha256_file

log = logging.getLogger(__name__)

#: Output kinds written for each ``--format`` value.
FORMATS: dict[str, tuple[str, ...]] = {
    "wheel": ("wheel",),
    "archive": ("tar.gz",),
    "zip": ("zip",),
    "hub": ("hub",),
    "all": ("wheel", "tar.gz"),
}

#: Name of the checksum file at the top of an archive's bundle folder.
CHECKSUMS_NAME = "SHA256SUMS"
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

BASE_CLASSIFIERS = (
    "Programming Language :: Python :: 3",
    "Topic :: Multimedia :: Sound/Audio :: Speech",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
)


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


def dist_name(bundle_name: str) -> str:
    """Wheel file / import name of a bundle: ``higgs-audio-v3-tiny-cpu-int4`` -> ``higgs_audio_v3_tiny_cpu_int4``."""
    name = re.sub(r"[-_.]+", "_", bundle_name).lower()
    return name if name.isidentifier() else f"bundle_{name}"


def wheel_version(manifest: dict[str, Any]) -> str:
    """Wheel version: public part of the higgs-pack version that built the bundle.

    Falls back to the installed higgs-pack's version when the manifest's is not a
    valid version (e.g. ``"not installed"``).
    """
    from packaging.version import InvalidVersion, Version

    recorded = manifest["build"]["higgs_pack_version"]
    try:
        return Version(recorded).public
    except InvalidVersion:
        try:
            own = version("higgs-pack")
        except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
            own = "0"
        log.warning("manifest records higgs-pack version %r; using %s for the wheel", recorded, own)
        return Version(own).public


def output_names(manifest: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, str]:
    """Output file name per kind (``wheel``, ``tar.gz``, ``zip``)."""
    names = {}
    for kind in kinds:
        if kind == "wheel":
            names[kind] = f"{dist_name(manifest['name'])}-{wheel_version(manifest)}-py3-none-any.whl"
        elif kind == "hub":  # a folder: hub/<model-slug>/<bundle-name>/ (see targets/hub_layout.py)
            names[kind] = f"hub/{manifest['model']['slug']}/{manifest['name']}"
        else:
            names[kind] = f"{manifest['name']}.{kind}"
    return names


def package_bundle(
    bundle: str | Path,
    *,
    formats: str = "all",
    out_dir: str | Path = "dist",
    force: bool = False,
) -> list[Path]:
    """Package a bundle as a wheel and/or an archive.

    Args:
        bundle: bundle directory (or the name of an installed bundle).
        formats: ``"wheel"``, ``"archive"`` (``.tar.gz``), ``"zip"``, ``"hub"`` (a folder
            ``hub/<model-slug>/<bundle-name>/`` with a model card, ready for
            ``huggingface-cli upload``), or ``"all"`` (wheel + ``.tar.gz``).
        out_dir: folder for the outputs (created if missing); must not be inside
            the bundle.
        force: overwrite existing output files.

    Returns:
        The written files, wheel first.

    Raises:
        PackagingError: unknown format; the bundle is not valid (the message names
            the first problem: not a bundle, schema, a file missing or changed since
            build); ``out_dir`` is inside the bundle; an output exists and ``force``
            is False; a file changed while it was being packaged.
    """
    if formats not in FORMATS:
        raise PackagingError(unknown_choice("package format", str(formats), FORMATS, "--format / formats="))
    # Cheap checks first (manifest only), so a mistake is reported before hashing gigabytes.
    from higgs_pack.runtime.bundle import find_bundle

    try:
        path = find_bundle(bundle).resolve()
        manifest = read_manifest(path)
    except HiggsPackError as exc:
        raise PackagingError(f"cannot package {bundle}: {exc}") from exc
    out = Path(out_dir).resolve()
    if out == path or path in out.parents:
        raise PackagingError(
            f"output folder {out} is inside the bundle {path}; packaging into the bundle "
            "would change it. Choose a folder outside it with --out-dir (out_dir=)"
        )
    if out.exists() and not out.is_dir():
        raise PackagingError(f"output folder {out} exists and is not a folder; choose another --out-dir (out_dir=)")
    names = output_names(manifest, FORMATS[formats])
    targets = {kind: out / name for kind, name in names.items()}
    if not force:
        for target in targets.values():
            if target.exists():
                raise PackagingError(
                    f"{target} already exists; pass --force (force=True) to overwrite it, or choose "
                    "another --out-dir (out_dir=)"
                )
    if "wheel" in targets:
        _target_of(manifest, path)
    content = collect(path)
    out.mkdir(parents=True, exist_ok=True)
    epoch = source_date_epoch()
    written = []
    for kind, path in targets.items():
        start = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "hub" and path.exists():  # --force: replace the folder
            shutil.rmtree(path)
        with _atomic_output(path) as tmp:
            WRITERS[kind](content, tmp, epoch)
        if kind == "hub":
            from higgs_pack.targets.hub_layout import CARD_NAME, model_card

            (path.parent / CARD_NAME).write_text(model_card(path.parent), encoding="utf-8")
        log.info("wrote %s (%d bytes) in %.1f s", path, path.stat().st_size, time.perf_counter() - start)
        written.append(path)
    return written


def collect(bundle: str | Path) -> BundleContent:
    """Open and fully verify a bundle; list what will be packaged.

    Raises:
        PackagingError: the bundle is not valid; the message names the first problem.
    """
    from higgs_pack.runtime.bundle import open_bundle

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


def write_wheel(content: BundleContent, dest: Path, epoch: int) -> None:
    """Write the bundle wheel with :class:`wheel.wheelfile.WheelFile` (streamed, RECORD, zip64).

    Raises:
        PackagingError: the ``wheel`` package is missing or its writer changed.
    """
    target = _target_of(content.manifest, content.path)
    writer = _wheel_writer_class()
    package = dist_name(content.name)
    if any(m.relpath == "__init__.py" for m in content.members):
        raise PackagingError(f"cannot package {content.path} as a wheel: the bundle has its own __init__.py")
    init = Member.generated("__init__.py", _init_py(content).encode("utf-8"))
    with writer(dest, epoch) as wf:
        for member in sorted((*content.members, init), key=lambda m: m.relpath.split("/")):
            wf.write_member(f"{package}/{member.relpath}", member)
        info = wf.dist_info_path
        wf.writestr(f"{info}/METADATA", wheel_metadata(content, target))
        wf.writestr(f"{info}/WHEEL", _wheel_file())
        wf.writestr(f"{info}/entry_points.txt", f"[higgs_pack.bundles]\n{content.name} = {package}\n")


def _target_of(manifest: dict[str, Any], path: Path) -> Any:
    """The registered :class:`~higgs_pack.targets.base.Target` of a bundle (its extra and marker).

    Raises:
        PackagingError: the bundle's target is not registered in this higgs-pack.
    """
    from higgs_pack.targets.base import targets

    known = targets()
    if manifest["target"] not in known:
        raise PackagingError(
            f"cannot package {path} as a wheel: its target {manifest['target']!r} is not a target of this "
            f"higgs-pack (known: {', '.join(sorted(known))}), so its runtime extra is unknown; upgrade "
            "higgs-pack or package it as an archive (--format archive / formats='archive')"
        )
    return known[manifest["target"]]


def _wheel_writer_class() -> Callable[[Path, int], Any]:
    try:
        from wheel.wheelfile import WheelFile, urlsafe_b64encode
    except ImportError as exc:
        raise PackagingError(
            f"writing a wheel needs the `wheel` package ({exc}); pip install 'wheel>=0.40' "
            "(it comes with pip install 'higgs-pack[build]' environments), or use --format archive"
        ) from exc

    class BundleWheelFile(WheelFile):
        """``WheelFile`` that streams large members and dates every entry ``epoch``.

        ``WheelFile.write`` reads a whole file into memory and ``writestr`` dates
        entries with the current time unless ``$SOURCE_DATE_EPOCH`` is set; this
        subclass streams members through ``ZipFile.open(…, "w")`` and records their
        sha256 and size where ``WheelFile.close`` writes ``RECORD`` from.
        """

        def __init__(self, file: Path, epoch: int):
            super().__init__(file, "w")
            self._epoch = epoch
            if not (isinstance(getattr(self, "_file_hashes", None), dict)
                    and isinstance(getattr(self, "_file_sizes", None), dict)):
                self.close()
                raise PackagingError(
                    "this version of the `wheel` package keeps RECORD differently than higgs-pack "
                    "expects; pip install 'wheel>=0.40,<1', or use --format archive"
                )

        def writestr(self, zinfo_or_arcname, data, compress_type=None):
            if isinstance(zinfo_or_arcname, str):
                size = len(data.encode("utf-8") if isinstance(data, str) else data)
                zinfo_or_arcname = _zipinfo(zinfo_or_arcname, self._epoch, size=size)
            super().writestr(zinfo_or_arcname, data, compress_type)

        def write_member(self, arcname: str, member: Member) -> None:
            digest = _zip_member(self, arcname, member, self._epoch)
            self._file_hashes[arcname] = ("sha256", urlsafe_b64encode(bytes.fromhex(digest)).decode("ascii"))
            self._file_sizes[arcname] = member.size

    return BundleWheelFile


def _header(value: str) -> str:
    """One-line metadata header value (newlines would end the header)."""
    return " ".join(str(value).split())


def _requirement_with_marker(requirement: str, marker: str | None) -> str:
    """``requirement`` restricted to ``marker`` as well (markers combined with ``and``)."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    if marker and (req.marker is None or str(req.marker) != str(Marker(marker))):
        req.marker = Marker(f"({req.marker}) and ({marker})" if req.marker else marker)
    return str(req)


def requires_dist(manifest: dict[str, Any], target: Any, higgs_pack_version: str) -> list[str]:
    """``Requires-Dist`` lines: ``higgs-pack[<extra>]>=<version>`` and the manifest's runtime needs.

    Every line carries the target's platform marker (``sys_platform == 'win32'``
    for ``dml``), so installing a Windows-only bundle elsewhere pulls nothing it
    cannot use.
    """
    marker = target.platform_marker
    lines = [_requirement_with_marker(f"higgs-pack[{target.extra}]>={higgs_pack_version}", marker)]
    lines += [_requirement_with_marker(r, marker) for r in manifest["runtime_requirements"]]
    return list(dict.fromkeys(lines))


def wheel_metadata(content: BundleContent, target: Any) -> str:
    """Core metadata (``METADATA``, version 2.1) of the bundle wheel."""
    m = content.manifest
    where = m["execution_provider"] if m["backend"] == "onnxruntime" else m["device"]
    ver = wheel_version(m)
    size = sum(member.size for member in content.members)
    manifest_sha = next(x.sha256 for x in content.members if x.relpath == MANIFEST_NAME)
    keywords = ["higgs-audio", "higgs-audio-v3", "tts", "text-to-speech", "higgs-pack-bundle",
                m["backend"], m["target"], m["precision"]]
    headers = [
        ("Metadata-Version", "2.1"),
        ("Name", m["name"]),
        ("Version", ver),
        ("Summary", f"Higgs-Audio-v3 TTS bundle: {m['model']['id']} for {m['target']} "
                    f"({m['backend']} on {where}), {m['precision']}"),
        ("Keywords", ",".join(dict.fromkeys(keywords))),
        ("License", m["model"]["license"]),
        *(("Classifier", c) for c in (*BASE_CLASSIFIERS, *target.classifiers)),
        ("Requires-Python", ">=3.10"),
        *(("Requires-Dist", r) for r in requires_dist(m, target, ver)),
        ("Description-Content-Type", "text/markdown"),
    ]
    body = (
        f"# {m['name']}\n\n"
        f"Higgs-Audio-v3 text-to-speech bundle built by higgs-pack {m['build']['higgs_pack_version']}.\n\n"
        f"- model: `{m['model']['id']}` (checkpoint sha256 `{m['model']['checkpoint_sha256']}`)\n"
        f"- target: `{m['target']}`, backend `{m['backend']}` on `{where}`, precision `{m['precision']}`\n"
        f"- licence of the model: {m['model']['license']}\n"
        f"- runtime needs: {', '.join(m['runtime_requirements']) or 'nothing beyond higgs-pack'}\n"
        f"- {len(content.members)} files, {size} bytes; manifest.json sha256 `{manifest_sha}`\n\n"
        f"Use it by name once installed:\n\n"
        f"    higgs-pack list\n"
        f"    higgs-pack synthesize {m['name']} --text \"Hello.\" -o out.wav\n\n"
        f"or in Python: `higgs_pack.runtime.bundle.load(\"{m['name']}\")`.\n"
    )
    return "".join(f"{k}: {_header(v)}\n" for k, v in headers) + "\n" + body


def _wheel_file() -> str:
    try:
        own = version("higgs-pack")
    except PackageNotFoundError:  # pragma: no cover
        own = "unknown"
    return f"Wheel-Version: 1.0\nGenerator: higgs-pack ({own})\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _init_py(content: BundleContent) -> str:
    name = content.name
    return (
        f'"""Higgs-Audio-v3 TTS bundle {name} (this folder is the bundle).\n\n'
        f"Use it by name: ``higgs-pack synthesize {name} --text ... -o out.wav`` or\n"
        f'``higgs_pack.runtime.bundle.load("{name}")``.\n"""\n\n'
        "from pathlib import Path\n\n"
        f'BUNDLE_NAME = "{name}"\n'
        "BUNDLE_DIR = Path(__file__).resolve().parent\n"
    )


#: Output kind -> writer ``(content, destination, epoch)``.
def _write_hub(content: BundleContent, dest: Path, epoch: int) -> None:
    from higgs_pack.targets.hub_layout import write_hub_bundle

    write_hub_bundle(content, dest, epoch)


WRITERS: dict[str, Callable[[BundleContent, Path, int], None]] = {
    "wheel": write_wheel,
    "tar.gz": write_tar_gz,
    "zip": write_zip,
    "hub": _write_hub,
}
