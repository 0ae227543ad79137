"""Give back the resident pages of a memory-mapped weights file while a backend copies it.

OpenVINO maps an IR's ``.bin`` read-only and shared. For float and int8 weights its CPU
plugin copies them into its own packed buffers on the first inference and then no longer
reads the mapping, but the pages it read stay in the process's resident set: the full-size
fp16 decoder (6.9 GB ``.bin``) peaked at 14.0 GB RSS, half of it pages nobody reads again
(measured here, OpenVINO 2026.4, AMD EPYC AVX2; the OpenVINO maintainers describe the
packed copy in vllm-project/vllm#6473).  :func:`paging_out` asks the kernel to reclaim those
pages (``madvise(MADV_PAGEOUT)``, Linux 5.4 and later) every few milliseconds while the copy
runs: the same first inference then peaked at 7.1 GB, in the same time, with bit-identical
outputs.

``MADV_PAGEOUT`` is only advice: a page the plugin still reads is faulted back in from the
file, and applied to any other memory it never changes contents (unlike ``MADV_DONTNEED``),
so a mapping that moves or goes away meanwhile is harmless.  Elsewhere than Linux, or on a
kernel without ``MADV_PAGEOUT``, :func:`paging_out` does nothing and says so in its result.

A backend that keeps *reading* the mapping every step (ONNX Runtime running a float
decoder from its memory-mapped external data, prepacking off) needs the other mode,
``keep_page_cache=True``: pages leave this process's resident set with ``MADV_DONTNEED``
but stay in the kernel's page cache, so the next step faults them back in from memory, not
from disk.  ``MADV_PAGEOUT`` evicts clean file pages from the page cache too: re-reading the
full-size cpu int4 decoder (2.3 GB) after it took 1.3 s, after ``MADV_DONTNEED`` 0.014 s
(measured here).  ``MADV_DONTNEED`` would discard a page the process had written to (a private
copy), so it is only applied to mappings whose ``/proc/self/smaps`` shows no private copies
(``Anonymous: 0 kB``); any other mapping of the file gets ``MADV_PAGEOUT``, which never
changes contents.  Use this mode only while the backend keeps the file mapped (inside one of
its runs), never across its teardown.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: ``MADV_PAGEOUT`` from ``<linux/mman.h>`` (Linux 5.4).
MADV_PAGEOUT = 21
#: ``MADV_DONTNEED`` from ``<linux/mman.h>``.
MADV_DONTNEED = 4

#: Seconds between two passes while a copy runs.  A pass over the full-size fp16 decoder's
#: 6.9 GB mapping took about 30 ms (244 passes in its 12.3 s first inference), on a thread
#: of its own; that inference took no longer than without paging out (12.1-14.0 s).
DEFAULT_INTERVAL_S = 0.02


@dataclass
class PageOutResult:
    """What :func:`paging_out` did.

    Attributes:
        supported: ``madvise(MADV_PAGEOUT)`` was accepted at least once.
        passes: Passes over the file's mappings.
        mapped_bytes: Bytes of the file mapped into this process at the last pass.
        reason: Why nothing was done, when ``supported`` is False.
    """

    supported: bool = False
    passes: int = 0
    mapped_bytes: int = 0
    reason: str = ""


def _mapping(line: str) -> tuple[int, int, str] | None:
    """``(start, end, path)`` of a mapping line of ``/proc/self/maps`` (also the header
    lines of ``smaps``); ``None`` for any other line.  ``path`` is ``""`` for anonymous memory."""
    fields = line.split(maxsplit=5)
    if not fields or fields[0].count("-") != 1 or fields[0].endswith(":"):
        return None
    try:
        start, end = (int(x, 16) for x in fields[0].split("-"))
    except ValueError:
        return None
    return start, end, fields[5].rstrip("\n") if len(fields) == 6 else ""


def file_mappings(path: str | os.PathLike) -> list[tuple[int, int]]:
    """``(start address, length in bytes)`` of every mapping of ``path`` in this process.

    Read from ``/proc/self/maps``; ``path`` is compared after resolving symlinks (the
    kernel lists the real file).  Empty when the file is not mapped or there is no
    ``/proc`` (not Linux).
    """
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            mappings = [m for m in map(_mapping, maps) if m is not None and m[2] == real]
    except OSError:
        return []
    return [(start, end - start) for start, end, _ in mappings]


def _smaps(path: str | os.PathLike, field: str) -> list[tuple[int, int, int]]:
    """``(start, length, bytes of field)`` of every mapping of ``path`` in ``/proc/self/smaps``
    (``field`` e.g. ``"Rss:"``, ``"Anonymous:"``); empty when unmapped or without ``/proc``."""
    real = os.path.realpath(path)
    found: list[tuple[int, int, int]] = []
    inside = False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
            for line in smaps:
                mapping = _mapping(line)
                if mapping is not None:
                    inside = mapping[2] == real
                    if inside:
                        found.append((mapping[0], mapping[1] - mapping[0], 0))
                elif inside and line.startswith(field):
                    start, length, _ = found[-1]
                    found[-1] = (start, length, int(line.split()[1]) * 1024)
    except OSError:
        return []
    return found


def resident_bytes(path: str | os.PathLike) -> int:
    """Resident bytes of this process's mappings of ``path`` (``Rss`` in ``/proc/self/smaps``); 0 if none."""
    return sum(rss for _, _, rss in _smaps(path, "Rss:"))


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _page_out(madvise, path: Path, result: PageOutResult, keep_page_cache: bool = False) -> None:
    if keep_page_cache:  # MADV_DONTNEED only where the mapping holds no private copies
        ranges = [(start, length, MADV_PAGEOUT if private else MADV_DONTNEED)
                  for start, length, private in _smaps(path, "Anonymous:")]
    else:
        ranges = [(start, length, MADV_PAGEOUT) for start, length in file_mappings(path)]
    result.passes += 1
    result.mapped_bytes = sum(n for _, n, _ in ranges)
    for start, length, advice in ranges:
        if madvise(start, length, advice) == 0:
            result.supported = True
        elif ctypes.get_errno() == errno.EINVAL:
            result.reason = f"this kernel ({os.uname().release}) refuses madvise(MADV_PAGEOUT) (Linux 5.4 or later has it)"
            raise _Unsupported
        # ENOMEM: the range went away meanwhile; nothing to give back.


