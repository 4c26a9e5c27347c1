"""The `distserve` flip policy (cluster/replanning.py, planner/replan.py) on constructed
workload windows: its numbers and its split are what `pdserve plan` says for the same
requests (the window written as a JSONL trace), its verdicts follow from them, and it
never flips back on the workload it flipped for. No model runs: the planner simulates on
a measured profile written here (the coefficients `pdserve profile --threads 1 --quick`
fitted for the shipped SmolLM2 on an Intel Xeon)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.elastic import Paced, elastic, roles
from helpers.server import Server, prometheus, wait_clean, wait_for

from pdserve.cli import main as cli_main
from pdserve.cluster.evidence import (
    FlipDecision,
    InstanceLoad,
    Keep,
    LoadHistory,
    ObservedWindow,
    ScaleDecision,
    Served,
    Snapshot,
)
from pdserve.cluster.replanning import DistServePolicy, SplitAdvice, best_split, split_goodput
from pdserve.config import Role
from pdserve.planner.candidates import InstanceKnobs
from pdserve.planner.hardware import load_profile
from pdserve.planner.model_spec import resolve_model_spec
from pdserve.planner.replan import ProfileSplitPlanner
from pdserve.planner.search import SLOTarget

P, D = Role.PREFILL, Role.DECODE
TTFT, TPOT = 2.0, 0.1
WINDOW_S = 60.0

PROFILE = {
    "name": "xeon-1t",
    "kind": "measured",
    "coefficients": {
        "c1": 1.0781e-11,
        "c2": 2.3772e-10,
        "c3": 0.001243,
        "c4": 2.0797e-11,
        "c5": 1.1232e-09,
        "c6": 1.5973e-11,
        "knee": 2.0,
    },
    "device_memory_gb": 25.0,
}


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replan") / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


@pytest.fixture(scope="module")
def planner(profile_path: Path) -> ProfileSplitPlanner:
    return ProfileSplitPlanner(
        resolve_model_spec(None),
        load_profile(str(profile_path)),
        SLOTarget(TTFT, TPOT),
        InstanceKnobs(max_batch_size=64),
    )


def window(prompt: int, output: int, rate: float) -> list[Served]:
    """Requests at `rate` over the window, each finished 0.5 s after it arrived, the
    lengths varying a little."""
    return [
        Served(i / rate, i / rate + 0.5, prompt + i % 7, output + i % 5, 0.2, 0.02)
        for i in range(int(rate * WINDOW_S))
    ]


def history(split: dict[str, Role], served: list[Served], load: float = 0.5) -> LoadHistory:
    """Snapshots every 10 s over a whole window, each instance at `load`, and `served`."""
    return loaded_history({n: (r, load, 0) for n, r in split.items()}, served)


def loaded_history(loads: dict[str, tuple[Role, float, int]], served: list[Served]) -> LoadHistory:
    """`history` with each instance's own (role, load, waiting)."""
    h = LoadHistory(WINDOW_S)
    for t in range(0, int(WINDOW_S) + 1, 10):
        h.add(Snapshot(float(t), {n: InstanceLoad(*load) for n, load in loads.items()}))
        for s in served:
            if t - 10 < s.finished <= t:
                h.add_served(s)
    return h


def plan_argv(tmp_path: Path, profile: Path, served: list[Served], instances: int) -> list[str]:
    """`pdserve plan` on the window written as a trace, for its rate, on one node of
    `instances` devices (what a pdserve instance is on a CPU profile)."""
    trace = tmp_path / "window.jsonl"
    rows = ObservedWindow(WINDOW_S, tuple(served)).trace_rows()
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "plan.json"
    return [
        "plan",
        "--hardware", str(profile),
        "--nodes", "1",
        "--devices-per-node", str(instances),
        "--workload", str(trace),
        "--num-requests", "200",
        "--rate", repr(len(served) / WINDOW_S),
        "--ttft", repr(TTFT),
        "--tpot", repr(TPOT),
        "--affinity", "high",
        "--max-batch-size", "64",
        "--workers", "1",
        "--output", str(out),
        "--no-plot",
    ]  # fmt: skip


