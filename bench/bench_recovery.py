"""Fault tolerance as the client sees it: DéjàVu's Fig. 10 (§4.3) and issue 17's
stall, recovery and replication-overhead figures, measured against real servers.

    .venv/bin/python bench/bench_recovery.py                      # all three parts
    .venv/bin/python bench/bench_recovery.py --parts fig10 --repeats 3
    .venv/bin/python bench/bench_recovery.py --parts stall --streams 64
    .venv/bin/python bench/bench_recovery.py --parts overhead --overhead-levels 1,16,64
    # small, for a quick check:
    .venv/bin/python bench/bench_recovery.py --repeats 1 --fig10-prompt 100 \\
        --fig10-tokens 64 --fig10-kill-at 32 --streams 4 --stall-tokens 64 \\
        --overhead-levels 1,4 --overhead-tokens 32 --overhead-one-server-at-a-time

Every server is `python -m pdserve.cli serve --prefill 1 --decode 2
--enable-debug-endpoints` on 127.0.0.1 (plus the configuration's flags), started and
stopped (SIGINT, then SIGKILL) by this script. A decode instance is killed with SIGKILL;
which one serves what is read from GET /debug/cluster (`assigned_requests`).

Parts (`--parts`, default all):

1. fig10 - one request: a prompt of exactly `--fig10-prompt` tokens (checked with the
   served model's tokenizer), `--fig10-tokens` greedy tokens (ignore_eos); the decode
   instance serving it is SIGKILLed when the client has received token
   `--fig10-kill-at`. Configurations: (a) baseline, no failure; (b) restart from scratch
   (`--max-migrations 0`: the stream ends with an error and the client sends the whole
   request again; latency from the first send to the end of the retry); (c) migration by
   recompute (default server); (d) resume from replica (`--kv-replication`). Each
   configuration gets a fresh server per repeat (a killed one has a dead instance), warmed
   by one short request. Reported: end-to-end latency over (a)'s of the same repeat
   (DéjàVu: restart 1.91x, replication 1.24x), the stall (largest gap between consecutive
   tokens), detection (kill -> the controller marks the instance dead) and whether the
   text equals (a)'s.
2. stall - `--streams` concurrent streams (`--stall-tokens` tokens, prompts of 20-60
   tokens), one undisturbed run first on the same server (the reference texts), then the
   same workload while one decode instance (the one holding most requests) is SIGKILLed
   once every stream has >= 8 tokens; recompute vs replication, fresh server per
   (configuration, repeat). Per stream: the inter-token gap that spans the kill (median,
   worst) and the worst gap after it. Which streams were on the victim cannot be read over
   HTTP, so a heuristic picks them: the gap spanning the kill exceeds `--victim-factor`
   times the median inter-token gap before the kill (the victim's `assigned_requests`
   just before the kill is reported next to their count as a cross-check). For those:
   recovery = first token after the kill - kill, median, split into detection (from the
   kill on, a thread polls /debug/cluster every 20 ms and records when `alive` turns
   false; see DeadWatcher for what the figure bounds) and the rest (promotion +
   recompute or replica copy). All texts must equal the reference.
3. overhead - TPOT (mean inter-token time of a request, median over requests) with
   replication on vs off at `--overhead-levels` concurrent streams (`--overhead-tokens`
   each); two servers started once and kept, runs alternating on/off per level and repeat
   (`--overhead-one-server-at-a-time`: one server after the other, no alternation - for a
   machine that cannot hold both). Reported: ratio on/off per level (target <= 1.03).

Every measurement runs `--repeats` times with the configurations alternated (their order
rotated) within each repeat so they share the machine's noise; the table gives medians
over repeats and ratios to the baseline of the same repeat; `--out` (JSON) holds every
raw figure (rewritten after each part). Exit status: 0; 1 when a check failed (a text
differs from its reference, a stream did not end normally); 2 when a server did not start.

Caveats: on a 2-core CPU machine the front end, three engine processes, this client and
(for `overhead`) a second idle server compete for the same cores, so absolute times are
noisy and slower than on separate devices: read the ratios. A "token" on the client is
an SSE text chunk (each carries at least one token; `usage` at the end gives the exact
count). In (b) the retry hits the prefill instance's prefix cache, as a real client's
would. The victim-stream heuristic of `stall` can miss a victim stream whose gap was
short or include a survivor that stalled behind the recompute. /debug/cluster asks every
live instance for its stats and a pool integrity check, so it is polled only from the
kill on (never during the undisturbed part of a run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

BASE_FLAGS = ["--prefill", "1", "--decode", "2", "--enable-debug-endpoints"]
_WORD_TEXT = (
    "the quick brown fox jumps over a lazy dog while river stone light house keeper "
    "finds old map under green tree near cold sea and small boat sails far from home"
)
WORDS = _WORD_TEXT.split(" ")
WARMUP_PROMPT = "A short warm-up request about the weather in spring."
POLL_S = 0.02


class ServerStartError(RuntimeError):
    """A server did not answer /health in time, or exited while starting."""


# ---- prompts -------------------------------------------------------------------------


def exact_prompt(prompt_ids: Callable[[str], list[int]], n: int, offset: int = 0) -> str:
    """A prompt of words (WORDS from `offset` on, cycled) whose token count under
    `prompt_ids` is exactly `n`. Far from `n`, words are added in runs of half the
    missing count (kept only if they do not overshoot); near it one at a time, a word
    that overshoots being replaced by the next candidate."""
    words: list[str] = []
    count, i = 0, offset
    while count < n:
        run = (n - count) // 2
        if run > 1:
            cand = [*words, *(WORDS[(i + k) % len(WORDS)] for k in range(run))]
            got = len(prompt_ids(" ".join(cand)))
            if got <= n:
                words, count, i = cand, got, i + run
                continue
        for k in range(len(WORDS)):
            cand = [*words, WORDS[(i + k) % len(WORDS)]]
            got = len(prompt_ids(" ".join(cand)))
            if got <= n:
                words, count, i = cand, got, i + k + 1
                break
        else:
            raise ValueError(f"no prompt of exactly {n} tokens from these words")
    return " ".join(words)


def mixed_lengths(count: int, low: int, high: int) -> list[int]:
    """`count` deterministic prompt lengths spread over [low, high]."""
    span = high - low + 1
    return [low + (i * 37) % span for i in range(count)]


def load_prompt_ids() -> Callable[[str], list[int]]:
    """The served model's tokenizer (the shipped SmolLM2 by default)."""
    from pdserve.model.source import resolve_model
    from pdserve.model.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model(None)).prompt_ids


