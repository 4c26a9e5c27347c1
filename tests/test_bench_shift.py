"""bench/bench_shift.py's pure parts: the workload it sends and the attainment it
reports, on constructed results (the runs themselves are benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_shift


def test_the_workload_is_drawn_once_per_seed_with_each_phase_shape() -> None:
    args = bench_shift.parse_args(["--phase-seconds", "30", "--seed", "3"])
    plan = bench_shift.workload(args)
    assert plan == bench_shift.workload(args)  # the same requests for every configuration
    a = [p for p in plan if p.phase == "A"]
    b = [p for p in plan if p.phase == "B"]
    assert all(0 < p.at < 30 for p in a) and all(30 <= p.at < 60 for p in b)
    assert {len(p.prompt) for p in a} == {300} and {p.max_tokens for p in a} == {8}
    assert {len(p.prompt) for p in b} == {16} and {p.max_tokens for p in b} == {96}
    assert len({tuple(p.prompt) for p in plan}) == len(plan)  # no prompt shared
    assert [p.at for p in plan] == sorted(p.at for p in plan)


def test_attainment_by_phase_and_bucket() -> None:
    args = bench_shift.parse_args(["--phase-seconds", "20", "--bucket", "10"])

    def r(at: float, phase: str, ttft: float | None, tpot: float | None, error: str | None = None):
        return {"at": at, "phase": phase, "ttft": ttft, "tpot": tpot, "tokens": 8, "error": error}

    results = [
        r(1, "A", 1.0, 0.05),  # attains
        r(2, "A", 2.5, 0.05),  # TTFT over 2 s
        r(15, "A", 0.5, 0.2),  # TPOT over 0.1 s
        r(25, "B", 0.5, None),  # one token: no TPOT, attains
        r(26, "B", 0.5, 0.05, "HTTP 503"),  # an error never attains
    ]
    row = bench_shift.summarize({"config": "x", "results": results, "flips": []}, args)
    assert row["attainment"] == 2 / 5
    assert row["phases"]["A"] == {"attainment": 1 / 3, "goodput": 1 / 20}
    assert row["phases"]["B"] == {"attainment": 1 / 2, "goodput": 1 / 20}
    assert row["buckets"] == [1 / 2, 0.0, 1 / 2, None]
    assert row["errors"] == 1
