"""`pdserve serve --prefill N --decode M`: real instance processes, real KV transfers
(shared memory and TCP), the API unchanged; injected transfer faults and killed
instances under load, in every transfer mode.

Every completion that succeeds is compared with the greedy output of an undisturbed
colocated engine in this process (`reference`, helpers/reference.py); every failure is
checked against what the controller (`pdserve/cluster/controller.py`: `_on_dead`,
`_move`) must do. Tests wait for the states they need (bounded by generous timeouts),
never for a fixed time."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.reference import greedy
from helpers.server import (
    Server,
    cluster,
    cluster_rows,
    freeze_holding,
    holds,
    pdkv_segments,
    row_of,
    segments_left,
    stop,
    wait_clean,
    wait_dead,
)

from pdserve.engine.engine import Engine

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MODES = ["pull", "layer-push", "request-push"]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bright",
    "stars",
    "shine",
    "above",
    "quiet",
    "hills",
    "and",
    "rivers",
    "run",
    "to",
    "the",
    "sea",
    "past",
    "old",
    "towns",
    "with",
    "red",
    "roofs",
]


def mixed_prompts(n: int) -> list[str]:
    """n prompts of 3 to 42 words, deterministic."""
    out = []
    for i in range(n):
        k = 3 + (i * 37) % 40
        out.append(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(k)))
    return out


PROMPTS = mixed_prompts(32)
MAX_TOKENS = 8  # every workload of this module: PROMPTS (or some of them), 8 tokens


def complete(server: Server, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
    status, reply = server.post("/v1/completions", json.dumps(body).encode(), key=None)
    assert status == 200, reply
    phases = set(reply["pdserve_timings"])
    # The shipped length head runs by default (docs/scheduling.md).
    predicted = {"predicted_output_low", "predicted_output_high"}
    colocated = {"queue", "prefill", "decode", "ttft", "e2e"}
    assert phases in (colocated | predicted, colocated | predicted | {"transfer", "decode_queue"})
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def post_one(server: Server, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[int, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return server.post("/v1/completions", json.dumps(body).encode(), key=None)


def run_concurrently(server: Server, prompts: list[str]) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: post_one(server, p), prompts))


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = pdkv_segments()
    yield
    leaked = segments_left(before)
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture(scope="module")
def reference(served_engine: Engine) -> Callable[[str], str]:
    """The greedy completion (MAX_TOKENS) of a prompt of PROMPTS by an undisturbed
    colocated engine in this process (helpers/reference.py), one batch."""
    texts = dict(zip(PROMPTS, greedy(served_engine, PROMPTS, MAX_TOKENS), strict=True))
    return texts.__getitem__


# Every mode over shared memory (pull over TCP: the injected-failure test below); every
# mode x transport pair is tests/test_disagg_engine.py's (two cores in one process), which
# costs less CI time.
@pytest.mark.parametrize(
    "mode,transport",
    [
        ("pull", "shm"),
        ("layer-push", "shm"),
        ("request-push", "shm"),
    ],
)
def test_disaggregated_outputs_equal_colocated(
    reference: Callable[[str], str], mode: str, transport: str
) -> None:
    server = Server(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--transfer-mode",
        mode,
        "--kv-transport",
        transport,
        "--kv-verify-checksum",
        "--chunk-size",
        "256",
        "--enable-debug-endpoints",
    )
    try:
        assert complete(server, PROMPTS) == [reference(p) for p in PROMPTS]
        _, reply = post_one(server, PROMPTS[0], 4)
        timings = reply["pdserve_timings"]
        assert {"transfer", "decode_queue"} <= set(timings)
        assert all(timings[k] >= 0 for k in ("queue", "prefill", "transfer", "decode_queue"))
        wait_clean(server)
        roles = sorted(r["role"] for r in cluster_rows(server))
        assert roles == ["decode", "prefill"]
    finally:
        stop(server)


# Per transfer call: pull fetches a request's KV in one call, request-push flushes it in
# one, layer-push in one per layer (30): about a quarter of the attempts fail each way.
FAULT_RATES = {"pull": "0.25", "layer-push": "0.01", "request-push": "0.25"}
# Pull runs over TCP here (with checksums): the server-level check of that transport.
FAULT_TRANSPORTS = {"pull": "tcp", "layer-push": "shm", "request-push": "shm"}


@pytest.mark.parametrize("mode", MODES)
def test_injected_transfer_failures_fail_cleanly_or_complete_correctly(
    reference: Callable[[str], str], mode: str
) -> None:
    server = Server(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--transfer-mode",
        mode,
        "--kv-fault-rate",
        FAULT_RATES[mode],
        "--kv-fault-seed",
        "3",
        "--kv-transport",
        FAULT_TRANSPORTS[mode],
        "--kv-verify-checksum",
        "--enable-debug-endpoints",
    )
    try:
        results = run_concurrently(server, PROMPTS)
        failed = 0
        for prompt, (status, body) in zip(PROMPTS, results, strict=True):
            if status == 200:
                assert body["choices"][0]["text"] == reference(prompt), prompt
                continue
            # A failed hand-off is retried once from the prompt; only a second failure
            # ends the request (max_retries = 1).
            assert status == 503, body
            message = body["error"]["message"]
            assert message.startswith("the request failed (after 1 retries): "), message
            assert "injected transfer failure" in message, message
            failed += 1
        controller = cluster(server)["controller"]
        assert controller["failed"] == failed
        # Every failed request was retried first, and some retried requests completed.
        assert failed < controller["retries"] <= len(PROMPTS), (controller, failed)
        wait_clean(server)
    finally:
        stop(server)


class Load:
    """`concurrency` clients sending PROMPTS round-robin, one request at a time each,
    until `stop()`, which returns every (prompt, status, body)."""

    def __init__(self, server: Server, concurrency: int) -> None:
        self.server = server
        self.results: list[tuple[str, int, dict]] = []
        self.errors: list[BaseException] = []
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(concurrency)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                prompt = PROMPTS[self._count % len(PROMPTS)]
                self._count += 1
            try:
                status, body = post_one(self.server, prompt)
            except Exception as e:  # reported by stop()
                self.errors.append(e)
                return
            with self._lock:
                self.results.append((prompt, status, body))

    def stop(self) -> list[tuple[str, int, dict]]:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "a client is stuck"
        assert not self.errors, self.errors
        return self.results


@pytest.fixture(scope="module", params=["layer-push", "request-push"])
def kill_cluster(request: pytest.FixtureRequest) -> Iterator[Server]:
    """Two instances of each role, shared by the kill tests of one push mode (pull mode,
    the default, is tests/test_fault_tolerance.py's, under 64 streams): each test kills
    one instance and leaves a live one of every role. Silence never marks an instance
    dead here (the tests stop victims for a while): process exit does. Routing is by load:
    routing by cache would keep sending the repeated prompts to a stopped decode victim
    that holds them (its load does not move while it is stopped, and a cached prefix earns
    it up to --decode-balance more), so what it held at the freeze would not be what it
    held at the kill, which the test counts exactly."""
    before = pdkv_segments()
    server = Server(
        "--prefill",
        "2",
        "--decode",
        "2",
        "--transfer-mode",
        request.param,
        "--instance-timeout",
        "600",
        "--routing",
        "least-load",
        "--enable-debug-endpoints",
    )
    yield server
    stop(server)
    leaked = segments_left(before)
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
def test_killing_an_instance_under_load_keeps_serving(
    kill_cluster: Server, reference: Callable[[str], str], victim: str
) -> None:
    server = kill_cluster
    assert row_of(server, victim)["alive"]
    start = cluster(server)["controller"]
    pid = row_of(server, victim)["pid"]
    killed = False
    load = Load(server, concurrency=8)
    try:
        held = freeze_holding(server, victim)
        os.kill(pid, signal.SIGKILL)
        killed = True
        # Noticed by the controller's watchdog (the process exited), asynchronously.
        reason = wait_dead(server, victim)
    finally:
        if not killed:  # a failed test leaves no stopped instance behind
            os.kill(pid, signal.SIGCONT)
        results = load.stop()
    assert reason == "process exited (exit code -9)"
    controller = cluster(server)["controller"]
    migrations = controller["migrations"] - start["migrations"]
    assert controller["failed"] == start["failed"]
    # Nothing is lost: what the victim held moved to live instances and completed with
    # the text of an undisturbed run (docs/fault-tolerance.md).
    for prompt, status, body in results:
        assert status == 200, body
        assert body["choices"][0]["text"] == reference(prompt), prompt
    if victim.startswith("prefill"):
        assert migrations >= 1, (held, controller)
    else:
        # Stopped, the victim finished nothing it held: each of those requests moved.
        assert migrations == holds(held), (held, controller)

    # New requests avoid the dead instance and complete.
    after = run_concurrently(server, PROMPTS[:4])
    assert [(s, b["choices"][0]["text"]) for s, b in after] == [
        (200, reference(p)) for p in PROMPTS[:4]
    ]
    assert not row_of(server, victim)["alive"]
    wait_clean(server)
