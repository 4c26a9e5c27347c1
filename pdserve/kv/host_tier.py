"""`HostTier`: bookkeeping of host (CPU) block ids that hold swapped-out KV.

A host block is always private to one swapped-out request (refcount exactly 1): there is no
prefix sharing and no index on the host tier. The tensors are in `kv/cache.py`; this only
hands out and takes back ids. A tier of 0 blocks is valid (swapping disabled).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.kv.block_pool import BlockAccountingError, BlockPool, integrity_check


class HostTier:
    """Host block ids 0..num_blocks-1, each either free or owned by one swapped request."""

    def __init__(self, num_blocks: int) -> None:
        self._pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    def refcount(self, block_id: int) -> int:
        return self._pool.refcount(block_id)

    def allocate(self, n: int) -> list[int] | None:
        """`n` host blocks (FIFO order), or None and no change if fewer are free."""
        return self._pool.allocate(n)

    def free(self, block_ids: Iterable[int]) -> None:
        """Return host blocks (each held once) to the free list, in the given order.

        All or nothing: raises BlockAccountingError, freeing none, if a block is not in use
        or is listed twice.
        """
        blocks = list(block_ids)
        if len(set(blocks)) != len(blocks):
            raise BlockAccountingError(f"host blocks listed twice in {blocks}")
        for block_id in blocks:
            if self._pool.refcount(block_id) != 1:
                raise BlockAccountingError(f"free of host block {block_id}, which is not in use")
        for block_id in blocks:
            self._pool.decref(block_id)
            self._pool.free(block_id)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every host block is free or used once."""
        self._pool.check_integrity()
        integrity_check(self._pool.num_idle_held == 0, "host block neither free nor used")
        for block_id in range(self._pool.num_blocks):
            integrity_check(
                self._pool.refcount(block_id) <= 1,
                f"host block {block_id} has {self._pool.refcount(block_id)} owners",
            )
