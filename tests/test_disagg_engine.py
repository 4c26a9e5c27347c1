"""Prefill and decode roles of the engine core, in one process: a prefill core and a
decode core over one model, a tiny synchronous router passing their messages (the
cluster controller's job, tested with real processes in test_disagg_server.py).

Checked exactly: greedy tokens equal the colocated core's, the decode pool holds the
prefill pool's KV bit for bit, and block accounting is back to zero on both sides. Also
one live core switched between roles (`EngineCore.switch_role`), working in each, and
MemServe's PD-Caching-3 return (protocol/cache.py): a finished request's prompt + answer
KV lands in the prefill core's prefix cache bit for bit, and every way it can fail frees
what it held on both sides.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.pairs import (
    Router,
    assert_clean,
    colocated_outputs,
    drain,
    make_core,
    prompts,
    run_pair,
)
from helpers.tiny_models import make_tiny_model

from pdserve.cluster.transfer_policy import transfer_policy
from pdserve.config import EngineConfig, Role
from pdserve.engine.core import EngineCore
from pdserve.engine.engine import load_model
from pdserve.engine.features.cache_exchange import CacheExchange
from pdserve.engine.features.role_flip import RoleFlip
from pdserve.engine.roles import ColocatedRole, DecodeRole, PrefillRole
from pdserve.kv.transfer import gather
from pdserve.model.base import CausalLM
from pdserve.protocol.cache import FetchPrefix, KVOffered, OfferKind, OfferPrefix, PrefixFetched
from pdserve.protocol.core import AddRequest
from pdserve.protocol.handoff import (
    AddPrefilled,
    Handoff,
    KVHandedOff,
    KVReceived,
    ReserveKV,
    TransferMode,
)
from pdserve.protocol.role import RoleSwitched, SwitchRole
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.wire import EngineInput, EngineMessage

MODES = ["pull", "layer-push", "request-push"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("disagg"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> CausalLM:
    return load_model(EngineConfig(model=str(model_dir), num_threads=1))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
@pytest.mark.parametrize("mode", MODES)
def test_disaggregated_pair_matches_colocated_and_moves_kv_bit_exact(
    model_dir: Path, model: CausalLM, mode: str, transport: str
) -> None:
    batch = prompts(32, model.config.vocab_size)
    reference = colocated_outputs(make_core(model_dir, model, Role.COLOCATED), batch, GREEDY)
    router, p, d = run_pair(model_dir, model, mode, GREEDY, batch, transport)
    try:
        assert router.failures == {}
        assert router.tokens == reference
        assert router.kv_equal == {f"r{i}": True for i in range(len(batch))}
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("d_block", [8, 32, 5])
@pytest.mark.parametrize("mode", MODES)
def test_instances_with_different_block_sizes_exchange_kv(
    model_dir: Path, model: CausalLM, mode: str, d_block: int
) -> None:
    batch = prompts(12, model.config.vocab_size, seed=1)
    reference = colocated_outputs(make_core(model_dir, model, Role.COLOCATED), batch, GREEDY)
    router, p, d = run_pair(model_dir, model, mode, GREEDY, batch, "shm", 16, d_block)
    try:
        assert router.failures == {}
        assert router.tokens == reference
        assert all(router.kv_equal.values()) and len(router.kv_equal) == len(batch)
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_continues_the_same_random_stream(
    model_dir: Path, model: CausalLM, mode: str
) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    batch = prompts(6, model.config.vocab_size, seed=2)
    reference = colocated_outputs(make_core(model_dir, model, Role.COLOCATED), batch, params)
    router, p, d = run_pair(model_dir, model, mode, params, batch)
    try:
        assert router.tokens == reference
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_transfer_failing_frees_every_block_on_both_sides(
    model_dir: Path, model: CausalLM, mode: str
) -> None:
    batch = prompts(8, model.config.vocab_size, seed=3)
    router, p, d = run_pair(
        model_dir, model, mode, GREEDY, batch, "shm", fault_failure_rate=1.0, fault_seed=0
    )
    try:
        assert sorted(router.failures) == sorted(f"r{i}" for i in range(len(batch)))
        side = "fetching" if mode == "pull" else "pushing"
        for message in router.failures.values():
            assert message.startswith(f"{side} the KV")
            assert "injected transfer failure" in message
        # The first token was produced by the prefill side; nothing after it.
        assert all(len(t) == 1 for t in router.tokens.values())
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", MODES)
def test_some_transfers_failing_leaves_the_rest_exact_and_leaks_nothing(
    model_dir: Path, model: CausalLM, mode: str
) -> None:
    """A 0.3 transfer failure rate over many requests: each one either finishes with the
    colocated tokens or fails with the injected error (after only its first token), both
    outcomes happen (seeded draws on one transfer thread: deterministic), and no block is
    left used, held, reserved or in flight on either side."""
    batch = prompts(24, model.config.vocab_size, seed=6)
    reference = colocated_outputs(make_core(model_dir, model, Role.COLOCATED), batch, GREEDY)
    router, p, d = run_pair(
        model_dir, model, mode, GREEDY, batch, "shm", fault_failure_rate=0.3, fault_seed=1
    )
    try:
        ids = [f"r{i}" for i in range(len(batch))]
        failed = sorted(router.failures, key=ids.index)
        completed = sorted(router.finished - set(failed), key=ids.index)
        assert sorted(failed + completed, key=ids.index) == ids  # each one exactly once
        assert failed and completed, (failed, completed)
        side = "fetching" if mode == "pull" else "pushing"
        for rid in failed:
            assert router.failures[rid].startswith(f"{side} the KV"), router.failures[rid]
            assert "injected transfer failure" in router.failures[rid]
            assert len(router.tokens[rid]) == 1  # the prefill side's first token, no more
        assert {rid: router.tokens[rid] for rid in completed} == {
            rid: reference[rid] for rid in completed
        }
        assert all(router.kv_equal[rid] for rid in completed)
        assert_clean(p, d)
        assert isinstance(p.role, PrefillRole) and isinstance(d.role, DecodeRole)
        assert p.role.num_held == p.role.num_transferring == 0
        assert d.role.num_reserved == d.role.num_transferring == 0
        for core in (p, d):
            assert core.kv.num_free_host_blocks == core.kv.cfg.num_host_blocks
            assert core.kv.num_obtainable_blocks == core.kv.cfg.num_blocks
    finally:
        p.close()
        d.close()


def test_decode_side_prefix_cache_fetches_only_the_uncached_tail(
    model_dir: Path, model: CausalLM
) -> None:
    shared = prompts(1, model.config.vocab_size, seed=4)[0][:40] * 2  # 80 tokens
    batch = [shared, [*shared[:64], 7, 8, 9]]
    p = make_core(model_dir, model, Role.PREFILL, "pull", "shm")
    d = make_core(model_dir, model, Role.DECODE, "pull", "shm")
    received: list[KVReceived] = []
    try:
        for prompt in batch:  # one after the other: the second finds the first's blocks
            router = Router(p, d, "pull", [prompt], GREEDY)
            original = router.route

            def spy(msg: EngineMessage, original=original) -> None:  # type: ignore[no-untyped-def]
                if isinstance(msg, KVReceived):
                    received.append(msg)
                original(msg)

            router.route = spy  # type: ignore[method-assign]
            router.run()
            assert router.kv_equal == {"r0": True}
        per_token = 2 * model.config.num_hidden_layers * d.kv_layout.token_bytes
        # 64 of the second prompt's tokens (4 full blocks) were already on the decode side.
        assert [m.nbytes for m in received] == [80 * per_token, 3 * per_token]
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_a_fetch_past_the_lease_fails_instead_of_reading_reused_blocks(
    model_dir: Path, model: CausalLM
) -> None:
    p = make_core(model_dir, model, Role.PREFILL, "pull", "shm", lease_s=2.0, timeout_s=1.0)
    d = make_core(model_dir, model, Role.DECODE, "pull", "shm", lease_s=2.0, timeout_s=1.0)
    batch = prompts(1, model.config.vocab_size, seed=5)
    router = Router(p, d, "pull", batch, GREEDY)
    original = router.route

    def late(msg: EngineMessage) -> None:
        if isinstance(msg, KVHandedOff) and msg.source is not None:
            source = msgspec.structs.replace(
                msg.source, lease_deadline=msg.source.lease_deadline - 1.5
            )
            msg = msgspec.structs.replace(msg, source=source)
        original(msg)

    router.route = late  # type: ignore[method-assign]
    try:
        router.run()
        assert router.failures == {
            "r0": "the prefill instance's lease on the KV ran out before it was fetched"
        }
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


# ---- one live core, switched between roles -------------------------------------------


def assert_idle_pool(core: EngineCore, cached: int | None = None) -> int:
    """Integrity and exact accounting of an idle pool; returns the cached block count."""
    kv = core.kv
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.cfg.num_blocks
    if cached is not None:
        assert kv.num_cached_blocks == cached
    return kv.num_cached_blocks


def assert_pair_exact(
    prefill: EngineCore, decode: EngineCore, batch: list[list[int]], reference: EngineCore
) -> None:
    """Every request handed off (KVHandedOff -> AddPrefilled -> KVReceived, KV bit for
    bit) and finished with the colocated `reference`'s tokens; both sides clean."""
    router = Router(prefill, decode, "pull", batch, GREEDY)
    router.run()
    assert router.failures == {}
    assert router.kv_equal == {f"r{i}": True for i in range(len(batch))}
    assert router.tokens == colocated_outputs(reference, batch, GREEDY)
    assert_clean(prefill, decode)