def body(prompt: str, tokens: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# ---- servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One `pdserve serve` process started by this script (its log in `log`)."""

    label: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        """SIGINT, then SIGKILL past 30 s; the engine children are waited for (bounded)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        _, alive = psutil.wait_procs(children, timeout=30)
        for child in alive:
            child.kill()
        psutil.wait_procs(alive, timeout=10)


def start_server(label: str, flags: Sequence[str], timeout_s: float) -> Server:
    """Start a server with BASE_FLAGS + `flags`; ServerStartError (with the log's tail)
    if it exits or does not answer /health within `timeout_s`."""
    port = free_port()
    fd, name = tempfile.mkstemp(prefix=f"bench_recovery_{label}_", suffix=".log")
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(port), *BASE_FLAGS]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen([*cmd, *flags], stdout=log, stderr=subprocess.STDOUT)
    server = Server(label, proc, f"http://127.0.0.1:{port}", Path(name))
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                print(f"  started {label} in {time.monotonic() - started:.0f} s", flush=True)
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    why = f"exited with {proc.returncode}" if proc.poll() is not None else "no /health"
    server.stop()
    tail = server.log.read_text(errors="replace")[-2000:]
    raise ServerStartError(
        f"server {label} ({' '.join(flags) or 'default'}) did not start ({why} within "
        f"{timeout_s:.0f} s); log {server.log}:\n{tail}"
    )


def cluster(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/debug/cluster", timeout=10)
    r.raise_for_status()
    return dict(r.json())


def busiest_decode(url: str) -> dict[str, Any] | None:
    """The live decode instance holding most requests (None if none holds any)."""
    rows = [r for r in cluster(url)["instances"] if r["role"] == "decode" and r["alive"]]
    rows = [r for r in rows if r["assigned_requests"] > 0]
    return max(rows, key=lambda r: r["assigned_requests"]) if rows else None


class DeadWatcher:
    """When the controller marks instance `name` dead, from the client: once `arm()`ed
    (right after the kill; nothing is polled before, so the run is not disturbed), polls
    /debug/cluster every POLL_S from a thread until `name` shows dead.

    `/debug/cluster` reads `alive` between a poll's send and its reply, and a poll in
    flight at the kill waits on the dead instance's stats until the controller fences it;
    so the first poll that shows it dead is sent just after the detection: `dead_sent`
    (the estimate) and `dead_seen` (its reply, an upper bound)."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.dead_sent: float | None = None
        self.dead_seen: float | None = None
        self.answers: list[float] = []  # seconds each poll took to be answered
        self._go = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self._go.set()

    def _run(self) -> None:
        while not self._go.wait(POLL_S):
            if self._stop.is_set():
                return
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    rows = client.get(self.url + "/debug/cluster").json()["instances"]
                except (httpx.HTTPError, ValueError, KeyError):
                    rows = []
                self.answers.append(time.monotonic() - sent)
                if any(r["name"] == self.name and not r["alive"] for r in rows):
                    self.dead_sent, self.dead_seen = sent, time.monotonic()
                    return
                self._stop.wait(POLL_S)

    def wait(self, timeout_s: float) -> float | None:
        """`dead_sent` once seen (None past `timeout_s`)."""
        self._thread.join(timeout_s)
        return self.dead_sent

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join(15)


# ---- streams -------------------------------------------------------------------------


@dataclass
class StreamRecord:
    """One streamed completion as the client saw it (times: time.monotonic())."""

    sent: float = 0.0
    ended: float = 0.0
    status: int = 0
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # one per text chunk
    completion_tokens: int | None = None
    error: str | None = None  # an error body or event, or a broken connection

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def stream_completion(
    url: str,
    request: dict[str, Any],
    timeout_s: float,
    on_chunk: Callable[[int], None] | None = None,
    out: StreamRecord | None = None,
) -> StreamRecord:
    """POST one streamed completion and record it; `on_chunk(k)` after the k-th text
    chunk (from this thread)."""
    rec = out if out is not None else StreamRecord()
    rec.sent = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=timeout_s) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = r.read().decode(errors="replace")[:500]
            else:
                _read_events(r, rec, on_chunk)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.ended = time.monotonic()
    return rec


def _read_events(
    r: httpx.Response, rec: StreamRecord, on_chunk: Callable[[int], None] | None
) -> None:
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            rec.error = json.dumps(event["error"])[:500]
            continue
        if event.get("usage"):
            rec.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                rec.text += choice["text"]
                rec.arrivals.append(time.monotonic())
                if on_chunk is not None:
                    on_chunk(len(rec.arrivals))


class Streams:
    """Concurrent streamed completions, one thread (and connection) each."""

    def __init__(self, url: str, requests: list[dict[str, Any]], timeout_s: float) -> None:
        self.records = [StreamRecord() for _ in requests]
        self.timeout_s = timeout_s
        self._threads = [
            threading.Thread(
                target=stream_completion, args=(url, req, timeout_s, None, rec), daemon=True
            )
            for req, rec in zip(requests, self.records, strict=True)
        ]
        for t in self._threads:
            t.start()

    def wait_tokens(self, k: int, timeout_s: float) -> None:
        """Until every stream still running has >= k chunks; RuntimeError past timeout."""
        deadline = time.monotonic() + timeout_s
        while any(
            t.is_alive() and len(r.arrivals) < k
            for t, r in zip(self._threads, self.records, strict=True)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"streams did not reach {k} tokens in {timeout_s:.0f} s")
            time.sleep(POLL_S / 2)

    def results(self) -> list[StreamRecord]:
        deadline = time.monotonic() + self.timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise RuntimeError("streams did not end in time")
        return self.records


def run_streams(url: str, requests: list[dict[str, Any]], timeout_s: float) -> list[StreamRecord]:
    return Streams(url, requests, timeout_s).results()


def warm_up(url: str, timeout_s: float) -> None:
    rec = stream_completion(url, body(WARMUP_PROMPT, 8), timeout_s)
    if not rec.ok:
        raise RuntimeError(f"warm-up request failed: {rec.error}")


# ---- pure figures --------------------------------------------------------------------


def gaps(arrivals: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals)]


