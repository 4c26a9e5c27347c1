"""The router's rules (cluster/routing.py) over real prompt trees fed real events.

The instances are stand-ins (a name, a role, liveness and load: what the router reads);
the prompt trees are the controller's own, fed the events a real `KVManager` records while
real requests are allocated, committed and freed. Servers route through the same code in
test_caching_server.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.cluster.config import ClusterConfig, Routing
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.routing import RouteKey, Router, session_key
from pdserve.config import Role
from pdserve.kv.config import KVCacheConfig
from pdserve.kv.manager import KVManager
from pdserve.protocol.core import LoadReport

BS = 16


@dataclass
class Stand:
    """What the router reads of an `Instance`."""

    name: str
    role: Role
    alive: bool = True
    assigned_prefill_tokens: int = 0
    assigned_requests: int = 0
    report: LoadReport | None = None


def report(stored: list[int], removed: list[int] = ()) -> LoadReport:  # type: ignore[assignment]
    return LoadReport(0.0, 0, 0, 0, 100, 100, 0, 0, 0, list(stored), list(removed))


def make_router(routing: Routing, **cluster: object) -> Router:
    config = ClusterConfig(num_prefill=2, num_decode=2, routing=routing, **cluster)  # type: ignore[arg-type]
    return Router(config, BS, DecodeChooser(config.decode_policy, 0))


class Pool:
    """A real instance-side KV pool whose prefix-index events feed the router."""

    def __init__(self, inst: Stand, router: Router, num_blocks: int = 64) -> None:
        self.inst, self.router = inst, router
        self.kv = KVManager(KVCacheConfig(block_size=BS, num_blocks=num_blocks))
        self.kv.record_cache_events()
        self.n = 0

    def run(self, tokens: list[int]) -> None:
        """Prefill `tokens` and finish (its full blocks stay cached), then report."""
        rid = f"r{self.n}"
        self.n += 1
        cached = self.kv.match_prefix(tokens).num_cached_tokens
        assert self.kv.allocate(rid, tokens, len(tokens) - cached) is not None
        self.kv.commit(rid, tokens, len(tokens))
        self.kv.free(rid)
        self.sync()

    def sync(self) -> None:
        events = self.kv.take_cache_events()
        self.router.on_report(self.inst, report(events.stored, events.removed))  # type: ignore[arg-type]


def doc(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


def test_prefix_routing_prefers_the_cache_until_its_queue_costs_more_than_it_saves() -> None:
    router = make_router(Routing.PREFIX)
    a, b = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
    Pool(b, router).run(doc(1, 200))  # b holds 12 blocks of the document
    prompt = doc(1, 200) + doc(2, 40)
    key = router.key(prompt, None)
    choice = router.prefill([a, b], key)  # type: ignore[list-item]
    assert choice is not None and (choice.instance.name, choice.cached_tokens) == ("prefill-1", 192)
    # b's queue may exceed a's by up to the 192 tokens its cache saves, not more
    b.assigned_prefill_tokens = 192
    assert router.prefill([a, b], key).instance is b  # type: ignore[list-item, union-attr]
    b.assigned_prefill_tokens = 193
    assert router.prefill([a, b], key).instance is a  # type: ignore[list-item, union-attr]
    assert router.counters.cache_routed == 2
    # nothing cached anywhere: the shortest queue (least-load), ties to the first listed
    fresh = router.key(doc(3, 100), None)
    b.assigned_prefill_tokens = 0
    assert router.prefill([a, b], fresh).instance is a  # type: ignore[list-item, union-attr]
    a.assigned_prefill_tokens = 5
    assert router.prefill([a, b], fresh).instance is b  # type: ignore[list-item, union-attr]


def test_prefix_routing_picks_what_its_rule_says_among_many_instances() -> None:
    """64 instances, random queues with many ties, each holding a random share of a few
    documents: every choice is the definition's - the fewest prompt tokens to compute
    (queue + what the cache lacks), then the most cached, then the first listed -
    checked against an exhaustive minimum over all 64 for 300 prompts (the router
    compares the holders with the least queued of the rest only)."""
    import random

    rng = random.Random(7)
    router = make_router(Routing.PREFIX)
    insts = [Stand(f"prefill-{i}", Role.PREFILL) for i in range(64)]
    docs = [doc(100 + d, 320) for d in range(4)]
    for inst in insts:
        if rng.random() < 0.3:
            Pool(inst, router).run(rng.choice(docs)[: BS * rng.randrange(1, 20)])
    for _ in range(300):
        for inst in insts:
            inst.assigned_prefill_tokens = rng.choice((0, 16, 48, 100, 300))
        prompt = rng.choice(docs)[: rng.randrange(17, 320)] if rng.random() < 0.7 else doc(9, 64)
        key = router.key(prompt, None)
        held = router._cached_tokens(insts, key)  # type: ignore[arg-type]
        want = min(
            range(64),
            key=lambda n: (
                insts[n].assigned_prefill_tokens + len(prompt) - held.get(insts[n].name, 0),
                -held.get(insts[n].name, 0),
                n,
            ),
        )
        choice = router.prefill(insts, key)  # type: ignore[arg-type]
        assert choice is not None and choice.instance is insts[want], (want, choice)
        assert choice.cached_tokens == held.get(insts[want].name, 0)


def test_the_cap_leaves_one_prompt_token_to_compute_as_instances_do() -> None:
    router = make_router(Routing.PREFIX)
    a = Stand("prefill-0", Role.PREFILL)
    Pool(a, router).run(doc(4, 64))
    for n, want in ((64, 48), (65, 64), (80, 64)):
        choice = router.prefill([a], router.key(doc(4, 64) + doc(5, n - 64), None))  # type: ignore[list-item]
        assert choice is not None and choice.cached_tokens == want


def test_evictions_reported_by_an_instance_leave_the_tree() -> None:
    router = make_router(Routing.PREFIX)
    a = Stand("prefill-0", Role.PREFILL)
    pool = Pool(a, router, num_blocks=8)
    pool.run(doc(6, 96))  # 6 blocks cached
    key = router.key([*doc(6, 96), 1], None)
    assert router.prefill([a], key).cached_tokens == 96  # type: ignore[list-item, union-attr]
    pool.run(doc(7, 96))  # needs 6 blocks of 8: evicts 4 of the first document (LRU leaves)
    assert pool.kv.match_prefix([*doc(6, 96), 1]).num_cached_tokens == 32
    assert router.prefill([a], key).cached_tokens == 32  # type: ignore[list-item, union-attr]
    tree = router.trees[Role.PREFILL]
    assert tree.num_entries == pool.kv.num_cached_blocks == 8


def test_a_ttl_expiry_forgets_entries_and_a_dead_instance_leaves_at_once() -> None:
    router = make_router(Routing.PREFIX, prefix_ttl_s=0.05)
    a, b = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
    Pool(a, router).run(doc(8, 64))
    Pool(b, router).run(doc(8, 64))
    tree = router.trees[Role.PREFILL]
    assert tree.num_entries == 8
    router.forget(b)  # type: ignore[arg-type]
    assert tree.num_entries == 4
    key = router.key([*doc(8, 64), 1], None)
    assert router.prefill([a, b], key).instance is a  # type: ignore[list-item, union-attr]
    import time

    router.expire(time.monotonic() + 0.06)
    assert (tree.num_entries, tree.expired_total) == (0, 4)


def test_decode_prefers_the_cached_prefix_within_the_balance() -> None:
    router = make_router(Routing.PREFIX, decode_balance=1)
    d0, d1 = Stand("decode-0", Role.DECODE), Stand("decode-1", Role.DECODE)
    Pool(d1, router).run(doc(9, 128))
    key = router.key(doc(9, 128) + doc(10, 30), None)
    assert router.decode([d0, d1], key, 10) is d1  # type: ignore[list-item]
    d1.assigned_requests = 1
    assert router.decode([d0, d1], key, 10) is d1  # type: ignore[list-item]
    d1.assigned_requests = 2  # two more than decode-0: beyond the balance of 1
    assert router.decode([d0, d1], key, 10) is d0  # type: ignore[list-item]
    d1.alive = False
    d1.assigned_requests = 0
    assert router.decode([d0, d1], key, 10) is d0  # type: ignore[list-item]


def test_a_session_sticks_to_its_instances_and_moves_only_when_they_die() -> None:
    router = make_router(Routing.SESSION)
    a, b = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
    d0, d1 = Stand("decode-0", Role.DECODE), Stand("decode-1", Role.DECODE)
    key = router.key(doc(11, 50), session_key("alice"))
    assert key.hashes == ()  # session routing hashes no prompts
    first = router.prefill([a, b], key).instance  # type: ignore[list-item, union-attr]
    assert first is a
    first_d = router.decode([d0, d1], key, 4)  # type: ignore[list-item]
    assert first_d is d0
    a.assigned_prefill_tokens, d0.assigned_requests = 10_000, 50  # busy: still sticks
    assert router.prefill([a, b], key).instance is a  # type: ignore[list-item, union-attr]
    assert router.decode([d0, d1], key, 4) is d0  # type: ignore[list-item]
    other = router.key(doc(12, 50), session_key("bob"))
    assert router.prefill([a, b], other).instance is b  # type: ignore[list-item, union-attr]
    a.alive = False
    assert router.prefill([a, b], key).instance is b  # type: ignore[list-item, union-attr]
    a.alive = True
    assert router.prefill([a, b], key).instance is b  # type: ignore[list-item, union-attr]
    assert router.num_sessions == 3  # (prefill, alice), (decode, alice), (prefill, bob)


def test_session_ids_of_any_size_or_bytes_are_hashed_and_bounded() -> None:
    router = make_router(Routing.SESSION, max_sessions=2)
    a = Stand("prefill-0", Role.PREFILL)
    for raw in ("x" * 1_000_000, "\ud800\udfff\x00binary\uffff", ""):
        key = router.key([1, 2, 3], session_key(raw))
        assert key.session is not None and len(key.session) == 32
        assert router.prefill([a], key).instance is a  # type: ignore[list-item, union-attr]
    assert router.num_sessions == 2  # the oldest was forgotten


def test_least_load_ignores_sessions_and_caches() -> None:
    router = make_router(Routing.LEAST_LOAD)
    a, b = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
    Pool(b, router).run(doc(13, 100))
    key = router.key([*doc(13, 100), 1], session_key("s"))
    assert key == RouteKey(101, (), None)
    assert router.prefill([a, b], key).instance is a  # type: ignore[list-item, union-attr]


@pytest.mark.parametrize("field", ["pd_caching", "prefix_ttl_s", "max_sessions"])
def test_bad_cluster_settings_are_refused_with_the_name(field: str) -> None:
    bad = {"pd_caching": 4, "prefix_ttl_s": 0.0, "max_sessions": 0}[field]
    with pytest.raises(ValueError, match=field):
        ClusterConfig(num_prefill=1, num_decode=1, **{field: bad})  # type: ignore[arg-type]


def test_the_donor_is_the_other_instance_holding_the_most_quietest_first() -> None:
    router = make_router(Routing.PREFIX)
    a, b = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
    d = Stand("decode-0", Role.DECODE)
    Pool(b, router).run(doc(14, 160))  # 10 blocks
    Pool(d, router).run(doc(14, 160))
    key = router.key([*doc(14, 160), 1], None)
    b.assigned_prefill_tokens = 1000  # busy: the router picks a, which holds nothing
    choice = router.prefill([a, b], key)  # type: ignore[list-item]
    assert choice is not None and (choice.instance, choice.cached_tokens) == (a, 0)
    donor = router.donor([a, b, d], key, a, 0)  # type: ignore[list-item, arg-type]
    assert donor is not None and (donor.instance, donor.cached_tokens) == (d, 160)
    b.assigned_prefill_tokens = 0  # a tie in tokens goes to the fewest queued: the first
    assert router.donor([a, b, d], key, a, 0).instance is b  # type: ignore[list-item, arg-type, union-attr]
    # less than a block more than the chosen one holds: no donor
    assert router.donor([a, b, d], key, a, 160 - BS + 1) is None  # type: ignore[list-item, arg-type]
    assert router.donor([a, b, d], key, a, 160 - BS) is not None  # type: ignore[list-item, arg-type]
    assert router.donor([a, b, d], router.key(doc(15, 64), None), a, 0) is None  # type: ignore[list-item, arg-type]


def test_fetching_pays_when_the_copy_and_overhead_beat_the_prefill() -> None:
    from pdserve.cluster.costs import RecoveryCost
    from pdserve.cluster.routing import FETCH_OVERHEAD_S

    rates = RecoveryCost(prefill_tokens_per_s=1000.0, copy_bytes_per_s=1e9)
    token_bytes = 10**5  # 0.1 ms per token to copy, 1 ms to compute
    # copy: 0.1 s + n * 1e-4 s; compute: n * 1e-3 s: even at n = 111.1
    assert FETCH_OVERHEAD_S == 0.1
    assert not Router.fetch_pays(111, token_bytes, rates)
    assert Router.fetch_pays(112, token_bytes, rates)


def test_an_instance_holding_less_than_the_tree_said_counts_a_miss() -> None:
    router = make_router(Routing.PREFIX)
    router.observe(predicted=64, actual=64)
    router.observe(predicted=0, actual=32)  # more than believed: no miss
    assert (router.counters.misses, router.counters.missed_tokens) == (0, 0)
    router.observe(predicted=96, actual=32)  # evicted between the report and the prefill
    assert (router.counters.misses, router.counters.missed_tokens) == (1, 64)
