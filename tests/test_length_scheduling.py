"""Length-aware scheduling (TetriInfer §3.3-§3.4): the exact decisions of each rule, and
the engine running under every combination of them with greedy outputs unchanged.

- prefill order (engine/prefill_queue.py): sjf / ljf within scheduling batches, the
  starvation bound, then the same order out of a real core;
- decode admission (engine/admission.py) on constructed batches, worked by hand;
- decode dispatch (cluster/policies.py) on constructed loads;
- the length head (engine/length_head.py): what a bad file is told, the prediction riding on
  the first output and on to the decode core, and deliberately wrong heads (always the
  shortest bucket, always the longest) under every admission rule: outputs identical to
  the colocated default, no leak, no deadlock.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers.pairs import Router, assert_clean, colocated_outputs, make_core, prompts
from helpers.tiny_models import make_tiny_model

from pdserve.cluster.config import DecodePolicy
from pdserve.cluster.policies import DecodeChooser, same_class
from pdserve.config import DecodeAdmission, EngineConfig, PrefillPolicy, Role, SchedulerConfig
from pdserve.engine.admission import KVJob, admits, peak_future_blocks
from pdserve.engine.engine import load_model
from pdserve.engine.head_spec import HeadSpec, head_shapes
from pdserve.engine.length_head import LengthHead, set_probe
from pdserve.engine.prefill_queue import PrefillQueue
from pdserve.engine.request import Request
from pdserve.errors import ModelLoadError
from pdserve.model.base import CausalLM
from pdserve.protocol.core import LoadReport
from pdserve.protocol.prediction import LengthPrediction, remaining_tokens
from pdserve.protocol.sampling_params import SamplingParams

# ---- prefill order -------------------------------------------------------------------------


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(), None)


def queue(policy: PrefillPolicy, batch: int) -> PrefillQueue:
    return PrefillQueue(policy, batch, lambda r: r.num_tokens)


def drain_queue(q: PrefillQueue) -> list[int]:
    out = []
    while q:
        out.append(q.popleft().num_tokens)
    return out


LENGTHS = [50, 10, 40, 20, 5, 30, 60, 1]


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (PrefillPolicy.FCFS, LENGTHS),
        (PrefillPolicy.SJF, [10, 20, 40, 50, 1, 5, 30, 60]),
        (PrefillPolicy.LJF, [50, 40, 20, 10, 60, 30, 5, 1]),
    ],
)
def test_each_scheduling_batch_is_sorted_by_the_policy(
    policy: PrefillPolicy, expected: list[int]
) -> None:
    q = queue(policy, 4)
    for i, n in enumerate(LENGTHS):
        q.append(request(f"r{i}", n))
    assert drain_queue(q) == expected
    assert q.num_batches == (0 if policy is PrefillPolicy.FCFS else 2)


def test_a_batch_is_formed_from_what_waits_and_later_arrivals_wait_for_the_next() -> None:
    q = queue(PrefillPolicy.SJF, 4)
    for i, n in enumerate([30, 20, 10]):
        q.append(request(f"a{i}", n))
    assert q.peek() is not None and q.peek().num_tokens == 10  # batch of 3 formed now
    q.append(request("late", 1))  # shorter, but the next batch's
    q.appendleft(request("moved", 99))  # a migrated request: ahead of everything
    assert drain_queue(q) == [99, 10, 20, 30, 1]


def test_remove_finds_a_request_in_either_queue() -> None:
    q = queue(PrefillPolicy.LJF, 2)
    reqs = [request(f"r{i}", n) for i, n in enumerate([5, 6, 7])]
    for r in reqs:
        q.append(r)
    q.peek()  # r0, r1 scheduled; r2 raw
    q.remove(reqs[2])
    q.remove(reqs[0])
    assert [r.request_id for r in q] == ["r1"]
    with pytest.raises(ValueError):
        q.remove(reqs[0])


@pytest.mark.parametrize("policy", [PrefillPolicy.SJF, PrefillPolicy.LJF])
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_no_request_is_passed_by_more_than_batch_minus_one_later_arrivals(
    policy: PrefillPolicy, batch: int
) -> None:
    """The starvation bound, over random arrivals interleaved with admissions."""
    rng = random.Random(batch)
    q = queue(policy, batch)
    arrived: dict[str, int] = {}
    order: list[str] = []
    for step in range(400):
        if rng.random() < 0.55:
            rid = f"r{step}"
            arrived[rid] = step
            q.append(request(rid, rng.randint(1, 500)))
        elif q:
            order.append(q.popleft().request_id)
    order.extend(r.request_id for r in list(q.scheduled) + list(q.raw))
    for k, rid in enumerate(order):
        passed_by = sum(1 for other in order[:k] if arrived[other] > arrived[rid])
        assert passed_by <= batch - 1, (rid, passed_by)


# ---- decode admission ------------------------------------------------------------------------

BS = 16
BATCH = [KVJob(100, 50), KVJob(30, 10)]
NEW = KVJob(40, 100)


def test_peak_future_blocks_worked_by_hand() -> None:
    # t=10: all three alive: 3 + 7 + 4 = 14; t=50: 150 and 90 tokens: 10 + 6 = 16;
    # t=100: the new one alone at 140 tokens: 9. The peak is 16.
    assert peak_future_blocks([*BATCH, NEW], BS) == 16


@pytest.mark.parametrize(
    ("obtainable", "greedy", "static", "dynamic", "past_future"),
    [
        (2, False, False, False, False),
        (3, True, False, False, False),  # the prompt fits now
        (5, True, False, True, False),  # s=10: 0 + 1 growth + 4 for the new one
        (7, True, False, True, True),  # peak 16 <= 9 held + 7
        (9, True, True, True, True),  # 140 tokens: 9 blocks
    ],
)
def test_admission_rules_on_a_constructed_batch(
    obtainable: int, greedy: bool, static: bool, dynamic: bool, past_future: bool
) -> None:
    decide = {policy: admits(policy, BATCH, NEW, obtainable, BS) for policy in DecodeAdmission}
    assert decide == {
        DecodeAdmission.GREEDY: greedy,
        DecodeAdmission.RESERVE_STATIC: static,
        DecodeAdmission.RESERVE_DYNAMIC: dynamic,
        DecodeAdmission.PAST_FUTURE: past_future,
    }


def test_remaining_tokens_follows_the_bucket_and_never_ends_a_request() -> None:
    bucket = LengthPrediction(1, 64, 128)
    assert remaining_tokens(None, 5, 300) == 300  # no prediction: max_tokens' bound
    assert remaining_tokens(bucket, 10, 300) == 118  # to the bucket's upper end
    assert remaining_tokens(bucket, 10, 50) == 50  # max_tokens is certain
    assert remaining_tokens(bucket, 130, 300) == 62  # past it: the next bucket, to 192
    assert remaining_tokens(bucket, 192, 300) == 64
    assert remaining_tokens(LengthPrediction(4, 256, None), 300, 40) == 40  # open bucket
    assert remaining_tokens(bucket, 127, 0) == 1


# ---- decode dispatch -------------------------------------------------------------------------


@dataclass
class Stand:
    """What the decode chooser reads of an `Instance`."""

    name: str
    assigned_requests: int = 0
    assigned_heavy: int = 0
    alive: bool = True
    report: LoadReport | None = None


def room(blocks: int) -> LoadReport:
    return LoadReport(0.0, 0, 0, 0, blocks, 100, 0, 0, 0)


def test_length_aware_balances_each_class_over_the_two_drawn() -> None:
    a = Stand("a", assigned_requests=3, assigned_heavy=2)  # 2 heavy, 1 light
    b = Stand("b", assigned_requests=1, assigned_heavy=0)  # 1 light
    chooser = DecodeChooser(DecodePolicy.LENGTH_AWARE, seed=0)
    assert (same_class(a, True), same_class(b, True)) == (2, 0)
    assert chooser.choose([a, b], 1, heavy=True) is b
    assert chooser.choose([a, b], 1, heavy=False) is b  # 1 light each: fewer requests
    c = Stand("c", assigned_requests=4, assigned_heavy=0)  # 4 light
    d = Stand("d", assigned_requests=1, assigned_heavy=1)  # 1 heavy
    assert chooser.choose([d, c], 1, heavy=True) is c  # not the less loaded one
    assert chooser.choose([d, c], 1, heavy=False) is d


def test_length_aware_draws_two_among_those_with_room_for_the_predicted_length() -> None:
    full = Stand("full", report=room(3))
    roomy = [Stand(f"i{k}", assigned_requests=k, assigned_heavy=k % 2) for k in range(4)]
    chooser = DecodeChooser(DecodePolicy.LENGTH_AWARE, seed=7)
    replica = random.Random(7)
    for heavy in (True, False, True, True, False):
        pair = replica.sample(roomy, 2)
        want = min(pair, key=lambda i: (same_class(i, heavy), i.assigned_requests))
        assert chooser.choose([full, *roomy], 4, heavy) is want


def test_imbalance_and_random_baselines() -> None:
    insts = [Stand("a"), Stand("b", assigned_requests=3), Stand("c", assigned_requests=1)]
    worst = DecodeChooser(DecodePolicy.IMBALANCE)
    assert worst.choose(insts, 1, heavy=True) is insts[0]
    assert worst.choose(insts, 1, heavy=False) is insts[2]  # least loaded of the others
    rand = DecodeChooser(DecodePolicy.RANDOM, seed=3)
    replica = random.Random(3)
    assert [rand.choose(insts, 1).name for _ in range(6)] == [
        replica.choice(insts).name for _ in range(6)
    ]


# ---- the engine under the policies -------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lengths"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def model(model_dir: Path) -> CausalLM:
    return load_model(EngineConfig(model=str(model_dir), num_threads=1))


def constant_head(model: CausalLM, path: Path, bucket: int, granularity: int = 4) -> str:
    """A head that always predicts `bucket` (of 4 buckets of `granularity` tokens),
    trained for `model` as far as its file says."""
    c = model.config
    spec = HeadSpec(granularity, 4, c.hidden_size, c.vocab_size, c.architecture)
    head = LengthHead(spec)
    with torch.no_grad():
        head.net.weight.zero_()  # type: ignore[union-attr]
        head.net.bias.copy_(torch.nn.functional.one_hot(torch.tensor(bucket), 4) * 10.0)  # type: ignore[union-attr]
    set_probe(head, model.embed_tokens)
    head.save(path)
    return str(path)


def first_token_order(
    core_lengths: list[int], policy: PrefillPolicy, model_dir: Path, model: CausalLM
) -> list[int]:
    sched = SchedulerConfig(
        max_num_batched_tokens=512, max_num_seqs=1, prefill_policy=policy, prefill_sched_batch=8
    )
    core = make_core(model_dir, model, Role.COLOCATED, scheduler=sched)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(core_lengths):
        core.add_request(f"r{i}", list(range(5, 5 + n)), params)
    order: list[int] = []
    while core.has_unfinished():
        for o in core.step():
            k = int(o.request_id[1:])
            if core_lengths[k] not in order:
                order.append(core_lengths[k])
    assert_clean(core)
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (PrefillPolicy.FCFS, [40, 8, 30, 16, 24, 4]),
        (PrefillPolicy.SJF, [4, 8, 16, 24, 30, 40]),
        (PrefillPolicy.LJF, [40, 30, 24, 16, 8, 4]),
    ],
)
def test_a_core_admits_prompts_in_the_policy_order(
    policy: PrefillPolicy, expected: list[int], model_dir: Path, model: CausalLM
) -> None:
    assert first_token_order([40, 8, 30, 16, 24, 4], policy, model_dir, model) == expected


def test_bad_head_files_are_refused_with_the_file_and_the_mismatch(
    tmp_path: Path, model_dir: Path, model: CausalLM
) -> None:
    def load(path: Path | str) -> str:
        with pytest.raises(ModelLoadError) as e:
            make_core(model_dir, model, Role.COLOCATED, length_predictor=str(path))
        return str(e.value)

    missing = tmp_path / "missing.safetensors"
    assert load(missing) == f"length predictor file {missing} does not exist"
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    assert load(garbage).startswith(f"length predictor file {garbage} is not a safetensors file")
    other_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", seed=1)  # same shapes, other weights
    other = load_model(EngineConfig(model=str(other_dir), num_threads=1))
    foreign = constant_head(other, tmp_path / "other.safetensors", 0)
    msg = load(foreign)
    assert msg.startswith(
        f"length predictor file {foreign} was trained for another model (unnamed)"
    )
    assert "(at least 0.95 needed); train one with `pdserve predictor train`" in msg
    wide_dir = make_tiny_model(tmp_path, "LlamaForCausalLM", hidden_size=48)
    wide = load_model(EngineConfig(model=str(wide_dir), num_threads=1))
    wrong_size = constant_head(wide, tmp_path / "wide.safetensors", 0)
    c = model.config
    assert load(wrong_size) == (
        f"length predictor file {wrong_size} was trained for a model with vocabulary "
        f"{c.vocab_size} and hidden size 48; the served model has {c.vocab_size} and "
        f"{c.hidden_size}"
    )
    # A file whose tensors are not what its spec says (the front end reads it so, with
    # no torch, before any instance starts: head_spec.read_head_file).
    spec = HeadSpec(8, 4, c.hidden_size, c.vocab_size, c.architecture)
    tensors = {k: v.clone() for k, v in LengthHead(spec).state_dict().items()}
    tensors["net.bias"] = torch.zeros(5)
    meta = {"format": "pdserve-length-head/1", "spec": json.dumps(dataclasses.asdict(spec))}
    short = tmp_path / "short.safetensors"
    safetensors.torch.save_file(tensors, str(short), metadata=meta)
    msg = load(short)
    assert msg.startswith(f"length predictor file {short} is corrupt: it holds {{")
    assert "'net.bias': (5,)" in msg and "'net.bias': (4,)" in msg


@pytest.mark.parametrize("mlp_hidden", [0, 32])
def test_a_heads_tensors_are_the_shapes_its_file_is_checked_against(mlp_hidden: int) -> None:
    spec = HeadSpec(8, 5, 64, 1000, "LlamaForCausalLM", mlp_hidden=mlp_hidden)
    module = {k: tuple(v.shape) for k, v in LengthHead(spec).state_dict().items()}
    assert head_shapes(spec) == module


def test_the_prediction_rides_on_the_first_output_and_on_to_the_decode_core(
    tmp_path: Path, model_dir: Path, model: CausalLM
) -> None:
    head = constant_head(model, tmp_path / "b2.safetensors", 2)
    core = make_core(model_dir, model, Role.COLOCATED, length_predictor=head)
    core.add_request(
        "r0", [5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    outs = [o for _ in range(3) for o in core.step()]
    assert [o.prediction for o in outs] == [LengthPrediction(2, 8, 12), None, None]
    batch = prompts(4, model.config.vocab_size, seed=11)
    p = make_core(model_dir, model, Role.PREFILL, length_predictor=head)
    d = make_core(model_dir, model, Role.DECODE)  # no head: it uses what arrives
    router = Router(
        p, d, "pull", batch, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    )
    seen: list[LengthPrediction | None] = []
    original = d._prefilled_request

    def spy(msg):  # type: ignore[no-untyped-def]
        req = original(msg)
        seen.append(req.prediction if req is not None else None)
        return req

    d._prefilled_request = spy  # type: ignore[method-assign]
    router.run()
    assert seen == [LengthPrediction(2, 8, 12)] * 4
    assert_clean(p, d)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("admission", list(DecodeAdmission))
@pytest.mark.parametrize("head_bucket", [None, 0, 3])  # none, far too short, open-ended
def test_every_admission_rule_with_wrong_predictions_keeps_outputs_exact(
    admission: DecodeAdmission,
    head_bucket: int | None,
    tmp_path: Path,
    model_dir: Path,
    model: CausalLM,
) -> None:
    """32 mixed prompts through a prefill core (sjf) and a decode core whose pool holds
    about a third of them at once (preemption by swap is the safety net)."""
    batch = prompts(32, model.config.vocab_size)
    reference = colocated_outputs(make_core(model_dir, model, Role.COLOCATED), batch, GREEDY)
    head = (
        None
        if head_bucket is None
        else constant_head(model, tmp_path / "h.safetensors", head_bucket)
    )
    p_sched = SchedulerConfig(max_num_batched_tokens=64, prefill_policy=PrefillPolicy.SJF)
    d_sched = SchedulerConfig(max_num_batched_tokens=64, decode_admission=admission)
    p = make_core(model_dir, model, Role.PREFILL, scheduler=p_sched, length_predictor=head)
    d = make_core(model_dir, model, Role.DECODE, num_blocks=48, scheduler=d_sched)
    router = Router(p, d, "pull", batch, GREEDY)
    router.run()
    assert router.failures == {}
    assert router.tokens == reference
    assert_clean(p, d)
    if admission is DecodeAdmission.GREEDY:  # the pool is tight: preemption ran
        assert (d.admission.num_waits, d.scheduler.num_preemptions > 0) == (0, True)
    else:  # and the rule held requests back
        assert d.admission.num_waits > 0
