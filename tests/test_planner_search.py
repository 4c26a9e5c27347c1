"""Latency model, configuration enumeration, goodput search, placement (Alg. 1 / 2),
replanning and the `pdserve plan` CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.cli import main as cli_main
from pdserve.cluster.placement import PlacedInstance, lay_out, read_placement
from pdserve.config import Role
from pdserve.planner.candidates import (
    InstanceKnobs,
    explain_no_fit,
    kv_capacity_tokens,
    parallel_configs,
    tp_options,
)
from pdserve.planner.goodput import max_rate
from pdserve.planner.hardware import (
    ClusterSpec,
    HardwareProfile,
    datasheet_profile,
    load_profile,
)
from pdserve.planner.latency import (
    Coefficients,
    Interconnect,
    Parallelism,
    decode_rows,
    step_cost,
    step_features,
)
from pdserve.planner.model_spec import PRESETS, ModelSpec, PlanInputError
from pdserve.planner.plan import make_plan
from pdserve.planner.replan import WorkloadStats, advise_replan
from pdserve.planner.search import (
    SearchContext,
    SLOTarget,
    Task,
    run_task,
    search,
)
from pdserve.planner.workload import sample_workload

TOY = ModelSpec(
    name="toy",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=1000,
    ffn_matrices=2,
    dtype_bytes=2,
    max_context=2048,
)
TOY_HW = HardwareProfile(
    name="toy-device",
    kind="estimate",
    coefficients=Coefficients(c1=1.6e-11, c2=2e-11, c3=1e-3, c4=1e-9, c5=1e-9, c6=1.6e-11),
    device_memory_bytes=0.05e9,
    tp_bandwidth=50e9,
    tp_latency_s=5e-6,
)
TOY_CLUSTER = ClusterSpec(1, 4, 0.05e9, 50e9, 5e9)


def toy_context(n: int = 200, slo: SLOTarget | None = None) -> SearchContext:
    return SearchContext(
        TOY,
        TOY_HW,
        TOY_CLUSTER,
        InstanceKnobs(max_batch_size=64, prefill_batch_tokens=512, colocated_chunk_tokens=512),
        slo or SLOTarget(ttft=0.05, tpot=0.03, attainment=0.9),
        sample_workload("chatbot", n, 1.0, seed=3),
        rel_tol=0.01,
    )


# ---- latency model ----------------------------------------------------------------------


def test_features_dot_coefficients_is_the_step_cost() -> None:
    c = Coefficients(1e-11, 2e-12, 3e-3, 4e-10, 5e-10, 6e-11)
    cost = step_cost(TOY, c)
    counts = (300, 300**2 + 17**2, 2, 7, 900)
    feats = step_features(TOY, *counts)
    expected = float(np.dot(feats, [c.c1, c.c2, c.c3, c.c4, c.c5, c.c6]))
    assert cost.stage_time(*counts) == pytest.approx(expected, rel=1e-12)


def test_decode_rows_past_the_knee_pay_and_prompt_rows_fill_it_first() -> None:
    cost = dataclasses.replace(
        step_cost(TOY, Coefficients(0.0, 0.0, 1.0, 0.0, 0.0, 0.0)),
        prompt_token=0.01,
        decode_token=0.1,
        decode_comm=0.001,
        knee=4,
    )
    assert decode_rows(0, 3, 4) == 0 and decode_rows(0, 6, 4) == 2
    assert decode_rows(2, 6, 4) == 4  # the prompt's 2 rows leave 2 under the knee
    assert decode_rows(10, 6, 4) == 6  # prompt rows past the knee: every decode row pays
    assert cost.stage_time(decode_tokens=3) == pytest.approx(1.0 + 0.003)
    assert cost.stage_time(decode_tokens=6) == pytest.approx(1.0 + 0.2 + 0.006)
    assert cost.stage_time(2, 0, 0, 6) == pytest.approx(1.0 + 0.02 + 0.4 + 0.006)
    assert cost.decode_time(4, 0) == pytest.approx(cost.decode_time(1, 0) + 3 * 0.001)


def test_features_with_a_knee_dot_coefficients_is_the_step_cost() -> None:
    c = Coefficients(1e-11, 2e-12, 3e-3, 4e-10, 5e-10, 6e-11, knee=5)
    cost = step_cost(TOY, c)
    for counts in [(0, 0, 0, 3, 90), (0, 0, 0, 9, 270), (2, 4, 1, 7, 300), (30, 900, 1, 7, 300)]:
        feats = step_features(TOY, *counts, knee=c.knee)
        expected = float(np.dot(feats, [c.c1, c.c2, c.c3, c.c4, c.c5, c.c6]))
        assert cost.stage_time(*counts) == pytest.approx(expected, rel=1e-12)


def test_tensor_parallel_all_reduces_are_paid_by_every_decode_row() -> None:
    link = Interconnect(tp_bandwidth=100e9, tp_latency_s=0.0)
    c = dataclasses.replace(TOY_HW.coefficients, knee=8)
    two = step_cost(TOY, c, Parallelism(2, 1), link)
    all_reduce = 2 * TOY.num_layers * (2 * 1 / 2) * TOY.hidden_size * TOY.dtype_bytes / 100e9
    assert two.knee == 8 and two.decode_comm == pytest.approx(all_reduce)
    assert two.decode_time(8, 0) - two.decode_time(1, 0) == pytest.approx(7 * all_reduce)


def test_opt_sizes_match_the_paper() -> None:
    # DistServe Table 1: OPT-66B 132 GB, OPT-175B 350 GB in fp16; §3.3: a 512-token
    # OPT-66B request holds about 1.13 GB of KV.
    assert PRESETS["opt-66b"].weight_bytes / 1e9 == pytest.approx(131.4, abs=0.1)
    assert PRESETS["opt-175b"].weight_bytes / 1e9 == pytest.approx(349.1, abs=0.1)
    assert 512 * PRESETS["opt-66b"].kv_bytes_per_token / 1e9 == pytest.approx(1.208, abs=1e-3)
    assert PRESETS["opt-13b"].linear_params_per_layer == 4 * 5120**2 + 2 * 5120 * 20480


def test_tensor_parallelism_divides_work_and_adds_all_reduces() -> None:
    """TP 2 halves the weights, FLOPs and KV reads and adds two all-reduces a layer."""
    c = TOY_HW.coefficients
    link = Interconnect(tp_bandwidth=100e9, tp_latency_s=1e-5, pp_bandwidth=10e9)
    one = step_cost(TOY, c, Parallelism(1, 1), link)
    two = step_cost(TOY, c, Parallelism(2, 1), link)
    act = TOY.hidden_size * TOY.dtype_bytes
    all_reduce = 2 * TOY.num_layers * (2 * 1 / 2) * act / 100e9
    assert two.prompt_token == pytest.approx(one.prompt_token / 2 + all_reduce)
    assert one.base == pytest.approx(c.c3 + c.c4 * TOY.weight_bytes)
    assert two.base == pytest.approx(c.c3 + c.c4 * TOY.weight_bytes / 2 + 2 * 4 * 1e-5)
    assert two.prompt_seq == pytest.approx(one.prompt_seq / 2)
    assert two.context_token == pytest.approx(one.context_token / 2)


def test_an_uneven_tensor_split_is_priced_by_its_largest_rank() -> None:
    """SmolLM2's shape at TP 2: rank 0 holds 2 of the 3 GQA groups (6 of 9 query heads)
    and 24 of the 48 MLP column blocks, as parallel/layout.py splits it; TP 4 is more
    ranks than KV heads, refused with the engine's message."""
    smol = dataclasses.replace(
        TOY, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576, intermediate_size=1536
    )
    c = TOY_HW.coefficients
    link = Interconnect(tp_bandwidth=100e9)
    one = step_cost(smol, c, Parallelism(1, 1), link)
    two = step_cost(smol, c, Parallelism(2, 1), link)
    h = smol.hidden_size
    attn = 2 * h * smol.q_size + 2 * h * smol.kv_size
    mlp = smol.ffn_matrices * h * smol.intermediate_size
    assert one.decode_token / c.c6 == pytest.approx(
        2 * (attn + mlp) * smol.num_layers + 2 * h * smol.vocab_size
    )
    assert two.decode_token / c.c6 == pytest.approx(
        2 * (attn * 2 / 3 + mlp / 2) * smol.num_layers + 2 * h * smol.vocab_size / 2
    )
    assert two.prompt_unit == pytest.approx(one.prompt_unit * 2 / 3)
    assert two.context_token == pytest.approx(one.context_token * 2 / 3)
    with pytest.raises(PlanInputError, match="tensor-parallel-size 4 is more than the model's 3"):
        step_cost(smol, c, Parallelism(4, 1), link)


