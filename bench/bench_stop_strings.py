"""How long a request with adversarial stop strings holds up everything else on the
server: /health probed every 10 ms while one request runs with stop strings whose
beginnings match its (greedy, predictable) output, so text is held back on every token.

    python bench/bench_stop_strings.py                      # starts `pdserve serve` itself
    python bench/bench_stop_strings.py --url http://127.0.0.1:8000 --stops 1901 --length 2000

`--stops N --length L`: N stop strings of L characters (the hardening issue's attack is
1,900 of 2,000 plus one; today's limits are 64 strings and 4,096 characters in all, so
a server with the limits answers 400 to more). Prints the probe latency (median, p99,
worst) with no request running and during the request, and the request's duration.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PROMPT = "Write a long story about a lighthouse keeper."


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _probe(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=600) as r:
            r.read()
        out.append(time.perf_counter() - t)
        time.sleep(0.01)


def _summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return (
        f"{len(xs)} probes: median {statistics.median(xs) * 1e3:.1f} ms, "
        f"p99 {p99 * 1e3:.1f} ms, worst {xs[-1] * 1e3:.1f} ms"
    )


def _stops(text: str, count: int, length: int) -> list[str]:
    """`count` strings of `length` characters beginning like the output (none completes),
    plus the whole output + NUL (held back to the very end)."""
    head = [(text[: 4 + i % 40] + f"\x00{i:04d}" + "q" * length)[:length] for i in range(count)]
    return [*head, text + "\x00"]


def run(url: str, count: int, length: int, n: int) -> None:
    plain = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    status, reply = _post(url, plain)
    assert status == 200, reply
    text = reply["choices"][0]["text"]
    idle: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_probe, args=(url, stop, idle))
    t.start()
    time.sleep(1.0)
    stop.set()
    t.join()
    busy: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_probe, args=(url, stop, busy))
    t.start()
    start = time.perf_counter()
    status, reply = _post(url, {**plain, "n": n, "stop": _stops(text, count, length)})
    took = time.perf_counter() - start
    stop.set()
    t.join()
    outcome = (
        "texts equal the undisturbed output"
        if status == 200 and all(c["text"] == text for c in reply["choices"])
        else f"status {status}: {json.dumps(reply)[:200]}"
    )
    print(f"stop strings: {count + 1} ({count} x {length} chars + the output), n={n}")
    print(f"  request: {took:.2f} s, {outcome}")
    print(f"  /health idle:  {_summary(idle)}")
    print(f"  /health during: {_summary(busy)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--stops", type=int, default=63)
    p.add_argument("--length", type=int, default=60)
    p.add_argument("--n", type=int, default=16)
    args = p.parse_args()
    if args.url is not None:
        run(args.url, args.stops, args.length, args.n)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.5)
        run(url, args.stops, args.length, args.n)
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
