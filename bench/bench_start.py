"""Server start: launch to the first 200 from /health, and to a completion's first token.

    .venv/bin/python bench/bench_start.py [--repeats 5] [--settings colocated,1p1d,2p2d]
        [--ref /tmp/pdserve-ref] [--json out.json]

Each launch is `python -m pdserve.cli serve --port P [ARGS]` run from a source tree (its
folder first on PYTHONPATH, this interpreter): this one, and with `--ref` another
checkout of pdserve, e.g. the commit before (`git worktree add /tmp/pdserve-ref <commit>`;
copy `pdserve/kernels/_kernels*.so` into it or build it there). The clock starts before
the process does. `/health` is polled every 50 ms; once it answers 200 one streamed
completion is sent (greedy, 4 tokens) and the clock read again at its first token: the
first step's costs (a KV pool's pages touched on first use, the first calls' warm-up)
count. The front end's resident memory is read then (`/proc/PID/status` VmRSS: its own
process, not its instances'). The server is then stopped (SIGTERM, its process group
killed after).

Within each repeat every setting is launched once per tree, the trees alternating (their
order flips every repeat), so a slower minute of a shared machine falls on both. One
unmeasured colocated launch per tree comes first (the tokenizer cache and the page
cache warm). Printed: medians per setting and tree, and the median of the ratios
this / ref taken within each repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

THIS_TREE = Path(__file__).resolve().parents[1]
SETTINGS = {
    "colocated": [],
    "1p1d": ["--prefill", "1", "--decode", "1"],
    "2p2d": ["--prefill", "2", "--decode", "2"],
}
POLL_S = 0.05
TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(port: int) -> int | None:
    """The status of GET /health, None while nothing listens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def first_token(port: int) -> None:
    """Send a streamed completion; return at its first token."""
    body = json.dumps(
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "stream": True}
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: {resp.read()!r}")
        while line := resp.readline():
            if line.startswith(b"data: {"):
                return
        raise RuntimeError("the stream ended without a token")
    finally:
        conn.close()


def launch(tree: Path, args: list[str], log: Path) -> dict[str, float]:
    """One start of a server from `tree`: seconds to /health 200 and to the first token."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with log.open("w") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        try:
            while health(port) != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: see {log}")
                if time.perf_counter() - t0 > TIMEOUT_S:
                    raise RuntimeError(f"{' '.join(cmd)}: no 200 in {TIMEOUT_S} s")
                time.sleep(POLL_S)
            ready = time.perf_counter() - t0
            first_token(port)
            token = time.perf_counter() - t0
            rss = rss_mib(proc.pid)
        finally:
            stop(proc)
    return {"health_s": ready, "first_token_s": token, "frontend_rss_mib": rss}


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def launch_retrying(tree: Path, args: list[str], log: Path, tries: int = 3) -> dict[str, float]:
    """`launch`, again after a start that failed (on a shared machine an instance can be
    the OOM killer's pick); the failure is printed."""
    for attempt in range(1, tries + 1):
        try:
            return launch(tree, args, log)
        except RuntimeError as e:
            print(f"launch failed ({attempt}/{tries}): {e}", file=sys.stderr)
            if attempt == tries:
                raise
    raise AssertionError("unreachable")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server, then kill what is left of its process group (its instances)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run(opts: argparse.Namespace) -> dict[str, dict[str, list[dict[str, float]]]]:
    trees = {"this": THIS_TREE}
    if opts.ref:
        trees["ref"] = Path(opts.ref).resolve()
    logs = Path(opts.logs)
    logs.mkdir(parents=True, exist_ok=True)
    for name, tree in trees.items():  # warm-up: tokenizer cache, page cache
        launch_retrying(tree, SETTINGS["colocated"], logs / f"warmup-{name}.log")
    rows: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {t: [] for t in trees} for s in opts.settings
    }
    for rep in range(opts.repeats):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for setting in opts.settings:
            for name in order:
                log = logs / f"{setting}-{name}.log"
                got = launch_retrying(trees[name], SETTINGS[setting], log)
                rows[setting][name].append(got)
                print(f"repeat {rep + 1} {setting} {name}: {fmt(got)}", file=sys.stderr)
    return rows


def fmt(got: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in got.items())


def report(rows: dict[str, dict[str, list[dict[str, float]]]]) -> None:
    keys = ("health_s", "first_token_s", "frontend_rss_mib")
    print(
        "| setting | tree | /health 200 s | first token s | front end RSS MiB "
        "| this / ref, /health | first token | RSS |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for setting, trees in rows.items():
        for name, runs in trees.items():
            med = [statistics.median(r[k] for r in runs) for k in keys]
            ratios = ["", "", ""]
            if name == "this" and "ref" in trees:
                pairs = list(zip(runs, trees["ref"], strict=True))
                ratios = [f"{statistics.median(a[k] / b[k] for a, b in pairs):.2f}x" for k in keys]
            print(
                f"| {setting} | {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.0f} "
                f"| {' | '.join(ratios)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--settings",
        type=lambda s: s.split(","),
        default=list(SETTINGS),
        help=f"comma-separated, of {', '.join(SETTINGS)} (default: all)",
    )
    ap.add_argument("--ref", default=None, help="another pdserve source tree to launch")
    ap.add_argument("--logs", default="/tmp/bench-start-logs", help="servers' stderr")
    ap.add_argument("--json", default=None)
    opts = ap.parse_args()
    unknown = set(opts.settings) - set(SETTINGS)
    if unknown:
        ap.error(f"unknown settings {sorted(unknown)}")
    rows = run(opts)
    report(rows)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
