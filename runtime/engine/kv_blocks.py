"""A pool of fixed-size KV-cache blocks and the block table of each request (paged attention).

Paged attention (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023; the scheme OpenVINO's ``PagedAttentionExtension`` runs) keeps
the KV cache as blocks of ``block_size`` positions in one pool; a request's *block table* lists
the blocks holding its positions in order (position ``p`` is at offset ``p % block_size`` of
block ``table[p // block_size]``).  A request holds the blocks its positions need, not a slot
of the longest length, and a block may be named by several tables (a voice prefix shared by
every request of that voice): each block counts its references and goes back to the free list
when the last one lets go.

:class:`BlockPool` is bookkeeping only (numpy-free ints); the decoder that owns the cache
tensors moves the data (:mod:`higgs_pack.runtime.backends.openvino.paged`).
"""

from __future__ import annotations

from higgs_pack.errors import InputError, Problem


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions: ``ceil(positions / block_size)``."""
    return -(-int(positions) // int(block_size))


class BlockPool:
    """``capacity`` blocks of ``block_size`` positions, each with a reference count.

    Args:
        block_size: positions per block (>= 1; the device's, read from its cache layout).
        capacity: blocks in the pool now (>= 0); :meth:`grow` adds more.

    Attributes:
        block_size, capacity: as given (capacity grows).
        peak_in_use: most blocks referenced at once.

    Raises:
        InputError: a block size < 1 or a negative capacity.
    """

    def __init__(self, block_size: int, capacity: int = 0):
        if block_size < 1 or capacity < 0:
            raise InputError.of(Problem.said(f"block_size must be >= 1 and capacity >= 0, got {block_size} and {capacity}"))
        self.block_size = int(block_size)
        self.capacity = 0
        self._refs: list[int] = []
        self._free: list[int] = []
        self.peak_in_use = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Make the pool ``capacity`` blocks (never fewer than it has); the new ones are free."""
        if capacity <= self.capacity:
            return
        new = range(self.capacity, int(capacity))
        self._refs.extend(0 for _ in new)
        self._free.extend(reversed(new))  # popped from the end: lowest first
        self._free.sort(reverse=True)
        self.capacity = int(capacity)

    @property
    def free(self) -> int:
        """Blocks no table names."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Blocks some table names (each counted once however many name it)."""
        return self.capacity - len(self._free)

    def refs(self, block: int) -> int:
        """How many tables name ``block``."""
        return self._refs[block]

    def take(self, n: int) -> list[int]:
        """``n`` free blocks, each referenced once, lowest first.

        Raises:
            MemoryError: fewer than ``n`` are free (nothing taken); :meth:`grow` first.
        """
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks asked, {len(self._free)} of {self.capacity} free")
        out = [self._free.pop() for _ in range(n)]
        for block in out:
            self._refs[block] = 1
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (all in use).

        Raises:
            ValueError: a block is free (nothing changed).
        """
        if any(self._refs[b] < 1 for b in blocks):
            raise ValueError(f"blocks {[b for b in blocks if self._refs[b] < 1]} are free; only used blocks are shared")
        for block in blocks:
            self._refs[block] += 1

    def drop(self, blocks: list[int]) -> list[int]:
        """One reference less to each of ``blocks``; returns those that became free.

        Raises:
            ValueError: a block is already free (nothing changed).
        """
        if any(self._refs[b] < 1 for b in blocks):
            raise ValueError(f"blocks {[b for b in blocks if self._refs[b] < 1]} are free already")
        freed = []
        for block in blocks:
            self._refs[block] -= 1
            if not self._refs[block]:
                freed.append(block)
                self._free.append(block)
        if freed:
            self._free.sort(reverse=True)
        return freed
