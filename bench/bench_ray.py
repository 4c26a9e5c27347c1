"""What Ray costs: `serve --ray` against the embedded launch, same topology, one run.

    .venv/bin/python bench/bench_ray.py [--repeats 3] [--requests 8] [--json out.json]

Starts a two-node Ray cluster on this machine (Ray's `cluster_utils`: a head and a
worker node, each with its own raylet), then, alternating within each repeat, three
`pdserve serve --prefill 1 --decode 1` servers:

* embedded: the instances are children of the server (no Ray);
* ray, one node: both instances placed on the head node (KV through shared memory,
  as embedded: only the control path differs);
* ray, two nodes: prefill on the head, decode on the worker (KV over TCP).

For each: the startup time (process start to the first 200 from /health, the model
loaded by both instances), then `--requests` sequential streamed completions (a
~256-token prompt with a different first word each: no prefix-cache hits; 64 tokens,
`ignore_eos`, greedy) after one warm-up, timed by the client: TTFT and TPOT =
(E2E - TTFT) / 63. Medians per setting; the ratios against
embedded are taken within each repeat, then their median reported.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from ray.cluster_utils import Cluster

PROMPT = " ".join(f"word{i % 97}" for i in range(128))  # ~256 tokens
TOKENS = 64
SETTINGS = ("embedded", "ray, one node", "ray, two nodes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str]) -> tuple[subprocess.Popen[bytes], str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *args]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        time.sleep(0.1)


def one_request(url: str, n: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one streamed completion, as the client sees them; `n` starts the
    prompt, so no prompt is a prefix-cache hit."""
    body = {
        "prompt": f"{n} {PROMPT}",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    assert first is not None
    return first, (e2e - first) / (TOKENS - 1)


def measure(args: list[str], requests: int) -> dict[str, float]:
    proc, url, startup = start(args)
    try:
        one_request(url, requests)  # warm-up
        samples = [one_request(url, n) for n in range(requests)]
    finally:
        proc.terminate()
        proc.wait(60)
    return {
        "startup_s": startup,
        "ttft_ms": 1000 * statistics.median(s[0] for s in samples),
        "tpot_ms": 1000 * statistics.median(s[1] for s in samples),
    }


def placement(path: Path, decode_node: int) -> str:
    doc = {
        "instances": [
            {"role": "prefill", "node": 0, "devices": 1},
            {"role": "decode", "node": decode_node, "devices": 1},
        ]
    }
    path.write_text(json.dumps(doc))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "object_store_memory": 80 << 20, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=2, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    tmp = Path(tempfile.mkdtemp())
    common = ["--prefill", "1", "--decode", "1", "--num-threads", "2"]
    ray = ["--ray", "--ray-address", cluster.address]
    argv = {
        "embedded": common,
        "ray, one node": [*common, *ray, "--placement", placement(tmp / "one.json", 0)],
        "ray, two nodes": [*common, *ray, "--placement", placement(tmp / "two.json", 1)],
    }
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    try:
        for rep in range(opts.repeats):
            for setting in SETTINGS:
                rows[setting].append(measure(argv[setting], opts.requests))
                print(f"repeat {rep + 1} {setting}: {rows[setting][-1]}", file=sys.stderr)
    finally:
        cluster.shutdown()
    report(rows)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))


def report(rows: dict[str, list[dict[str, float]]]) -> None:
    base = rows["embedded"]
    head = ["launch", "startup s", "TTFT ms", "TPOT ms"]
    head += [f"{k} / embedded" for k in ("startup", "TTFT", "TPOT")]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for setting in SETTINGS:
        med = {k: statistics.median(r[k] for r in rows[setting]) for k in base[0]}
        ratio = {
            k: statistics.median(r[k] / b[k] for r, b in zip(rows[setting], base, strict=True))
            for k in base[0]
        }
        print(
            f"| {setting} | {med['startup_s']:.1f} | {med['ttft_ms']:.0f} | {med['tpot_ms']:.2f} "
            f"| {ratio['startup_s']:.2f}x | {ratio['ttft_ms']:.3f}x | {ratio['tpot_ms']:.3f}x |"
        )


if __name__ == "__main__":
    main()
