"""What the HTTP server adds on top of the engine, measured from both sides of one run.

    .venv/bin/python bench/bench_server.py [--requests 24] [--tokens 64] [--json out.json]

Starts `pdserve serve` and streams completions from 1 and from 32 closed-loop
clients (each sends its next request when the last one ends; `--rounds` requests
each; a ~70-token prompt, a seeded output length in [tokens/2, 3*tokens/2] with
`ignore_eos`, so the clients drift apart as real ones do). The first round of 32
arrives as one burst and is reported apart from the steady rounds after it. For
every request the client's clock is put next to the engine's (`pdserve_timings`,
measured in the core process from the moment the HTTP process hands it over):

* added TTFT = client TTFT - engine TTFT: request parsing, validation,
  tokenization, the trip to the core, and the first token's way back (IPC,
  detokenization, JSON, SSE) - everything the server adds to the engine;
* added time per token = client TPOT - engine TPOT, where TPOT = (E2E - TTFT) /
  (tokens - 1): how much slower tokens reach the client than the engine makes
  them (zero if the server keeps up, whatever its constant delay);
* HTTP-process CPU per streamed token: the server process's CPU time (the engine
  child excluded) over the run divided by the tokens streamed: its cost on a
  machine where it shares cores with the engine;
* the engine's own step time (engine TPOT) as the yardstick.

Medians over requests; the client is a plain httpx stream on the same machine, so
its own overhead counts against the server (the figures are upper bounds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import httpx
import psutil

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. " * 4


@dataclass
class Sample:
    round: int
    client_ttft: float
    client_e2e: float
    engine_ttft: float
    engine_e2e: float
    tokens: int

    @property
    def added_ttft(self) -> float:
        return self.client_ttft - self.engine_ttft

    @property
    def client_tpot(self) -> float:
        return (self.client_e2e - self.client_ttft) / (self.tokens - 1)

    @property
    def engine_tpot(self) -> float:
        return (self.engine_e2e - self.engine_ttft) / (self.tokens - 1)


async def one_request(client: httpx.AsyncClient, url: str, tokens: int, rnd: int = 0) -> Sample:
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    first = last = None
    timings = None
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            chunk = json.loads(line[6:])
            timings = chunk.get("pdserve_timings") or timings
    assert first is not None and last is not None and timings is not None
    return Sample(rnd, first - start, last - start, timings["ttft"], timings["e2e"], tokens)


async def run_level(url: str, clients: int, rounds: int, tokens: int, seed: int) -> list[Sample]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    rng = random.Random(seed)
    lengths = [
        [rng.randint(tokens // 2, 3 * tokens // 2) for _ in range(rounds)] for _ in range(clients)
    ]
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, 4)  # warm the connection and the server

        async def worker(mine: list[int]) -> list[Sample]:
            return [await one_request(client, url, n, r) for r, n in enumerate(mine)]

        per_client = await asyncio.gather(*(worker(mine) for mine in lengths))
    return [s for samples in per_client for s in samples]


def start_server(port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ms(x: float) -> float:
    return round(x * 1000, 3)


def summarize(samples: list[Sample], cpu_s: float) -> dict[str, float | int]:
    med = statistics.median
    streamed = sum(s.tokens for s in samples)
    steady = [s for s in samples if s.round > 0] or samples
    burst = [s for s in samples if s.round == 0]
    return {
        "requests": len(samples),
        "added_ttft_ms_burst": ms(med(s.added_ttft for s in burst)),
        "added_ttft_ms_p90": ms(statistics.quantiles([s.added_ttft for s in steady], n=10)[-1])
        if len(steady) > 1
        else ms(steady[0].added_ttft),
        "http_cpu_per_request_ms": ms(cpu_s / len(samples)),
        "added_ttft_ms": ms(med(s.added_ttft for s in steady)),
        "added_per_token_ms": ms(med(s.client_tpot - s.engine_tpot for s in steady)),
        "http_cpu_per_token_ms": ms(cpu_s / streamed),
        "engine_tpot_ms": ms(med(s.engine_tpot for s in samples)),
        "client_tpot_ms": ms(med(s.client_tpot for s in samples)),
        "engine_ttft_ms": ms(med(s.engine_ttft for s in samples)),
        "client_ttft_ms": ms(med(s.client_ttft for s in samples)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="requests per client")
    ap.add_argument("--tokens", type=int, default=64, help="mean output length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", default="1,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port = free_port()
    proc = start_server(port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    http = psutil.Process(proc.pid)
    results: dict[str, object] = {}
    try:
        for level in (int(x) for x in args.levels.split(",")):
            rounds = args.rounds * 6 if level == 1 else args.rounds  # ~same count at 1
            before = http.cpu_times()
            samples = asyncio.run(run_level(url, level, rounds, args.tokens, args.seed))
            after = http.cpu_times()
            cpu = (after.user - before.user) + (after.system - before.system)
            results[f"concurrency_{level}"] = {
                "summary": summarize(samples, cpu),
                "samples": [asdict(s) for s in samples],
            }
    finally:
        proc.terminate()
        proc.wait(60)
    cols = (
        "added_ttft_ms",
        "added_ttft_ms_p90",
        "added_ttft_ms_burst",
        "added_per_token_ms",
        "http_cpu_per_request_ms",
        "http_cpu_per_token_ms",
        "engine_tpot_ms",
        "engine_ttft_ms",
    )
    print("| clients | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, res in results.items():
        s = res["summary"]  # type: ignore[index]
        print(f"| {name.split('_')[1]} | " + " | ".join(str(s[c]) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
