"""Heavy build steps in child processes that exit, with the peak memory of the process tree.

A 4B build must fit in 12 GiB (DESIGN.md, real size), and memory one step held (the
float model, an exporter's caches) must be gone before the next starts.  So every
heavy step runs as ``python -m higgs_pack.exporters.process SPEC.json`` in a child
process: the spec names a function (``module:function``) and its JSON keyword
arguments; the child writes its JSON return value, or the error it raised, next to the
spec and exits.  While it runs, :class:`TreeMemory` samples the resident set of the
whole process tree (the builder and every descendant, ModelBuilder's own subprocess
included) and keeps the peak.  No pickles cross the process boundary.

A child killed by a signal (the kernel's out-of-memory killer sends SIGKILL) or one
whose failure left its output folder without free space is reported as such.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from higgs_pack import errors
from higgs_pack.errors import BuildError, HiggsPackError

#: Seconds between two samples of the process tree's resident memory.
SAMPLE_INTERVAL_S = 0.1
#: A failed step whose folders have less free space than this is reported as out of disk.
LOW_DISK_BYTES = 1 << 30
#: Lines of a child's unexpected traceback quoted in the error.
TRACEBACK_LINES = 12


def tree_rss(pid: int | None = None) -> int:
    """Resident set size in bytes of process ``pid`` (default: this one) plus all its descendants."""
    return tree_memory(pid)[0]


def tree_memory(pid: int | None = None) -> tuple[int, int]:
    """``(rss, anonymous)`` bytes of process ``pid`` (default: this one) plus all its descendants.

    ``anonymous`` leaves out file-backed resident pages (``shared`` in psutil: memory-mapped
    weights such as an OpenVINO IR's ``.bin`` or ONNX external data, and shared libraries),
    which the kernel can drop and re-read under memory pressure; what is left must fit in
    memory.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    rss = anon = 0
    for proc in procs:
        try:
            info = proc.memory_info()
        except psutil.Error:
            continue
        rss += info.rss
        anon += max(0, info.rss - getattr(info, "shared", 0))
    return rss, anon


class TreeMemory:
    """Samples :func:`tree_rss` of this process in a background thread; ``peak`` in bytes.

    Use as a context manager around the work to measure.  ``mark()`` starts a new
    phase and returns the previous phase's peak, so one monitor times several phases.
    """

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self.peak_anon = 0
        self.last_phase_anon = 0
        self._phase_peak = 0
        self._phase_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="higgs-pack-memory", daemon=True)

    def _sample(self) -> None:
        rss, anon = tree_memory()
        self.peak = max(self.peak, rss)
        self._phase_peak = max(self._phase_peak, rss)
        self.peak_anon = max(self.peak_anon, anon)
        self._phase_anon = max(self._phase_anon, anon)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def mark(self) -> int:
        """Peak RSS bytes since the previous mark (or the start); starts a new phase.
        The phase's anonymous peak is left in ``last_phase_anon``."""
        self._sample()
        peak, self._phase_peak = self._phase_peak, 0
        self.last_phase_anon, self._phase_anon = self._phase_anon, 0
        return peak

    def __enter__(self) -> TreeMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@dataclass
class StepRecord:
    """What one build step cost.

    Attributes:
        name: the step (``export llm_decoder``, ``golden``, ``verify``…).
        seconds: wall time.
        peak_rss_mb: peak resident memory of the whole process tree during the step, MiB.
        detail: the step's own breakdown (for example seconds per sub-part).
        peak_anon_mb: peak of its anonymous (not file-backed) resident memory, MiB.
    """

    name: str
    seconds: float
    peak_rss_mb: float
    detail: dict[str, Any] = field(default_factory=dict)
    peak_anon_mb: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": round(self.seconds, 2),
                "peak_rss_mb": round(self.peak_rss_mb, 1),
                **({"peak_anon_mb": round(self.peak_anon_mb, 1)} if self.peak_anon_mb is not None else {}),
                **({"detail": self.detail} if self.detail else {})}


def disk_note(folders: Iterable[str | Path]) -> str:
    """`` (out of disk space: F has N MiB free)`` for the first folder nearly full, else ``""``."""
    for folder in folders:
        path = Path(folder)
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            free = shutil.disk_usage(path).free
        except OSError:
            continue
        if free < LOW_DISK_BYTES:
            return (f" (out of disk space: {path} has {free / 2**20:.0f} MiB free; free space there "
                    "or move the scratch with --work-dir / HIGGS_PACK_WORK_DIR)")
    return ""


def describe_exit(returncode: int, *folders: str | Path) -> str:
    """Words for a child's exit status: a signal (SIGKILL: out of memory) or a status, plus disk."""
    if returncode < 0:
        sig = -returncode
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        text = f"was killed by signal {sig} ({name})"
        if sig == signal.SIGKILL:
            text += (" - most likely the kernel's out-of-memory killer: the machine ran out of memory "
                     "(check `dmesg`; close other programs or build on a machine with more memory)")
    else:
        text = f"failed with exit status {returncode}"
    return text + disk_note(folders)


