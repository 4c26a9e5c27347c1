"""`BlockPool`: reference counts and a free list over a fixed set of block ids 0..n-1.

A block is in exactly one of three states:

- free:       on the free list, refcount 0;
- in use:     refcount > 0 (held by one or more block tables);
- idle-held:  refcount 0 but *not* on the free list. The pool's owner parks it there on
              purpose (the KV manager does this for blocks kept in the prefix index, i.e.
              "cached" blocks) and must later either `incref` it again or `free` it.

So `decref` to 0 never frees by itself: the owner decides (`free`) whether the block goes back
to the free list. Allocation is all or nothing and FIFO: blocks are handed out in the order
they went back to the free list (initially 0, 1, 2, ...), which keeps block ids predictable.

The error classes of the whole `pdserve.kv` package live here, at its lowest layer.
"""

from __future__ import annotations

from collections import deque

from pdserve.errors import PdserveError


class KVCacheError(PdserveError):
    """Base class of errors raised by the KV-memory layer."""


class BlockAccountingError(KVCacheError, ValueError):
    """A block operation that would corrupt the accounting (double free, decref below 0, ...)."""


class BlockPool:
    """Reference counts and FIFO free list for block ids 0..num_blocks-1. Not thread-safe."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (got {num_blocks})")
        self._num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._is_free = [True] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._num_used = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_used

    @property
    def num_idle_held(self) -> int:
        """Blocks with refcount 0 that the owner keeps off the free list."""
        return self._num_blocks - len(self._free) - self._num_used

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refs[block_id]

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return self._is_free[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks, each with refcount 1; None (and no change) if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        taken = [self._free.popleft() for _ in range(n)]
        for block_id in taken:
            self._is_free[block_id] = False
            self._refs[block_id] = 1
        self._num_used += n
        return taken

    def incref(self, block_id: int) -> None:
        """Add a reference to an in-use or idle-held block (never to a free one)."""
        self._check_id(block_id)
        if self._is_free[block_id]:
            raise BlockAccountingError(f"incref of block {block_id}, which is on the free list")
        if self._refs[block_id] == 0:
            self._num_used += 1
        self._refs[block_id] += 1

    def decref(self, block_id: int) -> int:
        """Drop a reference; returns the new refcount. At 0 the block is idle-held, not free."""
        self._check_id(block_id)
        if self._refs[block_id] == 0:
            raise BlockAccountingError(f"decref of block {block_id}, which has no references")
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            self._num_used -= 1
        return self._refs[block_id]

    def free(self, block_id: int) -> None:
        """Put an unreferenced, idle-held block back at the end of the free list."""
        self._check_id(block_id)
        if self._is_free[block_id]:
            raise BlockAccountingError(f"double free of block {block_id}")
        if self._refs[block_id]:
            raise BlockAccountingError(
                f"free of block {block_id}, which still has {self._refs[block_id]} references"
            )
        self._is_free[block_id] = True
        self._free.append(block_id)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free list, flags and counters agree (O(num_blocks))."""
        integrity_check(len(set(self._free)) == len(self._free), "free list holds a block twice")
        on_list = set(self._free)
        for block_id in range(self._num_blocks):
            integrity_check(
                self._is_free[block_id] == (block_id in on_list),
                f"block {block_id}: free flag disagrees with the free list",
            )
            integrity_check(self._refs[block_id] >= 0, f"block {block_id}: negative refcount")
            integrity_check(
                not (self._is_free[block_id] and self._refs[block_id]),
                f"block {block_id}: on the free list with references",
            )
        used = sum(1 for r in self._refs if r > 0)
        integrity_check(used == self._num_used, f"used counter {self._num_used} != {used}")

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise BlockAccountingError(
                f"block id {block_id} out of range 0..{self._num_blocks - 1}"
            )


def integrity_check(condition: bool, message: str) -> None:
    """Integrity checks raise even under `python -O` (unlike `assert`)."""
    if not condition:
        raise AssertionError(message)
