"""A base image made on this machine, for machines that reach no container registry.

``python -m higgs_pack.targets.packaging.local_base [--cache DIR]`` writes a minimal Debian 12
root file system with Python (``mmdebstrap --variant=minbase --include=python3,python3-venv,
ca-certificates bookworm``: Debian's packages only) as a tarball, keeps it in ``DIR/images/``
under a name made of the sha256 of the command that made it (so it is made once per machine and
remade when the command changes), imports it with ``podman import`` and prints the image's name
(``localhost/higgs-pack-base:<digest>``), to be given as ``--base-image``.

Needs ``mmdebstrap`` and ``podman`` (``apt-get install mmdebstrap podman``) and root (mmdebstrap
in its default mode).  Measured on a 2-core AMD EPYC (Zen 4, AVX-512) VM: the rootfs takes 30 to 90
s (the mirror's speed), 215 MiB; the import a few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from higgs_pack.errors import PackagingError

#: The command that writes the root file system; its last argument, the tarball, is appended.
MMDEBSTRAP = ("mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm")
#: The repository of the imported image; its tag is the command's digest.
REPOSITORY = "localhost/higgs-pack-base"


def digest() -> str:
    """The first 16 hex digits of the sha256 of :data:`MMDEBSTRAP` (what the tarball is made of)."""
    return hashlib.sha256("\0".join(MMDEBSTRAP).encode("utf-8")).hexdigest()[:16]


def rootfs(cache: Path) -> Path:
    """The tarball in ``cache/images/``, made with :data:`MMDEBSTRAP` when missing.

    Raises:
        PackagingError: mmdebstrap is not installed or failed.
    """
    tarball = cache / "images" / f"debian-bookworm-minbase-{digest()}.tar"
    if tarball.is_file():
        return tarball
    if shutil.which(MMDEBSTRAP[0]) is None:
        raise PackagingError("making a local base image needs mmdebstrap: apt-get install mmdebstrap")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    partial = tarball.with_suffix(".partial.tar")
    done = subprocess.run([*MMDEBSTRAP, str(partial)], stdout=sys.stderr, check=False)
    if done.returncode:
        partial.unlink(missing_ok=True)
        raise PackagingError(f"{' '.join(MMDEBSTRAP)} failed (exit {done.returncode}); its output above says why")
    os.replace(partial, tarball)
    return tarball


def base_image(cache: Path, engine: str = "podman") -> str:
    """The local base image's name, imported from :func:`rootfs` unless the engine has it.

    Raises:
        PackagingError: as :func:`rootfs`, or the import failed.
    """
    name = f"{REPOSITORY}:{digest()}"
    if subprocess.run([engine, "image", "exists", name], capture_output=True, check=False).returncode == 0:
        return name
    tarball = rootfs(cache)
    done = subprocess.run([engine, "import", str(tarball), name], capture_output=True, text=True, check=False)
    if done.returncode:
        raise PackagingError(f"{engine} import {tarball} failed: {done.stderr.strip()}")
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m higgs_pack.targets.packaging.local_base",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("HIGGS_PACK_CACHE", ".nox/cache")),
                        help="where the tarball is kept (default: $HIGGS_PACK_CACHE, else .nox/cache)")
    args = parser.parse_args(argv)
    try:
        print(base_image(args.cache))
    except PackagingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
