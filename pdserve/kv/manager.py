"""`KVManager`: block tables, prefix caching and swapping for one engine instance.

The scheduler talks to `KVManager` only and never sees block ids; the model runner reads
`block_table(req_id)` and executes the `SwapPlan`s. Single-threaded: called from the step loop.

Ownership: each running request holds one reference on every block of its table. A block whose
refcount drops to 0 goes back to the free list unless it is in the prefix index; then it stays
"cached" (refcount 0, evictable) until a later request matches it or an allocation evicts it
(LRU over unreferenced leaves). Device tier: free + used + cached == num_blocks.

Readings of kv/SPEC.md where it leaves room (see also `allocate`, `commit`, `swap_out`):

- "num_computed" in `allocate` is `num_computed_tokens(req_id)`: the prefix match on the first
  call, then whatever `commit` reported. Each call makes the table cover
  num_computed + num_new_tokens tokens; it never shrinks the table.
- Prefix-cache statistics count once per request, on its first successful `allocate`
  (queries += len(token_ids), hits += num_cached_tokens). `match_prefix` is a peek the
  scheduler may repeat while a request waits, so it does not count.
- A swap copies only the blocks that hold computed KV (ceil(num_computed / block_size));
  blocks allocated for tokens not yet computed are dropped, and after `swap_in` the scheduler
  grows the table again with `allocate`. `swap_out`/`swap_in` raise `OutOfBlocksError` (and
  change nothing) when `can_swap_out`/`can_swap_in` is False.
- Copy plans of one step must be executed in the order the manager returned them, before any
  KV write of that step: a block freed by one swap may be handed out by the next call.
- After `swap_in` the request's blocks are private copies; its next `commit` re-inserts its
  full blocks and, where the index still holds them, switches to the indexed blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from pdserve.kv.block_pool import BlockPool, KVCacheError, integrity_check
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.host_tier import HostTier
from pdserve.kv.radix import CacheEvents, RadixPrefixIndex

ReqId: TypeAlias = Hashable


class UnknownRequestError(KVCacheError, LookupError):
    """The request id has no KV state (never allocated, or already freed)."""


class RequestStateError(KVCacheError, ValueError):
    """The call does not fit the request's state (e.g. `allocate` while it is swapped out)."""


