"""Which instance gets a request: by load, by session, or by cached prefix (MemServe §6).

The controller keeps one global prompt tree per instance type (`PromptTree`), fed by the
events every instance reports with its load (what its prefix index stored and evicted), so
the tree knows, per instance, how many leading blocks of a prompt it holds. The rules:

- `least-load`: the prefill (or colocated) instance with the fewest prompt tokens queued
  (assigned and not yet prefilled); decode instances by `--decode-policy`.
- `session`: the first request of a session goes by least load; later ones stick to the
  same prefill and decode instances while they live (MemServe's intra-session policy).
  Session ids are hashed (any length, any bytes); at most `max_sessions` are remembered.
- `prefix`: a prefill instance's cost is the prompt tokens it would have to compute
  before this request's first token: its queue plus the part of this prompt it does not
  hold. The cheapest wins (ties: the longest cached prefix, then the order listed). Said
  as a threshold: the instance with the longest cached prefix gets the request unless its
  queue exceeds the least loaded one's by more than the tokens its cache saves. With
  nothing cached anywhere this is `least-load`. Decode instances: among those with room
  that run at most `decode_balance` requests more than the least loaded, the longest
  cached prefix (fewest blocks to move), then the fewest requests.

Prefix fetch (`prefix` routing, disaggregated): when another prefill or decode instance
holds a longer prefix than the chosen one, the chosen instance copies the difference
before its prefill if that is cheaper than computing it: copy time (bytes over the
measured KV copy bandwidth, plus the measured overhead of a copy: the round trips and
each instance's wait for its step to end, `fetch_overhead`, a running median of the
copies that committed, `FETCH_OVERHEAD_S` until the first) below prefill time (tokens
over the measured prefill rate) - the rates the recovery rule measures
(cluster/replication.py). The copies themselves, and the requests waiting for them:
cluster/cache_copies.py.

A tree's belief can be stale (an eviction reported after the choice): the instance then
computes what it lacks and the controller counts a miss. Nothing here is needed for
correctness, only for speed.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cluster.config import ClusterConfig, Routing
from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.instance import Instance
from pdserve.cluster.policies import DecodeChooser, choose_prefill, has_room
from pdserve.cluster.prompt_tree import PromptTree
from pdserve.config import Role
from pdserve.kv.block_hash import block_hashes
from pdserve.protocol.core import LoadReport

# The overhead of a copy until one is measured: two hops through the front end and the
# holder's wait for its current step to end (about one decode step on the CPUs measured).
FETCH_OVERHEAD_S = 0.1


def session_key(raw: str) -> str:
    """A bounded, printable key for any session id a client sends (hashed: an absurdly
    long or binary id costs 32 characters, and nothing about it can break a lookup)."""
    data = raw.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class RouteKey:
    """What the router knows of one request."""

    num_tokens: int  # prompt tokens
    hashes: Sequence[int]  # chained block hashes of the prompt (prefix routing only)
    session: str | None  # `session_key` of the client's session id


@dataclass(frozen=True)
class PrefillChoice:
    instance: Instance
    cached_tokens: int  # what the tree believes the instance holds of the prompt


@dataclass(frozen=True)
class Donor:
    """An instance holding more of a prompt than the one chosen to prefill it."""

    instance: Instance
    cached_tokens: int  # what the tree says it holds (a multiple of the block size)


@dataclass
class CacheCounters:
    """For /metrics and /debug/cluster: how routing and the KV returns went."""

    cache_routed: int = 0  # requests sent where the tree saw a cached prefix
    misses: int = 0  # an instance held less than the tree believed (evicted meanwhile)
    missed_tokens: int = 0
    # PD-Caching-3 returns (protocol/cache.py), by outcome.
    returns_fetched: int = 0  # some blocks moved into the prefill instance's cache
    returns_held: int = 0  # the prefill instance held every block already
    returns_dropped: int = 0  # destination busy or gone: not attempted
    returns_failed: int = 0  # no room, transfer failure, lease
    returned_tokens: int = 0  # tokens whose KV moved back
    # Prefix fetches before a prefill, by outcome, and the tokens they moved.
    prefetches: int = 0
    prefetches_failed: int = 0  # nothing was cached any more, no room, transfer failure
    prefetched_tokens: int = 0
    # Running requests' KV moved off an instance that flips (cluster/flip.py), by outcome.
    kv_moves: int = 0
    kv_moves_failed: int = 0
    kv_moved_tokens: int = 0
    # Requests that waited for a copy already on its way into their prefill instance (a
    # return, another request's prefetch: cluster/cache_copies.py), and waits of any kind
    # (their own prefetch too) that ended by the bound, not by the copy.
    kv_waits: int = 0
    kv_wait_timeouts: int = 0

    def returned(self, fetched: int, error: str | None) -> None:
        if error is not None:
            self.returns_failed += 1
        elif fetched:
            self.returns_fetched += 1
            self.returned_tokens += fetched
        else:
            self.returns_held += 1

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class RunningMedian:
    """The median of the last `window` samples; `seed` until the first."""

    def __init__(self, seed: float, window: int = 32) -> None:
        self.seed = seed
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, sample: float) -> None:
        self._samples.append(sample)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def value(self) -> float:
        return statistics.median(self._samples) if self._samples else self.seed


def _queued(inst: Instance) -> int:
    return inst.assigned_prefill_tokens


class Router:
    def __init__(self, config: ClusterConfig, block_size: int, decode: DecodeChooser) -> None:
        self.config = config
        self.block_size = block_size
        self.decode_chooser = decode
        self.trees = {
            role: PromptTree(block_size, config.prefix_ttl_s, config.prefix_tree_max_entries)
            for role in Role
        }
        self._sessions: OrderedDict[tuple[Role, str], str] = OrderedDict()
        self.counters = CacheCounters()
        # Seconds a copy takes beyond its bytes (module docstring), fed by cache_copies.py.
        self.fetch_overhead = RunningMedian(FETCH_OVERHEAD_S)

    @property
    def policy(self) -> Routing:
        return self.config.routing

    def key(self, prompt: Sequence[int], session: str | None) -> RouteKey:
        hashes = block_hashes(prompt, self.block_size) if self.policy is Routing.PREFIX else ()
        return RouteKey(len(prompt), hashes, session if self.policy is Routing.SESSION else None)

    # ---- prefill (and colocated) instances ---------------------------------------------

    def prefill(self, candidates: Sequence[Instance], key: RouteKey) -> PrefillChoice | None:
        live = [i for i in candidates if i.alive]
        if not live:
            return None
        if self.policy is Routing.PREFIX:
            return self._by_prefix(live, key)
        inst = self._sticky(live, key)
        if inst is None:
            inst = choose_prefill(live)
            assert inst is not None
            self._remember(inst, key)
        return PrefillChoice(inst, 0)

    def _by_prefix(self, live: list[Instance], key: RouteKey) -> PrefillChoice:
        """The instance with the fewest prompt tokens to compute (its queue plus what its
        cache lacks); ties: more cached, then the earlier in `live`. Instances holding
        nothing differ only by their queue: the least queued of them (a C-level `min`,
        the first of equals) stands for them all, against each holder (a few)."""
        held = self._cached_tokens(live, key)
        unheld = [inst for inst in live if inst.name not in held] if held else live
        pool = [inst for inst in live if inst.name in held]
        if unheld:
            pool.append(min(unheld, key=_queued))
        order = {id(inst): n for n, inst in enumerate(live)} if len(pool) > 1 else {}

        def cost(inst: Instance) -> tuple[int, int, int]:
            cached = held.get(inst.name, 0)
            queued = inst.assigned_prefill_tokens + key.num_tokens - cached
            return (queued, -cached, order.get(id(inst), 0))

        best = min(pool, key=cost)
        cached = held.get(best.name, 0)
        if cached:
            self.counters.cache_routed += 1
            tree = self.trees[best.role]
            tree.touch(best.name, key.hashes[: cached // self.block_size], time.monotonic())
        return PrefillChoice(best, cached)

    def _cached_tokens(self, live: list[Instance], key: RouteKey) -> dict[str, int]:
        """Per instance: prompt tokens its tree entries say it holds, capped as an
        instance caps its own match (at least one prompt token is always computed)."""
        if not key.hashes:
            return {}
        cap = (key.num_tokens - 1) // self.block_size * self.block_size
        blocks = self.trees[live[0].role].match(key.hashes, time.monotonic())
        return {name: min(n * self.block_size, cap) for name, n in blocks.items()}

    def donor(
        self, instances: Sequence[Instance], key: RouteKey, chosen: Instance, cached: int
    ) -> Donor | None:
        """The live prefill or decode instance other than `chosen` holding the most of the
        prompt, if that is at least a block more than `cached` (what `chosen` holds). Ties
        go to the one with the fewest prompt tokens queued (a decode instance has none):
        it answers between two steps, and a short step ends sooner."""
        if not key.hashes:
            return None
        found: list[tuple[int, int, Instance]] = []
        for role in (Role.PREFILL, Role.DECODE):
            live = [i for i in instances if i.role is role and i.alive and i is not chosen]
            held = self._cached_tokens(live, key) if live else {}
            found += [(held[i.name], -i.assigned_prefill_tokens, i) for i in live if i.name in held]
        if not found:
            return None
        tokens, _, inst = max(found, key=lambda f: (f[0], f[1]))
        return Donor(inst, tokens) if tokens >= cached + self.block_size else None

    @staticmethod
    def fetch_pays(
        tokens: int, token_bytes: int, rates: RecoveryCost, overhead_s: float = FETCH_OVERHEAD_S
    ) -> bool:
        """Copying `tokens` tokens' KV, `overhead_s` beyond its bytes (`fetch_overhead`'s
        value), beats computing them (module docstring)."""
        copy_s = overhead_s + tokens * token_bytes / rates.copy.value
        return copy_s < tokens / rates.prefill.value

    # ---- decode instances ----------------------------------------------------------------

    def decode(
        self, candidates: Sequence[Instance], key: RouteKey, num_blocks: int, heavy: bool = False
    ) -> Instance | None:
        """A live decode instance for a request needing `num_blocks` blocks (`heavy`: a
        predicted heavy decode). The length-based decode policies (cluster/policies.py)
        decide under any routing; otherwise the routing rule does."""
        live = [i for i in candidates if i.alive]
        if not live:
            return None
        chooser = self.decode_chooser
        if self.policy is Routing.LEAST_LOAD or chooser.overrides_routing:
            return chooser.choose(live, num_blocks, heavy)
        roomy = [i for i in live if has_room(i, num_blocks)] or live
        if self.policy is Routing.SESSION:
            inst = self._sticky(roomy, key) or chooser.choose(roomy, num_blocks, heavy)
            assert inst is not None
            self._remember(inst, key)
            return inst
        least = min(i.assigned_requests for i in roomy)
        near = [i for i in roomy if i.assigned_requests <= least + self.config.decode_balance]
        held = self._cached_tokens(near, key)
        return min(near, key=lambda i: (-held.get(i.name, 0), i.assigned_requests))

    # ---- sessions ------------------------------------------------------------------------

    def _sticky(self, live: Sequence[Instance], key: RouteKey) -> Instance | None:
        if key.session is None or not live:
            return None
        name = self._sessions.get((live[0].role, key.session))
        inst = next((i for i in live if i.name == name), None)
        if inst is not None:
            self._sessions.move_to_end((inst.role, key.session))
        return inst

    def _remember(self, inst: Instance, key: RouteKey) -> None:
        if key.session is None:
            return
        self._sessions[(inst.role, key.session)] = inst.name
        self._sessions.move_to_end((inst.role, key.session))
        while len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    # ---- keeping the trees true ------------------------------------------------------------

    def on_report(self, inst: Instance, report: LoadReport) -> None:
        """An instance's prefix-index events (stored, then removed: net per hash)."""
        if report.cache_stored or report.cache_removed:
            tree = self.trees[inst.role]
            tree.apply(inst.name, report.cache_stored, report.cache_removed, time.monotonic())

    def stored(self, inst: Instance, hashes: Sequence[int], now: float) -> None:
        """A copy committed the blocks `hashes` (a root path) into `inst`'s cache: its tree
        knows it at once (the instance's own events say it again in a later report, and an
        eviction after it follows it there)."""
        if hashes:
            self.trees[inst.role].apply(inst.name, hashes, [], now)

    def forget(self, inst: Instance) -> None:
        """A dead instance's entries leave its tree at once."""
        self.trees[inst.role].drop_instance(inst.name)

    def role_changed(self, inst: Instance, old: Role) -> None:
        """`inst` was an `old` instance and is an `inst.role` one now (instance flip): what
        it caches moves to its new role's tree (a prefix it cached is a hit there), and
        the sessions kept on it in its old role forget it."""
        self.trees[old].move_instance(inst.name, self.trees[inst.role])
        for key, name in list(self._sessions.items()):
            if key[0] is old and name == inst.name:
                del self._sessions[key]

    def expire(self, now: float) -> None:
        for tree in self.trees.values():
            tree.expire(now)

    def summary(self) -> dict[str, object]:
        """Counters and the trees' sizes (/debug/cluster)."""
        trees = {
            role.value: {
                "entries": tree.num_entries,
                "by_instance": tree.entries_by_instance(),
                "approx_bytes": tree.approx_bytes,
                "expired": tree.expired_total,
                "evicted": tree.evicted_total,
            }
            for role, tree in self.trees.items()
        }
        return {
            "routing": self.policy.value,
            **self.counters.as_dict(),
            "fetch_overhead_s": self.fetch_overhead.value,
            "fetch_overhead_samples": self.fetch_overhead.num_samples,
            "sessions": self.num_sessions,
            "trees": trees,
        }

    def observe(self, predicted: int, actual: int) -> None:
        """The instance's own count of cached prompt tokens for a routed request."""
        if actual < predicted:
            self.counters.misses += 1
            self.counters.missed_tokens += predicted - actual
