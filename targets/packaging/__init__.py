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

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from higgs_pack.errors import HiggsPackError, PackagingError, unknown_choice
from higgs_pack.manifests.manifest import read_manifest
from higgs_pack.targets.packaging.archives import write_tar_gz, write_zip
from higgs_pack.targets.packaging.content import (
    DEFAULT_EPOCH,
    BundleContent,
    Member,
    _atomic_output,
    collect,
    source_date_epoch,
)
from higgs_pack.targets.packaging.wheel import (
    BASE_CLASSIFIERS,
    _target_of,
    dist_name,
    requires_dist,
    wheel_metadata,
    wheel_version,
    wheel_writer_class,
    write_wheel,
)

log = logging.getLogger(__name__)

#: Output kinds written for each ``--format`` value.
FORMATS: dict[str, tuple[str, ...]] = {
    "wheel": ("wheel",),
    "archive": ("tar.gz",),
    "zip": ("zip",),
    "hub": ("hub",),
    "all": ("wheel", "tar.gz"),
}


def output_names(manifest: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, str]:
    """Output file name per kind (``wheel``, ``tar.gz``, ``zip``)."""
    names = {}
    for kind in kinds:
        if kind == "wheel":
            names[kind] = f"{dist_name(manifest['name'])}-{wheel_version(manifest)}-py3-none-any.whl"
        elif kind == "hub":  # a folder: hub/<model-slug>/<bundle-name>/ (see hub_layout.py)
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
    from higgs_pack.runtime.sources.bundle import find_bundle

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
    if "wheel" in targets:  # both refused before anything is hashed or written
        _target_of(manifest, path)
        wheel_writer_class()
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
            from higgs_pack.targets.packaging.hub_layout import CARD_NAME, model_card

            (path.parent / CARD_NAME).write_text(model_card(path.parent), encoding="utf-8")
        log.info("wrote %s (%d bytes) in %.1f s", path, path.stat().st_size, time.perf_counter() - start)
        written.append(path)
    return written


#: Output kind -> writer ``(content, destination, epoch)``.
def _write_hub(content: BundleContent, dest: Path, epoch: int) -> None:
    from higgs_pack.targets.packaging.hub_layout import write_hub_bundle

    write_hub_bundle(content, dest, epoch)


WRITERS: dict[str, Callable[[BundleContent, Path, int], None]] = {
    "wheel": write_wheel,
    "tar.gz": write_tar_gz,
    "zip": write_zip,
    "hub": _write_hub,
}


__all__ = [
    "BASE_CLASSIFIERS", "DEFAULT_EPOCH", "FORMATS", "WRITERS", "BundleContent", "Member", "collect",
    "dist_name", "output_names", "package_bundle", "requires_dist", "source_date_epoch", "wheel_metadata",
    "wheel_version", "write_tar_gz", "write_wheel", "write_zip",
]
