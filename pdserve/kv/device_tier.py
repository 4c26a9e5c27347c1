"""`DeviceTier`: the device block ids of one instance, each free, used or cached.

A `BlockPool` over the device blocks plus the prefix index (`RadixPrefixIndex`, absent when
the prefix cache is off). A block whose last reference is dropped stays *cached* (refcount 0,
evictable) while the index holds it and goes back to the free list otherwise; taking blocks
evicts cached blocks, least recently used first, when the free list is short. So
free + used + cached == num_blocks, and without an index nothing is ever cached.

The tier knows no requests: `KVManager` keeps the block tables, takes and drops references
through this class, and passes who holds what to `check_integrity`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from pdserve.kv.block_pool import BlockPool, integrity_check
from pdserve.kv.radix import CacheEvents, RadixPrefixIndex


class DeviceTier:
    """Device blocks 0..num_blocks-1 with reference counts and the prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool) -> None:
        self._pool = BlockPool(num_blocks)
        self._index = RadixPrefixIndex(block_size) if prefix_cache else None

    # -- counts and lookups ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return self._pool.num_free

    @property
    def num_used(self) -> int:
        """Blocks referenced at least once."""
        return self._pool.num_used

    @property
    def num_cached(self) -> int:
        """Blocks held only by the prefix index (refcount 0, evictable)."""
        return self._pool.num_idle_held

    @property
    def num_obtainable(self) -> int:
        """Blocks `take` could hand out now: free plus evictable cached."""
        return self._pool.num_free + self._pool.num_idle_held

    @property
    def prefix_cache(self) -> bool:
        """Whether the tier has a prefix index (`match`, `insert` and cached blocks)."""
        return self._index is not None

    def refcount(self, block_id: int) -> int:
        return self._pool.refcount(block_id)

    def is_indexed(self, block_id: int) -> bool:
        return self._index is not None and block_id in self._index

    def parent_block(self, block_id: int) -> int | None:
        """The indexed block before `block_id` in its prefix (None at the root)."""
        assert self._index is not None
        return self._index.parent_block(block_id)

    def indexed_blocks(self) -> Iterator[int]:
        """Every block id the prefix index holds (none without an index)."""
        return iter(()) if self._index is None else self._index.block_ids()

    # -- prefix index ------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest indexed full-block prefix of `token_ids` (at most
        `max_blocks`; [] without an index). Touches their LRU times, takes no reference."""
        if self._index is None:
            return []
        return self._index.match(token_ids, max_blocks=max_blocks)

    def insert(self, token_ids: Sequence[int], blocks: list[int], start: int, stop: int) -> None:
        """Index `blocks[start:stop]`, the full blocks of `token_ids` there (the caller holds a
        reference on each). Where the index already holds an identical block, `blocks[i]` is
        switched to it (a reference taken on it) and the caller's duplicate released."""
        assert self._index is not None, "insert without a prefix index"
        held = self._index.insert(token_ids, blocks, start, stop)
        for i, indexed in enumerate(held, start):
            own = blocks[i]
            if indexed != own:
                self._pool.incref(indexed)
                blocks[i] = indexed
                self._release(own)

    def record_events(self) -> None:
        """Record what the index stores and removes (`RadixPrefixIndex.record_events`);
        no-op without an index."""
        if self._index is not None:
            self._index.record_events()

    def take_events(self) -> CacheEvents:
        """The index's net events since the previous take (empty without an index)."""
        if self._index is None:
            return CacheEvents(stored=[], removed=[])
        return self._index.take_events()

    # -- references --------------------------------------------------------------------------

    def take(self, n: int) -> list[int] | None:
        """`n` fresh blocks (refcount 1), evicting LRU cached blocks if the free list is
        short. None, with nothing evicted, if free + cached < n."""
        if n > self.num_obtainable:
            return None
        shortfall = n - self._pool.num_free
        if shortfall > 0:
            assert self._index is not None  # cached blocks exist only with an index
            evicted = self._index.evict(shortfall, self._is_unreferenced)
            assert len(evicted) == shortfall, "every cached block must be evictable"
            for block_id in evicted:
                self._pool.free(block_id)
        return self._pool.allocate(n)

    def take_with(self, matched: list[int], num_new: int) -> list[int] | None:
        """A reference on each of the `matched` blocks (just returned by `match`) and
        `num_new` fresh blocks: `matched + fresh`. None, with nothing taken or evicted,
        without room."""
        # Matched blocks that are cached now stop being evictable once we reference them.
        num_revived = sum(1 for b in matched if self._pool.refcount(b) == 0)
        if num_new > self.num_obtainable - num_revived:
            return None
        for block_id in matched:
            self._pool.incref(block_id)
        fresh = self.take(num_new)
        assert fresh is not None  # guaranteed by the check above
        return matched + fresh

    def release_all(self, blocks: list[int]) -> None:
        """Drop one reference on each of `blocks` (see `_release`)."""
        # Tail first: those blocks are the least likely to be shared by another prompt.
        for block_id in reversed(blocks):
            self._release(block_id)

    # -- integrity ---------------------------------------------------------------------------

    def check_integrity(self, holders: Counter[int]) -> None:
        """Raise AssertionError unless the pool, the index and `holders` (block id -> the
        number of block tables listing it) agree: every refcount equals its holders, every
        indexed block is referenced or cached, every cached block is indexed, and
        free + used + cached == total."""
        self._pool.check_integrity()
        if self._index is not None:
            self._index.check_integrity(self._is_unreferenced)
        for block_id in range(self._pool.num_blocks):
            refs = self._pool.refcount(block_id)
            integrity_check(
                refs == holders[block_id],
                f"block {block_id}: refcount {refs} but {holders[block_id]} tables hold it",
            )
        self._check_cached_blocks()

    # -- internals ---------------------------------------------------------------------------

    def _is_unreferenced(self, block_id: int) -> bool:
        return self._pool.refcount(block_id) == 0

    def _release(self, block_id: int) -> None:
        """Drop one reference; at 0 an indexed block becomes cached (LRU-newest), others free."""
        if self._pool.decref(block_id):
            return
        if self._index is not None and block_id in self._index:
            self._index.touch(block_id)
        else:
            self._pool.free(block_id)

    def _check_cached_blocks(self) -> None:
        indexed = set(self.indexed_blocks())
        for block_id in indexed:
            integrity_check(
                not self._pool.is_free(block_id), f"indexed block {block_id} is on the free list"
            )
        idle = {
            b
            for b in range(self._pool.num_blocks)
            if not self._pool.is_free(b) and self._pool.refcount(b) == 0
        }
        integrity_check(idle <= indexed, f"blocks {sorted(idle - indexed)} leaked (not indexed)")
        total = self._pool.num_free + self._pool.num_used + len(idle)
        integrity_check(total == self._pool.num_blocks, "free + used + cached != total")
