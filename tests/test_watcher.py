"""The transition watcher's decisions (cluster/watcher.py) on load histories built by
hand: no model, no process. A workload shift flips toward the role that is short, and
back when the shift reverses; a steady workload, a role's last instance, a window not yet
whole, a peak above the idle bound, an other role that is not saturated: no flip. And
the watcher on a real cluster through a shift and its reversal."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers.elastic import Load, elastic, roles
from helpers.server import Server, prometheus, wait_clean, wait_for

from pdserve.cluster.evidence import FlipDecision, InstanceLoad, LoadHistory, Snapshot
from pdserve.cluster.watcher import TetriInferPolicy, utilisation
from pdserve.config import Role
from pdserve.protocol.core import LoadReport

P, D = Role.PREFILL, Role.DECODE
POLICY = TetriInferPolicy(idle_load=0.1, idle_s=60.0, busy_load=0.8)


def feed(
    history: LoadHistory,
    start: float,
    seconds: float,
    loads: dict[str, tuple[Role, float, int]],
    every: float = 10.0,
) -> list[FlipDecision | None]:
    """Snapshots every `every` s from `start` for `seconds` s, all with `loads`
    (name -> role, utilisation, waiting); the policy's decision after each."""
    out: list[FlipDecision | None] = []
    t = start
    while t <= start + seconds + 1e-9:
        history.add(Snapshot(t, {n: InstanceLoad(*v) for n, v in loads.items()}))
        out.append(POLICY.decide(history))
        t += every
    return out


def test_a_shift_flips_toward_the_short_role_and_back_when_it_reverses() -> None:
    history = LoadHistory(60.0)
    # Long prompts, short answers: prefill saturated and queueing, both decodes idle.
    heavy_prefill = {
        "prefill-0": (P, 0.97, 6),
        "decode-0": (D, 0.04, 0),
        "decode-1": (D, 0.02, 0),
    }
    decisions = feed(history, 0.0, 60.0, heavy_prefill)
    assert decisions[:-1] == [None] * 6  # not a whole window of evidence before t=60
    decision = decisions[-1]
    assert decision is not None
    assert (decision.instance, decision.role) == ("decode-1", P)  # the less loaded one
    assert decision.reason == (
        "decode-1: every decode instance ran under 10% for 60 s (peak 4.0%) while the "
        "prefill instances queued requests in every snapshot"
    )
    assert decision.numbers == {
        "peak_idle_load": 0.04,
        "other_mean_load": pytest.approx(0.97),
        "window_s": 60.0,
    }

    # The watcher clears the history after a flip; decode-1 now prefills. The shift
    # reverses: short prompts, long answers: decode-0 saturated, both prefills idle.
    history.clear()
    heavy_decode = {
        "prefill-0": (P, 0.05, 0),
        "decode-1": (P, 0.03, 0),
        "decode-0": (D, 0.92, 0),
    }
    decisions = feed(history, 70.0, 60.0, heavy_decode)
    assert decisions[:-1] == [None] * 6
    back = decisions[-1]
    assert back is not None and (back.instance, back.role) == ("decode-1", D)
    assert back.reason == (
        "decode-1: every prefill instance ran under 10% for 60 s (peak 5.0%) while the "
        "decode instances averaged 92%"
    )


def test_a_steady_workload_never_flips() -> None:
    history = LoadHistory(60.0)
    steady = {"prefill-0": (P, 0.55, 1), "decode-0": (D, 0.5, 0), "decode-1": (D, 0.45, 0)}
    assert feed(history, 0.0, 600.0, steady) == [None] * 61
    # Idle everywhere (nothing to serve) is steady too: no role is short.
    idle = {"prefill-0": (P, 0.0, 0), "decode-0": (D, 0.0, 0), "decode-1": (D, 0.0, 0)}
    history.clear()
    assert feed(history, 0.0, 600.0, idle) == [None] * 61


