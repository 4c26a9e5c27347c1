"""`KVManager`: block tables, prefix caching and swapping for one engine instance.

The scheduler talks to `KVManager` only and never sees block ids; the model runner reads
`block_table(req_id)` and executes the `SwapPlan`s. Single-threaded: called from the step loop.

Ownership: each running request holds one reference on every block of its table. A block whose
refcount drops to 0 goes back to the free list unless it is in the prefix index; then it stays
"cached" (refcount 0, evictable) until a later request matches it or an allocation evicts it
(LRU over unreferenced leaves). Device tier: free + used + cached == num_blocks.
The pieces: `DeviceTier` (kv/device_tier.py) keeps that device accounting, the prefix index
and eviction; `HostTier` the host blocks; `ReqState` (kv/tables.py) one state's tables, with
the checks a commit and `check_integrity` run on them. `KVManager` owns the states and ties
the tiers together.

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

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kv.block_pool import KVCacheError
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.device_tier import DeviceTier
from pdserve.kv.host_tier import HostTier
from pdserve.kv.radix import CacheEvents
from pdserve.kv.tables import ReqId, ReqState, check_commit, check_tables


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


class KVManager:
    """Device and host KV blocks of one engine instance (see the module docstring)."""

    def __init__(self, cfg: KVCacheConfig) -> None:
        self._cfg = cfg
        self._bs = cfg.block_size
        self._device = DeviceTier(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self._host = HostTier(cfg.num_host_blocks)
        self._reqs: dict[ReqId, ReqState] = {}
        self._hits = 0
        self._queries = 0

    # -- counters ----------------------------------------------------------------------------

    @property
    def cfg(self) -> KVCacheConfig:
        return self._cfg

    @property
    def num_free_blocks(self) -> int:
        """Device blocks on the free list."""
        return self._device.num_free

    @property
    def num_used_blocks(self) -> int:
        """Device blocks referenced by at least one request."""
        return self._device.num_used

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks held only by the prefix index (refcount 0, evictable)."""
        return self._device.num_cached

    @property
    def num_obtainable_blocks(self) -> int:
        """Device blocks an allocation could get now: free plus evictable cached."""
        return self._device.num_obtainable

    @property
    def usage(self) -> float:
        """Fraction of device blocks referenced by requests (cached blocks count as free)."""
        return self._device.num_used / self._device.num_blocks

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
        self._device.record_events()

    def take_cache_events(self) -> CacheEvents:
        """The prefix index's net events since the previous take (empty without an index)."""
        return self._device.take_events()

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
        new_blocks = self._device.take(num_new)
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
        statistics. What MemServe's pin and transfer calls use (engine/features/cache_exchange.py):
        with `num_tokens` 0 it pins what the index holds; the caller `commit`s what it wrote
        into the fresh blocks and `free`s the state.
        """
        if req_id in self._reqs:
            raise RequestStateError(f"hold of {req_id!r}: the id already has KV state")
        cached = self._device.match(token_ids)
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
        check_commit(req_id, state, token_ids, num_computed_tokens, self._bs)
        state.num_computed = num_computed_tokens
        if self._device.prefix_cache:
            self._index_full_blocks(state, token_ids)

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
        self._device.release_all(state.blocks)

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
        self._device.release_all(state.blocks)
        state.blocks = []
        state.num_committed = 0
        state.host_blocks = host_blocks
        return SwapPlan(copies)

    def can_swap_in(self, req_id: ReqId) -> bool:
        """Whether enough device blocks are free or evictable for req (req must be swapped)."""
        host_blocks = self._swapped_host_blocks(req_id)
        return len(host_blocks) <= self._device.num_obtainable

    def swap_in(self, req_id: ReqId) -> SwapPlan:
        """Give req fresh device blocks (all or nothing, evicting cached blocks if needed).

        Returns (host, device) pairs the runner must copy before any KV write of this step;
        the host blocks are freed at once.
        """
        host_blocks = self._swapped_host_blocks(req_id)
        device_blocks = self._device.take(len(host_blocks))
        if device_blocks is None:
            raise OutOfBlocksError(
                f"swap_in of {req_id!r} needs {len(host_blocks)} device blocks, "
                f"{self._device.num_obtainable} free or evictable"
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
        check_tables(self._reqs, self._device, self._host, self._bs)

    # -- internals: allocation ---------------------------------------------------------------

    def _match(self, token_ids: Sequence[int]) -> list[int]:
        """Matched block ids, capped so at least one token of `token_ids` stays uncached."""
        if not token_ids:
            return []
        return self._device.match(token_ids, max_blocks=(len(token_ids) - 1) // self._bs)

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
        blocks = self._device.take_with(cached, num_new)
        if blocks is None:
            return False
        self._reqs[req_id] = ReqState(
            blocks=blocks,
            num_computed=len(cached) * self._bs,
            num_committed=len(cached),
        )
        return True

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._bs)

    # -- internals: commit -------------------------------------------------------------------

    def _index_full_blocks(self, state: ReqState, token_ids: Sequence[int]) -> None:
        """Insert req's newly full blocks; switch to blocks the index already held."""
        num_full = state.num_computed // self._bs
        if num_full > state.num_committed:
            self._device.insert(token_ids, state.blocks, state.num_committed, num_full)
            state.num_committed = num_full

    # -- internals: request lookup -----------------------------------------------------------

    def _state(self, req_id: ReqId) -> ReqState:
        state = self._reqs.get(req_id)
        if state is None:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return state

    @staticmethod
    def _require_running(req_id: ReqId, state: ReqState) -> None:
        if state.host_blocks is not None:
            raise RequestStateError(f"request {req_id!r} is swapped out")

    def _swapped_host_blocks(self, req_id: ReqId) -> list[int]:
        host_blocks = self._state(req_id).host_blocks
        if host_blocks is None:
            raise RequestStateError(f"request {req_id!r} is not swapped out")
        return host_blocks
