"""The KV block pool of the paged engine (runtime/engine/kv_blocks.py): references, sharing, growth."""

from __future__ import annotations

import pytest

from higgs_pack.errors import InputError
from higgs_pack.runtime.engine.kv_blocks import BlockPool, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 32) for n in (0, 1, 31, 32, 33, 64, 65)] == [0, 1, 1, 1, 2, 2, 3]


def test_take_share_drop():
    pool = BlockPool(16, 4)
    a = pool.take(2)
    assert a == [0, 1] and pool.free == 2 and pool.in_use == 2
    pool.share(a)  # a second table names them
    assert [pool.refs(b) for b in a] == [2, 2]
    assert pool.drop(a) == [] and pool.in_use == 2  # the other table still names them
    assert pool.drop(a) == [0, 1] and pool.free == 4
    assert pool.take(1) == [0], "freed blocks are reused, lowest first"
    assert pool.peak_in_use == 2


def test_growth_adds_free_blocks_and_keeps_references():
    pool = BlockPool(8)
    assert pool.capacity == 0 and pool.free == 0
    with pytest.raises(MemoryError, match="1 KV blocks asked, 0 of 0 free"):
        pool.take(1)
    pool.grow(3)
    taken = pool.take(3)
    pool.grow(2)  # never shrinks
    assert pool.capacity == 3
    pool.grow(5)
    assert pool.free == 2 and [pool.refs(b) for b in taken] == [1, 1, 1] and pool.take(2) == [3, 4]


def test_broken_uses_are_refused_and_change_nothing():
    with pytest.raises(InputError, match="block_size must be >= 1"):
        BlockPool(0)
    with pytest.raises(InputError, match="capacity >= 0"):
        BlockPool(4, -1)
    pool = BlockPool(4, 3)
    used = pool.take(1)
    with pytest.raises(ValueError, match=r"blocks \[1\] are free; only used blocks are shared"):
        pool.share([used[0], 1])
    assert pool.refs(used[0]) == 1
    with pytest.raises(ValueError, match=r"blocks \[2\] are free already"):
        pool.drop([used[0], 2])
    assert pool.refs(used[0]) == 1 and pool.free == 2
    with pytest.raises(MemoryError):
        pool.take(3)
    assert pool.free == 2