def _set_parent_death_signal() -> None:
    """Linux: die with the parent, so a killed build leaves no orphan exporter running."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def run_step(
    entry: str,
    kwargs: dict[str, Any],
    *,
    name: str,
    folders: Iterable[str | Path] = (),
    memory: TreeMemory | None = None,
    work_dir: str | Path | None = None,
) -> tuple[Any, StepRecord]:
    """Run ``entry(**kwargs)`` in a child Python process and return (its value, its record).

    Args:
        entry: ``"package.module:function"``; the function takes JSON-able keyword
            arguments and returns a JSON-able value.
        kwargs: its keyword arguments (paths as strings).
        name: step name for the record and errors.
        folders: folders the step writes to, checked for free space when it fails.
        memory: a running :class:`TreeMemory` whose phase peak is the step's; without
            one, a monitor runs for this step alone.
        work_dir: where the spec and result files go (default: the system temp folder).

    Returns:
        ``(value, StepRecord)``.

    Raises:
        HiggsPackError: the child raised one (same class, same message).
        BuildError: the child failed otherwise, was killed (out of memory) or ran out of disk.
    """
    folders = list(folders)
    own = memory is None
    monitor = TreeMemory() if own else memory
    spec_dir = Path(tempfile.mkdtemp(prefix="higgs-pack-step-", dir=work_dir))
    spec = spec_dir / "spec.json"
    result = spec_dir / "result.json"
    spec.write_text(json.dumps({"entry": entry, "kwargs": kwargs, "result": str(result)}))
    start = time.perf_counter()
    try:
        if own:
            monitor.__enter__()
        else:
            monitor.mark()
        child = subprocess.run(
            [sys.executable, "-m", "higgs_pack.exporters.process", str(spec)],
            check=False,
        )
        peak = monitor.mark()
        seconds = time.perf_counter() - start
        if child.returncode != 0 and not result.is_file():
            raise BuildError(f"{name} {describe_exit(child.returncode, *folders)}")
        outcome = json.loads(result.read_text())
    finally:
        if own:
            monitor.__exit__(None, None, None)
        shutil.rmtree(spec_dir, ignore_errors=True)
    if "error" in outcome:
        error = outcome["error"]
        cls = getattr(errors, error.get("type", ""), None)  # only our own errors carry a type
        message = error["message"]
        if isinstance(cls, type) and issubclass(cls, HiggsPackError):
            raise cls(message)  # our own error, with its own words
        raise BuildError(f"{name} failed: {message}{disk_note(folders)}")
    value = outcome.get("value")
    detail = value.pop("_detail", {}) if isinstance(value, dict) else {}
    return value, StepRecord(name, seconds, peak / 2**20, detail, monitor.last_phase_anon / 2**20)


@dataclass
class ToolRun:
    """How one run of a tool's command line went (:func:`run_tool`).

    Attributes:
        returncode: its exit status (negative: killed by that signal); None when it timed out.
        seconds: wall time.
        peak_rss_mb: peak resident memory of the tool and its descendants, MiB (sampled
            every :data:`SAMPLE_INTERVAL_S`).
        peak_anon_mb: peak of their anonymous (not file-backed) resident memory, MiB: what
            must fit in memory (memory-mapped inputs are file-backed).
    """

    returncode: int | None
    seconds: float
    peak_rss_mb: float
    peak_anon_mb: float = 0.0


def run_tool(command: list[str], log_path: Path, *, env: dict[str, str] | None = None,
             timeout_s: float | None = None) -> ToolRun:
    """Run a tool's command line as a child process, its output to ``log_path``, and sample the
    resident memory of its process tree while it runs.

    Args:
        command: the command (``[sys.executable, "-m", "tool", ...]``).
        log_path: file that gets ``$ command`` and then the tool's stdout and stderr.
        env: its environment (default: this process's).
        timeout_s: kill it (and wait for it) after this many seconds.

    Returns:
        A :class:`ToolRun`; ``returncode`` None when it was killed for the timeout.
    """
    peak = peak_anon = 0
    start = time.perf_counter()
    with Path(log_path).open("w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                child.wait(timeout=SAMPLE_INTERVAL_S)
                break
            except subprocess.TimeoutExpired:
                rss, anon = tree_memory(child.pid)
                peak, peak_anon = max(peak, rss), max(peak_anon, anon)
                if timeout_s is not None and time.perf_counter() - start > timeout_s:
                    child.kill()
                    child.wait()
                    return ToolRun(None, time.perf_counter() - start, peak / 2**20, peak_anon / 2**20)
    return ToolRun(child.returncode, time.perf_counter() - start, peak / 2**20, peak_anon / 2**20)


def _child(spec_path: str) -> int:
    """Child side of :func:`run_step`."""
    import importlib
    import logging

    logging.basicConfig(level=os.environ.get("HIGGS_PACK_LOG_LEVEL", "WARNING"))
    _set_parent_death_signal()
    spec = json.loads(Path(spec_path).read_text())
    result = Path(spec["result"])
    try:
        module, function = spec["entry"].split(":")
        value = getattr(importlib.import_module(module), function)(**spec["kwargs"])
        outcome: dict[str, Any] = {"value": value}
    except HiggsPackError as exc:
        outcome = {"error": {"type": type(exc).__name__, "message": str(exc)}}
    except MemoryError:
        outcome = {"error": {"message": "out of memory (MemoryError); build on a machine with more memory"}}
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            message = f"out of disk space ({exc})"
        else:
            message = f"{type(exc).__name__}: {exc}"
        outcome = {"error": {"message": message}}
    except BaseException as exc:  # anything else: the message and the tail of the traceback
        tail = "".join(traceback.format_exception(exc)[-TRACEBACK_LINES:])
        outcome = {"error": {"message": f"{type(exc).__name__}: {exc}\n{tail}"}}
    result.write_text(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1]))
