"""Instance flip: what a flip costs, and a decode drain against waiting for decode to end.

    .venv/bin/python bench/bench_flip.py [--streams 16] [--tokens 256] [--rounds 5]
        [--json out.json] [-- SERVER ARGS]

Starts `pdserve serve --prefill 1 --decode 2` (plus SERVER ARGS) and, each round:

1. **Idle flips**: decode-1 (from round 2 on, the decode instance step 4 added) ->
   prefill -> decode with nothing running. The reports'
   `switch_s` is the instance replacing its role object (TetriInfer §3.5: 5-7 ms; target
   under 10 ms); `total_s` is the whole call seen from the front end.
2. **Baseline**: `--streams` greedy streams of `--tokens` tokens (ignore_eos); from the
   moment every stream has 8 tokens, how long until the last one ends: what a flip that
   waits for decode to end (vLLM's role switch) would wait at most.
3. **Loaded D->P**: the same streams; at the same moment decode-1 flips to prefill, its
   requests moving to decode-0 with their KV. Its `drain_s` (front end), `waited_s` (the
   instance waiting for the copies to let go of its blocks) and `total_s`; `moved`, `copied`.
   After the streams end, decode-1 flips back (idle).
4. **Scale-in under load, then scale-out**: the same streams; at the same moment the
   newest decode instance is removed (`DELETE /admin/instances/NAME`, cluster/scaling.py):
   its `drain_s` and `seconds` (until its process is gone), `moved`. Then a decode
   instance is added in its room (`POST /admin/instances`): `seconds` until it serves (a
   new process, the model loaded, the handshake).

Printed: medians over the rounds, and the ratio of the loaded flip's total to the
baseline's remaining time within each round (median). Greedy texts of the flipped
round are compared with the baseline's: a differing text is reported as an error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TREE = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass by"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port)]
        cmd += ["--prefill", "1", "--decode", "2", "--enable-debug-endpoints", *extra]
        self.proc = subprocess.Popen(cmd, cwd=TREE, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start")

    def flip(self, name: str, role: str) -> dict:
        r = httpx.post(f"{self.url}/admin/instances/{name}/role", json={"role": role}, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"flip {name} -> {role}: {r.status_code} {r.text}")
        return dict(r.json())

    def scale(self, method: str, path: str, body: dict | None = None) -> dict:
        r = httpx.request(method, f"{self.url}{path}", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return dict(r.json())

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


class Streams:
    """`n` greedy streams; `wait(k)`: every one has k chunks; `join()`: the texts."""

    def __init__(self, url: str, n: int, tokens: int) -> None:
        self.chunks = [0] * n
        self.texts = [""] * n
        self.ended = [0.0] * n
        body = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        self.threads = [
            threading.Thread(target=self._run, args=(url, i, {**body, "prompt": f"{PROMPT} {i}"}))
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _run(self, url: str, i: int, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    self.texts[i] += choice["text"]
                    self.chunks[i] += 1
        self.ended[i] = time.monotonic()

    def wait(self, k: int) -> None:
        deadline = time.monotonic() + 300
        while min(self.chunks) < k:
            if time.monotonic() > deadline:
                raise RuntimeError("streams stalled")
            time.sleep(0.005)

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(300)
        return self.texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("server_args", nargs="*")
    args = ap.parse_args()
    cluster = Cluster(args.server_args)
    rows: list[dict] = []
    errors: list[str] = []
    newest = "decode-1"  # the decode instance flipped and removed; then the one added
    try:
        for rnd in range(args.rounds):
            there, back = cluster.flip(newest, "prefill"), cluster.flip(newest, "decode")
            base = Streams(cluster.url, args.streams, args.tokens)
            base.wait(8)
            t0 = time.monotonic()
            want = base.join()
            remaining = max(base.ended) - t0
            loaded = Streams(cluster.url, args.streams, args.tokens)
            loaded.wait(8)
            flip = cluster.flip(newest, "prefill")
            got = loaded.join()
            if got != want:
                errors.append(f"round {rnd}: texts differ from the baseline's")
            cluster.flip(newest, "decode")
            leaving = Streams(cluster.url, args.streams, args.tokens)
            leaving.wait(8)
            removed = cluster.scale("DELETE", f"/admin/instances/{newest}")
            if leaving.join() != want:
                errors.append(f"round {rnd}: texts differ after a removal")
            added = cluster.scale("POST", "/admin/instances", {"role": "decode"})
            newest = str(added["instance"])
            row = {
                "idle_switch_ms": 1000 * statistics.median([there["switch_s"], back["switch_s"]]),
                "idle_total_ms": 1000 * statistics.median([there["total_s"], back["total_s"]]),
                "moved": flip["moved"],
                "copied": flip["copied"],
                "drain_ms": 1000 * flip["drain_s"],
                "waited_ms": 1000 * flip["waited_s"],
                "switch_ms": 1000 * flip["switch_s"],
                "total_ms": 1000 * flip["total_s"],
                "remaining_decode_ms": 1000 * remaining,
                "flip_over_remaining": flip["total_s"] / remaining,
                "remove_moved": removed["moved"],
                "remove_drain_ms": 1000 * removed["drain_s"],
                "remove_total_ms": 1000 * removed["seconds"],
                "add_s": added["seconds"],
            }
            rows.append(row)
            print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    finally:
        cluster.stop()
    medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}
    print("| figure | median |\n|---|---|")
    for k, v in medians.items():
        print(f"| {k} | {v} |")
    for e in errors:
        print("ERROR:", e)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "medians": medians}, indent=1))
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
