"""Simulator speed: simulated requests per second of wall time (median of repeats).

Systems: OPT-13B on the A100 datasheet profile, chatbot workload, at a rate near
each system's capacity (so batches are large and queues form):
1 prefill + 1 decode, 4 prefill + 4 decode, one colocated (chunked), one colocated
(prefill-first). The issue's target: >= 100,000 simulated requests per second.

    .venv/bin/python bench/bench_simulator.py [--requests 50000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.planner.hardware import datasheet_profile
from pdserve.planner.latency import step_cost
from pdserve.planner.model_spec import PRESETS
from pdserve.planner.simulator import ColocatedSystem, DisaggSystem, InstanceSpec, simulate
from pdserve.planner.workload import sample_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    spec = PRESETS["opt-13b"]
    cost = step_cost(spec, datasheet_profile("a100").coefficients)
    cap = 50_000
    pre = InstanceSpec(cost, cap, 256, 512, chunked=False)
    dec = InstanceSpec(cost, cap, 256, 512)
    systems = {
        "1P+1D": (DisaggSystem((pre,), (dec,), spec.kv_bytes_per_token, 25e9), 5.0),
        "4P+4D": (DisaggSystem((pre,) * 4, (dec,) * 4, spec.kv_bytes_per_token, 25e9), 20.0),
        "colocated chunked": (ColocatedSystem((dec,)), 5.0),
        "colocated prefill-first": (
            ColocatedSystem((InstanceSpec(cost, cap, 256, 512, False),)),
            5.0,
        ),
    }
    w = sample_workload("chatbot", args.requests, 1.0, seed=0)
    print(f"{'system':<26}{'rate':>6}{'attain':>8}{'sim req/s (median)':>20}{'min..max':>22}")
    for name, (system, rate) in systems.items():
        wr = w.with_rate(rate)
        speeds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = simulate(system, wr)
            speeds.append(args.requests / (time.perf_counter() - t0))
        att = r.attainment(0.25, 0.1)
        print(
            f"{name:<26}{rate:>6g}{att:>8.1%}{statistics.median(speeds):>20,.0f}"
            f"{min(speeds):>11,.0f}..{max(speeds):<9,.0f}"
        )


if __name__ == "__main__":
    main()