def test_a_live_idle_core_switches_role_and_works_in_each(model_dir: Path, model: CausalLM) -> None:
    """colocated -> prefill -> decode -> colocated on one core (shm regions): the switch
    keeps the pool's accounting and prefix cache; as prefill the core hands every request
    off to a decode core, as decode it takes every request from a prefill core (tokens
    and KV exact), and back as colocated it gives its first outputs again, now from its
    prefix cache (the pool was copied into the region with the cached blocks' KV)."""
    vocab = model.config.vocab_size
    first, handed, taken = (prompts(6, vocab, seed=s) for s in (7, 8, 9))
    reference = make_core(model_dir, model, Role.COLOCATED)
    core = make_core(model_dir, model, Role.COLOCATED, transport="shm")
    peer_d = make_core(model_dir, model, Role.DECODE, transport="shm")
    peer_p = make_core(model_dir, model, Role.PREFILL, transport="shm")
    try:
        before = colocated_outputs(core, first, GREEDY)
        cached = assert_idle_pool(core)
        assert cached > 0 and core.link is None

        core.switch_role(Role.PREFILL)
        assert isinstance(core.role, PrefillRole) and core.config.role is Role.PREFILL
        assert core.link is not None
        assert core.runner.cache.device_tensor is core.link.region.tensor
        assert_idle_pool(core, cached)
        assert_pair_exact(core, peer_d, handed, reference)
        cached = assert_idle_pool(core)

        region = core.link.region
        core.switch_role(Role.DECODE)
        assert isinstance(core.role, DecodeRole) and core.link.region is region
        assert_idle_pool(core, cached)
        assert_pair_exact(peer_p, core, taken, reference)
        cached = assert_idle_pool(core)

        core.switch_role(Role.COLOCATED)
        assert isinstance(core.role, ColocatedRole) and core.runner.hooks is None
        assert_idle_pool(core, cached)
        hits = core.kv.prefix_cache_hits
        assert colocated_outputs(core, first, GREEDY) == before
        assert core.kv.prefix_cache_hits > hits
        assert_idle_pool(core)
    finally:
        for c in (reference, core, peer_d, peer_p):
            c.close()


