"""BlockPool and HostTier: exact block ids and counts after each operation."""

from __future__ import annotations

import pytest

from pdserve.errors import PdserveError
from pdserve.kv.block_pool import BlockAccountingError, BlockPool
from pdserve.kv.host_tier import HostTier


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free, pool.num_used, pool.num_idle_held


def test_fresh_allocation_is_fifo_from_zero() -> None:
    pool = BlockPool(6)
    assert counts(pool) == (6, 0, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert counts(pool) == (1, 5, 0)
    assert [pool.refcount(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert counts(pool) == (1, 3, 0)
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    pool.check_integrity()


def test_freed_blocks_are_reused_last() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.decref(0) == 0
    pool.free(0)
    assert counts(pool) == (3, 1, 0)
    assert pool.allocate(3) == [2, 3, 0]
    pool.check_integrity()


def test_decref_to_zero_parks_block_until_freed() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    pool.incref(0)
    assert pool.refcount(0) == 2
    assert pool.decref(0) == 1
    assert counts(pool) == (2, 1, 0)
    assert pool.decref(0) == 0
    assert counts(pool) == (2, 0, 1)
    assert not pool.is_free(0)
    pool.incref(0)  # an idle-held (cached) block may be revived
    assert counts(pool) == (2, 1, 0)
    assert pool.decref(0) == 0
    pool.free(0)
    assert counts(pool) == (3, 0, 0)
    assert pool.is_free(0)
    pool.check_integrity()


def test_accounting_errors() -> None:
    pool = BlockPool(3)
    assert pool.allocate(1) == [0]
    with pytest.raises(BlockAccountingError, match="still has 1 references"):
        pool.free(0)
    with pytest.raises(BlockAccountingError, match="double free of block 1"):
        pool.free(1)
    with pytest.raises(BlockAccountingError, match="incref of block 2, which is on the free list"):
        pool.incref(2)
    with pytest.raises(BlockAccountingError, match="decref of block 1, which has no references"):
        pool.decref(1)
    with pytest.raises(BlockAccountingError, match=r"block id 3 out of range 0\.\.2"):
        pool.incref(3)
    with pytest.raises(BlockAccountingError, match="out of range"):
        pool.refcount(-1)
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)
    assert issubclass(BlockAccountingError, PdserveError)
    assert counts(pool) == (2, 1, 0)
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._refs[2] = 1  # a reference on a block that is still on the free list
    with pytest.raises(AssertionError, match="block 2: on the free list with references"):
        pool.check_integrity()


def test_host_tier_allocate_and_free() -> None:
    host = HostTier(4)
    assert host.allocate(3) == [0, 1, 2]
    assert (host.num_free, host.num_used) == (1, 3)
    assert host.allocate(2) is None
    host.free([2, 0])
    assert (host.num_free, host.num_used) == (3, 1)
    assert host.allocate(3) == [3, 2, 0]
    host.check_integrity()


def test_host_tier_free_is_all_or_nothing() -> None:
    host = HostTier(3)
    assert host.allocate(2) == [0, 1]
    with pytest.raises(BlockAccountingError, match="host block 2, which is not in use"):
        host.free([0, 2])
    with pytest.raises(BlockAccountingError, match="listed twice"):
        host.free([1, 1])
    assert (host.num_free, host.num_used) == (1, 2)
    host.check_integrity()


def test_empty_host_tier() -> None:
    host = HostTier(0)
    assert host.allocate(0) == []
    assert host.allocate(1) is None
    assert (host.num_blocks, host.num_free, host.num_used) == (0, 0, 0)
    host.check_integrity()