class _Unsupported(Exception):
    pass


@contextlib.contextmanager
def paging_out(path: str | os.PathLike, interval_s: float = DEFAULT_INTERVAL_S, *,
               keep_page_cache: bool = False) -> Iterator[PageOutResult]:
    """While the ``with`` body runs, keep this process's mapped pages of ``path`` out of its resident set.

    A background thread asks the kernel every ``interval_s`` seconds to reclaim the pages
    of every mapping of ``path`` (``madvise(MADV_PAGEOUT)``), and once more when the body
    ends.  Use it around the step in which a backend reads a mapped weights file once to
    copy it (OpenVINO's CPU plugin packing float weights on the first inference).  Pages
    read again later are faulted back in from the file; contents never change.
    The kernel reclaims clean pages only: a file still being written back (just written,
    not yet flushed) keeps its dirty pages resident until writeback has cleaned them.

    Args:
        path: The mapped file (an IR's ``.bin``, an ONNX graph's external data).
        interval_s: Seconds between passes.
        keep_page_cache: Drop the pages from this process only (``MADV_DONTNEED`` on
            mappings without private copies), leaving them in the page cache for a backend
            that reads them again next step; see the module docstring.  Only inside a
            backend call that keeps the file mapped.

    Yields:
        A :class:`PageOutResult`, filled in when the body ends (``supported`` False
        with a ``reason`` on other platforms and on kernels before Linux 5.4).
    """
    result = PageOutResult()
    madvise = _madvise()
    if madvise is None:
        result.reason = f"madvise(MADV_PAGEOUT) is Linux-only (this is {sys.platform})"
        yield result
        return
    stop = threading.Event()
    target = Path(path)

    def loop() -> None:
        try:
            while not stop.wait(interval_s):
                _page_out(madvise, target, result, keep_page_cache)
        except _Unsupported:
            pass

    thread = threading.Thread(target=loop, name="higgs-pack-page-out", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        if not result.reason:
            with contextlib.suppress(_Unsupported):
                _page_out(madvise, target, result, keep_page_cache)