def refusal(core: EngineCore, role: Role) -> str:
    """The error of a refused switch; the core kept its role, config and pool."""
    before = (core.role, core.config, core.link, core.runner.cache.device_tensor)
    with pytest.raises(RuntimeError) as exc:
        core.switch_role(role)
    assert (core.role, core.config, core.link, core.runner.cache.device_tensor) == before
    return str(exc.value)


def test_a_busy_core_refuses_to_switch_role(model_dir: Path, model: CausalLM) -> None:
    """Refused with what it still holds, and nothing changes; once drained it switches."""
    prompt = prompts(1, model.config.vocab_size, seed=10)[0][:40] * 2  # 80 tokens: 5 blocks
    core = make_core(model_dir, model, Role.COLOCATED, transport="shm")
    prefill = make_core(model_dir, model, Role.PREFILL, transport="shm")
    try:
        core.add_request("r0", prompt, GREEDY)
        assert refusal(core, Role.PREFILL) == (
            "cannot switch the colocated core to prefill: it is not idle (requests 1, "
            "held 0, transferring 0, reserved 0, blocks in use 0); switch between steps "
            "once it has drained"
        )
        core.step()  # one 64-token chunk: 4 blocks
        assert refusal(core, Role.DECODE) == (
            "cannot switch the colocated core to decode: it is not idle (requests 1, "
            "held 0, transferring 0, reserved 0, blocks in use 4); switch between steps "
            "once it has drained"
        )
        assert core.link is None  # no region was opened for the refused switches
        drain(core)
        core.switch_role(Role.DECODE)
        assert isinstance(core.role, DecodeRole)

        # A prefill core holding a handed-off prompt's KV (pull: until ReleaseKV).
        prefill.add_request("r0", prompt, GREEDY, handoff=Handoff(TransferMode.PULL))
        drain(prefill)
        assert any(isinstance(m, KVHandedOff) for m in prefill.take_messages())
        assert refusal(prefill, Role.COLOCATED) == (
            "cannot switch the prefill core to colocated: it is not idle (requests 0, "
            "held 1, transferring 0, reserved 0, blocks in use 5); switch between steps "
            "once it has drained"
        )
        prefill.release(["r0"])
        prefill.switch_role(Role.COLOCATED)
        assert_idle_pool(prefill)
    finally:
        core.close()
        prefill.close()