def test_pipeline_parallelism_splits_layers_into_stages() -> None:
    link = Interconnect(pp_bandwidth=10e9)
    one = step_cost(TOY, TOY_HW.coefficients, Parallelism(1, 1), link)
    two = step_cost(TOY, TOY_HW.coefficients, Parallelism(1, 2), link)
    assert two.stages == 2
    assert two.prompt_unit == pytest.approx(one.prompt_unit / 2)
    hop = TOY.hidden_size * TOY.dtype_bytes / 10e9
    st = two.stage_time(100, 100**2, 1)
    assert two.prefill_time([100]) == pytest.approx(2 * st + hop * 100)
    # a fixed cost a hand-off (`pp_latency_s`): once per stage boundary
    fixed = step_cost(TOY, TOY_HW.coefficients, Parallelism(1, 2), Interconnect(0, 0, 10e9, 1e-3))
    assert fixed.prefill_time([100]) == pytest.approx(2 * st + hop * 100 + 1e-3)
    # 3 stages of 4 layers: 2, 1, 1 - the first stage's 2 set the pace
    three = step_cost(TOY, TOY_HW.coefficients, Parallelism(1, 3), link)
    assert three.prompt_unit == pytest.approx(two.prompt_unit)
    with pytest.raises(PlanInputError, match="pipeline-parallel-size 5 is more than the model's 4"):
        step_cost(TOY, TOY_HW.coefficients, Parallelism(1, 5), link)


