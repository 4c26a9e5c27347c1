"""The planner's latency model against measured TP 2 / PP 2 step times on this machine.

    .venv/bin/python bench/bench_planner_parallel.py [--profile profile.json]
        [--rounds 2] [--json out.json] [--write-profile fitted.json]

A "device" here is one core: the profile is `pdserve profile --threads 1` (made here with
the quick grid unless `--profile` names one), and the layouts compared are TP 1 on one
thread, TP 2 and PP 2 on two ranks of one thread each (engines of the shipped model,
in process, alternating over `--rounds`; bench/bench_parallel.py's timings: a 512-token
prefill, one greedy stream's decode step, 8 streams' decode step).

The link terms the model takes (`planner.latency.Interconnect`) come two ways:
- from the micro-benchmark: the time of one all-reduce of [n, hidden] fp32
  (`group.all_reduce_sum`) and of one one-way stage hand-off (`group.send`/`recv`)
  between two ranks of one thread, n = 1, 64, 512 -> each a fixed cost and a bandwidth
  (the line through n = 1 and 512);
- fitted to the steps: the fixed costs per sum and per hand-off that make the model
  meet the measured one-stream decode step of TP 2 and of PP 2 (what a step pays for
  each beyond the micro-benchmark: the ranks' Python per layer, the stages' waits).
For each, `step_cost` predicts every layout's three times, printed beside the measured
ones (prediction / measurement). `--write-profile` saves the profile with the fitted
link, which `pdserve plan --hardware` then searches TP and PP with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_parallel import BATCH, DECODE_TOKENS, PROMPT_TOKENS, communication, measure

from pdserve.planner.hardware import HardwareProfile, load_profile
from pdserve.planner.latency import Interconnect, Parallelism, StepCost, step_cost
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.profiler import ProfileConfig, profile

ROWS = (1, 64, 512)
LAYOUTS = ((1, 1), (2, 1), (1, 2))


def fit_link(spec: ModelSpec, comm: dict[str, list[float]]) -> Interconnect:
    """The model's link terms from the micro-benchmark: an all-reduce of b bytes costs
    tp_latency_s + ring * b / tp_bandwidth (ring = 2 (T - 1) / T = 1 at T = 2), a
    hand-off pp_latency_s + b / pp_bandwidth; each line through the smallest and the
    largest rows (a decode step's sum, a 512-token prefill's: small sums go through
    shared memory, large ones through gloo)."""
    b = [n * spec.hidden_size * spec.dtype_bytes for n in (ROWS[0], ROWS[-1])]

    def line(times: list[float]) -> tuple[float, float]:
        per_byte = max((times[-1] - times[0]) / (b[1] - b[0]), 1e-15)
        return max(times[0] - per_byte * b[0], 0.0), 1.0 / per_byte

    tp_lat, tp_bw = line(comm["reduce"])
    pp_lat, pp_bw = line(comm["handoff"])
    return Interconnect(tp_bw, tp_lat, pp_bw, pp_lat)


def predict(cost: StepCost) -> dict[str, float]:
    """The three measured quantities as the model prices them: the prompt's prefill, a
    decode step of 1 and of BATCH streams at their mean context."""
    one = 16 + DECODE_TOKENS // 2
    return {
        "prefill_s": cost.prefill_time([PROMPT_TOKENS]),
        "tpot_s": cost.decode_time(1, one),
        "batch_tpot_s": cost.decode_time(BATCH, BATCH * one),
    }


def fit_to_steps(
    spec: ModelSpec, hw: HardwareProfile, link: Interconnect, b1: dict[str, float]
) -> Interconnect:
    """The fixed all-reduce and hand-off costs that make the model meet the measured
    decode step of one stream (`b1`: layout -> seconds) on TP 2 and PP 2: what a step
    pays per sum and per hand-off in all (the ranks' Python per layer included)."""
    c = hw.coefficients
    no_fixed = replace(link, tp_latency_s=0.0, pp_latency_s=0.0)
    tp2 = predict(step_cost(spec, c, Parallelism(2, 1), no_fixed))["tpot_s"]
    pp2 = predict(step_cost(spec, c, Parallelism(1, 2), no_fixed))["tpot_s"]
    per_sum = (b1["2x1"] - tp2) / (2 * spec.num_layers)  # two sums a layer
    per_hop = b1["1x2"] - pp2  # one stage boundary
    return replace(link, tp_latency_s=max(per_sum, 0.0), pp_latency_s=max(per_hop, 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="a `pdserve profile --threads 1` JSON")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--write-profile",
        default=None,
        help="the profile with the link fitted to the steps, for `pdserve plan --hardware`",
    )
    args = ap.parse_args()
    hw: HardwareProfile = (
        load_profile(args.profile)
        if args.profile
        else profile(ProfileConfig(threads=1, quick=True), progress=False)
    )
    spec = ModelSpec.from_dict(hw.fit["model_spec"], "the profile")
    comm = communication(spec.hidden_size, ROWS)
    measured: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for tp, pp in LAYOUTS:
            for k, v in measure(args.quantization, tp, pp, tp * pp).items():
                measured.setdefault(f"{tp}x{pp}", {}).setdefault(k, []).append(v)
    med = {
        name: {k: statistics.median(v) for k, v in runs.items()} for name, runs in measured.items()
    }
    links = {"micro-benchmark": fit_link(spec, comm)}
    links["fitted to b=1 steps"] = fit_to_steps(
        spec, hw, links["micro-benchmark"], {n: m["tpot_s"] for n, m in med.items()}
    )
    rows = ", ".join(map(str, ROWS))
    print(f"profile: {hw.source}")
    print(
        f"[n, {spec.hidden_size}] fp32 between 2 ranks of 1 thread, n = {rows}: all-reduce "
        f"{', '.join(f'{t * 1e6:.0f}' for t in comm['reduce'])} us, one-way hand-off "
        f"{', '.join(f'{t * 1e6:.0f}' for t in comm['handoff'])} us"
    )
    report: dict[str, dict[str, float]] = {}
    for what, link in links.items():
        print(
            f"link ({what}): all-reduce {link.tp_latency_s * 1e6:.0f} us + "
            f"{link.tp_bandwidth / 1e9:.2f} GB/s, hand-off {link.pp_latency_s * 1e6:.0f} us "
            f"+ {link.pp_bandwidth / 1e9:.2f} GB/s"
        )
        for tp, pp in LAYOUTS:
            name = f"{tp}x{pp}"
            pred = predict(step_cost(spec, hw.coefficients, Parallelism(tp, pp), link))
            report[f"{name} {what}"] = pred
            cells = [
                f"{k.removesuffix('_s')} {med[name][k] * 1e3:.1f} ms, model "
                f"{pred[k] * 1e3:.1f} ({pred[k] / med[name][k]:.2f}x)"
                for k in ("prefill_s", "tpot_s", "batch_tpot_s")
            ]
            print(f"  TP {tp} x PP {pp}: " + "; ".join(cells))
    fitted = links["fitted to b=1 steps"]
    if args.write_profile:
        replace(
            hw,
            tp_bandwidth=fitted.tp_bandwidth,
            tp_latency_s=fitted.tp_latency_s,
            pp_latency_s=fitted.pp_latency_s,
            source=hw.source + "; links fitted by bench/bench_planner_parallel.py",
        ).save(Path(args.write_profile))
    if args.json:
        with open(args.json, "w") as f:
            doc = {
                "profile_source": hw.source,
                "communication": comm,
                "links": {k: vars(v) for k, v in links.items()},
                "measured": measured,
                "predicted": report,
            }
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
