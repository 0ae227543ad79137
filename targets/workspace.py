"""A build's scratch space: where it goes, how much it needs, and cleaning up after killed builds.

The scratch folder (the remapped Qwen3 directory, ModelBuilder's float graph before
int4, OpenVINO's unconverted IR, Olive's caches) is
``<root>/higgs-pack-work-<pid>-<random>`` with ``<root>`` from ``--work-dir``, else
``$HIGGS_PACK_WORK_DIR``, else the system temp folder.  The building process id in the
name lets the next build remove folders whose builder was killed (SIGKILL, the
out-of-memory killer) and so never ran its own cleanup.

Before anything heavy runs, :func:`check_space` compares an estimate of the scratch
and bundle bytes (from the checkpoint's tensor headers and each exporter's rule in
:mod:`higgs_pack.exporters.space`) with the free space of both folders and refuses
with the folder, the bytes needed and the bytes free.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from higgs_pack.errors import BuildError, InputError, Problem

log = logging.getLogger(__name__)

#: Environment variable naming the scratch root (``--work-dir`` wins).
WORK_DIR_ENV = "HIGGS_PACK_WORK_DIR"
#: Prefix of every scratch folder (the builder's pid follows).
WORK_PREFIX = "higgs-pack-work-"
#: Seconds between two measurements of the scratch size.
SIZE_INTERVAL_S = 0.5


def work_root(work_dir: str | Path | None = None) -> Path:
    """The folder scratch folders are created in (``work_dir``, ``$HIGGS_PACK_WORK_DIR``, temp)."""
    chosen = work_dir or os.environ.get(WORK_DIR_ENV) or tempfile.gettempdir()
    return Path(chosen)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_scratch(root: Path, prefix: str = WORK_PREFIX) -> list[Path]:
    """Delete ``root/<prefix><pid>-*`` folders whose process is gone; return them.

    A folder without a pid in its name, or whose process still runs, is left alone.
    """
    removed = []
    if not root.is_dir():
        return removed
    for stale in root.glob(f"{prefix}*"):
        pid = stale.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)) or not stale.is_dir():
            continue
        log.warning("removing %s, scratch of a build that was killed", stale)
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    return removed


def usable_work_root(work_dir: str | Path | None = None) -> Path:
    """:func:`work_root`, checked before a build starts work.

    Raises:
        InputError: the folder does not exist or cannot be written (problem field ``work_dir``).
    """
    root = work_root(work_dir)
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        state = "does not exist" if not root.exists() else "is not a folder" if not root.is_dir() else "cannot be written"
        raise InputError(problems=[Problem(
            "work_dir", str(root), allowed="an existing folder this process can write",
            fix=f"it {state}; create it or pass another --work-dir (or ${WORK_DIR_ENV})")])
    return root


@contextmanager
def work_area(work_dir: str | Path | None = None) -> Iterator[Path]:
    """A fresh scratch folder under :func:`work_root`, removed on exit (also after errors).

    Raises:
        InputError: the root does not exist or is not writable (:func:`usable_work_root`).
        BuildError: the scratch folder cannot be created in it.
    """
    root = usable_work_root(work_dir)
    remove_dead_scratch(root)
    try:
        path = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-", dir=root))
    except OSError as exc:
        raise BuildError(f"cannot create a scratch folder in {root} ({exc}); pass another --work-dir") from exc
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (0 if it is gone)."""
    total = 0
    for base, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                continue
    return total


class FolderPeak:
    """Samples the total size of some folders in a background thread; ``peak`` in bytes."""

    def __init__(self, *folders: Path, interval_s: float = SIZE_INTERVAL_S) -> None:
        self.folders = folders
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="higgs-pack-scratch", daemon=True)

    def sample(self) -> None:
        self.peak = max(self.peak, sum(folder_bytes(f) for f in self.folders))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> FolderPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class SpaceNeed:
    """Estimated bytes a build writes: ``scratch`` (removed at the end) and ``bundle`` (kept)."""

    scratch: int
    bundle: int


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_space(need: SpaceNeed, scratch_root: Path, bundle_parent: Path) -> str:
    """Refuse a build whose estimate does not fit; returns a one-line summary when it does.

    Raises:
        BuildError: a folder has less free space than the estimate asks of it (the
            message names the folder, the GiB needed and the GiB free, and how to move
            the scratch).
    """
    gib = 2**30
    scratch_at, bundle_at = _nearest_existing(scratch_root), _nearest_existing(bundle_parent)
    same = os.stat(scratch_at).st_dev == os.stat(bundle_at).st_dev
    wants = [(scratch_at, need.scratch + (need.bundle if same else 0), "scratch" + (" + bundle" if same else ""))]
    if not same:
        wants.append((bundle_at, need.bundle, "bundle"))
    for folder, needed, what in wants:
        free = shutil.disk_usage(folder).free
        if free < needed:
            raise BuildError(
                f"not enough disk space for this build: {what} needs about {needed / gib:.1f} GiB in "
                f"{folder}, which has {free / gib:.1f} GiB free. Free space there, or put the scratch "
                f"on another disk with --work-dir DIR (or ${WORK_DIR_ENV}) and the bundle with --out."
            )
    return (f"disk: room checked for scratch up to {_size(need.scratch)} in {scratch_at} and a bundle up to "
            f"{_size(need.bundle)} in {bundle_at} (upper bounds, with a margin)")


def _size(count: int) -> str:
    """Bytes as a person reads them: MiB below a GiB (``280 MiB``), else GiB (``1.3 GiB``)."""
    return f"{count / 2**20:.0f} MiB" if count < 2**30 else f"{count / 2**30:.1f} GiB"