# ---- hardware profiles and cluster ----------------------------------------------------------


def test_datasheet_profile_is_marked_estimate_and_round_trips(tmp_path: Path) -> None:
    hw = datasheet_profile("a100")
    assert hw.is_estimate and "estimate" in hw.label
    assert hw.coefficients.c1 == pytest.approx(1 / (312e12 * 0.6))
    path = tmp_path / "a100.json"
    hw.save(path)
    assert load_profile(str(path)) == hw


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"name": "x", "kind": "measured", "device_memory_gb": 1}', "no 'coefficients'"),
        (
            '{"name": "x", "kind": "measured", "device_memory_gb": 1, "coefficients": {"c1": 1}}',
            r"missing \['c2', 'c3', 'c4', 'c5'\]",
        ),
        (
            '{"name": "x", "kind": "guess", "device_memory_gb": 1, '
            '"coefficients": {"c1": 1, "c2": 1, "c3": 1, "c4": 1, "c5": 1}}',
            "kind must be measured or estimate",
        ),
        (
            '{"name": "x", "kind": "measured", "device_memory_gb": 1, '
            '"coefficients": {"c1": -1, "c2": 1, "c3": 1, "c4": 1, "c5": 1}}',
            "c1 must be a number >= 0",
        ),
    ],
)
def test_malformed_profiles_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(PlanInputError, match=message):
        load_profile(str(path))


def test_unknown_device_names_the_known_ones() -> None:
    with pytest.raises(PlanInputError, match="datasheet profiles exist for a100-40gb"):
        load_profile("tpu-v9")


# ---- candidate configurations ------------------------------------------------------------