def planned(tmp_path: Path, profile: Path, served: list[Served], instances: int) -> dict:
    assert cli_main(plan_argv(tmp_path, profile, served, instances)) == 0
    return json.loads((tmp_path / "plan.json").read_text())


ONE_PREFILL = {"prefill-0": P, "decode-0": D, "decode-1": D}
TWO_PREFILL = {"prefill-0": P, "prefill-1": P, "decode-0": D}


@pytest.mark.parametrize(
    ("served", "split", "expect"),
    [
        # long answers at 0.5 req/s: decode is short, the running 1P:2D is the best split
        (window(30, 200, 0.5), ONE_PREFILL, None),
        # the same workload on 2P:1D: one prefill instance moves to decode
        (window(30, 200, 0.5), TWO_PREFILL, ("prefill-0", D)),
        # medium prompts, short answers at 0.8 req/s: prefill is short, 2P:1D wins
        (window(160, 24, 0.8), ONE_PREFILL, ("decode-0", P)),
    ],
)
def test_decisions_are_what_pdserve_plan_says(
    tmp_path: Path,
    profile_path: Path,
    planner: ProfileSplitPlanner,
    served: list[Served],
    split: dict[str, Role],
    expect: tuple[str, Role] | None,
) -> None:
    policy = DistServePolicy(planner, WINDOW_S, gain=0.2, min_requests=20)
    plan = planned(tmp_path, profile_path, served, len(split))
    best = plan["best_disaggregated"]["configs"]
    gp, gd = best[0]["goodput"], best[1]["goodput"]
    need = plan["disaggregated_instances"]
    running = sum(1 for r in split.values() if r is P)
    advice = planner.advise(ObservedWindow(WINDOW_S, tuple(served)), running, len(split) - running)
    # the policy's planner and `pdserve plan` ran the same search on the same requests
    assert (advice.prefill_goodput, advice.decode_goodput) == (gp, gd)
    assert (advice.needed_prefill, advice.needed_decode) == (need["prefill"], need["decode"])
    # the best split from plan.json's numbers alone: every split that gives each phase
    # what the plan sizes for the rate, the one serving the most within the SLOs
    n = len(split)
    fits = [p for p in range(1, n) if p >= need["prefill"] and n - p >= need["decode"]]
    target = max(fits, key=lambda p: (min(p * gp, (n - p) * gd), -p))
    verdict = policy.decide(history(split, served))
    if expect is None:
        assert target == running
        assert isinstance(verdict, Keep)
        assert (
            verdict.reason == f"the running split {running}P:{n - running}D is the planner's best"
        )
        return
    assert isinstance(verdict, FlipDecision)
    assert (verdict.instance, verdict.role) == expect
    step = 1 if expect[1] is P else -1
    assert (target - running) * step > 0  # toward the plan's split
    assert verdict.numbers["target_prefill"] == target
    assert verdict.numbers["target_goodput"] == min(target * gp, (n - target) * gd)
    assert verdict.numbers["running_goodput"] == min(running * gp, (n - running) * gd)
    assert verdict.numbers["target_goodput"] > 1.2 * verdict.numbers["running_goodput"]
    # after the flip, on the same workload: kept (no oscillation)
    flipped = dict(split)
    flipped[expect[0]] = expect[1]
    if running + step == target:
        again = policy.decide(history(flipped, served))
        assert isinstance(again, Keep)
        assert again.reason.startswith(f"the running split {target}P:")


