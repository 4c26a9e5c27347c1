"""Single-stream decode beside a busy core: TPOT alone and while one CPU-bound process
runs on the second core.

    .venv/bin/python bench/bench_busy_core.py [--paths auto,none] [--rounds 5]
        [--tokens 48] [--busy-cpu 1] [--env KEY=VALUE ...] [--json out.json]

For each path (a `--quantization`: auto, the default, serves the shipped SmolLM2's
Q4_1 blocks through the compiled kernels; none serves fp32 through torch) it starts
`pdserve serve` with its defaults (every core, so the engine's OpenMP team has a
thread on the busy one), then runs `--rounds` rounds of one streamed completion alone
and one while `python -c 'while True: pass'` runs pinned to `--busy-cpu` (taskset).
TPOT is the client's: (last token - first token) / (tokens - 1). Prints the medians
and busy / alone, the figure that matters.

The machine is never quite alone where other people's work shares it: `others` is the
CPU (in cores) that processes other than the server, this client and the busy loop
used during a run, the median over the runs, to read the figures with.

`--env KEY=VALUE` goes into the server's environment. pdserve sets OMP_WAIT_POLICY
only where neither it nor GOMP_SPINCOUNT is set (pdserve/runtime.py), so
`--env GOMP_SPINCOUNT=300000` (libgomp's own default) gives the spinning waits of
before, and `--env OMP_WAIT_POLICY=ACTIVE` spins for good.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import httpx
import psutil

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Run:
    tpot_s: float
    others_cores: float  # CPU used meanwhile by processes not ours


@dataclass
class PathResult:
    path: str
    alone: list[Run]
    busy: list[Run]

    @property
    def alone_ms(self) -> float:
        return 1000 * statistics.median(r.tpot_s for r in self.alone)

    @property
    def busy_ms(self) -> float:
        return 1000 * statistics.median(r.tpot_s for r in self.busy)

    def others(self, runs: list[Run]) -> float:
        return statistics.median(r.others_cores for r in runs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, quantization: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    cmd += ["--quantization", quantization]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server (--quantization {quantization}) did not start")


def tpot(client: httpx.Client, url: str, tokens: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    stamps = []
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{len(stamps)} chunks streamed, expected {tokens}")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def ours(
    server: subprocess.Popen[bytes], busy: subprocess.Popen[bytes] | None
) -> list[psutil.Process]:
    root = psutil.Process(server.pid)
    procs = [root, psutil.Process(), *root.children(recursive=True)]
    return procs + ([psutil.Process(busy.pid)] if busy is not None else [])


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


@contextlib.contextmanager
def busy_core(cpu: int | None) -> Iterator[subprocess.Popen[bytes] | None]:
    if cpu is None:
        yield None
        return
    loop = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)  # running, not starting
    try:
        yield loop
    finally:
        loop.kill()
        loop.wait()


def one_run(
    client: httpx.Client, url: str, tokens: int, server: subprocess.Popen[bytes], cpu: int | None
) -> Run:
    with busy_core(cpu) as loop:
        procs = ours(server, loop)
        mine0, all0, t0 = cpu_s(procs), machine_busy_s(), time.perf_counter()
        t = tpot(client, url, tokens)
        mine1, all1, t1 = cpu_s(procs), machine_busy_s(), time.perf_counter()
    others = max(0.0, (all1 - all0) - (mine1 - mine0)) / (t1 - t0)
    return Run(t, round(others, 2))


def measure(path: str, args: argparse.Namespace, env: dict[str, str]) -> PathResult:
    port = free_port()
    server = start_server(port, path, env)
    url = f"http://127.0.0.1:{port}/v1/completions"
    result = PathResult(path, [], [])
    try:
        with httpx.Client(timeout=600) as client:
            tpot(client, url, 8)  # warm the connection and the server
            for _ in range(args.rounds):
                result.alone.append(one_run(client, url, args.tokens, server, None))
                result.busy.append(one_run(client, url, args.tokens, server, args.busy_cpu))
    finally:
        server.terminate()
        server.wait(60)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="auto,none", help="--quantization values, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--busy-cpu", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json")
    args = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in args.env)
    results = []
    print(f"{args.tokens}-token streams, medians of {args.rounds}; env {env or 'as is'}")
    for path in args.paths.split(","):
        r = measure(path, args, env)
        results.append(r)
        print(
            f"--quantization {path:5s} alone {r.alone_ms:7.1f} ms/token (others "
            f"{r.others(r.alone):.2f} cores)  busy cpu {args.busy_cpu} {r.busy_ms:7.1f} ms/token "
            f"(others {r.others(r.busy):.2f})  busy/alone {r.busy_ms / r.alone_ms:5.2f}x",
            flush=True,
        )
    if args.json:
        rows = [{**asdict(r), "ratio": r.busy_ms / r.alone_ms} for r in results]
        with open(args.json, "w") as f:
            json.dump({"env": env, "tokens": args.tokens, "paths": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
