"""`pdserve bench overhead`: how fast the load generator is, against the instant stub.

The stub runs in its own process (its own core on a 2-core machine) and writes each
response in one write, stamping it with `time.perf_counter()` (CLOCK_MONOTONIC on
Linux, shared across processes). The real runner sends the requests; for each one:

- timestamp overhead = the client's first-token timestamp - the stub's write time:
  loopback, the kernel, aiohttp's parsing and the event loop's delay until the
  client takes its timestamp, all of which would otherwise inflate TTFT;
- lag = how late a request left against its scheduled arrival (RequestRecord.lag);
- achieved rate = completed requests / duration.

Medians over repeats are printed (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np

from pdserve.bench.config import ArrivalConfig, RequestOptions, Target
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import RunSettings, run_workload
from pdserve.bench.workloads.spec import Session, Turn, Workload, single_turn_order


def add_overhead_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="200,400,inf", help="offered rates (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--output-len", type=int, default=16, help="tokens (SSE events) per response")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_overhead_cli)


def _overhead_cli(args: argparse.Namespace) -> int:
    rates = [None if r.strip() == "inf" else float(r) for r in args.rates.split(",")]
    stub = _start_stub(args.port)
    try:
        rows = [_measure(rate, args, f"http://127.0.0.1:{args.port}") for rate in rates]
    finally:
        stub.terminate()
        stub.wait(10)
    print(_table(rows, args))
    return 0


def _start_stub(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdserve.bench", "stub-server", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the stub server did not start")


def _workload(n: int, output_len: int) -> Workload:
    """Prompts don't matter to the stub: one short fixed text (no tokenizer needed)."""
    turn = Turn(" hello world", 2, output_len)
    return Workload("overhead", tuple(Session(i, (turn,)) for i in range(n)), single_turn_order(n))


def _measure(rate: float | None, args: argparse.Namespace, url: str) -> dict[str, Any]:
    from pdserve.workload.arrivals import offsets_at, unit_offsets

    w = _workload(args.num_prompts, args.output_len)
    arrival = ArrivalConfig("poisson", 1.0, args.max_concurrency)
    unit = unit_offsets(w.num_requests, arrival, args.seed)
    settings = RunSettings(Target("stub", url), "stub", RequestOptions(), args.max_concurrency)
    reps = []
    for _ in range(args.repeats):
        out = asyncio.run(run_workload(w, offsets_at(unit, rate), settings, None))
        reps.append(overhead_stats(out.records, out.t0, out.duration_s))
    return {"rate": rate, **{k: statistics.median(r[k] for r in reps) for k in reps[0]}}


def overhead_stats(records: list[RequestRecord], t0: float, duration: float) -> dict[str, float]:
    """Achieved rate, failures, timestamp overhead and lag (ms) of one run."""
    ok = [r for r in records if r.success and r.ttft is not None]
    over = [
        1000 * (t0 + r.sent_at + r.ttft - r.server_timings["stub_sent_at"])  # type: ignore[operator]
        for r in ok
        if r.server_timings and "stub_sent_at" in r.server_timings
    ]
    lags = [1000 * r.lag for r in records]
    return {
        "achieved_rps": len(ok) / duration if duration > 0 else 0.0,
        "failed": float(len(records) - len(ok)),
        "overhead_p50_ms": float(np.percentile(over, 50)) if over else float("nan"),
        "overhead_p99_ms": float(np.percentile(over, 99)) if over else float("nan"),
        "lag_p50_ms": float(np.percentile(lags, 50)),
        "lag_p99_ms": float(np.percentile(lags, 99)),
    }


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"load generator vs instant stub: {args.num_prompts} streamed requests x "
        f"{args.output_len} tokens, max concurrency {args.max_concurrency}, "
        f"median of {args.repeats} runs"
    )
    lines = [head, "offered req/s  achieved req/s  failed  ts-overhead p50/p99 ms  lag p50/p99 ms"]
    for r in rows:
        offered = "inf" if r["rate"] is None else f"{r['rate']:g}"
        lines.append(
            f"{offered:>13}  {r['achieved_rps']:>14.0f}  {r['failed']:>6.0f}  "
            f"{r['overhead_p50_ms']:>10.3f} / {r['overhead_p99_ms']:<9.3f}  "
            f"{r['lag_p50_ms']:.3f} / {r['lag_p99_ms']:.3f}"
        )
    return "\n".join(lines)