def test_a_workload_no_split_serves_is_kept_with_the_planners_reason(
    tmp_path: Path,
    profile_path: Path,
    planner: ProfileSplitPlanner,
    capsys: pytest.CaptureFixture[str],
) -> None:
    policy = DistServePolicy(planner, WINDOW_S, gain=0.2, min_requests=20)
    # long answers at 2 req/s: the plan needs more decode instances than 3 leave
    served = window(30, 200, 2.0)
    advice = planner.advise(ObservedWindow(WINDOW_S, tuple(served)), 1, 2)
    assert advice.needed_prefill + advice.needed_decode > 3
    verdict = policy.decide(history(ONE_PREFILL, served))
    assert isinstance(verdict, Keep)
    assert verdict.reason == (
        "no split of 3 instances serves 2 req/s within the SLOs: the planner needs "
        f"{advice.needed_prefill} prefill + {advice.needed_decode} decode instances"
    )
    # `pdserve plan` sizes the same instances, more than 3 devices hold
    plan = planned(tmp_path, profile_path, served, 8)
    need = plan["disaggregated_instances"]
    assert (need["prefill"], need["decode"]) == (advice.needed_prefill, advice.needed_decode)
    assert cli_main(plan_argv(tmp_path, profile_path, served, 3)) == 2
    assert "is beyond this cluster" in capsys.readouterr().err
    # prompts no instance prefills within the TTFT: the planner's own words
    verdict = policy.decide(history(ONE_PREFILL, window(600, 8, 1.0)))
    assert isinstance(verdict, Keep)
    assert verdict.reason.startswith(
        "the planner finds no placement: no placement meets TTFT 2 s and TPOT 0.1 s"
    )


def test_too_little_evidence_is_not_judged(planner: ProfileSplitPlanner) -> None:
    policy = DistServePolicy(planner, WINDOW_S, gain=0.2, min_requests=20)
    served = window(30, 200, 0.5)
    short = LoadHistory(WINDOW_S)
    short.add(Snapshot(0.0, {n: InstanceLoad(r, 0.5, 0) for n, r in TWO_PREFILL.items()}))
    short.add(Snapshot(50.0, {n: InstanceLoad(r, 0.5, 0) for n, r in TWO_PREFILL.items()}))
    assert policy.decide(short) is None  # 50 s of a 60 s window
    verdict = policy.decide(history(TWO_PREFILL, served[:19]))
    assert verdict == Keep(
        "19 requests finished in the last 60 s; replanning needs 20", {"requests": 19}
    )


class Fixed:
    """A planner that answers `advice` whatever the window (the policy's own logic)."""

    def __init__(self, advice: SplitAdvice) -> None:
        self.advice = advice

    def advise(self, window: ObservedWindow, prefill: int, decode: int) -> SplitAdvice:
        return self.advice


def test_the_gain_threshold_and_the_least_loaded_instance() -> None:
    advice = SplitAdvice(1.0, 1.0, 1, 1, 0.5, TTFT, TPOT)
    assert best_split(advice, 4) == 2  # min(2, 2) = 2 beats min(1, 3) = min(3, 1) = 1
    assert split_goodput(advice, 1, 3) == 1.0
    lopsided = SplitAdvice(3.0, 1.0, 1, 2, 0.5, TTFT, TPOT)
    assert best_split(lopsided, 4) == 1  # min(3, 3) = 3; 2P:2D gives min(6, 2) = 2
    assert best_split(SplitAdvice(1.0, 1.0, 3, 2, 0.5, TTFT, TPOT), 4) is None

    served = window(30, 200, 0.5)
    split = {"prefill-0": P, "decode-0": D, "decode-1": D, "decode-2": D}
    h = history(split, served)
    # 1P:3D serves 1 req/s, 2P:2D 2: a gain of 1.0 is not more than 1.0
    assert isinstance(DistServePolicy(Fixed(advice), WINDOW_S, 1.0, 20).decide(h), Keep)
    verdict = DistServePolicy(Fixed(advice), WINDOW_S, 0.99, 20).decide(h)
    assert isinstance(verdict, FlipDecision)
    assert verdict.role is P
    # the least loaded decode instance gives itself up
    loads = {
        "prefill-0": (P, 0.9, 3),
        "decode-0": (D, 0.7, 0),
        "decode-1": (D, 0.2, 0),
        "decode-2": (D, 0.4, 0),
    }
    h2 = loaded_history(loads, served)
    verdict = DistServePolicy(Fixed(advice), WINDOW_S, 0.5, 20).decide(h2)
    assert isinstance(verdict, FlipDecision)
    assert (verdict.instance, verdict.role) == ("decode-1", P)
    assert verdict.reason == (
        "the planner's best split for 0.5 req/s is 2P:2D (2 req/s within the SLOs) against "
        "the running 1P:3D's 1: decode-1 moves from decode to prefill"
    )