def test_parallel_configs_respect_memory_heads_and_layers() -> None:
    cluster = ClusterSpec(1, 8, 80e9, 300e9, 3e9)
    configs = parallel_configs(PRESETS["opt-66b"], cluster)
    # 131.4 GB of weights + one 2048-token request's KV need >= 2 devices of 72 GB.
    assert all(p.devices >= 2 for p in configs)
    assert Parallelism(2, 1) in configs and Parallelism(1, 2) in configs
    assert Parallelism(1, 1) not in configs
    # 72 heads: every TP up to the node's 8 (a rank holds whole heads, evenly or not; a
    # node need not be divisible by TP); 64 layers into even stages
    assert {p.tp for p in configs} == set(range(1, 9))
    assert all(64 % p.pp == 0 and p.devices <= 8 for p in configs)
    # SmolLM2's 3 KV heads: TP 1 to 3 (vLLM refuses 2: 9 query heads do not divide)
    smol = dataclasses.replace(
        TOY, num_heads=9, num_kv_heads=3, intermediate_size=1536, name="smollm2-like"
    )
    assert tp_options(smol, 8) == [1, 2, 3]
    cap = kv_capacity_tokens(PRESETS["opt-66b"], Parallelism(2, 1), 72e9)
    assert cap == int((144e9 - PRESETS["opt-66b"].weight_bytes) // (2 * 64 * 9216 * 2))


def test_hardware_without_an_all_reduce_link_gets_no_tensor_or_pipeline_parallelism() -> None:
    """A CPU profile: the plan is for pdserve to start, whose instance is one process."""
    cpu = dataclasses.replace(TOY_HW, kind="measured", tp_bandwidth=0.0)
    ctx = dataclasses.replace(toy_context(), hw=cpu)
    assert (ctx.max_tp, ctx.max_pp) == (1, 1)
    outcome = search(ctx, "both", workers=1)
    tasks = [r.task for p in [*outcome.ranked, *outcome.colocated] for r in p.results]
    assert tasks and all(t.par == Parallelism(1, 1) for t in tasks)
    assert all(t.decode_par in (None, Parallelism(1, 1)) for t in tasks)


def test_model_that_cannot_fit_gives_the_numbers() -> None:
    cluster = ClusterSpec(1, 2, 80e9, 300e9, 3e9)
    msg = explain_no_fit(PRESETS["opt-175b"], cluster)
    assert msg.startswith("opt-175b does not fit: weights 349.1 GB + KV of one 2048-token")
    assert "need 358.8 GB, i.e. at least 5 devices of 80 GB x 0.9 headroom = 72.0 GB usable" in msg
    assert msg.endswith("the cluster has 1 x 2 = 2 devices")


# ---- goodput search ------------------------------------------------------------------------


@pytest.mark.parametrize("guess", [0.01, 1.0, 3.3, 500.0])
def test_max_rate_brackets_and_bisects(guess: float) -> None:
    calls: list[float] = []

    def att(r: float) -> float:
        calls.append(r)
        return 1.0 if r <= 3.3 else 0.5

    got = max_rate(att, 0.9, guess, rel_tol=0.001)
    assert 3.3 * 0.999 <= got <= 3.3
    assert len(calls) < 60


def test_max_rate_is_zero_when_nothing_passes() -> None:
    assert max_rate(lambda r: 0.0, 0.9, 1.0) == 0.0


def _all_configs_by_hand() -> list[Parallelism]:
    """Every (tp, pp) on the toy 1 x 4 cluster, enumerated independently of the planner:
    tp up to the 4 KV heads (whole heads a rank, evenly or not: TP 3 holds 2, 1 and 1),
    pp dividing the 4 layers, at most 4 devices, the weights and one 2048-token request
    fit in 0.9 x 0.05 GB per device."""
    out = []
    for tp in (1, 2, 3, 4):
        for pp in (1, 2, 3, 4):
            if 4 % pp or tp * pp > 4:
                continue
            room = tp * pp * 0.045e9 - TOY.weight_bytes
            if room >= 2048 * TOY.kv_bytes_per_token:
                out.append(Parallelism(tp, pp))
    return out


def test_search_finds_the_exhaustive_optimum_on_a_small_cluster() -> None:
    ctx = toy_context()
    outcome = search(ctx, "both", workers=1)
    configs = _all_configs_by_hand()
    assert len(configs) == 7  # (1,1) (1,2) (1,4) (2,1) (2,2) (3,1) (4,1)
    goodput = {}
    for par in configs:
        for kind in ("prefill", "decode"):
            goodput[Task(kind, par)] = run_task(ctx, Task(kind, par)).goodput
        for chunked in (True, False):
            t = Task("colocated", par, chunked)
            goodput[t] = run_task(ctx, t).goodput
    # Alg. 2 units by hand: pp stages in the single node -> pp = 1; segments inside 4 devices
    for tp_p in (1, 2, 3, 4):
        for tp_d in (1, 2, 3, 4):
            for n_p in range(1, 5):
                n_d = (4 - n_p * tp_p) // tp_d
                if n_d >= 1:
                    t = Task("pair", Parallelism(tp_p, 1), True, Parallelism(tp_d, 1), n_p, n_d)
                    goodput[t] = run_task(ctx, t).goodput

    def best(kind: str) -> float:
        return max(g / t.devices for t, g in goodput.items() if t.kind == kind)

    # Alg. 1: a prefill and a decode config (one of each fits in the 4 devices),
    # combined by replication: R / (R * dev_p / g_p + R * dev_d / g_d)
    pre = [(t, g) for t, g in goodput.items() if t.kind == "prefill"]
    dec = [(t, g) for t, g in goodput.items() if t.kind == "decode"]
    alg1 = max(
        1 / (tp.devices / gp + td.devices / gd)
        for tp, gp in pre
        for td, gd in dec
        if tp.devices + td.devices <= 4
    )
    high = [p for p in outcome.disaggregated if p.kind.startswith("disaggregated (high")]
    assert high[0].per_device_goodput == pytest.approx(alg1)
    low = [p for p in outcome.disaggregated if p.kind.startswith("disaggregated (low")]
    assert low[0].per_device_goodput == pytest.approx(best("pair"))
    dis = outcome.best_disaggregated
    assert dis is not None
    assert dis.per_device_goodput == pytest.approx(max(alg1, best("pair")))
    assert outcome.best_colocated is not None
    assert outcome.best_colocated.per_device_goodput == pytest.approx(best("colocated"))
    assert outcome.best is not None
    assert outcome.best.per_device_goodput == pytest.approx(
        max(alg1, best("pair"), best("colocated"))
    )
    # and the search saw exactly these candidates
    searched = {r.task for p in outcome.disaggregated + outcome.colocated for r in p.results}
    assert searched <= set(goodput)
    assert outcome.tasks == len(goodput)


def test_alg1_per_device_goodput_combines_replicas() -> None:
    ctx = toy_context()
    outcome = search(ctx, "high", workers=1)
    best = outcome.best_disaggregated
    assert best is not None
    p, d = best.results
    expected = 1 / (p.task.devices / p.goodput + d.task.devices / d.goodput)
    assert best.per_device_goodput == pytest.approx(expected)
    n = best.instances_for(10 * p.goodput)
    assert n["prefill"] == 10
    assert n["decode"] == math.ceil(10 * p.goodput / d.goodput - 1e-9)


def test_plan_verifies_the_sized_cluster_and_refuses_too_high_rates() -> None:
    ctx = toy_context()
    result = make_plan(ctx, rate=5.0, affinity="high", workers=1)
    assert result.sizing is not None and result.sizing["devices"] <= 4
    assert result.verified_attainment is not None and 0.0 <= result.verified_attainment <= 1.0
    with pytest.raises(PlanInputError, match=r"--rate 100000 req/s is beyond this cluster"):
        make_plan(ctx, rate=1e5, affinity="high", workers=1)


def test_unmeetable_slo_explains_the_zero_load_latency() -> None:
    ctx = toy_context(slo=SLOTarget(ttft=1e-5, tpot=1e-5))
    with pytest.raises(PlanInputError, match="even with no queueing, the fastest configuration"):
        make_plan(ctx, rate=None, affinity="high", workers=1)


# ---- replanning ----------------------------------------------------------------------------


def test_replan_keeps_the_best_and_replaces_a_poor_placement() -> None:
    ctx = toy_context()
    outcome = search(ctx, "both", workers=1)
    assert outcome.best is not None
    w = ctx.workload
    same = WorkloadStats(2.0, float(w.input_lens.mean()), float(w.output_lens.mean()))
    keep = advise_replan(ctx, outcome.best, same, tolerance=0.1, workers=1)
    assert keep.keep and keep.ratio == pytest.approx(1.0)
    worst = outcome.ranked[-1]
    assert worst.per_device_goodput < 0.9 * outcome.best.per_device_goodput
    change = advise_replan(ctx, worst, same, tolerance=0.1, workers=1)
    assert not change.keep
    assert change.best.per_device_goodput == pytest.approx(outcome.best.per_device_goodput)
    assert change.instances == outcome.best.instances_for(2.0)


# ---- CLI -------------------------------------------------------------------------------------


def _plan(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "plan",
        "--hardware",
        "a100",
        "--output",
        str(tmp_path / "plan.json"),
        "--workers",
        "1",
        "--num-requests",
        "200",
        *extra,
    ]


def test_cli_plan_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = _plan(
        tmp_path,
        "--model", "opt-13b", "--nodes", "1", "--devices-per-node", "2",
        "--ttft", "0.25", "--tpot", "0.1", "--rate", "4", "--affinity", "high",
    )  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "datasheet ESTIMATE" in out
    assert "chosen: " in out and "best disaggregated: disaggregated (high affinity)" in out
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["hardware_is_estimate"] is True
    # the chosen placement is the best per device of everything searched
    best = max(
        doc["best_disaggregated"], doc["best_colocated"], key=lambda p: p["per_device_goodput"]
    )
    assert doc["chosen"] == best
    assert doc["verified_attainment"] >= 0.9
    assert doc["instances"]["devices"] <= 2
    # the placement `serve --placement` starts, read back as written
    placed = read_placement(tmp_path / "plan.json")
    assert [p.to_dict() for p in placed] == doc["placement"]["instances"]
    assert sum(p.devices for p in placed) == doc["instances"]["devices"]
    assert set(doc["curves"]) == {"disaggregated", "colocated"}
    assert (tmp_path / "plan.png").stat().st_size > 1000


@pytest.mark.parametrize("sustained", [100.0, 1e9])
def test_cli_plan_weighs_the_streamed_tokens_against_one_front_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sustained: float
) -> None:
    """`--frontend-tokens-per-s`: the cluster's streamed tokens/s (the rate times the
    workload's mean output) against what one front end sustains; a WARNING past it. The
    plan's verified attainment is the sized cluster's through that front end: a front end
    of 100 tokens/s offered several times that saturates and the requests after the first
    few miss TTFT; one of 1e9 tokens/s changes nothing (the attainment without the flag)."""
    from pdserve.planner.workload import sample_workload

    flags = (
        "--model", "opt-13b", "--nodes", "1", "--devices-per-node", "2", "--ttft", "0.25",
        "--tpot", "0.1", "--rate", "4", "--affinity", "high", "--no-plot",
    )  # fmt: skip
    argv = _plan(tmp_path, *flags, "--frontend-tokens-per-s", f"{sustained:g}")
    assert cli_main(argv) == 0
    mean = float(sample_workload("chatbot", 200, 1.0, 0, None).output_lens.mean())
    tokens = 4 * mean
    lines = capsys.readouterr().out.splitlines()
    want = (
        f"WARNING: at 4 req/s the cluster streams ~{tokens:.4g} tokens/s (mean output "
        f"{mean:.0f} tokens), beyond the 100 tokens/s one front end sustains "
        "(--frontend-tokens-per-s): its queue adds to every TTFT and TPOT (the verified "
        "attainment above counts it); run more front ends, each for part of the instances"
        if sustained == 100
        else f"front end: at 4 req/s the cluster streams ~{tokens:.4g} tokens/s, "
        f"{tokens / 1e9:.0%} of the 1e+09 one front end sustains"
    )
    assert want in lines, lines
    verified = json.loads((tmp_path / "plan.json").read_text())["verified_attainment"]
    free = tmp_path / "free"
    free.mkdir()
    assert cli_main(_plan(free, *flags)) == 0
    unqueued = json.loads((free / "plan.json").read_text())["verified_attainment"]
    assert unqueued >= 0.9  # the cluster was sized for the SLOs' 90%
    if sustained == 100:
        assert verified < 0.1  # all but the first few requests wait past TTFT 0.25 s
    else:
        assert verified == unqueued


