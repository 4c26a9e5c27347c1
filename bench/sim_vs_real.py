"""The simulator against the real system: SLO attainment across a rate sweep.

1. calibration: `pdserve serve` (colocated by default, or --prefill/--decode) runs
   with `PDSERVE_STEP_TRACE`, `pdserve bench run` sends a calibration sweep (its own
   seed), and `pdserve profile --from-trace` fits the latency model to the steps the
   serving engine traced (the HTTP front end and the load generator share this
   2-core machine, so isolated step times are too optimistic under load);
2. evaluation: a fresh server, the evaluation sweep (another seed);
3. every measured request (its prompt and output length and the moment it was sent)
   is replayed through the simulator, configured like the server, with the serving
   profile (and, for comparison, an isolated `pdserve profile` grid profile);
4. it prints measured vs simulated attainment (and mean TTFT / TPOT) per rate.

--cross-fit adds a third profile per rate, fitted to the evaluation run's own step
trace *without that rate's steps* (leave one rate out): the machine's speed in the
minutes of the sweep, never the steps being predicted. This machine is shared, and
its speed drifts by 10-20% between runs minutes apart.

    .venv/bin/python bench/sim_vs_real.py --grid-profile profile.json \
        --rates 1,1.5,2,3 --num-prompts 80 --slo ttft:1000 tpot:100

With --results FILE --profile FILE it skips the runs (re-analyses an earlier sweep);
`--pool OUT1.json OUT2.json ...` averages the outputs of repeated sweeps.
--noise-interval S adds rows simulated with the machine's speed redrawn every S s
(`simulator.SpeedNoise`, sigma estimated from step traces), averaged over seeds.
--pin-engine CPU runs the engine on that CPU and the HTTP front end and the load
generator on the others, so their work (which grows with the request rate) does not
take the engine's CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench import metrics
from pdserve.bench.config import SLO
from pdserve.bench.results import records_of
from pdserve.planner.hardware import HardwareProfile, load_profile
from pdserve.planner.latency import step_cost
from pdserve.planner.model_spec import resolve_model_spec
from pdserve.planner.profiler import (
    ProfileConfig,
    StepPoint,
    fitted_profile,
    measure_bandwidth,
    read_trace,
)
from pdserve.planner.simulator import (
    ColocatedSystem,
    DisaggSystem,
    InstanceSpec,
    SimResult,
    SpeedNoise,
    simulate,
)
from pdserve.planner.workload import SimWorkload

KV_GIB = 1.0  # CacheConfig.kv_cache_memory_gib default (--kv-gib)
MAX_NUM_SEQS = 64  # SchedulerConfig.max_num_seqs default
BUDGET = 512  # SchedulerConfig.max_num_batched_tokens default (and --chunk-size default)


def others(engine_cpu: int | None) -> Callable[[], None] | None:
    """A preexec_fn keeping a process (server front end, load generator) off the
    engine's CPU; None when the engine is not pinned."""
    if engine_cpu is None:
        return None
    rest = os.sched_getaffinity(0) - {engine_cpu}
    return lambda: os.sched_setaffinity(0, rest)


