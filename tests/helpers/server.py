"""A real `pdserve serve` process on loopback, and what the server tests ask of it.

`Server(*flags)` starts `python -m pdserve.cli serve --port <free> *flags` and returns once
`/health` answers 200 (bounded); its stderr is read as it comes by a thread (a server that
logs more than a pipe holds would otherwise block), `stderr()` returns it. The cluster
helpers read the front end's `/debug/cluster` (started with `--enable-debug-endpoints`);
every wait is bounded and polls for a state, never sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import httpx
import psutil

KEY = "sk-pdserve-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
START_TIMEOUT_S = 180.0
# Each instance a test starts faults its whole KV pool in (pdserve/kv/cache.py), 1 GiB by
# default: a test server gets this much unless it passes its own `--kv-cache-memory-gib`
# (728 blocks of 16 tokens in fp16: ~11,600 tokens an instance), so that the suite's two
# workers and their clusters fit the machine's memory.
TEST_KV_GIB = "0.25"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Server:
    def __init__(self, *extra: str, env: dict[str, str | None] | None = None) -> None:
        """`pdserve serve *extra`, ready (its /health answered 200); `env` is set over
        this process's environment, a None value removing that variable."""
        if "--kv-cache-memory-gib" not in extra:
            extra = (*extra, "--kv-cache-memory-gib", TEST_KV_GIB)
        self.args = extra
        # A port free when picked may be taken before the server binds it (by another
        # process's ephemeral port): the server then exits at once saying so (it binds
        # before it loads the model), and is started again on another.
        for _ in range(3):
            self._launch(extra, env)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if self.get("/health")[0] == 200:
                        return
                except OSError:
                    time.sleep(0.1)
            self.stop()
            err = self.stderr()
            if "Address already in use" not in err:
                break
        raise RuntimeError(f"server did not start (exit {self.proc.returncode}): {err[-2000:]}")

    def _launch(self, extra: tuple[str, ...], env: dict[str, str | None] | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), *extra]
        environ = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in environ.items() if v is not None},
        )
        self._err: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line)

    def stderr(self, wait: bool = True) -> str:
        """What the server wrote to stderr: all of it once the process ended (`wait`:
        until it has), else what arrived so far."""
        if wait and self.proc.poll() is not None:
            self._reader.join(30)
        return "".join(self._err)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path, data=body, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str, key: str | None = None) -> tuple[int, dict]:
        return self.request("GET", path, headers=auth(key))

    def post(
        self, path: str, raw: bytes, key: str | None = KEY, content_type: str = "application/json"
    ) -> tuple[int, dict]:
        return self.request("POST", path, raw, {"Content-Type": content_type, **auth(key)})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def post_and_leave(
    server: Server, body: bytes, path: str = "/v1/completions", key: str | None = None
) -> socket.socket:
    """Send a JSON POST on a connection of its own and read nothing: the client leaves
    when the caller closes the returned socket (as a user's client that gives up does)."""
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in auth(key).items()),
    ]
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    conn.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
    return conn


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll until `condition()` holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the server's state"
        time.sleep(0.05)


def stop(server: Server) -> None:
    """Stop `server` and wait until every process it started is gone: its instances and
    the resource tracker, which unlinks the segments of an instance that was killed."""
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    server.stop()
    psutil.wait_procs(children, timeout=60)


class _Lineage:
    """Every pid seen among this test process's descendants since this module was
    imported, sampled every 0.1 s on a daemon thread (and at each look): a process that
    lived a moment is still known once it is gone, so a segment it left is this test
    process's to answer for - and a segment of another test worker's process, alive or
    killed, never is."""

    def __init__(self) -> None:
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="lineage", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.pids()
            time.sleep(0.1)

    def pids(self) -> set[int]:
        try:
            now = {p.pid for p in psutil.Process().children(recursive=True)}
        except psutil.Error:  # a child ended while it was listed: the next look has it
            now = set()
        with self._lock:
            self._seen |= now
            return set(self._seen)


_LINEAGE = _Lineage()


def pdkv_segments(prefix: str = "pdkv-") -> set[str]:
    """KV segments in /dev/shm that this test process answers for: those created by it
    (an in-process core or rank group) or by its descendants, alive or dead since.
    Another program's (a server someone else runs on the machine, another test worker's)
    are not counted. Segment names carry the creating process's pid
    (`pdkv-<pid>-<random>-<name>`, kv/transfer/shm.py; `pdtp-<pid>-...`, a
    tensor-parallel group's sums, parallel/group.py)."""
    mine = _LINEAGE.pids() | {os.getpid()}
    return {f for f in os.listdir("/dev/shm") if f.startswith(prefix) and _ours(f, mine)}


