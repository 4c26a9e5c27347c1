"""How long the largest accepted request body holds up everything else on the server:
/health probed every 10 ms while one request of `--max-body-bytes` is processed.

    python bench/bench_health_stall.py                         # colocated, starts a server
    python bench/bench_health_stall.py --serve-args "--prefill 1 --decode 1"
    python bench/bench_health_stall.py --url http://127.0.0.1:8000 --kinds completion

The bodies (each just under the limit, `--max-body-bytes`, default 4 MiB):
`completion`: `{"prompt": "hello hello ...", "max_tokens": 4}` (~700k tokens, refused
with 400: it is over the context, but only once it is tokenized); `chat`: the same text
as one user message; `ids`: the prompt as token ids (`[1, 1, ...]`, ~1.4M ids: JSON and
pydantic's work, no tokenizer). Each kind is sent `--repeats` times, one at a time;
per request the probe's worst wait (a probe sent just before the request is answered
after it, so this is the stall) and the request's own time; then the medians over the
repeats. The same with no request running first (the probe's floor).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).parent))
from bench_stop_strings import _probe  # /health every 10 ms, each wait recorded

_T = TypeVar("_T")
KINDS = ("completion", "chat", "ids")


def body_of(kind: str, limit: int) -> bytes:
    """The largest body of `kind` within `limit` bytes."""
    shell = {
        "completion": {"prompt": "", "max_tokens": 4},
        "chat": {"messages": [{"role": "user", "content": ""}], "max_tokens": 4},
        "ids": {"prompt": [], "max_tokens": 4},
    }[kind]
    room = limit - len(json.dumps(shell).encode())
    if kind == "completion":
        return json.dumps({**shell, "prompt": "hello " * (room // 6)}).encode()
    if kind == "chat":
        message = {"role": "user", "content": "hello " * (room // 6)}
        return json.dumps({**shell, "messages": [message]}).encode()
    return json.dumps({**shell, "prompt": [1] * ((room + 2) // 3)}).encode()


def _post(url: str, path: str, raw: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def probed(url: str, action: Callable[[], _T]) -> tuple[list[float], float, _T]:
    """/health's waits while `action()` runs, the action's seconds and its result."""
    waits: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=_probe, args=(url, stop, waits))
    prober.start()
    time.sleep(0.1)  # the prober is in its rhythm before the request goes
    start = time.perf_counter()
    try:
        result = action()
    finally:
        took = time.perf_counter() - start
        stop.set()
        prober.join()
    return waits, took, result


def run(url: str, kinds: list[str], repeats: int, limit: int) -> None:
    idle, _, _ = probed(url, lambda: time.sleep(1.0))
    print(
        f"/health idle: {len(idle)} probes, median {statistics.median(idle) * 1e3:.1f} ms, "
        f"worst {max(idle) * 1e3:.1f} ms"
    )
    for kind in kinds:
        raw = body_of(kind, limit)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        worsts, tooks = [], []
        for _ in range(repeats):
            waits, took, (status, reply) = probed(url, functools.partial(_post, url, path, raw))
            worsts.append(max(waits))
            tooks.append(took)
            answer = f"{status} {reply.get('error', {}).get('message', '')[:90]}"
            print(
                f"  {kind}: {len(raw)} bytes -> {answer}; request {took:.2f} s, "
                f"/health worst {max(waits) * 1e3:.1f} ms over {len(waits)} probes"
            )
        print(
            f"{kind}: median of {repeats}: request {statistics.median(tooks):.2f} s, "
            f"/health worst {statistics.median(worsts) * 1e3:.1f} ms "
            f"(range {min(worsts) * 1e3:.1f}-{max(worsts) * 1e3:.1f} ms)"
        )


def start_server(serve_args: list[str], limit: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port)]
    cmd += ["--max-body-bytes", str(limit), *serve_args]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return server, url
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}") from None
            time.sleep(0.5)
    raise RuntimeError("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--serve-args", default="", help="extra `pdserve serve` flags, one string")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"some of {','.join(KINDS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds):
        p.error(f"--kinds: each one of {', '.join(KINDS)}")
    if args.url is not None:
        run(args.url, kinds, args.repeats, args.max_body_bytes)
        return 0
    server, url = start_server(shlex.split(args.serve_args), args.max_body_bytes)
    try:
        run(url, kinds, args.repeats, args.max_body_bytes)
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