def test_scaling_decisions_are_what_pdserve_plan_says(
    tmp_path: Path, profile_path: Path, planner: ProfileSplitPlanner
) -> None:
    """With room to scale (2 to 3 instances): 200-token answers at 0.5 req/s need the
    planner's 1 prefill + 2 decode instances, more than 1P:1D - a decode instance is
    added; 64-token answers at the same rate need 1 + 1, so 1P:2D gives its least loaded
    decode instance back; and on the workload it scaled out for, 1P:2D stays (no scale-in
    right after a scale-out: hysteresis)."""
    policy = DistServePolicy(planner, WINDOW_S, gain=0.2, min_requests=20, bounds=(2, 3))
    long_answers = window(20, 200, 0.5)
    plan = planned(tmp_path, profile_path, long_answers, 8)["disaggregated_instances"]
    assert (plan["prefill"], plan["decode"]) == (1, 2)
    verdict = policy.decide(history({"prefill-0": P, "decode-0": D}, long_answers))
    assert isinstance(verdict, ScaleDecision), verdict
    assert (verdict.action, verdict.role, verdict.instance) == ("add", D, None)
    assert verdict.reason == (
        "no split of 2 instances serves 0.5 req/s within the SLOs: the planner needs 1 "
        "prefill + 2 decode instances; a decode instance is added (at most 3)"
    )
    kept = policy.decide(history(ONE_PREFILL, long_answers))
    assert isinstance(kept, Keep) and kept.reason == "the running split 1P:2D is the planner's best"
    # at most 2: the old verdict, the placement kept
    capped = DistServePolicy(planner, WINDOW_S, 0.2, 20, bounds=(2, 2))
    verdict = capped.decide(history({"prefill-0": P, "decode-0": D}, long_answers))
    assert isinstance(verdict, Keep) and verdict.reason.startswith("no split of 2 instances")

    short_answers = window(20, 64, 0.5)
    plan = planned(tmp_path, profile_path, short_answers, 8)["disaggregated_instances"]
    assert (plan["prefill"], plan["decode"]) == (1, 1)
    advice = planner.advise(ObservedWindow(WINDOW_S, tuple(short_answers)), 1, 2)
    goodput = min(advice.prefill_goodput, advice.decode_goodput)
    loads = {"prefill-0": (P, 0.3, 0), "decode-0": (D, 0.4, 0), "decode-1": (D, 0.1, 0)}
    h = loaded_history(loads, short_answers)
    verdict = policy.decide(h)
    assert isinstance(verdict, ScaleDecision), verdict
    assert (verdict.action, verdict.role, verdict.instance) == ("remove", D, "decode-1")
    assert verdict.reason == (
        f"1P:1D serves {goodput:.3g} req/s within the SLOs, at least 1.2x the observed 0.5: "
        "decode-1 (the least loaded decode instance, 10%) is removed (at least 2)"
    )
    # at least 3: nothing is removed
    floor = DistServePolicy(planner, WINDOW_S, 0.2, 20, bounds=(3, 3))
    assert isinstance(floor.decide(h), Keep)


