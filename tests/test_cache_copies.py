"""The front end's KV copies into prefix caches and the requests waiting for them
(cluster/cache_copies.py), on stand-in instances and a clock the test moves.

Each test drives the messages of one copy (KVOffered, PrefixFetched, a death, the clock)
and asserts exactly what goes out: FetchPrefix to the destination, ReleaseKV to the
source once, the parked requests sent once (or dropped with a dead destination), the
counters, the measured overhead and the prompt tree. Servers run the same code in
test_caching_server.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.config import ClusterConfig, Routing
from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.routing import FETCH_OVERHEAD_S, Router, RunningMedian
from pdserve.config import Role
from pdserve.kv.block_hash import block_hashes
from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.protocol.cache import (
    FetchPrefix,
    KVOffered,
    OfferKind,
    OfferPrefix,
    PrefixFetched,
    offer_id,
)
from pdserve.protocol.core import AddRequest
from pdserve.protocol.handoff import KVSource, ReleaseKV
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.wire import EngineMessage

BS = 16
WAIT_S = 2.0
COPY_BPS = 1e9  # the measured copy bandwidth: 1 ms per MB


@dataclass
class Stand:
    """What the copies read of an `Instance`, and what they send it."""

    name: str
    role: Role
    alive: bool = True
    sent: list[EngineMessage] = field(default_factory=list)

    def send(self, msg: EngineMessage) -> None:
        self.sent.append(msg)

    def take(self) -> list[EngineMessage]:
        out, self.sent = self.sent, []
        return out


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """Two prefill and one decode stand-in, the copies over a real router, and the
    requests the copies sent (key, instance name)."""

    def __init__(self, **cluster: object) -> None:
        config = ClusterConfig(
            num_prefill=2, num_decode=1, routing=Routing.PREFIX, kv_wait_s=WAIT_S, **cluster
        )  # type: ignore[arg-type]
        self.router = Router(config, BS, DecodeChooser(config.decode_policy, 0))
        self.p0, self.p1 = Stand("prefill-0", Role.PREFILL), Stand("prefill-1", Role.PREFILL)
        self.d = Stand("decode-0", Role.DECODE)
        self.clock = Clock()
        self.sent: list[tuple[str, str]] = []
        by_name = {s.name: s for s in (self.p0, self.p1, self.d)}
        self.copies = CacheCopies(
            config,
            BS,
            self.router,
            RecoveryCost(copy_bytes_per_s=COPY_BPS),
            by_name.get,  # type: ignore[arg-type]
            lambda key, inst, request: self.sent.append((key, inst.name)),
            self.clock,
        )

    @property
    def counters(self) -> dict[str, int]:
        return self.router.counters.as_dict()

    def park(self, key: str, prompt: list[int], dest: Stand) -> int | None:
        """Park a request on the copy into `dest` that gives most of `prompt` (as the
        controller does); the tokens it gives, None when no copy gives any."""
        found = self.copies.inbound(dest, prompt)  # type: ignore[arg-type]
        if found is None:
            return None
        self.copies.wait(found[0], key, request(key, prompt))
        return found[1]


def request(key: str, prompt: list[int]) -> AddRequest:
    return AddRequest(key, prompt, SamplingParams(max_tokens=4), 0.0, None)


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


def offered(
    key: str, to: str, token_ids: list[int], kind: OfferKind = OfferKind.RETURN
) -> KVOffered:
    """The `kind` offer made for request `key`."""
    layout = KVLayout(
        num_layers=2, num_blocks=64, block_size=BS, num_kv_heads=1, head_dim=4, dtype="float32"
    )
    full = len(token_ids) // BS * BS
    region = RegionHandle("shm", "seg", "decode-0", layout)
    source = KVSource((region,), list(range(full // BS)), full, 1e9)
    return KVOffered(offer_id(kind, key), kind, to, token_ids[:full], source)


def fetched(
    offer_id: str, num_tokens: int, num_fetched: int, nbytes: int, error: str | None = None
) -> PrefixFetched:
    return PrefixFetched(offer_id, "decode-0", num_tokens, num_fetched, nbytes, error)


# A turn's prompt (100 tokens) and answer (40): the decode instance computed all but the
# last token, 139 tokens, 8 full blocks; the next turn's prompt starts with all 140.
PROMPT, ANSWER = tokens(100), tokens(40, seed=2)
HISTORY = (PROMPT + ANSWER)[:-1]
NEXT = PROMPT + ANSWER + tokens(30, seed=3)


def return_on_its_way(rig: Rig) -> None:
    rig.copies.expect_return("r1", rig.d, rig.p0, HISTORY)  # type: ignore[arg-type]


def next_turn_waiting_on_the_copy(rig: Rig) -> None:
    """The return offered and relayed (FetchPrefix taken), the next turn (r2) parked."""
    return_on_its_way(rig)
    rig.copies.on_offered(rig.d, offered("r1", "prefill-0", HISTORY))  # type: ignore[arg-type]
    assert [type(m) for m in rig.p0.take()] == [FetchPrefix]
    rig.park("r2", NEXT, rig.p0)


def test_the_next_turn_waits_for_the_return_and_goes_when_it_commits() -> None:
    rig = Rig()
    return_on_its_way(rig)
    # before the offer is even read, the next turn finds the copy: 8 blocks of its prompt
    assert rig.park("r2", NEXT, rig.p0) == 8 * BS
    assert rig.copies.inbound(rig.p1, NEXT) is None  # nothing on its way to prefill-1
    assert rig.sent == [] and rig.counters["kv_waits"] == 1
    rig.clock.now += 0.01
    rig.copies.on_offered(rig.d, offered("r1", "prefill-0", HISTORY))  # type: ignore[arg-type]
    [fetch] = rig.p0.take()
    assert isinstance(fetch, FetchPrefix) and fetch.offer_id == "r1@return"
    assert fetch.token_ids == HISTORY[: 8 * BS] and rig.sent == []
    rig.clock.now += 0.04  # 8 blocks, 1 MB: 1 ms of copy, 49 ms of overhead
    rig.copies.on_fetched(rig.p0, fetched("r1@return", 8 * BS, 2 * BS, 10**6))  # type: ignore[arg-type]
    assert rig.d.take() == [ReleaseKV(["r1@return"])]
    assert rig.sent == [("r2", "prefill-0")]
    assert rig.counters["returns_fetched"] == 1 and rig.counters["returned_tokens"] == 2 * BS
    assert rig.router.fetch_overhead.value == pytest.approx(0.05 - 0.001)
    # the tree knows at once that prefill-0 holds the 8 blocks (before its next report)
    held = rig.router.trees[Role.PREFILL].match(block_hashes(NEXT, BS), rig.clock.now)
    assert held == {"prefill-0": 8}
    assert rig.copies.num_copies == rig.copies.num_waiting == 0


def test_a_wait_ends_at_the_bound_and_the_copy_still_lands() -> None:
    rig = Rig()
    next_turn_waiting_on_the_copy(rig)
    rig.clock.now += WAIT_S - 0.01
    rig.copies.tick(rig.clock.now)
    assert rig.sent == []
    rig.clock.now += 0.01
    rig.copies.tick(rig.clock.now)
    assert rig.sent == [("r2", "prefill-0")] and rig.counters["kv_wait_timeouts"] == 1
    rig.copies.on_fetched(rig.p0, fetched("r1@return", 8 * BS, 2 * BS, 10**6))  # type: ignore[arg-type]
    assert rig.sent == [("r2", "prefill-0")]  # sent once
    assert rig.d.take() == [ReleaseKV(["r1@return"])]
    assert rig.counters["returns_fetched"] == 1


def test_a_failed_copy_sends_the_waiting_at_once_and_measures_nothing() -> None:
    rig = Rig()
    next_turn_waiting_on_the_copy(rig)
    rig.copies.on_fetched(rig.p0, fetched("r1@return", 0, 0, 0, "injected transfer failure"))  # type: ignore[arg-type]
    assert rig.sent == [("r2", "prefill-0")]
    assert rig.d.take() == [ReleaseKV(["r1@return"])]
    assert rig.counters["returns_failed"] == 1 and rig.counters["kv_wait_timeouts"] == 0
    assert rig.router.fetch_overhead.num_samples == 0
    assert rig.router.fetch_overhead.value == FETCH_OVERHEAD_S
    assert rig.router.trees[Role.PREFILL].num_entries == 0


def test_a_return_past_the_bound_of_copies_in_flight_is_dropped_and_unpinned() -> None:
    rig = Rig(max_returns_in_flight=1)
    other = tokens(64, seed=9)
    rig.copies.on_offered(rig.d, offered("r0", "prefill-0", other))  # type: ignore[arg-type]
    assert len(rig.p0.take()) == 1  # copying: prefill-0's one return in flight
    return_on_its_way(rig)
    rig.park("r2", NEXT, rig.p0)
    rig.copies.on_offered(rig.d, offered("r1", "prefill-0", HISTORY))  # type: ignore[arg-type]
    assert rig.p0.take() == [] and rig.d.take() == [ReleaseKV(["r1@return"])]
    assert rig.sent == [("r2", "prefill-0")]
    assert rig.counters["returns_dropped"] == 1
    # an offer to an instance nobody knows: unpinned at once
    rig.copies.on_offered(rig.d, offered("r3", "prefill-9", HISTORY))  # type: ignore[arg-type]
    assert rig.d.take() == [ReleaseKV(["r3@return"])]
    assert rig.counters["returns_dropped"] == 2


def test_a_dead_destination_unpins_its_copies_and_its_waiting_requests_move_with_it() -> None:
    rig = Rig()
    next_turn_waiting_on_the_copy(rig)
    rig.p0.alive = False
    rig.copies.instance_dead(rig.p0)  # type: ignore[arg-type]
    assert rig.d.take() == [ReleaseKV(["r1@return"])]
    assert rig.sent == []  # the controller moves r2 with prefill-0's other requests
    assert rig.copies.num_copies == rig.copies.num_waiting == 0
    assert rig.counters["returns_failed"] == 1
    rig.copies.on_fetched(rig.p0, fetched("r1@return", 8 * BS, 2 * BS, 10**6))  # type: ignore[arg-type]
    assert rig.d.take() == [] and rig.counters["returns_fetched"] == 0  # unpinned once


def test_a_source_dead_before_its_offer_sends_the_waiting_and_counts_no_return() -> None:
    rig = Rig()
    return_on_its_way(rig)
    rig.park("r2", NEXT, rig.p0)
    rig.d.alive = False
    rig.copies.instance_dead(rig.d)  # type: ignore[arg-type]
    assert rig.sent == [("r2", "prefill-0")]
    assert rig.counters["returns_failed"] == rig.counters["returns_dropped"] == 0


def test_an_offer_that_never_comes_is_forgotten_after_the_bound() -> None:
    rig = Rig()
    return_on_its_way(rig)
    rig.clock.now += WAIT_S
    rig.copies.tick(rig.clock.now)
    assert rig.copies.num_copies == 0 and rig.counters["returns_failed"] == 0
    # it comes after all: relayed as a return nobody expected
    rig.copies.on_offered(rig.d, offered("r1", "prefill-0", HISTORY))  # type: ignore[arg-type]
    assert [type(m) for m in rig.p0.take()] == [FetchPrefix]


def test_a_prefetch_parks_its_request_and_others_wanting_the_same_prefix() -> None:
    rig = Rig()
    doc = tokens(200, seed=5)
    first, second = doc + tokens(10, seed=6), doc + tokens(20, seed=7)
    rig.copies.prefetch("a", rig.d, rig.p1, doc[:192], request("a", first))  # type: ignore[arg-type]
    [offer] = rig.d.take()
    assert offer == OfferPrefix("a@prefetch", doc[:192], "prefill-1")
    assert rig.counters["kv_waits"] == 0  # its own fetch
    assert rig.park("b", second, rig.p1) == 192
    assert rig.counters["kv_waits"] == 1
    # the donor evicted it meanwhile: both go, and prefill-1 computes
    rig.copies.on_fetched(rig.d, fetched("a@prefetch", 0, 0, 0, "not cached here any more"))  # type: ignore[arg-type]
    assert sorted(rig.sent) == [("a", "prefill-1"), ("b", "prefill-1")]
    assert rig.counters["prefetches_failed"] == 1 and rig.d.take() == []  # nothing pinned


def test_a_prefetch_that_commits_counts_its_tokens() -> None:
    rig = Rig()
    doc = tokens(200, seed=5)
    rig.copies.prefetch("a", rig.d, rig.p1, doc[:192], request("a", doc))  # type: ignore[arg-type]
    rig.d.take()
    rig.copies.on_offered(rig.d, offered("a", "prefill-1", doc[:192], OfferKind.PREFETCH))  # type: ignore[arg-type]
    assert [type(m) for m in rig.p1.take()] == [FetchPrefix]
    rig.copies.on_fetched(rig.p1, fetched("a@prefetch", 192, 192, 0))  # type: ignore[arg-type]
    assert rig.sent == [("a", "prefill-1")] and rig.d.take() == [ReleaseKV(["a@prefetch"])]
    assert (rig.counters["prefetches"], rig.counters["prefetched_tokens"]) == (1, 192)


def test_inbound_takes_the_copy_giving_most_capped_as_an_instance_caps_its_match() -> None:
    rig = Rig()
    return_on_its_way(rig)  # 8 blocks of NEXT
    rig.copies.expect_return("r0", rig.d, rig.p0, PROMPT)  # type: ignore[arg-type]
    found = rig.copies.inbound(rig.p0, NEXT)  # type: ignore[arg-type]
    assert found is not None and (found[0].offer_id, found[1]) == ("r1@return", 8 * BS)
    # a prompt that is the history itself: its last token is computed, 7 full blocks + 15
    found = rig.copies.inbound(rig.p0, HISTORY[: 8 * BS])  # type: ignore[arg-type]
    assert found is not None and found[1] == 7 * BS
    assert rig.copies.inbound(rig.p0, tokens(100, seed=8)) is None  # nothing in common


def test_the_running_median_is_the_seed_until_measured_then_the_recent_median() -> None:
    median = RunningMedian(0.1, window=3)
    assert (median.value, median.num_samples) == (0.1, 0)
    for sample in (0.5, 0.01, 0.02):
        median.observe(sample)
    assert median.value == 0.02
    median.observe(0.03)  # 0.5 leaves the window
    assert median.value == 0.02 and median.num_samples == 3


def test_a_measured_overhead_changes_whether_a_fetch_pays() -> None:
    rates = RecoveryCost(prefill_tokens_per_s=1000.0, copy_bytes_per_s=1e9)
    token_bytes = 10**5  # 0.1 ms per token to copy, 1 ms to compute
    # 48 tokens: 48 ms to compute; copying costs 4.8 ms + the overhead
    assert not Router.fetch_pays(48, token_bytes, rates)  # the seed, 100 ms
    assert Router.fetch_pays(48, token_bytes, rates, overhead_s=0.02)
    assert not Router.fetch_pays(48, token_bytes, rates, overhead_s=0.05)


def test_the_wait_bound_and_the_fault_scope_are_checked() -> None:
    from pdserve.config import TransferConfig

    assert ClusterConfig(num_colocated=1).kv_wait_s == 2.0
    with pytest.raises(ValueError, match="kv_wait_s must be > 0, got 0"):
        ClusterConfig(num_colocated=1, kv_wait_s=0)
    with pytest.raises(ValueError, match="fault_scope must be all or cache, got 'copies'"):
        TransferConfig(fault_scope="copies")