class OutOfBlocksError(KVCacheError):
    """A swap was asked for without room for it (check `can_swap_out` / `can_swap_in`)."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Tokens of a prompt whose KV the prefix cache holds (a multiple of block_size)."""

    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one `allocate` call did: tokens reused from the prefix cache (first call only)
    and device blocks newly taken for the request."""

    num_cached_tokens: int
    num_new_blocks: int


@dataclass(frozen=True, slots=True)
class SwapPlan:
    """Block copies for the runner: (src, dst) pairs; device->host for swap_out,
    host->device for swap_in."""

    copies: tuple[tuple[int, int], ...]

    @property
    def num_blocks(self) -> int:
        return len(self.copies)


@dataclass(slots=True)
class _ReqState:
    blocks: list[int]  # device block table; empty while swapped out
    num_computed: int  # tokens whose KV is written (survives swapping)
    num_committed: int = 0  # leading blocks of `blocks` already in the prefix index
    host_blocks: list[int] | None = None  # set exactly while swapped out


class KVManager:
    """Device and host KV blocks of one engine instance (see the module docstring)."""

    def __init__(self, cfg: KVCacheConfig) -> None:
        self._cfg = cfg
        self._bs = cfg.block_size
        self._pool = BlockPool(cfg.num_blocks)
        self._host = HostTier(cfg.num_host_blocks)
        self._index = RadixPrefixIndex(cfg.block_size) if cfg.enable_prefix_cache else None
        self._reqs: dict[ReqId, _ReqState] = {}
        self._hits = 0
        self._queries = 0

    # -- counters ----------------------------------------------------------------------------

    @property
    def cfg(self) -> KVCacheConfig:
        return self._cfg

    @property
    def num_free_blocks(self) -> int:
        """Device blocks on the free list."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Device blocks referenced by at least one request."""
        return self._pool.num_used

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks held only by the prefix index (refcount 0, evictable)."""
        return self._pool.num_idle_held

    @property
    def num_obtainable_blocks(self) -> int:
        """Device blocks an allocation could get now: free plus evictable cached."""
        return self._num_obtainable()

    @property
    def usage(self) -> float:
        """Fraction of device blocks referenced by requests (cached blocks count as free)."""
        return self._pool.num_used / self._pool.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        return self._host.num_free

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens reused from the prefix cache, summed over requests' first allocations."""
        return self._hits

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache, summed over first allocations."""
        return self._queries

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._reqs

    def is_swapped(self, req_id: ReqId) -> bool:
        return self._state(req_id).host_blocks is not None

    # -- prefix index events (for the front end's global prompt tree) ------------------------

    def record_cache_events(self) -> None:
        """Record what the prefix index stores and removes, for `take_cache_events` (see
        `RadixPrefixIndex.record_events`); the caller must then drain them. No-op without an
        index."""
        if self._index is not None:
            self._index.record_events()

    def take_cache_events(self) -> CacheEvents:
        """The prefix index's net events since the previous take (empty without an index)."""
        if self._index is None:
            return CacheEvents(stored=[], removed=[])
        return self._index.take_events()

    # -- prefix cache and allocation ---------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached full-block prefix, leaving at least one token to compute.

        Mutates only LRU times; takes no references and counts no statistics.
        """
        return PrefixMatch(len(self._match(token_ids)) * self._bs)

    def allocate(
        self, req_id: ReqId, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation | None:
        """Make req's table cover num_computed_tokens(req) + num_new_tokens tokens.

        The first call for a request matches the prefix cache, takes a reference on the matched
        blocks and sets num_computed to the match. Evicts cached blocks (LRU) when the free list
        is short. All or nothing: on None no reference was taken and nothing was evicted.
        Raises RequestStateError while the request is swapped out.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0 (got {num_new_tokens})")
        state = self._reqs.get(req_id)
        if state is None:
            return self._allocate_first(req_id, token_ids, num_new_tokens)
        self._require_running(req_id, state)
        num_new = self.num_new_blocks(req_id, num_new_tokens)
        if num_new <= 0:
            return Allocation(num_cached_tokens=0, num_new_blocks=0)
        new_blocks = self._take_blocks(num_new)
        if new_blocks is None:
            return None
        state.blocks.extend(new_blocks)
        return Allocation(num_cached_tokens=0, num_new_blocks=num_new)

    def num_new_blocks(self, req_id: ReqId, num_new_tokens: int) -> int:
        """Fresh blocks `allocate(req_id, ..., num_new_tokens)` would take now (<= 0: none),
        for a request that already has KV state."""
        state = self._state(req_id)
        return self._blocks_for(state.num_computed + num_new_tokens) - len(state.blocks)

    def hold(self, req_id: ReqId, token_ids: Sequence[int], num_tokens: int = 0) -> int | None:
        """A KV state that is no request: references on the indexed full-block prefix of
        `token_ids` (every full block may match: nothing is left to compute) and fresh blocks
        up to `num_tokens` tokens. Returns the tokens matched (its num_computed_tokens), or
        None - nothing taken, nothing evicted - without room. Counts no prefix-cache
        statistics. What MemServe's pin and transfer calls use (engine/cache_exchange.py):
        with `num_tokens` 0 it pins what the index holds; the caller `commit`s what it wrote
        into the fresh blocks and `free`s the state.
        """
        if req_id in self._reqs:
            raise RequestStateError(f"hold of {req_id!r}: the id already has KV state")
        cached = [] if self._index is None else self._index.match(token_ids)
        num_new = max(0, self._blocks_for(num_tokens) - len(cached))
        if not self._open_state(req_id, cached, num_new):
            return None
        return len(cached) * self._bs

    def num_computed_tokens(self, req_id: ReqId) -> int:
        """Tokens whose KV is in the cache for req (kept while it is swapped out)."""
        return self._state(req_id).num_computed

    def commit(self, req_id: ReqId, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record that KV for tokens [0, num_computed_tokens) is written; index full blocks.

        `num_computed_tokens` may not decrease, exceed len(token_ids) or exceed the table's
        capacity (ValueError). Only blocks not yet indexed are looked at. Where the index
        already holds an identical block, req's table switches to it and req's duplicate is
        released (to the free list). The runner must use the new `block_table` next step.
        """
        state = self._reqs.get(req_id)
        if state is None:
            raise UnknownRequestError(f"commit for unknown request {req_id!r}")
        self._require_running(req_id, state)
        self._check_commit(req_id, state, token_ids, num_computed_tokens)
        state.num_computed = num_computed_tokens
        if self._index is not None:
            self._index_full_blocks(self._index, state, token_ids)

    def block_table(self, req_id: ReqId) -> list[int]:
        """Device block ids of req, in token order (a copy; for the model runner only)."""
        state = self._state(req_id)
        self._require_running(req_id, state)
        return list(state.blocks)

    def free(self, req_id: ReqId) -> None:
        """Drop all of req's blocks (device and, if swapped out, host). Unknown req: error.

        Indexed blocks nobody else holds stay cached; the others go back to the free list.
        """
        state = self._reqs.pop(req_id, None)
        if state is None:
            raise UnknownRequestError(f"free of unknown request {req_id!r} (double free?)")
        if state.host_blocks is not None:
            self._host.free(state.host_blocks)
        self._release_all(state.blocks)

    # -- swapping ----------------------------------------------------------------------------

    def can_swap_out(self, req_id: ReqId) -> bool:
        """Whether the host tier has room for req's computed blocks (req must be running)."""
        state = self._state(req_id)
        self._require_running(req_id, state)
        return self._blocks_for(state.num_computed) <= self._host.num_free

    def swap_out(self, req_id: ReqId) -> SwapPlan:
        """Move req's computed blocks to fresh private host blocks; release its device blocks.

        Returns (device, host) pairs the runner must copy before any KV write of this step
        (the device blocks may be reused at once). Shared or indexed blocks are copied too
        and stay cached on the device if indexed. num_computed_tokens(req) is unchanged.
        """
        state = self._state(req_id)
        self._require_running(req_id, state)
        num_valid = self._blocks_for(state.num_computed)
        host_blocks = self._host.allocate(num_valid)
        if host_blocks is None:
            raise OutOfBlocksError(
                f"swap_out of {req_id!r} needs {num_valid} host blocks, {self._host.num_free} free"
            )
        copies = tuple(zip(state.blocks[:num_valid], host_blocks, strict=True))
        self._release_all(state.blocks)
        state.blocks = []
        state.num_committed = 0
        state.host_blocks = host_blocks
        return SwapPlan(copies)

    def can_swap_in(self, req_id: ReqId) -> bool:
        """Whether enough device blocks are free or evictable for req (req must be swapped)."""
        host_blocks = self._swapped_host_blocks(req_id)
        return len(host_blocks) <= self._num_obtainable()

    def swap_in(self, req_id: ReqId) -> SwapPlan:
        """Give req fresh device blocks (all or nothing, evicting cached blocks if needed).

        Returns (host, device) pairs the runner must copy before any KV write of this step;
        the host blocks are freed at once.
        """
        host_blocks = self._swapped_host_blocks(req_id)
        device_blocks = self._take_blocks(len(host_blocks))
        if device_blocks is None:
            raise OutOfBlocksError(
                f"swap_in of {req_id!r} needs {len(host_blocks)} device blocks, "
                f"{self._num_obtainable()} free or evictable"
            )
        self._host.free(host_blocks)
        state = self._reqs[req_id]
        state.blocks = device_blocks
        state.host_blocks = None
        return SwapPlan(tuple(zip(host_blocks, device_blocks, strict=True)))

    # -- integrity ---------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless all accounting agrees (O(all blocks); tests/debug).

        Per tier free + in_use + cached == total; every refcount equals the number of tables
        holding the block; every indexed block is referenced or cached; every request's
        indexed blocks form a root path of the index; host blocks have exactly one owner.
        """
        self._pool.check_integrity()
        self._host.check_integrity()
        if self._index is not None:
            self._index.check_integrity(self._is_unreferenced)
        self._check_device_refs()
        self._check_cached_blocks()
        self._check_host_refs()
        for req_id, state in self._reqs.items():
            self._check_request(req_id, state)

    # -- internals: allocation ---------------------------------------------------------------

    def _match(self, token_ids: Sequence[int]) -> list[int]:
        """Matched block ids, capped so at least one token of `token_ids` stays uncached."""
        if self._index is None or not token_ids:
            return []
        return self._index.match(token_ids, max_blocks=(len(token_ids) - 1) // self._bs)

    def _allocate_first(
        self, req_id: ReqId, token_ids: Sequence[int], num_new_tokens: int
    ) -> Allocation | None:
        cached = self._match(token_ids)
        num_cached_tokens = len(cached) * self._bs
        num_new = max(0, self._blocks_for(num_cached_tokens + num_new_tokens) - len(cached))
        if not self._open_state(req_id, cached, num_new):
            return None
        self._queries += len(token_ids)
        self._hits += num_cached_tokens
        return Allocation(num_cached_tokens=num_cached_tokens, num_new_blocks=num_new)

    def _open_state(self, req_id: ReqId, cached: list[int], num_new: int) -> bool:
        """A new KV state: references on the matched `cached` blocks (committed, computed)
        and `num_new` fresh blocks. False, with nothing taken or evicted, without room."""
        # Matched blocks that are cached now stop being evictable once we reference them.
        num_revived = sum(1 for b in cached if self._pool.refcount(b) == 0)
        if num_new > self._num_obtainable() - num_revived:
            return False
        for block_id in cached:
            self._pool.incref(block_id)
        new_blocks = self._take_blocks(num_new)
        assert new_blocks is not None  # guaranteed by the check above
        self._reqs[req_id] = _ReqState(
            blocks=cached + new_blocks,
            num_computed=len(cached) * self._bs,
            num_committed=len(cached),
        )
        return True

    def _take_blocks(self, n: int) -> list[int] | None:
        """`n` fresh device blocks (refcount 1), evicting LRU cached blocks if the free list is
        short. None, with nothing evicted, if free + cached < n."""
        if n > self._num_obtainable():
            return None
        shortfall = n - self._pool.num_free
        if shortfall > 0:
            assert self._index is not None  # cached blocks exist only with an index
            evicted = self._index.evict(shortfall, self._is_unreferenced)
            assert len(evicted) == shortfall, "every cached block must be evictable"
            for block_id in evicted:
                self._pool.free(block_id)
        return self._pool.allocate(n)

    def _num_obtainable(self) -> int:
        return self._pool.num_free + self._pool.num_idle_held

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._bs)

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

    def _release_all(self, blocks: list[int]) -> None:
        # Tail first: those blocks are the least likely to be shared by another prompt.
        for block_id in reversed(blocks):
            self._release(block_id)

    # -- internals: commit -------------------------------------------------------------------

    def _check_commit(
        self, req_id: ReqId, state: _ReqState, token_ids: Sequence[int], num_computed: int
    ) -> None:
        if num_computed < state.num_computed:
            raise ValueError(
                f"commit of {req_id!r}: num_computed_tokens {num_computed} < "
                f"{state.num_computed} already committed"
            )
        if num_computed > len(token_ids):
            raise ValueError(
                f"commit of {req_id!r}: num_computed_tokens {num_computed} > "
                f"{len(token_ids)} known tokens"
            )
        capacity = len(state.blocks) * self._bs
        if num_computed > capacity:
            raise ValueError(
                f"commit of {req_id!r}: num_computed_tokens {num_computed} > "
                f"{capacity} tokens allocated"
            )

    def _index_full_blocks(
        self, index: RadixPrefixIndex, state: _ReqState, token_ids: Sequence[int]
    ) -> None:
        """Insert req's newly full blocks; switch to blocks the index already held."""
        num_full = state.num_computed // self._bs
        start = state.num_committed
        if num_full <= start:
            return
        held = index.insert(token_ids, state.blocks, start, num_full)
        for i, indexed in enumerate(held, start):
            own = state.blocks[i]
            if indexed != own:
                self._pool.incref(indexed)
                state.blocks[i] = indexed
                self._release(own)
        state.num_committed = num_full

    # -- internals: request lookup -----------------------------------------------------------

    def _state(self, req_id: ReqId) -> _ReqState:
        state = self._reqs.get(req_id)
        if state is None:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return state

    @staticmethod
    def _require_running(req_id: ReqId, state: _ReqState) -> None:
        if state.host_blocks is not None:
            raise RequestStateError(f"request {req_id!r} is swapped out")

    def _swapped_host_blocks(self, req_id: ReqId) -> list[int]:
        host_blocks = self._state(req_id).host_blocks
        if host_blocks is None:
            raise RequestStateError(f"request {req_id!r} is not swapped out")
        return host_blocks

    # -- internals: integrity ----------------------------------------------------------------

    def _check_device_refs(self) -> None:
        holders: Counter[int] = Counter()
        for req_id, state in self._reqs.items():
            integrity_check(
                len(set(state.blocks)) == len(state.blocks), f"{req_id!r}: block listed twice"
            )
            holders.update(state.blocks)
        for block_id in range(self._pool.num_blocks):
            refs = self._pool.refcount(block_id)
            integrity_check(
                refs == holders[block_id],
                f"block {block_id}: refcount {refs} but {holders[block_id]} tables hold it",
            )

    def _check_cached_blocks(self) -> None:
        indexed = set() if self._index is None else set(self._index.block_ids())
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

    def _check_host_refs(self) -> None:
        holders: Counter[int] = Counter()
        for state in self._reqs.values():
            holders.update(state.host_blocks or ())
        for block_id in range(self._host.num_blocks):
            refs = self._host.refcount(block_id)
            integrity_check(
                refs == holders[block_id],
                f"host block {block_id}: refcount {refs}, {holders[block_id]} owners",
            )
        integrity_check(
            self._host.num_free + self._host.num_used == self._host.num_blocks,
            "host free + used != total",
        )

    def _check_request(self, req_id: ReqId, state: _ReqState) -> None:
        bs = self._bs
        if state.host_blocks is not None:
            integrity_check(not state.blocks, f"{req_id!r}: swapped but holds device blocks")
            integrity_check(
                len(state.host_blocks) == self._blocks_for(state.num_computed),
                f"{req_id!r}: host copy does not match num_computed",
            )
            return
        integrity_check(
            state.num_computed <= len(state.blocks) * bs, f"{req_id!r}: computed beyond table"
        )
        integrity_check(
            state.num_committed * bs <= state.num_computed,
            f"{req_id!r}: committed blocks beyond num_computed",
        )
        parent: int | None = None
        for block_id in state.blocks[: state.num_committed]:
            integrity_check(
                self._index is not None and block_id in self._index,
                f"{req_id!r}: committed block {block_id} not indexed",
            )
            assert self._index is not None
            integrity_check(
                self._index.parent_block(block_id) == parent,
                f"{req_id!r}: committed blocks are not a path of the index",
            )
            parent = block_id
