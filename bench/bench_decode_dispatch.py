"""TetriInfer Fig. 19 by simulation: decode dispatch random vs imbalance vs length-aware.

    .venv/bin/python bench/bench_decode_dispatch.py --data data.npz [--instances 2,4,8]

This machine has 2 cores, too few to run 4 or 8 decode instances that do not simply take
turns on them, so (as the issue allows) the decode instances are simulated. What is real:
the dispatch rule is pdserve's own `DecodeChooser` (cluster/policies.py) over stand-in
instances carrying the same counters the controller keeps; the requests are rows of the
predictor's held-out data (the prompts' real SmolLM2 output lengths, `pdserve predictor
train --data`), and each request's prediction is the shipped head's on that row's hidden
state (or the true bucket: `oracle`). What is modelled: every instance runs continuous
batching of the requests sent to it (TetriInfer: 32 per instance, all dispatched at
once), one step costing the planner's latency model for llama-2-7b on an A100 datasheet
profile (planner/latency.py: a fixed part, the decode rows, the KV read of the context),
the setting of TetriInfer's testbed rather than this CPU's.

Reported per (instances, policy), medians over `--trials` draws of the requests: total
decode time (the slowest instance's), mean request decode time, and the heavy / light
decodes on the slowest instance.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.cluster.config import DecodePolicy
from pdserve.cluster.policies import DecodeChooser
from pdserve.engine.length_head import features, read_head
from pdserve.planner.hardware import datasheet_profile
from pdserve.planner.latency import StepCost, step_cost
from pdserve.planner.model_spec import PRESETS
from pdserve.predictor.data import LengthData
from pdserve.predictor.shipped import SHIPPED_DIR, SHIPPED_HEADS
from pdserve.predictor.train import split_by_prompt

HEAVY = 128  # TetriInfer: ShareGPT's median answer length
PER_INSTANCE = 32


@dataclass
class Stand:
    """What the decode chooser reads of an instance."""

    name: str
    assigned_requests: int = 0
    assigned_heavy: int = 0
    alive: bool = True
    report: None = None


def makespan(lengths: list[int], prompt_lens: list[int], cost: StepCost) -> tuple[float, float]:
    """(time until the last request ends, mean request decode time) for requests that
    all start at once and decode in one continuous batch."""
    if not lengths:
        return 0.0, 0.0
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    t, done, step = 0.0, 0, 0
    ends = []
    context = sum(prompt_lens)
    alive = len(lengths)
    while alive:
        t += cost.decode_time(alive, context)
        step += 1
        context += alive
        while done < len(order) and lengths[order[done]] <= step:
            k = order[done]
            context -= prompt_lens[k] + lengths[k]
            ends.append(t)
            alive -= 1
            done += 1
    return t, statistics.fmean(ends)


def simulate(
    policy: DecodePolicy,
    n: int,
    lengths: np.ndarray,
    prompt_lens: np.ndarray,
    heavy: np.ndarray,
    cost: StepCost,
    seed: int,
) -> dict[str, float]:
    chooser = DecodeChooser(policy, seed)
    insts = [Stand(f"d{k}") for k in range(n)]
    placed: dict[str, list[int]] = {i.name: [] for i in insts}
    for r in range(len(lengths)):
        inst = chooser.choose(insts, 1, bool(heavy[r]))
        assert inst is not None
        inst.assigned_requests += 1
        inst.assigned_heavy += bool(heavy[r])
        placed[inst.name].append(r)
    runs = {
        name: makespan([int(lengths[r]) for r in rs], [int(prompt_lens[r]) for r in rs], cost)
        for name, rs in placed.items()
    }
    slowest = max(runs, key=lambda name: runs[name][0])
    slow = placed[slowest]
    true_heavy = sum(int(lengths[r]) >= HEAVY for r in slow)
    means = [runs[name][1] * len(placed[name]) for name in runs]
    return {
        "total_s": runs[slowest][0],
        "mean_s": sum(means) / len(lengths),
        "heavy": true_heavy,
        "light": len(slow) - true_heavy,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--data", required=True, help="the data set of `pdserve predictor train --data`"
    )
    ap.add_argument("--instances", default="2,4,8")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    data = LengthData.load(args.data)
    test = split_by_prompt(data, int(data.meta.get("seed", 0))).test
    head = read_head(SHIPPED_DIR / next(iter(SHIPPED_HEADS.values())))
    with torch.inference_mode():
        x = features(torch.from_numpy(data.hidden[test]), data.prompt_lens[test].tolist())
        buckets = head(x).argmax(dim=1).numpy()
    low = buckets * head.spec.granularity
    cost = step_cost(PRESETS["llama-2-7b"], datasheet_profile("a100").coefficients)
    lengths_all, prompts_all = data.output_lens[test], data.prompt_lens[test]
    print(
        f"{len(test)} held-out rows; heavy (>= {HEAVY} tokens) "
        f"{np.mean(lengths_all >= HEAVY):.0%}; "
        f"head granularity {head.spec.granularity}; step prices: llama-2-7b on a100 (datasheet)"
    )
    print(
        "instances  policy        predictions  total decode (s)  mean decode (s)"
        "  slowest: heavy/light"
    )
    rng = np.random.default_rng(args.seed)
    for n in [int(k) for k in args.instances.split(",")]:
        draws = [rng.choice(len(test), n * PER_INSTANCE, replace=False) for _ in range(args.trials)]
        for policy, kind in (
            (DecodePolicy.RANDOM, "-"),
            (DecodePolicy.IMBALANCE, "oracle"),
            (DecodePolicy.LENGTH_AWARE, "head"),
            (DecodePolicy.LENGTH_AWARE, "oracle"),
        ):
            rows = []
            for t, pick in enumerate(draws):
                lengths, prompts = lengths_all[pick], prompts_all[pick]
                heavy = (lengths >= HEAVY) if kind == "oracle" else (low[pick] >= HEAVY)
                rows.append(simulate(policy, n, lengths, prompts, heavy, cost, args.seed + t))
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(
                f"{n:>9}  {policy.value:<12}  {kind:<11}  {med['total_s']:>16.2f}  "
                f"{med['mean_s']:>15.2f}  {med['heavy']:>8.0f}/{med['light']:.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
