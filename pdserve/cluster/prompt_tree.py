"""`PromptTree`: the front end's global prompt tree of one instance type (MemServe §6).

It records which instances hold the KV of which prompt prefix, block by block, so that the
router can send a request where the longest prefix of its prompt is cached. The controller holds
one tree per instance type (prefill, decode, colocated; e.g. a dict by role): a tree knows
nothing of roles, and an instance's events go to the tree of its type.

Flattened radix tree. A block is named by its chained hash (`kv/block_hash.py`): hash i of a
prompt identifies the whole prefix tokens[: (i+1)*block_size], that is one root path of the
block-granular radix tree, so a map hash -> holders *is* that tree with every node reachable in
one lookup; a prompt's path is its list of block hashes, and `match` walks that list from block
0, needing no parent or child links. (A hash collision only misroutes: the chosen instance
computes whatever it does not hold.)

Storage: per instance, an OrderedDict hash -> expiry time in refresh order, oldest first. Every
entry expires `ttl_s` after its last refresh, so refresh order is expiry order and the same
OrderedDict is both the TTL queue (`expire` pops fronts) and the LRU (the size cap removes the
oldest front of all instances). The holders of a hash are the instances whose map has it: a
cluster has few instances, so asking each is as cheap as a hash -> holders map would be, and
saves that map's memory (a set or tuple per node), and dropping an instance is dropping its map.
There is therefore no count of distinct nodes; `num_entries` counts (hash, instance) pairs.

Kept true by (the controller's side):

- `apply(instance, stored, removed, now)`: the instance's net prefix-index events
  (`KVManager.take_cache_events`), stored ones parent before child as the events list them.
- `touch(instance, hashes, now)`: the router sent a request there; its path stays fresh.
- `drop_instance(instance)`: the instance died; its events must not be applied afterwards.
- `expire(now)`: the fallback for lost events; call it often (amortised O(expired)).

Cost: `match` O(instances + blocks matched x holders), `apply` / `touch` O(hashes) plus
O(instances) per entry evicted by the cap, `expire` O(instances + expired), `drop_instance`
O(1) (plus freeing the map). `now` is the caller's monotonic clock (time.monotonic()) and must
not decrease between calls: the queues' order relies on it. Not thread-safe: the controller's
event loop owns it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

# Measured with tracemalloc on CPython 3.11 (bench/bench_prompt_tree.py prints it; 128-152
# by how full the dicts' tables are): an OrderedDict item (dict slot, linked-list node,
# fast-node slot) and the int hash; one float expiry is shared by the entries of a refresh.
BYTES_PER_ENTRY = 140
_ABSENT = -math.inf  # the expiry of an entry an instance does not hold


class PromptTree:
    """Which instance of one type holds which prompt prefix (see the module docstring)."""

    def __init__(self, block_size: int, ttl_s: float, max_entries: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s})")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1 (got {max_entries})")
        self._block_size = block_size
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._held: dict[str, OrderedDict[int, float]] = {}
        self._num_entries = 0
        self._expired_total = 0
        self._evicted_total = 0

    # -- counters (for /metrics) -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per block: the router hashes prompts with `block_hashes(tokens, block_size)`."""
        return self._block_size

    @property
    def num_entries(self) -> int:
        """(hash, instance) entries held, expired ones not yet removed included."""
        return self._num_entries

    @property
    def expired_total(self) -> int:
        """Entries removed by `expire` since the start."""
        return self._expired_total

    @property
    def evicted_total(self) -> int:
        """Entries removed by the `max_entries` cap since the start."""
        return self._evicted_total

    @property
    def approx_bytes(self) -> int:
        """Memory of the entries, estimated from `BYTES_PER_ENTRY`."""
        return self._num_entries * BYTES_PER_ENTRY

    def entries_by_instance(self) -> dict[str, int]:
        """Entries per instance (instances with none may be absent); O(instances)."""
        return {instance: len(held) for instance, held in self._held.items()}

    # -- queries -----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Per instance, how many leading blocks of `hashes` it holds (contiguous from block 0;
        an expired entry counts as absent). Instances holding no leading block are left out."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        first = hashes[0]
        for instance, held in self._held.items():
            # Most instances lack the first block: one lookup, not a call (the router's
            # hot loop runs over every instance: 64 instances cost ~3 us, not ~25).
            if held.get(first, _ABSENT) > now:
                n = _leading_run(held, hashes, now)
                matched[instance] = n
        return matched

    # -- updates -----------------------------------------------------------------------------

    def apply(
        self, instance: str, stored: Sequence[int], removed: Sequence[int], now: float
    ) -> None:
        """Replay an instance's net events: forget `removed`, add or refresh `stored`.

        `stored` lists parents before their children (as `CacheEvents` does); entries past the
        `max_entries` cap are then evicted, least recently refreshed first.
        """
        held = self._held.setdefault(instance, OrderedDict())
        before = len(held)
        for block_hash in removed:
            held.pop(block_hash, None)
        self._refresh(held, stored, now, add=True)
        self._num_entries += len(held) - before
        self._evict_over_cap()

    def touch(self, instance: str, hashes: Sequence[int], now: float) -> None:
        """Refresh the TTL of the entries `instance` holds on the path `hashes` (no adding)."""
        held = self._held.get(instance)
        if held:
            self._refresh(held, hashes, now, add=False)

    def drop_instance(self, instance: str) -> int:
        """Remove every entry of `instance` (it died); returns how many there were."""
        held = self._held.pop(instance, None)
        removed = 0 if held is None else len(held)
        self._num_entries -= removed
        return removed

    def move_instance(self, instance: str, to: PromptTree) -> int:
        """Hand every entry of `instance` to `to`, expiries kept (the instance changed role:
        instance flip); returns how many moved."""
        held = self._held.pop(instance, None)
        if not held:
            return 0
        self._num_entries -= len(held)
        target = to._held.setdefault(instance, OrderedDict())
        before = len(target)
        for block_hash, expiry in held.items():  # oldest first: the LRU order is kept
            if expiry > target.get(block_hash, _ABSENT):
                target[block_hash] = expiry
                target.move_to_end(block_hash)
        to._num_entries += len(target) - before
        to._evict_over_cap()
        return len(held)

    def expire(self, now: float) -> int:
        """Remove the entries whose TTL has passed; returns how many. O(instances + expired):
        only queue fronts are looked at."""
        expired = 0
        for held in self._held.values():
            while held and next(iter(held.values())) <= now:
                held.popitem(last=False)
                expired += 1
        self._num_entries -= expired
        self._expired_total += expired
        return expired

    # -- internals ---------------------------------------------------------------------------

    def _refresh(
        self, held: OrderedDict[int, float], path: Sequence[int], now: float, add: bool
    ) -> None:
        """Give the entries of `path` (root first) a fresh expiry, making them the newest.

        Deepest first, so that the root ends up newest: the LRU then always removes a path's
        deeper entries before their ancestors. The other way round, an ancestor could go while
        its descendants stay, and those would be dead weight: `match` counts from block 0 and
        would never reach them.
        """
        expiry = now + self._ttl_s
        for block_hash in reversed(path):
            if add or block_hash in held:
                held[block_hash] = expiry
                held.move_to_end(block_hash)

    def _evict_over_cap(self) -> None:
        """Remove the globally least recently refreshed entries while over `max_entries`."""
        while self._num_entries > self._max_entries:
            oldest = min((held for held in self._held.values() if held), key=_front_expiry)
            oldest.popitem(last=False)
            self._num_entries -= 1
            self._evicted_total += 1


def _front_expiry(held: OrderedDict[int, float]) -> float:
    return next(iter(held.values()))


def _leading_run(held: OrderedDict[int, float], hashes: Sequence[int], now: float) -> int:
    """How many leading `hashes` have an entry in `held` that is live at `now`."""
    get = held.get  # the router's hot loop: one bound method, one lookup per block
    n = 0
    for block_hash in hashes:
        if get(block_hash, _ABSENT) <= now:
            break
        n += 1
    return n
