"""A bundle as a per-hardware wheel: name, version, metadata (the target's extra, platform
marker and classifiers), RECORD, and the tiny package that registers the bundle by name.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from higgs_pack.errors import PackagingError, install_extra
from higgs_pack.manifests.manifest import MANIFEST_NAME
from higgs_pack.runtime.backends import placement_of
from higgs_pack.targets.packaging.archives import _zip_member, _zipinfo
from higgs_pack.targets.packaging.content import (
    BundleContent,
    Member,
)

log = logging.getLogger(__name__)

BASE_CLASSIFIERS = (
    "Programming Language :: Python :: 3",
    "Topic :: Multimedia :: Sound/Audio :: Speech",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
)


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


def write_wheel(content: BundleContent, dest: Path, epoch: int) -> None:
    """Write the bundle wheel with :class:`wheel.wheelfile.WheelFile` (streamed, RECORD, zip64).

    Raises:
        PackagingError: the ``wheel`` package is missing or its writer changed.
    """
    target = _target_of(content.manifest, content.path)
    writer = wheel_writer_class()
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
    from higgs_pack.targets.registry import targets

    known = targets()
    if manifest["target"] not in known:
        raise PackagingError(
            f"cannot package {path} as a wheel: its target {manifest['target']!r} is not a target of this "
            f"higgs-pack (known: {', '.join(sorted(known))}), so its runtime extra is unknown; upgrade "
            "higgs-pack or package it as an archive (--format archive / formats='archive')"
        )
    return known[manifest["target"]]


def wheel_writer_class() -> Callable[[Path, int], Any]:
    """The wheel writer (a ``wheel.wheelfile.WheelFile`` that streams and dates members).

    Raises:
        PackagingError: the ``wheel`` package is not installed (names the extra to install).
    """
    try:
        from wheel.wheelfile import WheelFile, urlsafe_b64encode
    except ImportError as exc:
        raise PackagingError(
            f"writing a wheel needs the `wheel` package ({exc}); {install_extra('package')} (the build "
            "environment has it), or write the archive alone with --format archive (formats='archive')"
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
    where = placement_of(m)
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
        f"or in Python: `higgs_pack.load(\"{m['name']}\")`.\n"
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
        f'``higgs_pack.load("{name}")``.\n"""\n\n'
        "from pathlib import Path\n\n"
        f'BUNDLE_NAME = "{name}"\n'
        "BUNDLE_DIR = Path(__file__).resolve().parent\n"
    )
