"""The front end and controller under more tokens than this CPU computes (issue 56,
item 3): `pdserve serve stub:RATE --allow-stub --colocated N` (pdserve/engine/stub.py:
real instance processes and sockets, a token source in place of the model) loaded by
`pdserve bench run` with many concurrent streams.

    .venv/bin/python bench/bench_frontend.py [--instances 1,8,64] [--streams 1024]
        [--rate 50] [--output-len 256] [--requests 2048] [--json out.json]

For each instance count, alone: the server is started, `--requests` requests of a
16-token prompt and `--output-len` tokens (ignore_eos) are sent with at most
`--streams` in flight, each stream offered `--rate` tokens/s by its instance; a thread
probes `/health` every 50 ms meanwhile. Reported:

* streamed tokens/s: every completion token the clients received over the run's
  wall time (`pdserve bench run`'s output throughput) against the offer
  (`streams x rate`, the most the stubs can give);
* front-end CPU us per streamed token: the server process's own CPU time (its
  instances excluded) over the run, per token - the front end's cost, whatever share
  of the cores it got;
* the instances' CPU per token and the client's, for the same run: where the 2 cores
  went;
* added inter-token delay: the clients' median and p99 gap between tokens minus the
  stub's tick (`1 / rate`);
* the worst `/health` probe.

The client is on the same 2 cores: it is part of the load, so the figures are of the
whole, with the shares above saying who used the cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from servers import free_port, pdserve_cmd, start, stop


class HealthProbe:
    """`/health` every 50 ms on its own connection; the worst answer time."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/health"
        self.worst = 0.0
        self.failed = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.done.wait(0.05):
                t0 = time.perf_counter()
                try:
                    ok = client.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.failed += not ok

    def stop(self) -> None:
        self.done.set()
        self.thread.join(60)


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class Row:
    instances: int
    streams: int
    rate: float
    offered_tokens_s: float
    streamed_tokens_s: float
    completed: int
    failed: int
    frontend_us_per_token: float
    instances_us_per_token: float
    client_us_per_token: float
    added_itl_median_ms: float
    added_itl_p99_ms: float
    worst_health_ms: float
    health_failures: int


def measure(n: int, args: argparse.Namespace) -> Row:
    port = free_port()
    serve = [f"stub:{args.rate:g}", "--allow-stub", "--colocated", str(n)]
    serve += ["--max-num-seqs", str(args.streams)]
    proc = start(pdserve_cmd(port, *serve), port)
    try:
        server = psutil.Process(proc.pid)
        children = [c for c in server.children(recursive=True)]
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "r.json"
            cmd = [
                sys.executable, "-m", "pdserve.cli", "bench", "run", "--base-url",
                f"http://127.0.0.1:{port}", "--workload", "random", "--random-input-len", "16",
                "--random-output-len", str(args.output_len), "--num-prompts",
                str(args.requests), "--max-concurrency", str(args.streams),
                "--request-timeout", "600", "--result-file", str(result), "--no-plots",
                "--disable-tqdm",
            ]  # fmt: skip
            fe0, inst0 = cpu_s([server]), cpu_s(children)
            probe = HealthProbe(port)
            client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
            client_ps = psutil.Process(client.pid)
            client_cpu = 0.0
            while client.poll() is None:
                client_cpu = max(client_cpu, cpu_s([client_ps]))
                time.sleep(0.2)
            probe.stop()
            fe, inst = cpu_s([server]) - fe0, cpu_s(children) - inst0
            if client.returncode != 0:
                raise RuntimeError(f"pdserve bench run exited with {client.returncode}")
            [run] = json.loads(result.read_text())["runs"]
        s = run["summary"]
        tokens = s["total_output_tokens"]
        tick_ms = 1000 / args.rate
        return Row(
            instances=n,
            streams=args.streams,
            rate=args.rate,
            offered_tokens_s=args.streams * args.rate,
            streamed_tokens_s=s["output_throughput"],
            completed=s["completed"],
            failed=s["failed"],
            frontend_us_per_token=1e6 * fe / tokens,
            instances_us_per_token=1e6 * inst / tokens,
            client_us_per_token=1e6 * client_cpu / tokens,
            added_itl_median_ms=s["median_itl_ms"] - tick_ms,
            added_itl_p99_ms=s["p99_itl_ms"] - tick_ms,
            worst_health_ms=1000 * probe.worst,
            health_failures=probe.failed,
        )
    finally:
        stop(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", default="1,8,64")
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for n in (int(x) for x in args.instances.split(",")):
        row = measure(n, args)
        rows.append(row)
        print(json.dumps(asdict(row)), flush=True)
    print(
        "| instances | streams | offered tok/s | streamed tok/s | front end us/token | "
        "instances us/token | client us/token | added ITL p50 / p99 ms | worst /health ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.instances} | {r.streams} | {r.offered_tokens_s:.0f} | "
            f"{r.streamed_tokens_s:.0f} | {r.frontend_us_per_token:.1f} | "
            f"{r.instances_us_per_token:.1f} | {r.client_us_per_token:.1f} | "
            f"{r.added_itl_median_ms:.1f} / {r.added_itl_p99_ms:.1f} | "
            f"{r.worst_health_ms:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
