"""DéjàVu KV replication, engine side: a source core streams its running requests' KV into a
holder core's replica region; when the source "dies" the holder resumes each request from
its replica and the continuation is token-identical to an undisturbed run.

Two real cores over the shipped SmolLM2 in one process (shm transport), the front end's
relaying done by hand in the order the process loop sends (poll -> messages, step ->
outputs -> drops, messages). Exact tokens, exact block accounting; waits are bounded
waits on the write task, never sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from pdserve.cluster.costs import CostChoice, RecoveryCost
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, TransferConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import build_core
from pdserve.engine.engine_process import _Loop
from pdserve.engine.features.replica_store import ReplicaStore
from pdserve.engine.features.replicator import Replicator
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.errors import InvalidRequestError
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer import (
    FaultConfig,
    FaultyTransport,
    TransferPlan,
    gather,
    gather_many,
    merge_plans,
)
from pdserve.model.base import CausalLM
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.core import AddRequest, RequestRejected
from pdserve.protocol.replica import (
    DropReplicas,
    KVReplicated,
    OpenReplicaStore,
    ReplicaBlocks,
    ReplicasStored,
    ReplicaStoreOpened,
    ReplicateTo,
    ResumeFromReplica,
    StoreReplicas,
)
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.wire import EngineMessage

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten year old.",
    "List five facts about the planet Mars.",
    "What is the difference between a virus and a bacterium?",
]
PARAMS = {
    "greedy": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(
        max_tokens=48, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True
    ),
}
NUM_BLOCKS = 96
BLOCK = 16
WAIT_S = 30.0

MakeCore = Callable[..., EngineCore]


@pytest.fixture
def make_core(smollm2: tuple[CausalLM, Tokenizer]) -> Iterator[MakeCore]:
    """Cores over the shared SmolLM2; closed at teardown after their integrity checks."""
    model, tokenizer = smollm2
    made: list[EngineCore] = []

    def factory(name: str, **transfer: object) -> EngineCore:
        config = EngineConfig(
            instance_name=f"{name}-{id(object())}",
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16),
            cache=CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS, num_host_blocks=0),
            transfer=TransferConfig(transport="shm", **transfer),  # type: ignore[arg-type]
        )
        core = build_core(config, model, tokenizer.stop_token_ids)
        made.append(core)
        return core

    yield factory
    for core in made:
        core.check_integrity()
        core.close()


@pytest.fixture
def prompts(smollm2: tuple[CausalLM, Tokenizer]) -> list[list[int]]:
    tok = smollm2[1]
    return [
        tok.prompt_ids(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS
    ]


class Relay:
    """The front end's part: relays replication messages source -> holder, keeps the
    acknowledged replica per request, drops a request's replica when it finishes."""

    def __init__(self, source: EngineCore, holder: EngineCore) -> None:
        self.source, self.holder = source, holder
        self.src = source.config.instance_name
        self.dst = holder.config.instance_name
        self.acked: dict[str, ReplicaBlocks] = {}
        self.reports: list[KVReplicated] = []
        self.streamed: dict[str, list[int]] = {}

    def open(self) -> None:
        self.holder.handle(OpenReplicaStore(self.src, self.source.kv_layout))
        (opened,) = self.holder.take_messages()
        assert isinstance(opened, ReplicaStoreOpened) and opened.source == self.src
        self.source.handle(ReplicateTo(self.dst, opened.region))

    def relay(self) -> None:
        """Source messages to the holder, the holder's acknowledgements back."""
        for msg in self.source.take_messages():
            assert isinstance(msg, KVReplicated) and msg.holder == self.dst
            self.reports.append(msg)
            self.holder.handle(StoreReplicas(self.src, msg.replicas))
        for ack in self.holder.take_messages():
            assert isinstance(ack, ReplicasStored)
            self.acked.update((r.request_id, r) for r in ack.replicas)

    def step(self) -> None:
        """One iteration of the source's process loop."""
        self.source.poll_transfers()
        self.relay()
        for out in self.source.step():
            self.streamed.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
            if out.finish_reason is not None:
                self.holder.handle(DropReplicas(self.src, [out.request_id]))
                self.acked.pop(out.request_id, None)
        self.relay()

    def settle(self) -> None:
        """Let the write in flight complete and relay its report (bounded wait); then
        write what it left behind, as the next step's end would, and relay that too."""
        for _ in range(2):
            assert self.source.participant(Replicator).wait(WAIT_S)
            self.source.poll_transfers()
            self.relay()
            self.source.participant(Replicator).step_ended(self.source.scheduler.running)
        assert self.source.participant(Replicator).wait(WAIT_S)
        self.source.poll_transfers()
        self.relay()


