"""`pdserve plan` for DistServe's OPT chatbot setups (Table 1 SLOs, §6.1 testbed) next to
the placements DistServe reports (App. B, Table 3), and the search time.

Testbed: 4 nodes x 8 A100-80GB, NVLink inside a node, 25 Gbps between nodes; the
A100 profile is a datasheet estimate (pdserve/planner/hardware.py).

    .venv/bin/python bench/plan_opt.py [--num-requests 1000] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.planner.candidates import InstanceKnobs
from pdserve.planner.hardware import ClusterSpec, datasheet_profile
from pdserve.planner.model_spec import PRESETS
from pdserve.planner.plan import make_plan
from pdserve.planner.search import Placement, SearchContext, SLOTarget
from pdserve.planner.workload import sample_workload

# DistServe Table 1 (chatbot, ShareGPT) and Table 3 (prefill TP/PP, decode TP/PP).
CASES = {
    "opt-13b": (0.25, 0.1, ((2, 1), (1, 1))),
    "opt-66b": (2.5, 0.15, ((4, 1), (2, 2))),
    "opt-175b": (4.0, 0.2, ((3, 3), (4, 3))),
}


def parallelism(p: Placement) -> str:
    if p.kind.startswith("disaggregated (high"):
        pre, dec = (r.task.par for r in p.results)
        return f"P TP{pre.tp} PP{pre.pp} / D TP{dec.tp} PP{dec.pp}"
    (r,) = p.results
    if r.task.kind == "pair":
        assert r.task.decode_par is not None
        return (
            f"{r.task.num_prefill}x P TP{r.task.par.tp} / {r.task.num_decode}x D "
            f"TP{r.task.decode_par.tp}, PP{r.task.par.pp}"
        )
    return (
        f"TP{r.task.par.tp} PP{r.task.par.pp} ({'chunked' if r.task.chunked else 'prefill-first'})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--models", default=",".join(CASES))
    ap.add_argument("--output", default="bench-results/plan_opt.json")
    args = ap.parse_args()
    hw = datasheet_profile("a100")
    cluster = ClusterSpec(4, 8, 80e9, 300e9, 25e9 / 8)
    rows = []
    for name in args.models.split(","):
        ttft, tpot, paper = CASES[name]
        ctx = SearchContext(
            PRESETS[name],
            hw,
            cluster,
            InstanceKnobs(),
            SLOTarget(ttft, tpot, 0.9),
            sample_workload("chatbot", args.num_requests, 1.0, seed=0),
        )
        t0 = time.perf_counter()
        res = make_plan(ctx, None, "both", args.workers)
        dt = time.perf_counter() - t0
        high = [p for p in res.outcome.disaggregated if "high" in p.kind]
        low = [p for p in res.outcome.disaggregated if "low" in p.kind]
        colo = res.outcome.best_colocated
        row = {
            "model": name,
            "slo": [ttft, tpot],
            "paper": f"P TP{paper[0][0]} PP{paper[0][1]} / D TP{paper[1][0]} PP{paper[1][1]}",
            "high": parallelism(high[0]) if high else None,
            "high_per_device": high[0].per_device_goodput if high else None,
            "low": parallelism(low[0]) if low else None,
            "low_per_device": low[0].per_device_goodput if low else None,
            "colocated": parallelism(colo) if colo else None,
            "colocated_per_device": colo.per_device_goodput if colo else None,
            "tasks": res.outcome.tasks,
            "seconds": dt,
        }
        rows.append(row)
        print(json.dumps(row))
    Path(args.output).parent.mkdir(exist_ok=True)
    Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