def start_server(port: int, extra: list[str], engine_cpu: int | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *extra]
    if engine_cpu is not None:
        cmd += ["--engine-cpus", str(engine_cpu)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=others(engine_cpu)
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("server did not become healthy in 180 s")


def run_sweep(
    args: argparse.Namespace, out: Path, rates: str, prompts: int, seed: int, trace: str
) -> None:
    # The simulator has no prefix cache, and every rate of a sweep sends the same
    # prompts: with the cache on, later rates would prefill almost nothing.
    extra = ["--no-prefix-cache", "--kv-cache-memory-gib", repr(args.kv_gib)]
    if args.threads:
        extra += ["--num-threads", str(args.threads)]
    if args.prefill:
        extra += ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    os.environ["PDSERVE_STEP_TRACE"] = trace
    proc = start_server(args.port, extra, args.pin_engine)
    del os.environ["PDSERVE_STEP_TRACE"]
    try:
        cmd = [
            sys.executable, "-m", "pdserve.cli", "bench", "run",
            "--port", str(args.port), "--workload", args.workload,
            "--num-prompts", str(prompts), "--seed", str(seed),
            "--request-rates", rates, "--slo", *args.slo,
            "--result-file", str(out), "--no-plots", "--disable-tqdm",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, preexec_fn=others(args.pin_engine))
    finally:
        proc.terminate()
        proc.wait(30)


def calibrate(args: argparse.Namespace, prefix: str) -> Path:
    trace = f"{prefix}.calibration-trace"
    for old in Path(trace).parent.glob(Path(trace).name + ".*"):
        old.unlink()
    run_sweep(
        args, Path(f"{prefix}.calibration.json"), args.calibrate_rates,
        args.calibrate_prompts, args.calibrate_seed, trace,
    )  # fmt: skip
    profile = Path(f"{prefix}.serving-profile.json")
    files = sorted(str(p) for p in Path(trace).parent.glob(Path(trace).name + ".*.jsonl"))
    cmd = [sys.executable, "-m", "pdserve.cli", "profile", "--from-trace", *files]
    if args.threads:
        cmd += ["--threads", str(args.threads)]  # names the profile (the trace has the times)
    subprocess.run([*cmd, "--output", str(profile)], check=True)
    return profile


def workload_of(run: dict[str, Any]) -> SimWorkload:
    recs = sorted(run["records"], key=lambda r: r["sent_at_s"])
    t0 = recs[0]["sent_at_s"]
    return SimWorkload(
        arrivals=np.array([r["sent_at_s"] - t0 for r in recs], dtype=np.float64),
        input_lens=np.array(
            [r["server_prompt_tokens"] or r["prompt_len"] for r in recs], dtype=np.int64
        ),
        output_lens=np.array([r["output_len"] for r in recs], dtype=np.int64),
        name=f"replay@{run['rate']}",
    )


System = ColocatedSystem | DisaggSystem


def system_for(args: argparse.Namespace, hw: HardwareProfile) -> System:
    spec = resolve_model_spec(None)
    cost = step_cost(spec, hw.coefficients)
    kv_tokens = int(args.kv_gib * 2**30 // spec.kv_bytes_per_token)
    if not args.prefill:
        inst = InstanceSpec(cost, kv_tokens, MAX_NUM_SEQS, BUDGET, chunked=True)
        return ColocatedSystem((inst,))
    pre = InstanceSpec(cost, kv_tokens, MAX_NUM_SEQS, BUDGET, chunked=True)
    dec = InstanceSpec(cost, kv_tokens, MAX_NUM_SEQS, BUDGET, chunked=True)
    bw = 1.0 / hw.coefficients.c4  # shm transfer: one copy at memory bandwidth
    return DisaggSystem((pre,) * args.prefill, (dec,) * args.decode, spec.kv_bytes_per_token, bw)


def rate_segments(points: list[StepPoint], requests: list[int]) -> list[list[StepPoint]]:
    """The traced steps of each rate of a sweep. The bench starts a rate only after
    every request of the previous one has finished, so rate k + 1 begins with the
    first step that computes prompt tokens after the (n_1 + ... + n_k)-th prompt
    completed (counts[2] counts prompts completing in a step)."""
    segments: list[list[StepPoint]] = [[] for _ in requests]
    ends = list(np.cumsum(requests))
    k = done = 0
    for p in points:
        if k + 1 < len(requests) and done >= ends[k] and p.counts[0] > 0:
            k += 1
        segments[k].append(p)
        done += p.counts[2]
    if done != ends[-1]:
        raise SystemExit(f"the trace completes {done} prompts, the sweep sent {ends[-1]}")
    return segments


def cross_fitted(args: argparse.Namespace, doc: dict[str, Any], trace: list[Path]) -> list[System]:
    """Per rate, a system priced by a profile fitted to the other rates' steps."""
    runs = [r for r in doc["runs"] if r["rate"] is not None]
    points = [dataclasses.replace(p, heldout=False) for p in read_trace(trace)]
    segments = rate_segments(points, [len(r["records"]) for r in runs])
    cfg = ProfileConfig(threads=args.threads or len(os.sched_getaffinity(0)))
    spec = resolve_model_spec(None)
    bandwidth = measure_bandwidth(64)
    systems = []
    for i, run in enumerate(runs):
        others = [p for j, seg in enumerate(segments) if j != i for p in seg]
        what = f"the evaluation trace without rate {run['rate']}"
        hw = fitted_profile(cfg, spec, others, bandwidth, what)
        print(f"rate {run['rate']}: {len(others)} steps of the other rates, "
              f"fit median error {hw.fit['train_median_rel_error']:.1%}, "
              f"mean scale {hw.fit['mean_scale']:.3f}")  # fmt: skip
        systems.append(system_for(args, hw))
    return systems


def speed_noise(hw: HardwareProfile, traces: list[Path], interval: float) -> SpeedNoise:
    """The machine's speed drift seen in traced steps: the log of measured / priced
    step time, averaged over windows of `interval` seconds (windows of >= 5 steps);
    sigma is the spread of those window means."""
    cost = step_cost(resolve_model_spec(None), hw.coefficients)
    windows: dict[tuple[int, int], list[float]] = {}
    for n, path in enumerate(traces):
        for p in read_trace([path]):
            if p.start is None:
                raise SystemExit(f"{path}: the trace has no step start times")
            key = (n, int(p.start // interval))
            windows.setdefault(key, []).append(math.log(p.seconds / cost.stage_time(*p.counts)))
    means = [float(np.mean(v)) for v in windows.values() if len(v) >= 5]
    if len(means) < 3:
        raise SystemExit(f"{len(means)} windows of {interval} s are too few to estimate noise")
    sigma = float(np.std(means, ddof=1))
    print(f"speed noise: sigma {sigma:.3f} over {len(means)} windows of {interval:g} s")
    return SpeedNoise(sigma, interval)


def measured(run: dict[str, Any], slo: SLO) -> tuple[float, float, float]:
    """Attainment under `slo` (the bench's own rule), mean TTFT and TPOT (s)."""
    s = run["summary"]
    att = metrics.attainment(records_of(run), slo)
    return att, s["mean_ttft_ms"] / 1e3, s["mean_tpot_ms"] / 1e3


def pool(files: list[str]) -> None:
    """Measured vs simulated attainment averaged over repeated sweeps (the outputs of
    earlier runs of this script): per profile, SLO and rate, the mean of the runs'
    measured and simulated attainment, their difference, and the spread between runs."""
    groups: dict[tuple[str, tuple[float, float], float], list[dict[str, Any]]] = {}
    for f in files:
        for row in json.loads(Path(f).read_text())["rows"]:
            key = (row["profile"], (row["slo_s"][0], row["slo_s"][1]), row["rate"])
            groups.setdefault(key, []).append(row)
    print(f"{len(files)} sweeps; attainment in %, measured mean (spread) / simulated mean")
    worst: dict[str, float] = {}
    for (label, (ttft, tpot), rate), rows in groups.items():
        meas = [100 * r["measured_attainment"] for r in rows]
        sim = [100 * r["simulated_attainment"] for r in rows]
        diff = float(np.mean(sim) - np.mean(meas))
        worst[label] = max(worst.get(label, 0.0), abs(diff))
        print(f"{label:<16} TTFT {ttft:g} s TPOT {tpot:g} s rate {rate:>5g}: "
              f"{np.mean(meas):5.1f} ({max(meas) - min(meas):4.1f}) / {np.mean(sim):5.1f} "
              f"diff {diff:+5.1f} pp")  # fmt: skip
    for label, w in worst.items():
        print(f"{label}: max |diff of means| {w:.1f} pp")


def main() -> None:
    if sys.argv[1:2] == ["--pool"]:
        pool(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--profile", default=None, help="serving profile (default: calibrate)")
    p.add_argument("--grid-profile", default=None, help="an isolated `pdserve profile`, too")
    p.add_argument("--results", default=None, help="analyse this bench JSON instead of running")
    p.add_argument("--rates", default="1,1.5,2,3")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--calibrate-rates", default="1,2,3")
    p.add_argument("--calibrate-prompts", type=int, default=40)
    p.add_argument("--calibrate-seed", type=int, default=1)
    p.add_argument("--workload", default="chatbot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:100"])
    p.add_argument(
        "--judge",
        nargs="+",
        default=None,
        metavar="TTFT_MS:TPOT_MS",
        help="SLO pairs to compare attainment under (default: --slo); runs are reused",
    )
    p.add_argument(
        "--cross-fit",
        action="store_true",
        help="also simulate each rate with a profile fitted to the other rates' steps",
    )
    p.add_argument("--port", type=int, default=8390)
    p.add_argument("--threads", type=int, default=None, help="engine threads (serve --num-threads)")
    p.add_argument(
        "--pin-engine",
        type=int,
        default=None,
        metavar="CPU",
        help="run the engine on this CPU, the front end and load generator on the others",
    )
    p.add_argument(
        "--noise-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="also simulate with the machine's speed redrawn every S seconds (0: off)",
    )
    p.add_argument(
        "--noise-trace",
        nargs="+",
        default=None,
        help="step traces to estimate the noise from (default: the calibration trace)",
    )
    p.add_argument("--noise-seeds", type=int, default=20, help="draws of the speed factors")
    p.add_argument(
        "--kv-gib",
        type=float,
        default=KV_GIB,
        help="each instance's KV pool (serve --kv-cache-memory-gib), served and simulated: "
        "small enough and the pools bind (held prefill KV, decode swap-outs)",
    )
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--output", default="bench-results/sim_vs_real.json")
    args = p.parse_args()
    os.makedirs("bench-results", exist_ok=True)
    prefix = str(Path(args.output).with_suffix(""))
    profile = args.profile or str(calibrate(args, prefix))
    results = Path(args.results) if args.results else Path(f"{prefix}.bench.json")
    if not args.results:
        run_sweep(args, results, args.rates, args.num_prompts, args.seed, f"{prefix}.eval-trace")
    doc = json.loads(results.read_text())
    slo = doc["slo"]
    judges = [SLO(slo["ttft_ms"] / 1e3, slo["tpot_ms"] / 1e3)]
    if args.judge:
        judges = [
            SLO(float(a) / 1e3, float(b) / 1e3) for a, b in (j.split(":") for j in args.judge)
        ]
    n_rates = sum(r["rate"] is not None for r in doc["runs"])
    systems = {"serving profile": [system_for(args, load_profile(profile))] * n_rates}
    if args.grid_profile:
        systems["grid profile"] = [system_for(args, load_profile(args.grid_profile))] * n_rates
    if args.cross_fit:
        trace = sorted(results.parent.glob(f"{prefix_of(results)}.eval-trace.*.jsonl"))
        systems["cross-fitted"] = cross_fitted(args, doc, trace)
    noise = None
    if args.noise_interval > 0:
        traces = args.noise_trace or sorted(
            str(p)
            for p in Path(prefix).parent.glob(Path(prefix).name + ".calibration-trace.*.jsonl")
        )
        noise = speed_noise(load_profile(profile), [Path(t) for t in traces], args.noise_interval)
    rows = []
    for label, per_rate in systems.items():
        for judge in judges:
            print(f"-- simulated with the {label}; SLO TTFT {judge.ttft_s} s TPOT {judge.tpot_s} s")
            rows += compare(doc, per_rate, label, judge)
            if noise is not None and label == "serving profile":
                print("-- the same with speed noise")
                rows += compare(doc, per_rate, f"{label} + noise", judge, noise, args.noise_seeds)
    Path(args.output).write_text(json.dumps({"profile": profile, "rows": rows}, indent=2))
    for label in dict.fromkeys(r["profile"] for r in rows):
        diffs = [abs(r["diff_pp"]) for r in rows if r["profile"] == label]
        print(f"{label}: max |diff| {max(diffs):.1f} pp")
    print(f"wrote {args.output}")


def prefix_of(results: Path) -> str:
    """`x.bench.json` -> `x` (the sweep's files share that prefix)."""
    return results.name.removesuffix(".json").removesuffix(".bench")


def simulated(
    system: System, w: SimWorkload, slo: SLO, noise: SpeedNoise | None, seeds: int
) -> tuple[float, float, float]:
    """Attainment, mean TTFT and mean TPOT (s) of `w` through `system`; with speed
    noise, the means over `seeds` draws of the factors."""
    draws = [None] if noise is None else [dataclasses.replace(noise, seed=k) for k in range(seeds)]
    out = []
    for draw in draws:
        sim: SimResult = simulate(system, w, draw)
        ok = sim.tpot[w.output_lens > 1]
        tpot = float(ok.mean()) if len(ok) else math.nan
        out.append((sim.attainment(slo.ttft_s, slo.tpot_s), float(sim.ttft.mean()), tpot))
    att, ttft, tpot = (float(np.mean(col)) for col in zip(*out, strict=True))
    return att, ttft, tpot


def compare(
    doc: dict[str, Any],
    systems: list[System],
    label: str,
    slo: SLO,
    noise: SpeedNoise | None = None,
    seeds: int = 1,
) -> list[dict[str, Any]]:
    """Measured vs simulated per rate; `systems[i]` simulates the i-th rate."""
    rows = []
    print(f"{'rate':>6} {'measured':>9} {'simulated':>9} {'diff pp':>8} "
          f"{'TTFT meas/sim (s)':>18} {'TPOT meas/sim (ms)':>19}")  # fmt: skip
    runs = [r for r in doc["runs"] if r["rate"] is not None]
    for run, system in zip(runs, systems, strict=True):
        w = workload_of(run)
        att_sim, sim_ttft, sim_tpot = simulated(system, w, slo, noise, seeds)
        att, ttft, tpot = measured(run, slo)
        row = {
            "profile": label,
            "slo_s": [slo.ttft_s, slo.tpot_s],
            "rate": run["rate"],
            "measured_attainment": att,
            "simulated_attainment": att_sim,
            "diff_pp": 100 * (att_sim - att),
            "measured_mean_ttft_s": ttft,
            "simulated_mean_ttft_s": sim_ttft,
            "measured_mean_tpot_s": tpot,
            "simulated_mean_tpot_s": sim_tpot,
        }
        rows.append(row)
        print(
            f"{run['rate']:>6g} {att:>9.1%} {att_sim:>9.1%} {row['diff_pp']:>+8.1f} "
            f"{ttft:>8.3f}/{row['simulated_mean_ttft_s']:<9.3f} "
            f"{1e3 * tpot:>8.1f}/{1e3 * row['simulated_mean_tpot_s']:<9.1f}"
        )
    return rows


if __name__ == "__main__":
    main()