def run(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_unfinished():
        core.poll_transfers()
        for o in core.step():
            out.setdefault(o.request_id, []).extend(t.token_id for t in o.new_tokens)
    return out


def reference(make_core: MakeCore, prompts: list[list[int]], params: SamplingParams) -> dict:
    core = make_core("reference")
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    return run(core)


def spy_schedule(core: EngineCore) -> list[SchedulerOutput]:
    """Record every SchedulerOutput the core's scheduler returns."""
    seen: list[SchedulerOutput] = []
    schedule = core.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        seen.append(out)
        return out

    core.scheduler.schedule = recording  # type: ignore[method-assign]
    return seen


def resume(
    relay: Relay, rid: str, prompt: list[int], params: SamplingParams, num_tokens: int
) -> str:
    new_id = f"{rid}-resumed"
    request = AddRequest(new_id, prompt, params, output_token_ids=relay.streamed[rid])
    relay.holder.participant(ReplicaStore).resume(
        ResumeFromReplica(request, relay.src, rid, num_tokens)
    )
    return new_id


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def assert_region_accounting(relay: Relay) -> None:
    """Source: free + allocated == region size; holder: recorded blocks == acknowledged."""
    rep = relay.source.participant(Replicator)
    allocated = sum(len(r.blocks) for r in rep._replicas.values())
    assert rep.num_free_blocks + allocated == NUM_BLOCKS
    store = relay.holder.participant(ReplicaStore)
    assert store.num_replicas == len(relay.acked)
    assert store.num_replica_blocks == sum(len(r.blocks) for r in relay.acked.values())
    for r in relay.acked.values():
        assert len(r.blocks) == blocks_for(r.num_tokens)


def kill_source(relay: Relay) -> None:
    """The source is gone: it never steps again (its requests are aborted at teardown)."""
    relay.source.handle(ReplicateTo(relay.dst, None))
    for rid in list(relay.source.requests):
        relay.source.abort(rid)
    assert relay.source.participant(Replicator).num_replicating == 0


def finish_on_holder(relay: Relay, resumed: dict[str, str]) -> dict[str, list[int]]:
    """Run the holder to the end; each resumed request's whole output (streamed + new)."""
    out = run(relay.holder)
    return {rid: relay.streamed[rid] + out[new] for rid, new in resumed.items()}


def assert_all_freed(relay: Relay) -> None:
    relay.holder.handle(DropReplicas(relay.src, []))
    for core in (relay.source, relay.holder):
        core.check_integrity()
        assert core.kv.num_used_blocks == 0 and not core.has_unfinished()
    assert relay.holder.participant(ReplicaStore).num_replicas == 0
    assert relay.holder.participant(ReplicaStore).num_replica_blocks == 0
    assert relay.source.participant(Replicator).num_replicating == 0


# ---- (a), (b): replicate while decoding, resume on the holder --------------------------


@pytest.mark.parametrize("name", list(PARAMS))
def test_resume_from_replicas_continues_token_for_token(
    make_core: MakeCore, prompts: list[list[int]], name: str
) -> None:
    params = PARAMS[name]
    whole = reference(make_core, prompts, params)
    source, holder = make_core("source"), make_core("holder")
    relay = Relay(source, holder)
    relay.open()
    for i, p in enumerate(prompts):
        source.add_request(f"r{i}", p, params)
    for _ in range(30):
        relay.step()
    relay.settle()
    assert len(relay.acked) == 4
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        total = len(p) + len(relay.streamed[rid])
        # Everything but the last sampled token is replicated once the writes settle.
        assert relay.acked[rid].num_tokens == total - 1
    assert_region_accounting(relay)
    kill_source(relay)

    seen = spy_schedule(holder)
    resumed: dict[str, str] = {}
    expected_new: dict[str, int] = {}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        # Half resume from the latest replica, half from an older acknowledged figure.
        n = relay.acked[rid].num_tokens - (0 if i % 2 == 0 else 7)
        resumed[rid] = resume(relay, rid, p, params, n)
        expected_new[resumed[rid]] = len(p) + len(relay.streamed[rid]) - n
    assert holder.participant(ReplicaStore).num_replicas == 0  # consumed
    for i, p in enumerate(prompts):
        new = resumed[f"r{i}"]
        n = len(p) + len(relay.streamed[f"r{i}"]) - expected_new[new]
        assert len(holder.kv.block_table(new)) == blocks_for(n)
        assert holder.requests[new].num_computed_tokens == n
    continued = finish_on_holder(relay, resumed)
    # The copied KV is used: the first step computes only the tokens after num_tokens.
    first = {s.request.request_id: s.num_new_tokens for s in seen[0].seqs}
    assert first == expected_new
    for rid, tokens in continued.items():
        assert tokens == whole[rid], rid
    assert_all_freed(relay)


# ---- (c): failed writes are not reported, later writes catch up ------------------------


def test_failed_writes_are_rewritten_and_resume_stays_identical(
    make_core: MakeCore, prompts: list[list[int]]
) -> None:
    params = PARAMS["greedy"]
    whole = reference(make_core, prompts[:2], params)
    source = make_core("source", fault_failure_rate=1.0, fault_seed=3)
    holder = make_core("holder")
    transport = source.transfer_link().transport
    assert isinstance(transport, FaultyTransport)
    relay = Relay(source, holder)
    relay.open()
    for i, p in enumerate(prompts[:2]):
        source.add_request(f"r{i}", p, params)
    for _ in range(8):
        relay.step()
    relay.settle()
    assert relay.reports == [] and relay.acked == {}
    assert holder.participant(ReplicaStore).num_replicas == 0
    assert all(r.written == 0 for r in source.participant(Replicator)._replicas.values())

    transport.config = FaultConfig()  # the link recovers
    relay.step()
    relay.settle()
    # The first successful write covers every token from 0, not just the newest.
    for i, p in enumerate(prompts[:2]):
        rid = f"r{i}"
        assert relay.acked[rid].num_tokens == len(p) + len(relay.streamed[rid]) - 1
    for _ in range(5):
        relay.step()
    relay.settle()
    assert_region_accounting(relay)
    kill_source(relay)

    resumed = {
        rid: resume(relay, rid, p, params, relay.acked[rid].num_tokens)
        for rid, p in zip(["r0", "r1"], prompts[:2], strict=True)
    }
    for rid, tokens in finish_on_holder(relay, resumed).items():
        assert tokens == whole[rid], rid
    assert_all_freed(relay)


# ---- (d): ReplicateTo(None) stops and frees ------------------------------------------


def test_replicate_to_none_stops_and_a_new_target_starts_from_token_zero(
    make_core: MakeCore, prompts: list[list[int]]
) -> None:
    params = PARAMS["greedy"]
    source, holder = make_core("source"), make_core("holder")
    relay = Relay(source, holder)
    relay.open()
    for i, p in enumerate(prompts[:2]):
        source.add_request(f"r{i}", p, params)
    for _ in range(4):
        relay.step()
    relay.settle()
    assert source.participant(Replicator).num_replicating == 2

    source.handle(ReplicateTo(relay.dst, None))
    assert (
        source.participant(Replicator).num_replicating == 0
        and not source.participant(Replicator).active
    )
    assert source.participant(Replicator).num_free_blocks == 0  # no region: nothing to allocate
    relay.reports.clear()
    for _ in range(3):
        relay.step()
    relay.settle()
    assert relay.reports == [] and not source.transfers_in_flight()
    holder.handle(DropReplicas(relay.src, []))  # the front end forgets them
    relay.acked.clear()
    assert (
        holder.participant(ReplicaStore).num_replicas == 0
        and holder.participant(ReplicaStore).num_replica_blocks == 0
    )

    relay.open()  # the same region again (idempotent open): from token 0
    relay.step()
    relay.settle()
    (report,) = relay.reports
    for r in report.replicas:
        i = int(r.request_id[1:])
        assert r.num_tokens == len(prompts[i]) + len(relay.streamed[r.request_id]) - 1
    assert_region_accounting(relay)
    run_rest(relay)
    assert_all_freed(relay)


def run_rest(relay: Relay) -> None:
    while relay.source.has_unfinished():
        relay.step()
    relay.settle()
    assert relay.source.participant(Replicator).num_free_blocks == NUM_BLOCKS


# ---- (e): the merged plan and the aggregated gather ----------------------------------


def test_merge_plans_concatenates_runs_and_joins_adjacent_ones() -> None:
    a = TransferPlan((0, 2), (0, 2), ((0, 32, 3), (3, 64, 2)), 8)
    b = TransferPlan((0, 2), (0, 2), ((5, 66, 4), (9, 16, 1)), 8)
    merged = merge_plans([a, b])
    assert merged.runs == ((0, 32, 3), (3, 64, 6), (9, 16, 1))
    assert merged.nbytes == a.nbytes + b.nbytes
    assert merge_plans([a]) == a
    with pytest.raises(ValueError):
        merge_plans([])
    with pytest.raises(ValueError):
        merge_plans([a, TransferPlan((0, 1), (0, 1), ((0, 0, 1),), 8)])
    with pytest.raises(ValueError):
        merge_plans([a, TransferPlan((0, 2), (0, 2), ((0, 0, 1),), 4)])


def test_gather_many_equals_gathers_concatenated() -> None:
    layout = KVLayout(
        num_layers=3, num_blocks=10, block_size=4, num_kv_heads=2, head_dim=3, dtype="float32"
    )
    pool = torch.randn(layout.shape)
    pieces = [([7, 2, 5], 3, 10), ([0], 0, 4), ([9, 1], 5, 6)]
    expected = torch.cat([gather(pool, layout, b, s, e) for b, s, e in pieces], dim=2)
    assert torch.equal(gather_many(pool, layout, pieces), expected)


# ---- (f): fallbacks: unknown replica, invalid request --------------------------------


def test_unknown_replica_falls_back_to_recompute(
    make_core: MakeCore, prompts: list[list[int]]
) -> None:
    params = PARAMS["seeded"]
    whole = reference(make_core, prompts[:1], params)["r0"]
    holder = make_core("holder")
    seen = spy_schedule(holder)
    request = AddRequest("moved", prompts[0], params, output_token_ids=whole[:9])
    holder.participant(ReplicaStore).resume(
        ResumeFromReplica(request, "nobody", "r0", len(prompts[0]) + 8)
    )
    assert [r.request_id for r in holder.scheduler.waiting] == ["moved"]
    rest = run(holder)["moved"]
    assert whole[:9] + rest == whole
    assert seen[0].seqs[0].num_new_tokens == len(prompts[0]) + 9  # all recomputed
    holder.check_integrity()
    assert holder.kv.num_used_blocks == 0


def test_invalid_resume_is_refused_and_keeps_the_replica(
    make_core: MakeCore, prompts: list[list[int]]
) -> None:
    source, holder = make_core("source"), make_core("holder")
    relay = Relay(source, holder)
    relay.open()
    source.add_request("r0", prompts[0], PARAMS["greedy"])
    for _ in range(3):
        relay.step()
    relay.settle()
    done = SamplingParams(max_tokens=len(relay.streamed["r0"]))  # nothing left to generate
    with pytest.raises(InvalidRequestError):
        resume(relay, "r0", prompts[0], done, relay.acked["r0"].num_tokens)
    assert holder.participant(ReplicaStore).num_replicas == 1 and not holder.has_unfinished()
    assert holder.kv.num_used_blocks == 0
    run_rest(relay)
    assert_all_freed(relay)


# ---- the process loop's handlers -----------------------------------------------------


class FakeSocket:
    """What `_Loop` sends, decoded."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.decoder = msgspec.msgpack.Decoder(EngineMessage)

    def send(self, raw: bytes) -> None:
        self.sent.append(self.decoder.decode(raw))


def test_engine_process_handles_the_replication_messages(make_core: MakeCore) -> None:
    holder, source = make_core("holder"), make_core("source")
    out = FakeSocket()
    loop = _Loop(holder, None, out)  # type: ignore[arg-type]
    layout = source.kv_layout
    loop.apply(OpenReplicaStore("src", layout))
    loop.apply(OpenReplicaStore("src", layout))  # idempotent: the same region
    loop.flush_messages()
    first, again = out.sent
    assert isinstance(first, ReplicaStoreOpened) and first == again
    blocks = [ReplicaBlocks("a", [0, 1], 20), ReplicaBlocks("b", [2], 16)]
    outside = ReplicaBlocks("c", [NUM_BLOCKS], 1)  # not in the region: not recorded
    loop.apply(StoreReplicas("src", [*blocks, outside]))
    loop.apply(StoreReplicas("src", [ReplicaBlocks("a", [0, 1, 3], 40)]))  # replaces a
    loop.flush_messages()
    assert out.sent[2:] == [
        ReplicasStored("src", blocks),
        ReplicasStored("src", [ReplicaBlocks("a", [0, 1, 3], 40)]),
    ]
    stats = loop.stats(1, check=True)
    assert (stats.num_replicas, stats.num_replica_blocks, stats.integrity_error) == (2, 4, None)
    # A record reusing b's block: the source reused it, so b's KV is gone (b forgotten).
    loop.apply(StoreReplicas("src", [ReplicaBlocks("d", [2], 5)]))
    assert sorted(holder.participant(ReplicaStore)._stores["src"].replicas) == ["a", "d"]
    # Invalid: nothing left to generate. Refused like an AddRequest; the replica is kept.
    request = AddRequest("x", [1, 2, 3], SamplingParams(max_tokens=1), output_token_ids=[4])
    loop.apply(ResumeFromReplica(request, "src", "a", 3))
    loop.flush_messages()  # answered with the loop's next messages, before any output
    rejected = out.sent[-1]
    assert isinstance(rejected, RequestRejected) and rejected.request_id == "x"
    loop.apply(DropReplicas("src", ["d", "unknown"]))
    assert loop.stats(2, check=True).num_replicas == 1
    loop.apply(DropReplicas("src", []))
    assert loop.stats(3, check=True).num_replica_blocks == 0
    # The source side: a region of another geometry is refused without failing the loop.
    src_loop = _Loop(source, None, FakeSocket())  # type: ignore[arg-type]
    other = msgspec.structs.replace(layout, head_dim=8)
    wrong = msgspec.structs.replace(first.region, layout=other)
    src_loop.apply(ReplicateTo("holder", wrong))
    assert not source.participant(Replicator).active
    src_loop.apply(ReplicateTo("holder", first.region))
    assert (
        source.participant(Replicator).active and src_loop.stats(4, check=True).num_replicating == 0
    )


# ---- the front end's cost rule (cluster/replication.py) ------------------------------


def test_the_cost_rule_resumes_only_where_copying_beats_recomputing() -> None:
    """README: "the front end picks replica or recompute per request by their cost".
    Resuming copies `through` tokens and recomputes the rest; recomputing computes all:
    so the replica wins exactly when one token's copy (token_bytes / copy rate) is
    shorter than its prefill (1 / prefill rate) - here 2^20 B/s against 1,024 tokens/s,
    a boundary at 1,024 bytes a token. A tie recomputes, and so does an empty replica
    even when copying is free. Powers of two: every time below is exact in floats."""
    rule = RecoveryCost(prefill_tokens_per_s=1024.0, copy_bytes_per_s=float(2**20))
    assert rule.choose(96, 160, 1023) == CostChoice(True, 96, 160, 0.156158447265625, 0.15625)
    assert rule.choose(96, 160, 1024) == CostChoice(False, 96, 160, 0.15625, 0.15625)
    assert rule.choose(96, 160, 1025) == CostChoice(False, 96, 160, 0.156341552734375, 0.15625)
    assert rule.choose(160, 160, 1023).resume  # the whole KV replicated: nothing recomputed
    assert rule.choose(0, 160, 0) == CostChoice(False, 0, 160, 0.15625, 0.15625)
    assert rule.choose(96, 160, 1023).describe() == (
        "resume from replica: replica 96/160 tokens -> copy + recompute 156.2 ms vs "
        "recompute all 156.2 ms"
    )
    assert rule.choose(96, 160, 1025).describe().startswith("recompute: replica 96/160 ")
    # The rates are measured while serving (an exponential mean, weight 0.2): a faster
    # prefill moves the boundary to 2^20 / 1228.8 = 853.3 bytes a token.
    rule.prefill.observe(2048, 1.0)
    assert rule.prefill.value == 1228.8
    assert (rule.choose(96, 160, 853).resume, rule.choose(96, 160, 854).resume) == (True, False)
    rule.prefill.observe(0, 1.0)  # nothing measured: the rate stays
    rule.copy.observe(2**20, 0.0)
    assert (rule.prefill.value, rule.copy.value) == (1228.8, float(2**20))