def switches(core: EngineCore) -> list[RoleSwitched]:
    """The RoleSwitched answers the core posted (its other messages dropped)."""
    return [m for m in core.take_messages() if isinstance(m, RoleSwitched)]


def test_switch_role_messages_wait_for_an_idle_core_and_a_later_one_replaces_them(
    model_dir: Path, model: CausalLM
) -> None:
    """SwitchRole (instance flip's instance side, engine/features/role_flip.py) on a busy
    core waits, polled between steps, and switches once the core holds nothing: the new
    role and token budget, the prefix cache kept, RoleSwitched with the wait. A SwitchRole
    to the role the core holds answers at once and cancels one waiting (never answered)."""
    vocab = model.config.vocab_size
    batch = prompts(2, vocab, seed=11)
    core = make_core(model_dir, model, Role.COLOCATED, transport="shm")
    try:
        flip = core.participant(RoleFlip)
        core.add_request("r0", batch[0], GREEDY)
        core.handle(SwitchRole(1, Role.DECODE, 512))
        assert switches(core) == [] and flip.busy()
        core.handle(SwitchRole(2, Role.COLOCATED, 512))  # cancels the switch waiting
        assert switches(core) == [RoleSwitched(2, Role.COLOCATED)] and not flip.busy()
        drain(core)
        core.poll_transfers()
        assert switches(core) == [] and isinstance(core.role, ColocatedRole)

        core.add_request("r1", batch[1], GREEDY)
        core.handle(SwitchRole(3, Role.PREFILL, 48))
        core.step()
        core.poll_transfers()  # still running r1: no switch
        assert switches(core) == [] and isinstance(core.role, ColocatedRole)
        drain(core)
        cached = assert_idle_pool(core)
        core.poll_transfers()
        [done] = switches(core)
        assert (done.flip_id, done.role, done.error) == (3, Role.PREFILL, None)
        assert done.waited_s > 0 and done.switch_s >= 0
        assert isinstance(core.role, PrefillRole) and core.config.role is Role.PREFILL
        assert core.scheduler.config.max_num_batched_tokens == 48
        assert core.config.scheduler.max_num_batched_tokens == 48
        assert_idle_pool(core, cached)
        assert core.stats()["num_role_switches"] == 1 and not flip.busy()

        # leave (a scale-in): waits for the idle core like a switch, changes nothing
        core.handle(SwitchRole(4, Role.COLOCATED, 512))
        core.poll_transfers()
        assert [s.role for s in switches(core)] == [Role.COLOCATED]
        core.add_request("r2", batch[0], GREEDY)
        core.handle(SwitchRole(5, Role.COLOCATED, 512, leave=True))
        core.step()
        core.poll_transfers()
        assert switches(core) == [] and flip.busy()
        drain(core)
        core.poll_transfers()
        [left] = switches(core)
        assert (left.flip_id, left.role, left.error, left.switch_s) == (5, Role.COLOCATED, None, 0)
        assert left.waited_s > 0 and isinstance(core.role, ColocatedRole)
        assert core.stats()["num_role_switches"] == 2 and not flip.busy()
    finally:
        core.close()


