"""Length-aware scheduling (issue 19) against real servers: TetriInfer Fig. 16 and Fig. 18.

    .venv/bin/python bench/bench_scheduling.py --experiment fig16 --repeats 2
    .venv/bin/python bench/bench_scheduling.py --experiment fig18 --repeats 2

Every setting is a fresh `python -m pdserve.cli serve` on 127.0.0.1 with `--num-threads 2`
in total, warmed by one short request per instance, driven by `pdserve bench`'s own runner
(Poisson arrivals, streamed), then stopped and checked for leftover processes (the helpers
of bench_caching.py). Settings alternate within each repeat; tables give medians over
repeats and the ratio to the first setting of the same repeat.

- fig16: TetriInfer's workloads LPLD, LPHD, HPLD, HPHD and Mixed (`pdserve bench`'s
  ShareGPT-shaped mixes; random-word prompts, output lengths fixed by max_tokens with
  ignore_eos) against colocated (`--colocated 1`), 1P1D with today's defaults, and 1P1D
  with TetriInfer's choices (`--prefill-policy sjf --decode-admission reserve-dynamic`).
  These prompts carry no meaning for the length head, so the TetriInfer setting runs
  `--predictor none`: its policies then use max_tokens, which with ignore_eos is the
  exact length (an oracle predictor). Reported: mean TTFT, mean JCT, resource time (the
  instances' busy seconds in steps, from /debug/cluster `busy_ms`) and requests per
  busy second (TetriInfer's perf/$ with equal prices).
- fig18: chat prompts of the predictor's kinds (`predictor/prompts.py`, another seed than
  the training set) on a memory-tight decode instance (`--kv-cache-memory-gib 0.05`:
  ~1,160 tokens of KV per instance), greedy, up to 256 tokens, under greedy /
  reserve-static / reserve-dynamic / past-future admission, with the shipped head and
  with an oracle (a first pass on a default server records every prompt's true length;
  the oracle runs send max_tokens = that length with `--predictor none`). Reported:
  mean JCT and the decode instance's preemptions and admission waits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bench_caching as bc
import httpx

from pdserve.bench.config import (
    SLO,
    ArrivalConfig,
    PlanConfig,
    RequestOptions,
    SearchConfig,
    Target,
)
from pdserve.bench.experiment import Experiment, run_experiment
from pdserve.bench.tokens import PromptFactory, load_tokenizer
from pdserve.bench.workloads import Workload, WorkloadOptions, build_workload
from pdserve.predictor.prompts import make_prompts

THREADS = ("--num-threads", "2")
P1D1 = ("--prefill", "1", "--decode", "1")
TETRI = ("--prefill-policy", "sjf", "--decode-admission", "reserve-dynamic")
FIG16_SETTINGS = (
    bc.Setting("colocated", ("--prefill", "0", "--decode", "0", "--colocated", "1", *THREADS), 1),
    bc.Setting("1P1D", (*P1D1, *THREADS), 2),
    bc.Setting("1P1D-tetri", (*P1D1, *THREADS, *TETRI, "--predictor", "none"), 2),
)
# (workload, requests/s, requests): light prefills run faster than heavy ones here.
FIG16_LOADS = (
    ("lpld", 1.0, 40),
    ("lphd", 0.3, 24),
    ("hpld", 0.3, 24),
    ("hphd", 0.1, 12),
    ("mixed", 0.2, 24),
)
TIGHT = ("--kv-cache-memory-gib", "0.05")
ADMISSIONS = ("greedy", "reserve-static", "reserve-dynamic", "past-future")
FIG18_PROMPTS = 48
FIG18_RATE = 0.5
WINDOW = 256


@dataclass(frozen=True)
class Run:
    setting: bc.Setting
    workload: Workload
    rate: float
    endpoint: str
    ignore_eos: bool


def stats_of(url: str) -> dict[str, dict[str, int]]:
    """Per live instance name: busy_ms, num_preemptions, num_admission_waits."""
    rows = httpx.get(url + "/debug/cluster?stats_timeout=30", timeout=60).json()["instances"]
    keys = ("busy_ms", "num_preemptions", "num_admission_waits")
    return {r["name"]: {k: r["stats"][k] for k in keys} for r in rows if r.get("stats")}


def run_one(run: Run, factory: PromptFactory, seed: int) -> dict[str, Any]:
    server = bc.start(run.setting)
    try:
        bc.warm_up(server.url, run.setting.instances)
        before = stats_of(server.url)
        exp = Experiment(
            targets=(Target(run.setting.name, server.url, run.endpoint),),
            workload=run.workload,
            arrival=ArrivalConfig("poisson", 1.0, None),
            options=RequestOptions(timeout_s=600, ignore_eos=run.ignore_eos),
            plan=PlanConfig(rates=(run.rate,)),
            slo=SLO(),
            search=SearchConfig(),
            seed=seed,
            settings={"command": " ".join(["bench/bench_scheduling.py", *sys.argv[1:]])},
        )
        doc = asyncio.run(run_experiment(exp, factory, lambda d: None, False))
        after = stats_of(server.url)
    finally:
        bc.stop(server)
    s = doc["runs"][0]["summary"]
    delta = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}

    def total(key: str, role: str = "") -> int:
        return sum(d[key] for n, d in delta.items() if n.startswith(role))

    records = sorted(doc["runs"][0]["records"], key=lambda r: r["index"])
    return {
        "completed": s["completed"],
        "num_requests": s["num_requests"],
        "mean_ttft_ms": s.get("mean_ttft_ms"),
        "mean_jct_ms": s.get("mean_e2el_ms"),
        "busy_s": total("busy_ms") / 1000,
        # Decode admission acts on decode (and colocated) instances; a prefill instance
        # preempts too when its pool is tight (it holds prompts' KV until the hand-off).
        "preemptions": total("num_preemptions") - total("num_preemptions", "prefill"),
        "prefill_preemptions": total("num_preemptions", "prefill"),
        "admission_waits": total("num_admission_waits"),
        "output_tokens": [r["output_tokens"] for r in records],
    }


def save(rows: list[dict[str, Any]], out: str | None) -> None:
    """Write every run so far, so a failure late in a long run loses nothing."""
    if out:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")


def fig16(args: argparse.Namespace, factory: PromptFactory) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for name, rate, n in FIG16_LOADS:
            workload = build_workload(
                WorkloadOptions(name=name, num_prompts=n, seed=args.seed), factory
            )
            for setting in FIG16_SETTINGS:
                row = run_one(
                    Run(setting, workload, rate, "/v1/completions", True), factory, args.seed
                )
                rows.append({"workload": name, "setting": setting.name, "repeat": repeat, **row})
                save(rows, args.out)
                print(f"  fig16 r{repeat} {name} {setting.name}: {summary(row)}", flush=True)
    return rows


def fig18(args: argparse.Namespace, factory: PromptFactory) -> list[dict[str, Any]]:
    prompts = [text for _, text in make_prompts(FIG18_PROMPTS, seed=args.seed + 1000)]
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-fig18-"))
    head_trace = write_trace(tmp / "head.jsonl", prompts, [WINDOW] * len(prompts))
    reference = bc.Setting("reference", (*P1D1, *THREADS), 2)
    workload = trace_workload(head_trace, factory, args.seed)
    ref = run_one(
        Run(reference, workload, FIG18_RATE, "/v1/chat/completions", False), factory, args.seed
    )
    lengths = [max(1, n) for n in ref["output_tokens"]]
    oracle_trace = write_trace(tmp / "oracle.jsonl", prompts, lengths)
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for admission in ADMISSIONS:
            for kind, trace, extra in (
                ("head", head_trace, ()),
                ("oracle", oracle_trace, ("--predictor", "none")),
            ):
                flags = (*P1D1, *THREADS, *TIGHT, "--decode-admission", admission, *extra)
                setting = bc.Setting(f"{admission} {kind}", flags, 2)
                wl = trace_workload(trace, factory, args.seed)
                row = run_one(
                    Run(setting, wl, FIG18_RATE, "/v1/chat/completions", False), factory, args.seed
                )
                row["same_lengths"] = row["output_tokens"] == ref["output_tokens"]
                rows.append({"workload": "chat", "setting": setting.name, "repeat": repeat, **row})
                save(rows, args.out)
                print(f"  fig18 r{repeat} {setting.name}: {summary(row)}", flush=True)
    return rows


def write_trace(path: Path, prompts: list[str], lengths: list[int]) -> Path:
    lines = [
        json.dumps({"prompt": p, "output_len": n}) for p, n in zip(prompts, lengths, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def trace_workload(path: Path, factory: PromptFactory, seed: int) -> Workload:
    opts = WorkloadOptions(
        name="file", dataset_path=str(path), num_prompts=FIG18_PROMPTS, seed=seed
    )
    return build_workload(opts, factory)


def summary(row: dict[str, Any]) -> str:
    return (
        f"{row['completed']}/{row['num_requests']} ok, TTFT {bc.ms(row['mean_ttft_ms'])} ms, "
        f"JCT {bc.ms(row['mean_jct_ms'])} ms, busy {row['busy_s']:.1f} s, "
        f"decode preemptions {row['preemptions']} (prefill {row.get('prefill_preemptions')}), "
        f"admission waits {row['admission_waits']}"
    )


def table(rows: list[dict[str, Any]], first: str) -> None:
    groups = sorted({r["workload"] for r in rows})
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    print(
        "\nworkload  setting              mean TTFT ms  mean JCT ms  busy s  req/busy s"
        "  preempt  JCT vs first"
    )
    for g in groups:
        base = {r["repeat"]: r for r in rows if r["workload"] == g and r["setting"] == first}
        for s in settings:
            mine = [r for r in rows if r["workload"] == g and r["setting"] == s]
            if not mine:
                continue

            def med(key: str, mine: list[dict[str, Any]] = mine) -> float:
                return statistics.median(r[key] or 0.0 for r in mine)

            ratio = statistics.median(
                (r["mean_jct_ms"] or 0.0) / (base[r["repeat"]]["mean_jct_ms"] or 1.0) for r in mine
            )
            per_busy = statistics.median(r["completed"] / r["busy_s"] for r in mine if r["busy_s"])
            print(
                f"{g:<8}  {s:<19}  {med('mean_ttft_ms'):>12.0f}  {med('mean_jct_ms'):>11.0f}  "
                f"{med('busy_s'):>6.1f}  {per_busy:>10.2f}  {med('preemptions'):>7.0f}  {ratio:.2f}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--experiment", choices=["fig16", "fig18"], required=True)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON of every run, rewritten after each")
    ap.add_argument("--table", default=None, help="print the table of a saved --out and exit")
    args = ap.parse_args()
    if args.table:
        rows = json.loads(Path(args.table).read_text())
        table(rows, rows[0]["setting"])
        return 0
    factory = PromptFactory(load_tokenizer(None))
    try:
        rows = fig16(args, factory) if args.experiment == "fig16" else fig18(args, factory)
    finally:
        bc.reap_children()
    table(rows, rows[0]["setting"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