def test_no_flip_without_the_whole_evidence() -> None:
    base = {"prefill-0": (P, 0.95, 3), "decode-0": (D, 0.02, 0), "decode-1": (D, 0.03, 0)}
    # The idle role's last instance is never taken.
    lone = {"prefill-0": (P, 0.95, 3), "decode-0": (D, 0.02, 0)}
    assert feed(LoadHistory(60.0), 0.0, 120.0, lone) == [None] * 13
    # One snapshot above the idle bound inside the window.
    history = LoadHistory(60.0)
    feed(history, 0.0, 30.0, base)
    history.add(
        Snapshot(40.0, {n: InstanceLoad(*v) for n, v in {**base, "decode-0": (D, 0.3, 0)}.items()})
    )
    assert POLICY.decide(history) is None
    # ... until it has left the window.
    assert feed(history, 50.0, 60.0, base)[-1] is not None
    # The other role neither saturated nor queueing.
    calm = {**base, "prefill-0": (P, 0.6, 0)}
    assert feed(LoadHistory(60.0), 0.0, 120.0, calm) == [None] * 13


def test_utilisation_is_busy_time_over_the_time_between_two_reports() -> None:
    first = LoadReport(10.0, 0, 1, 0, 100, 100, 0, 0, 0, busy_s=3.0)
    later = LoadReport(12.0, 0, 1, 0, 100, 100, 0, 0, 0, busy_s=4.5)
    assert utilisation(None, first) is None
    assert utilisation((first.sent_at, first.busy_s), later) == 0.75
    # No report since: the instance is inside one step (it reports between steps).
    assert utilisation((first.sent_at, first.busy_s), first) == 1.0


def test_a_real_cluster_follows_a_shift_and_its_reversal(start: Callable[..., Server]) -> None:
    """`--flip-policy tetriinfer` on `--prefill 1 --decode 2` (a 2 s window, a look every
    0.5 s): long prompts with 2-token answers saturate prefill-0 while both decode
    instances idle, and the watcher flips one of them to prefill; then short prompts with
    long answers saturate the decode instance left while both prefill instances idle, and
    it flips one back. Each phase's load runs until its flip is seen (bounded)."""
    server = start(
        "--prefill", "1", "--decode", "2", "--flip-policy", "tetriinfer",
        "--replan-interval", "0.5", "--flip-idle-seconds", "2",
        "--flip-idle-load", "0.3", "--flip-busy-load", "0.6",
    )  # fmt: skip
    long_prompt = " ".join(f"word{j % 97}" for j in range(400))
    prefill_heavy = {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}
    with Load(server, prefill_heavy, clients=3):
        wait_for(lambda: len(elastic(server)["decisions"]) == 1, timeout=120)
    [first] = elastic(server)["decisions"]
    assert first["role"] == "prefill" and first["flipped"], first
    assert first["outcome"].startswith("flipped in"), first
    moved = first["instance"]
    assert moved in ("decode-0", "decode-1") and roles(server)[moved] == "prefill"
    assert first["reason"].startswith(f"{moved}: every decode instance ran under 30% for 2 s")

    decode_heavy = {"prompt": "Tell me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with Load(server, decode_heavy, clients=6):
        wait_for(lambda: len(elastic(server)["decisions"]) == 2, timeout=120)
    second = elastic(server)["decisions"][1]
    assert second["role"] == "decode" and second["flipped"], second
    assert second["outcome"].startswith("flipped in"), second
    assert second["reason"].startswith(
        f"{second['instance']}: every prefill instance ran under 30% for 2 s"
    )
    assert sorted(roles(server).values()) == ["decode", "decode", "prefill"]
    assert [f["role"] for f in elastic(server)["flips"]] == ["prefill", "decode"]
    metrics = prometheus(server)
    assert metrics['pdserve_flip_decisions_total{outcome="flipped",policy="tetriinfer"}'] == 2
    assert metrics['pdserve_flip_decisions_total{outcome="refused",policy="tetriinfer"}'] == 0
    wait_clean(server)