def max_gap(arrivals: Sequence[float]) -> float:
    return max(gaps(arrivals), default=0.0)


def kill_gap(arrivals: Sequence[float], t_kill: float) -> float | None:
    """The inter-token gap that spans `t_kill` (None: the stream had no token on one
    side of it)."""
    for a, b in itertools.pairwise(arrivals):
        if a <= t_kill < b:
            return b - a
    return None


def first_after(arrivals: Sequence[float], t: float) -> float | None:
    return next((a for a in arrivals if a > t), None)


def gaps_before(arrivals: Sequence[float], t: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(arrivals) if b <= t]


def tpot(arrivals: Sequence[float]) -> float | None:
    """Mean inter-token time of one request (None below two tokens)."""
    if len(arrivals) < 2:
        return None
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def median_or_none(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def rotated(items: Sequence[str], repeat: int) -> list[str]:
    """`items` starting at position `repeat` (mod len): each repeat another order."""
    k = repeat % len(items)
    return [*items[k:], *items[:k]]


def fmt(x: float | None, unit: str = "", digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


# ---- part 1: fig10 -------------------------------------------------------------------

FIG10_CONFIGS: dict[str, list[str]] = {
    "baseline": [],
    "restart": ["--max-migrations", "0"],
    "recompute": [],
    "replication": ["--kv-replication"],
}


@dataclass
class Fig10Run:
    config: str
    repeat: int
    latency_s: float  # first send -> end of the (retried) stream
    stall_s: float  # largest gap between consecutive tokens (the retry's, for restart)
    text: str
    tokens: int | None
    killed: str | None = None
    killed_at_token: int | None = None
    detection_s: float | None = None  # kill -> the first poll showing it dead was sent
    detection_seen_s: float | None = None  # kill -> that poll's reply (upper bound)
    recovery_s: float | None = None  # kill -> next token (restart: -> the retry's first)
    first_error: str | None = None  # restart: the error that ended the first stream
    error: str | None = None  # the final stream's, if it did not end normally


class Killer:
    """SIGKILLs `pid` (set later) from the stream thread at chunk `at`."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.pid: int | None = None
        self.watcher: DeadWatcher | None = None
        self.killed_at: float | None = None

    def __call__(self, k: int) -> None:
        if k == self.at and self.pid is not None and self.killed_at is None:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
            if self.watcher is not None:
                self.watcher.arm()


def find_victim(url: str, rec: StreamRecord, timeout_s: float) -> dict[str, Any]:
    """The decode instance serving the single request once it streams (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if rec.arrivals:
            row = busiest_decode(url)
            if row is not None:
                return row
        time.sleep(POLL_S)
    raise RuntimeError("no decode instance took the request")


def fig10_once(
    url: str, config: str, repeat: int, request: dict[str, Any], kill_at: int, timeout_s: float
) -> Fig10Run:
    """One measured request on a warmed server; the serving decode instance is killed at
    token `kill_at` unless `config` is the baseline; restart re-sends after the error."""
    killer = Killer(kill_at)
    rec = StreamRecord()
    thread = threading.Thread(
        target=stream_completion, args=(url, request, timeout_s, killer, rec), daemon=True
    )
    thread.start()
    victim, watcher = None, None
    try:
        if config != "baseline":
            victim = find_victim(url, rec, timeout_s)
            killer.watcher = watcher = DeadWatcher(url, victim["name"])
            killer.pid = victim["pid"]
        thread.join(timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"{config}: the request did not end in {timeout_s:.0f} s")
        final, first_error = rec, None
        if config == "restart" and not rec.ok:
            first_error = rec.error
            final = stream_completion(url, request, timeout_s)
        dead = watcher.wait(30) if watcher is not None and killer.killed_at else None
    finally:
        if watcher is not None:
            watcher.stop()
    t_kill = killer.killed_at
    return Fig10Run(
        config=config,
        repeat=repeat,
        latency_s=final.ended - rec.sent,
        stall_s=max_gap(final.arrivals),
        text=final.text,
        tokens=final.completion_tokens,
        killed=victim["name"] if victim and t_kill else None,
        killed_at_token=kill_at if t_kill else None,
        detection_s=_since(dead, t_kill),
        detection_seen_s=_since(watcher.dead_seen if watcher else None, t_kill),
        recovery_s=_recovery(final, t_kill),
        first_error=first_error,
        error=final.error,
    )


def _since(t: float | None, t_kill: float | None) -> float | None:
    return t - t_kill if t is not None and t_kill is not None else None


def _recovery(final: StreamRecord, t_kill: float | None) -> float | None:
    if t_kill is None:
        return None
    nxt = first_after(final.arrivals, t_kill)
    return nxt - t_kill if nxt is not None else None


def run_fig10(args: argparse.Namespace, prompt_ids: Callable[[str], list[int]]) -> dict[str, Any]:
    prompt = exact_prompt(prompt_ids, args.fig10_prompt)
    request = body(prompt, args.fig10_tokens)
    runs: list[Fig10Run] = []
    for repeat in range(args.repeats):
        for config in rotated(args.fig10_configs, repeat):
            server = start_server(f"fig10-{config}", FIG10_CONFIGS[config], args.start_timeout)
            try:
                warm_up(server.url, args.request_timeout)
                run = fig10_once(
                    server.url, config, repeat, request, args.fig10_kill_at, args.request_timeout
                )
            finally:
                server.stop()
            runs.append(run)
            print(
                f"  fig10 repeat {repeat} {config}: {run.latency_s:.2f} s, "
                f"stall {run.stall_s:.3f} s, error {run.error}",
                flush=True,
            )
    return {"prompt_tokens": len(prompt_ids(prompt)), "runs": [asdict(r) for r in runs]}


def summarize_fig10(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: medians over repeats, latency over the same repeat's baseline,
    and whether every text equals that baseline's."""
    base = {r["repeat"]: r for r in runs if r["config"] == "baseline"}
    rows = []
    for config in FIG10_CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        ratios = [
            ratio(r["latency_s"], base[r["repeat"]]["latency_s"])
            for r in mine
            if r["repeat"] in base
        ]
        same = [r["text"] == base[r["repeat"]]["text"] for r in mine if r["repeat"] in base]
        rows.append(
            {
                "config": config,
                "latency_s": median_or_none([r["latency_s"] for r in mine]),
                "vs_baseline": median_or_none(ratios),
                "stall_s": median_or_none([r["stall_s"] for r in mine]),
                "detection_s": median_or_none([r["detection_s"] for r in mine]),
                "recovery_s": median_or_none([r["recovery_s"] for r in mine]),
                "text_equal": all(same) if same else None,  # None: no baseline run
                "errors": sum(r["error"] is not None for r in mine),
            }
        )
    return rows


def print_fig10(rows: list[dict[str, Any]]) -> None:
    print("\nfig10 (medians over repeats; ratio = latency / same repeat's baseline)")
    print("| config | latency | x baseline | stall | detection | recovery | text = baseline |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {fmt(r['latency_s'], ' s', 2)} | {fmt(r['vs_baseline'], 'x', 2)}"
            f" | {fmt(r['stall_s'], ' s')} | {fmt(r['detection_s'], ' s')}"
            f" | {fmt(r['recovery_s'], ' s')} | {r['text_equal']} |"
        )


# ---- part 2: stall -------------------------------------------------------------------

# config -> (the server's flags, the signal the busiest decode instance gets): SIGKILL
# (the process is gone: its exit is seen) or SIGSTOP (a hung instance: only its silence
# tells, past --instance-timeout).
STALL_CONFIGS: dict[str, tuple[list[str], signal.Signals]] = {
    "recompute": ([], signal.SIGKILL),
    "replication": (["--kv-replication"], signal.SIGKILL),
    "hang": ([], signal.SIGSTOP),
    "hang-replication": (["--kv-replication"], signal.SIGSTOP),
}


@dataclass
class StallRun:
    config: str
    repeat: int
    victim: str
    victim_requests: int  # its assigned_requests just before the kill
    normal_gap_s: float  # median inter-token gap before the kill, all streams
    kill_gaps_s: list[float | None]  # per stream: the gap spanning the kill
    after_gaps_s: list[float | None]  # per stream: the worst gap ending after the kill
    recovery_s: list[float | None]  # per stream: kill -> its first token after the kill
    on_victim: list[bool]  # the heuristic: kill gap > factor x normal gap
    detection_s: float | None  # kill -> the first poll showing it dead was sent
    detection_seen_s: float | None  # kill -> that poll's reply (upper bound)
    debug_worst_s: float | None  # the slowest /debug/cluster answer after the kill
    texts_equal: int
    streams_ok: int


def stall_requests(
    prompt_ids: Callable[[str], list[int]], streams: int, tokens: int
) -> list[dict[str, Any]]:
    lengths = mixed_lengths(streams, 20, 60)
    return [body(exact_prompt(prompt_ids, n, offset=i), tokens) for i, n in enumerate(lengths)]


def stall_figures(
    records: list[StreamRecord], t_kill: float, factor: float
) -> tuple[float, list[float | None], list[float | None], list[float | None], list[bool]]:
    """Normal gap, per-stream kill gap, worst gap after the kill, recovery, on-victim."""
    before = [g for r in records for g in gaps_before(r.arrivals, t_kill)]
    normal = statistics.median(before) if before else 0.0
    kill = [kill_gap(r.arrivals, t_kill) for r in records]
    after = [
        max(
            (b - a for a, b in itertools.pairwise(r.arrivals) if b > t_kill),
            default=None,
        )
        for r in records
    ]
    victim = [g is not None and g > factor * normal for g in kill]
    recovery = [
        (nxt - t_kill) if (nxt := first_after(r.arrivals, t_kill)) is not None else None
        for r in records
    ]
    return normal, kill, after, recovery, victim


def stall_once(
    url: str, config: str, repeat: int, requests: list[dict[str, Any]], args: argparse.Namespace
) -> StallRun:
    reference = run_streams(url, requests, args.request_timeout)
    bad = [r.error for r in reference if not r.ok]
    if bad:
        raise RuntimeError(f"stall {config}: the undisturbed run failed: {bad[0]}")
    streams = Streams(url, requests, args.request_timeout)
    streams.wait_tokens(8, args.request_timeout)
    victim = busiest_decode(url)
    if victim is None:
        raise RuntimeError(f"stall {config}: no decode instance holds a request")
    watcher = DeadWatcher(url, victim["name"])
    try:
        os.kill(victim["pid"], STALL_CONFIGS[config][1])
        t_kill = time.monotonic()
        watcher.arm()
        records = streams.results()
        dead = watcher.wait(30)
    finally:
        watcher.stop()
    normal, kill, after, recovery, on_victim = stall_figures(records, t_kill, args.victim_factor)
    return StallRun(
        config=config,
        repeat=repeat,
        victim=victim["name"],
        victim_requests=victim["assigned_requests"],
        normal_gap_s=normal,
        kill_gaps_s=kill,
        after_gaps_s=after,
        recovery_s=recovery,
        on_victim=on_victim,
        detection_s=_since(dead, t_kill),
        detection_seen_s=_since(watcher.dead_seen, t_kill),
        debug_worst_s=max(watcher.answers, default=None),
        texts_equal=sum(r.text == ref.text for r, ref in zip(records, reference, strict=True)),
        streams_ok=sum(r.ok for r in records),
    )


def run_stall(args: argparse.Namespace, prompt_ids: Callable[[str], list[int]]) -> dict[str, Any]:
    requests = stall_requests(prompt_ids, args.streams, args.stall_tokens)
    runs: list[StallRun] = []
    for repeat in range(args.repeats):
        for config in rotated(args.stall_configs, repeat):
            flags = STALL_CONFIGS[config][0]
            server = start_server(f"stall-{config}", flags, args.start_timeout)
            try:
                run = stall_once(server.url, config, repeat, requests, args)
            finally:
                server.stop()
            runs.append(run)
            print(
                f"  stall repeat {repeat} {config}: victim {run.victim} "
                f"({run.victim_requests} requests), texts equal "
                f"{run.texts_equal}/{len(requests)}",
                flush=True,
            )
    return {"streams": len(requests), "runs": [asdict(r) for r in runs]}


def summarize_stall(runs: list[dict[str, Any]], streams: int) -> list[dict[str, Any]]:
    rows = []
    for config in STALL_CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        if not mine:
            continue
        per_run = []
        for r in mine:
            kill = [g for g in r["kill_gaps_s"] if g is not None]
            rec = [x for x, v in zip(r["recovery_s"], r["on_victim"], strict=True) if v]
            med_rec = median_or_none(rec)
            per_run.append(
                {
                    "stall_median_s": median_or_none(kill),
                    "stall_worst_s": max(kill, default=None),
                    "after_worst_s": max(
                        (g for g in r["after_gaps_s"] if g is not None), default=None
                    ),
                    "victim_streams": sum(r["on_victim"]),
                    "victim_requests": r["victim_requests"],
                    "recovery_s": med_rec,
                    "detection_s": r["detection_s"],
                    "debug_worst_s": r.get("debug_worst_s"),
                    "rest_s": med_rec - r["detection_s"]
                    if med_rec is not None and r["detection_s"] is not None
                    else None,
                    "normal_gap_s": r["normal_gap_s"],
                    "all_equal": r["texts_equal"] == streams and r["streams_ok"] == streams,
                }
            )
        row: dict[str, Any] = {"config": config}
        for key in per_run[0]:
            vals = [p[key] for p in per_run]
            row[key] = all(vals) if key == "all_equal" else median_or_none(vals)
        rows.append(row)
    return rows


def print_stall(rows: list[dict[str, Any]]) -> None:
    print("\nstall (medians over repeats; victim streams by the gap heuristic)")
    print(
        "| config | normal gap | kill gap median | kill gap worst | worst gap after |"
        " victim streams / requests | recovery | detection | rest | slowest /debug/cluster |"
        " texts equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {fmt(r['normal_gap_s'], ' s')} | {fmt(r['stall_median_s'], ' s')}"
            f" | {fmt(r['stall_worst_s'], ' s')} | {fmt(r['after_worst_s'], ' s')}"
            f" | {fmt(r['victim_streams'], '', 0)} / {fmt(r['victim_requests'], '', 0)}"
            f" | {fmt(r['recovery_s'], ' s')} | {fmt(r['detection_s'], ' s')}"
            f" | {fmt(r['rest_s'], ' s')} | {fmt(r['debug_worst_s'], ' s')} | {r['all_equal']} |"
        )


# ---- part 3: overhead ----------------------------------------------------------------

OVERHEAD_CONFIGS: dict[str, list[str]] = {"off": [], "on": ["--kv-replication"]}


@dataclass
class OverheadRun:
    config: str
    level: int
    repeat: int
    tpot_s: list[float | None]  # per request
    ok: int


def overhead_once(
    url: str, config: str, level: int, repeat: int, requests: list[dict[str, Any]], timeout: float
) -> OverheadRun:
    records = run_streams(url, requests[:level], timeout)
    return OverheadRun(
        config, level, repeat, [tpot(r.arrivals) for r in records], sum(r.ok for r in records)
    )


def overhead_sweep(
    servers: dict[str, Server],
    levels: list[int],
    args: argparse.Namespace,
    requests: list[dict[str, Any]],
) -> list[OverheadRun]:
    runs = []
    for repeat in range(args.repeats):
        for level in levels:
            for config in rotated(list(servers), repeat + level):
                run = overhead_once(
                    servers[config].url, config, level, repeat, requests, args.request_timeout
                )
                runs.append(run)
                print(
                    f"  overhead repeat {repeat} level {level} {config}: TPOT median "
                    f"{fmt(median_or_none(run.tpot_s), ' s', 4)}",
                    flush=True,
                )
    return runs


def run_overhead(
    args: argparse.Namespace, prompt_ids: Callable[[str], list[int]]
) -> dict[str, Any]:
    levels = [int(x) for x in args.overhead_levels.split(",")]
    requests = stall_requests(prompt_ids, max(levels), args.overhead_tokens)
    groups = (
        [[c] for c in args.overhead_configs]
        if args.overhead_one_server_at_a_time
        else [args.overhead_configs]
    )
    runs: list[OverheadRun] = []
    for group in groups:
        servers: dict[str, Server] = {}
        try:
            for config in group:
                servers[config] = start_server(
                    f"overhead-{config}", OVERHEAD_CONFIGS[config], args.start_timeout
                )
                warm_up(servers[config].url, args.request_timeout)
            runs += overhead_sweep(servers, levels, args, requests)
        finally:
            for s in servers.values():
                s.stop()
    return {"levels": levels, "runs": [asdict(r) for r in runs]}


def summarize_overhead(runs: list[dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    """Per level: median TPOT (median over requests, then over repeats) on and off, the
    ratio of those medians and the median of the per-repeat ratios."""
    rows = []
    for level in levels:
        med: dict[tuple[str, int], float | None] = {
            (r["config"], r["repeat"]): median_or_none(r["tpot_s"])
            for r in runs
            if r["level"] == level
        }
        repeats = sorted({rep for _, rep in med})
        on = median_or_none([med.get(("on", rep)) for rep in repeats])
        off = median_or_none([med.get(("off", rep)) for rep in repeats])
        per_repeat = [ratio(med.get(("on", rep)), med.get(("off", rep))) for rep in repeats]
        rows.append(
            {
                "level": level,
                "tpot_off_s": off,
                "tpot_on_s": on,
                "ratio": ratio(on, off),
                "ratio_per_repeat_median": median_or_none(per_repeat),
                "failed": sum(len(r["tpot_s"]) - r["ok"] for r in runs if r["level"] == level),
            }
        )
    return rows


def print_overhead(rows: list[dict[str, Any]]) -> None:
    print("\noverhead (TPOT: median over requests, then over repeats; target ratio <= 1.03)")
    print("| streams | TPOT off | TPOT on | on/off | on/off per repeat (median) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['level']} | {fmt(r['tpot_off_s'], ' s', 4)} | {fmt(r['tpot_on_s'], ' s', 4)}"
            f" | {fmt(r['ratio'], 'x')} | {fmt(r['ratio_per_repeat_median'], 'x')} |"
        )


# ---- main ----------------------------------------------------------------------------


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", default="fig10,stall,overhead", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_recovery.json")
    p.add_argument("--fig10-prompt", type=int, default=500)
    p.add_argument("--fig10-tokens", type=int, default=1000)
    p.add_argument("--fig10-kill-at", type=int, default=600)
    p.add_argument("--fig10-configs", default=",".join(FIG10_CONFIGS), help="comma-separated")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stall-tokens", type=int, default=96)
    p.add_argument("--stall-configs", default=",".join(STALL_CONFIGS), help="comma-separated")
    p.add_argument("--victim-factor", type=float, default=3.0)
    p.add_argument("--overhead-levels", default="1,16,64")
    p.add_argument("--overhead-tokens", type=int, default=96)
    p.add_argument("--overhead-one-server-at-a-time", action="store_true")
    p.add_argument("--overhead-configs", default="off,on", help="comma-separated")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds per server")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per wait")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - {"fig10", "stall", "overhead"}
    if unknown:
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    if not 0 < args.fig10_kill_at < args.fig10_tokens:
        p.error("--fig10-kill-at must be within (0, --fig10-tokens)")
    args.parts = parts
    for name, known in (
        ("fig10_configs", FIG10_CONFIGS),
        ("stall_configs", STALL_CONFIGS),
        ("overhead_configs", OVERHEAD_CONFIGS),
    ):
        chosen = getattr(args, name).split(",")
        if not chosen or set(chosen) - set(known):
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag}: choose among {', '.join(known)}")
        setattr(args, name, chosen)
    return args


def run_parts(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    """Run the selected parts, print their tables, fill `result`; True if every check
    passed."""
    prompt_ids = load_prompt_ids()
    ok = True
    if "fig10" in args.parts:
        raw = run_fig10(args, prompt_ids)
        rows = summarize_fig10(raw["runs"])
        result["fig10"] = {**raw, "summary": rows}
        write_json(args.out, result)
        print_fig10(rows)
        ok &= all(r["text_equal"] is not False and r["errors"] == 0 for r in rows)
    if "stall" in args.parts:
        raw = run_stall(args, prompt_ids)
        rows = summarize_stall(raw["runs"], raw["streams"])
        result["stall"] = {**raw, "summary": rows}
        write_json(args.out, result)
        print_stall(rows)
        ok &= all(r["all_equal"] for r in rows)
    if "overhead" in args.parts:
        raw = run_overhead(args, prompt_ids)
        rows = summarize_overhead(raw["runs"], raw["levels"])
        result["overhead"] = {**raw, "summary": rows}
        write_json(args.out, result)
        print_overhead(rows)
        ok &= all(r["failed"] == 0 for r in rows)
    return ok


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items()}}
    started = time.monotonic()
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so every server started is stopped.
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        ok = run_parts(args, result)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; partial figures in {args.out}", file=sys.stderr)
        return 130
    finally:
        result["wall_s"] = time.monotonic() - started
        write_json(args.out, result)
    print(f"\nraw figures: {args.out} ({result['wall_s']:.0f} s)")
    if not ok:
        print(
            "error: a check failed (text differs or a stream did not end normally)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
