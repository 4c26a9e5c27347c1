"""`pdserve serve --prefill N --decode M`: real instance processes, real KV transfers
(shared memory and TCP), the API unchanged; injected transfer faults and killed
instances under load."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_server import Server

MODEL = "SmolLM2-135M-Instruct.Q4_1"
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


def complete(server: Server, prompts: list[str], max_tokens: int = 8) -> list[str]:
    body = {"model": MODEL, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0}
    status, reply = server.post("/v1/completions", json.dumps(body).encode(), key=None)
    assert status == 200, reply
    phases = set(reply["pdserve_timings"])
    assert phases == {"queue", "prefill", "decode", "ttft", "e2e"} or phases == {
        "queue",
        "prefill",
        "transfer",
        "decode_queue",
        "decode",
        "ttft",
        "e2e",
    }
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices]


def cluster_rows(server: Server) -> list[dict]:
    status, reply = server.get("/debug/cluster")
    assert status == 200, reply
    return reply["instances"]


def assert_pools_clean(server: Server) -> None:
    """Every live instance: integrity OK, nothing held, running, queued or in flight."""
    for row in cluster_rows(server):
        if not row["alive"]:
            continue
        stats = row["stats"]
        assert stats["integrity_error"] is None, row
        for field in (
            "num_running",
            "num_waiting",
            "num_swapped",
            "num_used_blocks",
            "num_held",
            "num_transferring",
            "num_reserved",
        ):
            assert stats[field] == 0, (row["name"], field, stats)


def wait_dead(server: Server, name: str, timeout: float) -> str | None:
    """The dead reason of instance `name` once the controller marks it dead; None if it
    is still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = next(r for r in cluster_rows(server) if r["name"] == name)
        if not row["alive"]:
            return str(row["dead_reason"])
        time.sleep(0.1)
    return None


def wait_clean(server: Server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_pools_clean(server)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def reference() -> list[str]:
    server = Server("--enable-debug-endpoints")
    try:
        return complete(server, PROMPTS)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "mode,transport",
    [
        ("pull", "shm"),
        ("pull", "tcp"),
        ("layer-push", "shm"),
        ("layer-push", "tcp"),
        ("request-push", "shm"),
        ("request-push", "tcp"),
    ],
)
def test_disaggregated_outputs_equal_colocated(
    reference: list[str], mode: str, transport: str
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
        assert complete(server, PROMPTS) == reference
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        _, reply = server.post("/v1/completions", json.dumps(body).encode(), key=None)
        timings = reply["pdserve_timings"]
        assert {"transfer", "decode_queue"} <= set(timings)
        assert all(timings[k] >= 0 for k in ("queue", "prefill", "transfer", "decode_queue"))
        wait_clean(server)
        roles = sorted(r["role"] for r in cluster_rows(server))
        assert roles == ["decode", "prefill"]
    finally:
        server.stop()


def run_concurrently(server: Server, prompts: list[str], max_tokens: int) -> list[tuple[int, dict]]:
    def one(prompt: str) -> tuple[int, dict]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return server.post("/v1/completions", json.dumps(body).encode(), key=None)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_injected_transfer_failures_fail_cleanly_or_complete_correctly() -> None:
    prompts = mixed_prompts(64)
    server = Server("--enable-debug-endpoints")
    try:
        want = {p: t for p, t in zip(prompts, complete(server, prompts, 6), strict=True)}
    finally:
        server.stop()
    server = Server(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-fault-rate",
        "0.05",
        "--kv-fault-seed",
        "3",
        "--enable-debug-endpoints",
    )
    try:
        results = run_concurrently(server, prompts, 6)
        ok = 0
        for prompt, (status, body) in zip(prompts, results, strict=True):
            if status == 200:
                assert body["choices"][0]["text"] == want[prompt]
                ok += 1
            else:
                assert status == 503, body
                assert "injected transfer failure" in body["error"]["message"]
        status, reply = server.get("/debug/cluster")
        controller = reply["controller"]
        assert controller["retries"] >= 1
        assert controller["failed"] == len(prompts) - ok
        wait_clean(server)
    finally:
        server.stop()


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_killing_an_instance_under_load_keeps_serving(victim: str) -> None:
    counts = ("2", "1") if victim == "prefill" else ("1", "2")
    server = Server(
        "--prefill",
        counts[0],
        "--decode",
        counts[1],
        "--instance-timeout",
        "5",
        "--enable-debug-endpoints",
    )
    try:
        prompts = mixed_prompts(24)
        with ThreadPoolExecutor(1) as pool:
            load = pool.submit(run_concurrently, server, prompts, 24)
            time.sleep(1.5)
            pid = next(r["pid"] for r in cluster_rows(server) if r["name"] == f"{victim}-0")
            os.kill(pid, signal.SIGKILL)
            results = load.result(timeout=120)
        for status, body in results:
            assert status in (200, 503), body
            if status == 503:
                assert f"instance {victim}-0 failed" in body["error"]["message"]
        # Death is noticed by the controller's watchdog (process exit, or silence for
        # --instance-timeout): asynchronously, so wait for it.
        assert wait_dead(server, f"{victim}-0", timeout=10) is not None
        # New requests avoid the dead instance and complete.
        after = run_concurrently(server, prompts[:8], 4)
        assert [s for s, _ in after] == [200] * 8
        wait_clean(server)
    finally:
        server.stop()


def test_an_instance_that_stops_reporting_is_marked_dead_and_avoided() -> None:
    server = Server(
        "--prefill", "1", "--decode", "2", "--instance-timeout", "2", "--enable-debug-endpoints"
    )
    try:
        pid = next(r["pid"] for r in cluster_rows(server) if r["name"] == "decode-0")
        os.kill(pid, signal.SIGSTOP)  # alive but silent: no outputs, no load reports
        reason = wait_dead(server, "decode-0", timeout=15)
        assert reason is not None and reason.startswith("sent nothing for ")
        results = run_concurrently(server, mixed_prompts(6), 4)
        assert [s for s, _ in results] == [200] * 6
        wait_clean(server)
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("pdkv-")}
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