def test_parallel_instances_are_laid_out_one_device_a_rank_and_read_back(tmp_path: Path) -> None:
    """A low-affinity unit of a TP 2 prefill and a PP 2 decode instance shares a node: 4
    devices, one a rank; the JSON `pdserve plan` writes reads back the same instances. A
    unit larger than a node is refused naming its instances."""
    unit = [(Role.PREFILL, 2, 1), (Role.DECODE, 1, 2)]
    placed = lay_out([unit, unit], nodes=2, devices_per_node=4)
    assert placed == [
        PlacedInstance(Role.PREFILL, 0, 2, 2, 1),
        PlacedInstance(Role.PREFILL, 1, 2, 2, 1),
        PlacedInstance(Role.DECODE, 0, 2, 1, 2),
        PlacedInstance(Role.DECODE, 1, 2, 1, 2),
    ]
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"instances": [p.to_dict() for p in placed]}))
    assert read_placement(path) == placed
    with pytest.raises(
        ValueError,
        match=r"^prefill \(TP2xPP1\) \+ decode \(TP1xPP2\) does "
        r"not fit on any node of 3 devices \(3 devices left on 1 nodes\)$",
    ):
        lay_out([unit], nodes=1, devices_per_node=3)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--model", "opt-175b", "--nodes", "1", "--devices-per-node", "2"),
            "opt-175b does not fit: weights 349.1 GB",
        ),
        (
            ("--model", "opt-13b", "--nodes", "1", "--devices-per-node", "1", "--ttft", "0.001"),
            "no placement meets TTFT 0.001 s",
        ),
        (
            ("--model", "opt-13b", "--nodes", "1", "--devices-per-node", "1", "--rate", "1e6"),
            "is beyond this cluster",
        ),
        (("--model", "gpt-9", "--nodes", "1", "--devices-per-node", "1"), "not a preset"),
        (("--model", "opt-13b", "--devices-per-node", "1"), "give --nodes and --devices-per-node"),
        (("--model", "opt-13b", "--nodes", "0", "--devices-per-node", "1"), ">= 1 node"),
        (
            ("--model", "opt-13b", "--nodes", "1", "--devices-per-node", "1", "--rate", "-2"),
            "--rate must be > 0",
        ),
        (
            ("--model", "opt-13b", "--nodes", "1", "--devices-per-node", "1", "--workload", "nope"),
            "nope",
        ),
        (
            (
                "--model",
                "opt-13b",
                "--nodes",
                "1",
                "--devices-per-node",
                "1",
                "--frontend-tokens-per-s",
                "0",
            ),
            "--frontend-tokens-per-s must be > 0, got 0.0",
        ),
    ],
)
def test_cli_plan_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    argv = _plan(tmp_path, *extra)
    if "--ttft" not in extra:
        argv += ["--ttft", "0.25"]
    argv += ["--tpot", "0.1"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_cli_plan_malformed_cluster_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "cluster.json"
    bad.write_text('{"nodes": 1, "devices_per_node": 2, "gpus": 8}')
    argv = _plan(
        tmp_path, "--model", "opt-13b", "--cluster", str(bad), "--ttft", "1", "--tpot", "1"
    )
    assert cli_main(argv) == 2
    assert "unknown cluster fields ['gpus']" in capsys.readouterr().err


def test_workload_reshaping_keeps_pattern() -> None:
    from pdserve.planner.replan import reshape_workload

    w = sample_workload("chatbot", 300, 1.0, seed=1)
    r = reshape_workload(w, WorkloadStats(1.0, 2 * float(w.input_lens.mean()), 50.0), 2048)
    assert np.array_equal(r.arrivals, w.arrivals)
    assert float(r.input_lens.mean()) == pytest.approx(2 * float(w.input_lens.mean()), rel=0.05)
    assert int((r.input_lens + r.output_lens).max()) <= 2048