# ---- PD-Caching-3: the decode core returns finished KV to the prefill core ----------------


class ReturningRouter(Router):
    """`Router`, plus the controller's part of the return: KVOffered -> FetchPrefix to
    the prefill core; PrefixFetched -> (KV compared while still pinned) ReleaseKV."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.return_to = "prefill"
        self.offers: dict[str, KVOffered] = {}
        self.fetched: dict[str, PrefixFetched] = {}
        self.returned_equal: dict[str, bool] = {}

    def idle(self) -> bool:
        return super().idle() and len(self.fetched) == len(self.offers)

    def route(self, msg: EngineMessage) -> None:
        if isinstance(msg, KVOffered):
            self.offers[msg.offer_id] = msg
            fetch = FetchPrefix(msg.offer_id, "decode", msg.token_ids, msg.source)
            self.prefill.handle(fetch)
        elif isinstance(msg, PrefixFetched):
            self.fetched[msg.offer_id] = msg
            self.returned_equal[msg.offer_id] = self.same_returned_kv(self.offers[msg.offer_id])
            self.decode.release([msg.offer_id])
        else:
            super().route(msg)

    def same_returned_kv(self, offer: KVOffered) -> bool:
        """The prefill pool's indexed KV of the offered tokens equals the decode pool's."""
        n = offer.source.num_tokens
        want = gather(
            self.decode.runner.cache.device_tensor, self.decode.kv_layout, offer.source.blocks, 0, n
        )
        p = self.prefill
        if p.kv.hold("probe", offer.token_ids, 0) != n:
            p.kv.free("probe")
            return False
        got = gather(p.runner.cache.device_tensor, p.kv_layout, p.kv.block_table("probe"), 0, n)
        p.kv.free("probe")
        return bool(torch.equal(want, got))


def test_finished_kv_returns_to_the_prefill_cache_bit_exact(
    model_dir: Path, model: CausalLM
) -> None:
    """Acceptance 2 of the caching issue: after a request finishes, the prefill core's
    index holds the answer's full blocks, bit-exact to the decode core's KV; only the
    blocks it lacked moved (the prompt's full blocks it computed itself stayed)."""
    batch = prompts(6, model.config.vocab_size, seed=7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    p = make_core(model_dir, model, Role.PREFILL, "pull", "shm")
    d = make_core(model_dir, model, Role.DECODE, "pull", "shm")
    try:
        router = ReturningRouter(p, d, "pull", batch, params)
        router.run()
        assert router.failures == {}
        bs = 16
        for i, prompt in enumerate(batch):
            rid = f"r{i}@return"
            full = (len(prompt) + params.max_tokens - 1) // bs * bs  # the last token has no KV
            tokens = prompt + router.tokens[f"r{i}"]
            assert router.offers[rid].token_ids == tokens[:full]
            assert router.offers[rid].kind is OfferKind.RETURN
            fetched = router.fetched[rid]
            assert fetched.error is None
            assert (fetched.num_tokens, fetched.num_fetched) == (
                full,
                full - len(prompt) // bs * bs,
            )
            assert router.returned_equal[rid]
            # the next turn's prompt (this one's prompt + answer + more) hits it all
            assert p.kv.match_prefix([*tokens, 5, 6]).num_cached_tokens == full
        assert_clean(p, d)
        assert (
            d.participant(CacheExchange).num_offers,
            p.participant(CacheExchange).num_fetches,
        ) == (0, 0)
    finally:
        p.close()
        d.close()


def offer_one(model_dir: Path, model: CausalLM, **transfer: object) -> tuple[EngineCore, KVOffered]:
    """A decode core that ran one request (pushed KV) to the end and offered its KV."""
    d = make_core(model_dir, model, Role.DECODE, "request-push", "shm", **transfer)
    prompt = list(range(5, 69))
    d.handle(ReserveKV("a", prompt))
    d.poll_transfers()
    d.take_messages()
    d.handle(AddPrefilled("a", prompt, [7], GREEDY, 0.0, None, None, return_to="prefill-x"))
    while d.has_unfinished():
        d.step()
    offers = [m for m in d.take_messages() if isinstance(m, KVOffered)]
    assert [o.offer_id for o in offers] == ["a@return"] and offers[0].to == "prefill-x"
    assert offers[0].source.num_tokens == (64 + 12 - 1) // 16 * 16
    assert d.participant(CacheExchange).num_offers == 1 and d.kv.num_used_blocks == 4
    return d, offers[0]


def fetch_answer(core: EngineCore, offer: KVOffered, timeout_s: float = 10.0) -> PrefixFetched:
    core.handle(FetchPrefix(offer.offer_id, "decode", offer.token_ids, offer.source))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        core.poll_transfers()
        answers = [m for m in core.take_messages() if isinstance(m, PrefixFetched)]
        if answers:
            return answers[0]
        time.sleep(0.001)
    raise AssertionError("no PrefixFetched")


def assert_pool_clean(*cores: EngineCore) -> None:
    for core in cores:
        core.kv.check_integrity()
        assert core.kv.num_used_blocks == 0
        assert (
            core.participant(CacheExchange).num_offers,
            core.participant(CacheExchange).num_fetches,
        ) == (0, 0)


def test_failed_returns_free_every_block_on_both_sides(model_dir: Path, model: CausalLM) -> None:
    d, offer = offer_one(model_dir, model)
    tiny = make_core(model_dir, model, Role.PREFILL, "pull", "shm", num_blocks=3)
    failing = make_core(model_dir, model, Role.PREFILL, "pull", "shm", fault_failure_rate=1.0)
    holding = make_core(model_dir, model, Role.PREFILL, "pull", "shm")
    try:
        no_room = fetch_answer(tiny, offer)
        assert no_room.error == "no room: 64 tokens, 48 obtainable"
        assert (no_room.num_tokens, no_room.num_fetched) == (0, 0)
        broken = fetch_answer(failing, offer)
        assert broken.error is not None and broken.error.startswith("fetching the KV failed: ")
        assert "injected" in broken.error
        late = msgspec.structs.replace(
            offer, source=msgspec.structs.replace(offer.source, lease_deadline=time.monotonic())
        )
        expired = fetch_answer(holding, late)
        assert expired.error == "the source's lease on the KV ends before a fetch could finish"
        first = fetch_answer(holding, offer)
        assert (first.error, first.num_tokens, first.num_fetched) == (None, 64, 64)
        again = fetch_answer(holding, msgspec.structs.replace(offer, offer_id="a2@return"))
        assert (again.error, again.num_tokens, again.num_fetched) == (None, 64, 0)
        assert_pool_clean(tiny, failing, holding)
        assert holding.kv.num_cached_blocks == 4
        d.release([offer.offer_id])
        assert_pool_clean(d)
        assert d.kv.num_cached_blocks == 4  # unpinned, still cached where it was
    finally:
        for core in (d, tiny, failing, holding):
            core.close()


def test_an_unclaimed_offer_is_unpinned_when_its_lease_ends(
    model_dir: Path, model: CausalLM
) -> None:
    d, offer = offer_one(model_dir, model, timeout_s=0.1, lease_s=0.3)
    try:
        assert offer.source.lease_deadline <= time.monotonic() + 0.3
        d.poll_transfers()
        assert d.participant(CacheExchange).num_offers == 1  # not yet
        time.sleep(0.35)
        d.poll_transfers()
        assert_pool_clean(d)
    finally:
        d.close()


def test_an_instance_offers_what_its_cache_holds_of_a_prefix(
    model_dir: Path, model: CausalLM
) -> None:
    """OfferPrefix (a prefix fetch's first step): the indexed full blocks are pinned and
    offered; a prefix held no longer is answered with PrefixFetched(error)."""
    d, offer = offer_one(model_dir, model)
    try:
        d.release([offer.offer_id])
        tokens = [*offer.token_ids, 9, 9, 9]
        d.handle(OfferPrefix("b@prefetch", tokens, "prefill-y"))
        (got,) = d.take_messages()
        assert isinstance(got, KVOffered) and got.offer_id == "b@prefetch"
        assert (got.to, got.token_ids, got.source.num_tokens) == ("prefill-y", tokens[:64], 64)
        assert got.source.blocks == offer.source.blocks  # the same cached blocks, pinned
        assert d.kv.num_used_blocks == 4
        d.handle(OfferPrefix("c@prefetch", [1, 2, 3] * 20, "prefill-y"))
        (miss,) = d.take_messages()
        assert miss == PrefixFetched(
            "c@prefetch", d.config.instance_name, 0, 0, 0, "not cached here any more"
        )
        d.release(["b@prefetch"])
        assert_pool_clean(d)
    finally:
        d.close()


def test_a_prefill_or_decode_instance_keeps_its_pool_in_host_memory() -> None:
    """The KV transports move host memory: a disaggregated role on a GPU is refused when
    configured (`pdserve serve --prefill 1 --decode 1 --device cuda` exits 2 with it)."""
    for role in (Role.PREFILL, Role.DECODE):
        with pytest.raises(ValueError) as err:
            EngineConfig(device="cuda:0", role=role)
        assert str(err.value) == (
            f"a {role.value} instance needs its KV pool in host memory (the KV transports "
            "move host memory), so it runs on the cpu, not cuda:0"
        )
    assert EngineConfig(device="cuda", role=Role.COLOCATED).device == "cuda"


def test_the_transfer_mode_travels_by_value_and_an_unknown_one_is_a_decode_error() -> None:
    """`Handoff.mode` is a `TransferMode` on the wire: it decodes back to the enum member,
    and a mode no engine knows is refused where the message is decoded."""
    decoder = msgspec.msgpack.Decoder(EngineInput)
    for mode in TransferMode:
        sent = AddRequest("r0", [1, 2, 3], GREEDY, 0.0, Handoff(mode))
        got = decoder.decode(msgspec.msgpack.encode(sent))
        assert isinstance(got, AddRequest) and got.handoff is not None
        assert got.handoff.mode is mode
    raw = msgspec.msgpack.encode(AddRequest("r0", [1], GREEDY, 0.0, Handoff(TransferMode.PULL)))
    assert raw.count(b"\xa4pull") == 1
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'push'"):
        decoder.decode(raw.replace(b"\xa4pull", b"\xa4push"))


def test_the_controller_pushes_in_the_push_modes_only() -> None:
    """Each mode's controller policy: pull hands off to a decode instance chosen after the
    prefill; the push modes reserve on the decode side first."""
    for mode in TransferMode:
        policy = transfer_policy(mode)
        assert policy.push is (mode is not TransferMode.PULL)
        assert policy.handoff() == Handoff(mode)