def test_scaling_picks_the_shorter_role_and_never_a_roles_last() -> None:
    served = window(30, 200, 0.5)
    two = history({"prefill-0": P, "decode-0": D}, served)
    # both roles short: 3/1 prefill against 2/1 decode - a prefill instance
    both = SplitAdvice(1.0, 1.0, 3, 2, 0.5, TTFT, TPOT)
    verdict = DistServePolicy(Fixed(both), WINDOW_S, 0.2, 20, (2, 8)).decide(two)
    assert isinstance(verdict, ScaleDecision) and verdict.role is P
    # one fewer would serve (1P:0D is no split), but each role has one: nothing removed
    idle = SplitAdvice(10.0, 10.0, 1, 1, 1.0, TTFT, TPOT)
    verdict = DistServePolicy(Fixed(idle), WINDOW_S, 0.2, 20, (1, 2)).decide(two)
    assert isinstance(verdict, Keep) and verdict.reason.startswith("the running split 1P:1D")
    # 1P:2D at 0.5 req/s: 1P:1D would serve 0.55, not 1.2x 0.5 - kept
    tight = SplitAdvice(10.0, 0.55, 1, 1, 1.0, TTFT, TPOT)
    three = history(ONE_PREFILL, served)
    verdict = DistServePolicy(Fixed(tight), WINDOW_S, 0.2, 20, (2, 3)).decide(three)
    assert isinstance(verdict, Keep), verdict
    roomy = SplitAdvice(10.0, 0.6, 1, 1, 1.0, TTFT, TPOT)  # 0.6 = 1.2 x 0.5
    verdict = DistServePolicy(Fixed(roomy), WINDOW_S, 0.2, 20, (2, 3)).decide(three)
    assert isinstance(verdict, ScaleDecision) and verdict.action == "remove"


def test_a_real_cluster_replans_through_a_shift_and_its_reversal(
    start: Callable[..., Server], profile_path: Path
) -> None:
    """`--flip-policy distserve` on `--prefill 1 --decode 2` (a 6 s window, a look every
    0.5 s), the profile above (so the planner's answers depend on the requests' lengths,
    not on this machine's speed): 150-token prompts with 24-token answers at 1 req/s
    make 2P:1D the best split (its predicted goodput 1.56x 1P:2D's), and a decode
    instance flips to prefill; then short prompts with 200-token answers at 0.5 req/s
    make 1P:2D the best again, and a prefill instance flips back. Each phase runs until
    its flip is seen (bounded); the verdicts between are kept, with reasons."""
    server = start(
        "--prefill", "1", "--decode", "2", "--flip-policy", "distserve",
        "--flip-profile", str(profile_path), "--slo-ttft", repr(TTFT), "--slo-tpot", repr(TPOT),
        "--replan-interval", "0.5", "--replan-window", "6", "--replan-min-requests", "3",
    )  # fmt: skip
    prompt = [100 + j % 997 for j in range(150)]  # token ids: exactly 150 prompt tokens
    prefill_heavy = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with Paced(server, prefill_heavy, rate=1.0):
        wait_for(lambda: len(elastic(server)["decisions"]) == 1, timeout=120)
    [first] = elastic(server)["decisions"]
    assert first["role"] == "prefill" and first["flipped"], first
    moved = first["instance"]
    assert moved in ("decode-0", "decode-1") and roles(server)[moved] == "prefill"
    numbers = first["numbers"]
    assert first["reason"].endswith(
        f"1P:2D's {numbers['running_goodput']:.3g}: {moved} moves from decode to prefill"
    )
    assert (numbers["target_prefill"], numbers["mean_prompt"], numbers["mean_output"]) == (
        2,
        150,
        24,
    )

    short = [100 + j for j in range(20)]
    decode_heavy = {"prompt": short, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with Paced(server, decode_heavy, rate=0.5):
        wait_for(lambda: len(elastic(server)["decisions"]) == 2, timeout=120)
    second = elastic(server)["decisions"][1]
    assert second["role"] == "decode" and second["flipped"], second
    assert (second["numbers"]["target_prefill"], second["numbers"]["mean_output"]) == (1, 200)
    assert sorted(roles(server).values()) == ["decode", "decode", "prefill"]
    summary = elastic(server)
    assert summary["policy"] == "distserve"
    assert [f["role"] for f in summary["flips"]] == ["prefill", "decode"]
    metrics = prometheus(server)
    assert metrics['pdserve_flip_decisions_total{outcome="flipped",policy="distserve"}'] == 2
    assert metrics['pdserve_flip_decisions_total{outcome="refused",policy="distserve"}'] == 0
    assert 0 <= metrics['pdserve_replan_attainment{kind="predicted"}'] <= 1
    wait_clean(server)
