"""KV-cache memory of the engine: bytes per position, the budget, and admission by it.

A request on a row of the batched decoder holds ``positions x bytes_per_position`` bytes of
KV cache at its peak, where ``positions`` is its largest text chunk's prompt plus the audio
steps of its frame cap, and ``bytes_per_position`` is ``num_layers x 2 (key, value) x
kv_heads x head_dim x`` the itemsize of the KV dtype the decoder binds (the tiny model at
fp32: 2 x 2 x 2 x 16 x 4 = 512 B; the 4B model at fp32: 36 x 2 x 8 x 128 x 4 = 288 KiB).
:class:`KVBudget` counts the bytes the admitted requests may reach and says whether
another fits; the engine (:mod:`higgs_pack.runtime.engine`) admits a waiting request
only when it does.

The default budget (:func:`default_kv_budget`) is :data:`DEFAULT_KV_FRACTION` of the memory
available when the engine starts: ``MemAvailable`` of ``/proc/meminfo`` on Linux, else
``os.sysconf`` (free pages x page size) where the OS has it, else no limit (logged).

Runtime code: no torch, no psutil.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from higgs_pack.errors import Problem
from higgs_pack.runtime.request import refuse

log = logging.getLogger(__name__)

#: Share of the available memory that the default KV budget takes (the rest is left for the
#: codec, activations and everything else on the machine).
DEFAULT_KV_FRACTION = 0.5

#: Where Linux says how much memory can be had without swapping (``MemAvailable``, kB).
MEMINFO = Path("/proc/meminfo")


def mib(nbytes: float) -> str:
    """``nbytes`` as MiB for messages: ``'288.00 MiB'``; three significant digits below 1 MiB."""
    value = nbytes / 2**20
    return f"{value:.2f} MiB" if value >= 1 else f"{value:.3g} MiB"


def available_memory() -> tuple[int | None, str]:
    """Bytes of memory this process could still take, and where the figure comes from.

    Returns:
        ``(bytes, source)``: ``MemAvailable`` of ``/proc/meminfo`` (Linux 3.14 and later),
        else ``os.sysconf('SC_AVPHYS_PAGES') x os.sysconf('SC_PAGE_SIZE')`` (free pages only:
        less than what reclaiming the page cache would give), else ``(None, why)``.
    """
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, f"MemAvailable of {MEMINFO}"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None, "neither /proc/meminfo nor os.sysconf('SC_AVPHYS_PAGES') exists here"
    if pages > 0 and size > 0:
        return int(pages) * int(size), "os.sysconf free pages"
    return None, "os.sysconf gave no free-page count"


def default_kv_budget(bytes_per_position: int | None, rows: int, max_length: int, *,
                      fraction: float = DEFAULT_KV_FRACTION) -> int | None:
    """The engine's KV budget when none is given: ``fraction`` of :func:`available_memory`,
    at most what ``rows`` rows of ``max_length`` positions hold.

    Args:
        bytes_per_position: the decoder's KV bytes per position of one row (None: unknown,
            then there is no budget).
        rows, max_length: the engine's ``max_batch`` and positions per row.
        fraction: share of the available memory, in (0, 1].

    Returns:
        Bytes, or None for no limit (logged: the decoder does not state its KV bytes, or the
        machine does not say how much memory is available).
    """
    if bytes_per_position is None:
        return None
    available, source = available_memory()
    if available is None:
        log.warning("engine KV budget: no limit (%s); pass max_kv_bytes= to set one", source)
        return None
    full = bytes_per_position * rows * max_length
    budget = min(int(available * fraction), full)
    log.info("engine KV budget %s: what %d rows x %d positions need (%s), at most %.0f%% of the %s available (%s)",
             mib(budget), rows, max_length, mib(full), fraction * 100, mib(available), source)
    return budget


@dataclass
class KVBudget:
    """The KV bytes of the admitted requests, against a budget (the engine's thread updates it;
    other threads may read it for figures).

    Attributes:
        bytes_per_position: KV bytes of one position of one row, or None when the decoder
            cannot say (then admission is by free rows only).
        block_size, block_bytes: a paged decoder's block (both or neither): a request's bytes
            are then those of the blocks its positions need.
        budget_bytes: most bytes the admitted requests may reach together, or None (no limit).
        in_use_bytes: bytes reserved by the requests admitted now (each its peak, from its
            admission until it leaves).
    """

    bytes_per_position: int | None
    budget_bytes: int | None
    in_use_bytes: int = 0
    block_size: int | None = None
    """Positions per KV block of a paged decoder (None: a row's cache grows by position)."""
    block_bytes: int | None = None
    """Bytes of one such block: a request then counts whole blocks (issue 39 item 3)."""

    @property
    def limited(self) -> bool:
        """Whether admission counts bytes (both figures known)."""
        return self.bytes_per_position is not None and self.budget_bytes is not None

    def request_bytes(self, positions: int) -> int | None:
        """KV bytes of a request reaching ``positions`` positions on its row (None: unknown)."""
        if self.bytes_per_position is None:
            return None
        if self.block_size and self.block_bytes:  # the blocks its positions need
            return -(-positions // self.block_size) * self.block_bytes
        return positions * self.bytes_per_position

    def check_request(self, positions: int) -> None:
        """Refuse a request whose own KV is larger than the whole budget (it could never start).

        Raises:
            InputError: naming the request's KV and the budget in MiB, and what to change.
        """
        need = self.request_bytes(positions)
        if not self.limited or need <= self.budget_bytes:
            return
        refuse([Problem("max_frames", None, message=(
            f"this request needs {mib(need)} of KV cache ({positions} positions x {self.bytes_per_position} B), "
            f"more than the engine's whole KV budget of {mib(self.budget_bytes)} (max_kv_bytes={self.budget_bytes}): "
            "shorten the text or lower "
            "{name}; the budget is the engine's (tts.engine(max_kv_bytes=...); the server's --max-kv-mb)"))])

    def fits(self, positions: int) -> bool:
        """Whether a request of ``positions`` fits in what the admitted requests leave."""
        return not self.limited or self.in_use_bytes + self.request_bytes(positions) <= self.budget_bytes

    def reserve(self, positions: int) -> int:
        """Count a request in; returns the bytes reserved (0 when unknown), for :meth:`release`."""
        need = self.request_bytes(positions) or 0
        self.in_use_bytes += need
        return need

    def release(self, nbytes: int) -> None:
        """Count a request's reserved bytes out."""
        self.in_use_bytes -= nbytes