# A SIGKILLed instance's segments are unlinked by its server's resource tracker as that
# server ends (kv/transfer/shm.py), a moment after the server's own exit.
TRACKER_GRACE_S = 10.0


def segments_left(before: set[str], prefix: str = "pdkv-") -> set[str]:
    """The segments this test process answers for (`pdkv_segments`) that were not there
    `before`, once its stopped servers' resource trackers had TRACKER_GRACE_S to unlink
    what their killed instances left: what is still there then is a leak."""
    deadline = time.monotonic() + TRACKER_GRACE_S
    while True:
        left = pdkv_segments(prefix) - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _ours(segment: str, mine: set[int]) -> bool:
    pid = segment.split("-")[1]
    return not pid.isdigit() or int(pid) in mine


def cluster(server: Server, stats_timeout: float = 5.0) -> dict:
    """/debug/cluster, every live instance's counters waited for up to `stats_timeout`
    seconds (5, not the server's 0.08: the tests compare them exactly; a test that holds
    an instance stopped asks for less)."""
    status, reply = server.get(f"/debug/cluster?stats_timeout={stats_timeout}", key=KEY)
    assert status == 200, reply
    return reply


def cluster_rows(server: Server, stats_timeout: float = 5.0) -> list[dict]:
    return cluster(server, stats_timeout)["instances"]


def row_of(server: Server, name: str, stats_timeout: float = 5.0) -> dict:
    return next(r for r in cluster_rows(server, stats_timeout) if r["name"] == name)


CLEAN_FIELDS = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "num_used_blocks",
    "num_held",
    "num_transferring",
    "num_reserved",
    "num_offers",
    "num_prefix_fetches",
)


def holds(row: dict) -> int:
    """Requests (decode) or prompt tokens (prefill) the controller has on the instance
    and has not seen leave it: `assigned_requests` / `assigned_prefill_tokens`."""
    return row["assigned_requests" if row["role"] == "decode" else "assigned_prefill_tokens"]


def freeze_holding(server: Server, victim: str, timeout: float = 120.0) -> dict:
    """SIGSTOP `victim` at a moment it holds requests (a decode instance: while it is
    decoding) and return its row read while it is stopped.

    Stopped, it produces and hands off nothing, so the requests it holds stay exactly
    where they are until it is killed (its row's stats time out; the controller's own
    counters are what counts)."""
    pid = row_of(server, victim)["pid"]
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"{victim} never held a request under load"
        row = row_of(server, victim)
        busy = holds(row) > 0
        if row["role"] == "decode":
            busy = busy and row.get("stats", {}).get("num_running", 0) > 0
        if not busy:
            time.sleep(0.05)
            continue
        os.kill(pid, signal.SIGSTOP)
        # What it sent before it stopped (a hand-off, a finished request) may still be on
        # its way to the controller: read its row (its counters will not come) until two
        # reads 0.3 s apart agree, so what it holds is what it holds while stopped.
        row = row_of(server, victim, stats_timeout=0.1)
        while True:
            time.sleep(0.3)
            again = row_of(server, victim, stats_timeout=0.1)
            if holds(again) == holds(row):
                break
            row = again
        if holds(row) > 0:
            return row
        os.kill(pid, signal.SIGCONT)  # it finished them meanwhile: again


def assert_pools_clean(server: Server, every_role: bool = True) -> None:
    """`every_role`: at least one live instance of every role the cluster runs. Every
    live instance: integrity OK, nothing held, running, queued or in flight (dead ones
    are skipped)."""
    rows = cluster_rows(server)
    for role in {r["role"] for r in rows} if every_role else ():
        assert any(r["alive"] for r in rows if r["role"] == role), (f"no live {role}", rows)
    for row in rows:
        if not row["alive"]:
            continue
        assert "stats" in row, ("a live instance sent no stats", row)
        stats = row["stats"]
        assert stats["integrity_error"] is None, row
        for field in CLEAN_FIELDS:
            assert stats[field] == 0, (row["name"], field, stats)


def wait_dead(server: Server, name: str, timeout: float = 60.0) -> str | None:
    """The dead reason of instance `name` once the controller marks it dead; None if it
    is still alive after `timeout` seconds. (Liveness only: counters not waited for.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = row_of(server, name, stats_timeout=0.1)
        if not row["alive"]:
            return str(row["dead_reason"])
        time.sleep(0.1)
    return None


def wait_clean(server: Server, timeout: float = 20.0, every_role: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_pools_clean(server, every_role)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def prometheus(server: Server) -> dict[str, float]:
    """The samples of GET /metrics by name (with labels)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
