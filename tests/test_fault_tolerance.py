"""No stream lost when an instance dies: migration by recompute, and resume from KV
replicas, under real failures (docs/fault-tolerance.md).

A workload of 64 concurrent requests of 96 tokens - half streamed, half not; a quarter
seeded sampling at temperature 0.8, the rest greedy - runs once undisturbed (the
reference), then again while an instance is SIGKILLed or SIGSTOPped. Every request must
end normally with exactly the reference text, finish reason and usage; then the
controller's counters are checked and every live pool must be clean (nothing used, held,
reserved, replicated) with no shared-memory segment left behind.

Two clusters of real processes, each shared by the tests of its part, which run in
order and each kill one more instance (so each asserts its victim is alive first):
- `--prefill 2 --decode 2` (migration by recompute): prefill-0 killed mid-prefill; then
  decode-0 killed and, once its requests run on decode-1, decode-1 stopped - the same
  requests move twice and only prefill-1 is left to run them whole.
- `--prefill 1 --decode 2 --kv-replication`: the replica bookkeeping while a source is
  stopped; then it is killed and, once its requests run on decode-1, decode-1 killed:
  the same requests move twice, resuming from replicas both times (the second time from
  decode-1's replicas on prefill-0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from helpers.streams import Outcome, Streams
from test_disagg_server import (
    cluster,
    mixed_prompts,
    pdkv_segments,
    row_of,
    stop,
    wait_clean,
    wait_dead,
)
from test_server import Server

N = 64
MAX_TOKENS = 96


def bodies() -> list[dict]:
    out = []
    for i, prompt in enumerate(mixed_prompts(N)):
        body: dict = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": i % 2 == 0,
            "temperature": 0,
        }
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        out.append(body)
    return out


def start_cluster(*args: str) -> Iterator[Server]:
    before = pdkv_segments()
    server = Server(*args, "--kv-cache-memory-gib", "0.5", "--enable-debug-endpoints")
    yield server
    stop(server)
    leaked = pdkv_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture(scope="module")
def ft_cluster() -> Iterator[Server]:
    yield from start_cluster("--prefill", "2", "--decode", "2", "--instance-timeout", "4")


@pytest.fixture(scope="module")
def rep_cluster(reference: list[Outcome]) -> Iterator[Server]:
    """Silence is not death here (the test stops a source for a while)."""
    yield from start_cluster(
        "--prefill", "1", "--decode", "2", "--kv-replication", "--instance-timeout", "600"
    )


@pytest.fixture(scope="module")
def reference(ft_cluster: Server) -> list[Outcome]:
    """The workload on the whole, undisturbed first cluster (both clusters must give
    exactly these texts: greedy and seeded outputs do not depend on the deployment)."""
    results = Streams(ft_cluster.url, bodies()).results()
    for out in results:
        assert out.status == 200 and out.error is None, out
        assert out.finish_reason == "length" and out.usage["completion_tokens"] == MAX_TOKENS
    wait_clean(ft_cluster)
    return results


def assert_identical(results: list[Outcome], reference: list[Outcome]) -> None:
    """Every request ended normally with the reference's text, finish reason and token
    counts (not `cached_tokens`: the reference run filled the caches the later runs hit)."""
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        assert (got.status, got.error) == (200, None), (i, got)
        assert got.text == want.text, (i, got.text, want.text)
        assert (got.finish_reason, counts(got.usage)) == (want.finish_reason, counts(want.usage)), i


def counts(usage: dict | None) -> dict | None:
    return (
        None if usage is None else {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    )


def test_a_killed_prefill_instance_loses_no_stream(
    ft_cluster: Server, reference: list[Outcome]
) -> None:
    server = ft_cluster
    before = cluster(server)["controller"]
    # Arrivals spread over ~6 s. The victim is stopped for a second first, so the prompts
    # the controller routes to it meanwhile (ties go to prefill-0) are queued or
    # mid-prefill there when it dies; the others run on prefill-1.
    streams = Streams(server.url, bodies(), stagger_s=0.1)
    streams.wait_first(1)
    pid = row_of(server, "prefill-0")["pid"]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(1.0)  # arrivals reach the stopped victim (not a synchronisation)
    os.kill(pid, signal.SIGKILL)
    assert wait_dead(server, "prefill-0") == "process exited (exit code -9)"
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert after["migrations"] > before["migrations"]
    assert after["failed"] == before["failed"]
    assert after["instance_failures"] == {"prefill": 1}
    wait_clean(server)


def test_decode_instances_killed_and_stopped_lose_no_stream(
    ft_cluster: Server, reference: list[Outcome]
) -> None:
    """decode-0 SIGKILLed once every stream has 8 tokens; then, once the moved requests
    decoded on decode-1, decode-1 SIGSTOPped: silent past --instance-timeout (4 s), it is
    marked dead and killed (a stopped process dies of SIGKILL) and reaped before its
    requests move, so the SIGCONT that follows finds no process. Requests move twice
    (--max-migrations 2); the last decode instance gone, prefill-1 runs them whole.
    Clients that leave while their requests move are aborted wherever they went."""
    server = ft_cluster
    before = cluster(server)["controller"]
    streams = Streams(server.url, bodies())
    leaving = Streams(server.url, [{**b, "max_tokens": 400, "stream": True} for b in bodies()[:8]])
    streams.wait_tokens(8)
    leaving.wait_tokens(8)
    first = row_of(server, "decode-0")
    assert first["alive"] and first["assigned_requests"] > 0, first
    os.kill(first["pid"], signal.SIGKILL)
    leaving.disconnect()
    assert wait_dead(server, "decode-0") == "process exited (exit code -9)"
    once = cluster(server)["controller"]
    moved = once["migrations"] - before["migrations"]
    # What the victim held moved once (some may have finished before the controller saw
    # the death); none failed.
    assert 0 < moved <= first["assigned_requests"], (first, once)
    assert once["recomputed_tokens"] > before["recomputed_tokens"]

    streams.wait_tokens(40)
    second = row_of(server, "decode-1")
    assert second["assigned_requests"] > 0, second
    os.kill(second["pid"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    reason = wait_dead(server, "decode-1")
    assert reason is not None and reason.startswith("sent nothing for "), reason
    assert time.monotonic() - stopped_at >= 4.0
    with contextlib.suppress(psutil.NoSuchProcess):  # reaped by the controller already
        psutil.wait_procs([psutil.Process(second["pid"])], timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(second["pid"], signal.SIGCONT)

    assert_identical(streams.results(), reference)
    assert all(o.finish_reason is None for o in leaving.results())
    after = cluster(server)["controller"]
    assert after["migrations"] > once["migrations"]
    assert after["failed"] == before["failed"]
    assert after["instance_failures"] == {"decode": 2, "prefill": 1}
    wait_clean(server, every_role=False)
    assert [r["name"] for r in cluster(server)["instances"] if r["alive"]] == ["prefill-1"]


# ---- KV replication ---------------------------------------------------------------------


def replica_rows(server: Server) -> dict[str, dict]:
    return {r["name"]: r for r in cluster(server)["instances"]}


def assert_no_replicas(server: Server) -> None:
    for row in cluster(server)["instances"]:
        if row["alive"]:
            stats = row["stats"]
            assert row["replicated_tokens"] == 0, row
            for field in ("num_replicas", "num_replica_blocks", "num_replicating"):
                assert stats[field] == 0, (row["name"], field, stats)


def test_replicas_bookkept_and_two_failures_in_a_row_resume_from_them(
    rep_cluster: Server, reference: list[Outcome]
) -> None:
    """decode-0 is stopped while its holder decode-1 runs on: the front end's
    replicated-through figures for decode-1 then equal decode-1's own records. decode-0
    is killed (stopped, with --instance-timeout 600 only the kill ends it): its requests
    resume on decode-1 from their replicas; the ring rearranged, decode-1 replicates to
    prefill-0; once the moved requests decoded there decode-1 is killed too, and the same
    requests move a second time (--max-migrations 2), resuming on prefill-0 from decode-1's
    replicas. Every text equals the undisturbed run; afterwards no replica is left."""
    server = rep_cluster
    rows = replica_rows(server)
    assert rows["decode-0"]["replicating_to"] == "decode-1"
    assert rows["decode-1"]["replicating_to"] == "decode-0"
    streams = Streams(server.url, bodies())
    streams.wait_tokens(8)
    first = row_of(server, "decode-0")
    assert first["alive"] and first["assigned_requests"] > 0, first
    os.kill(first["pid"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while True:
            holder = replica_rows(server)["decode-1"]
            held = holder["stats"]["num_replicated_tokens"]
            if held > 0 and holder["replicated_tokens"] == held:
                break
            assert time.monotonic() < deadline, holder
            time.sleep(0.1)
        assert holder["stats"]["num_replicas"] > 0
    finally:
        os.kill(first["pid"], signal.SIGKILL)
    assert wait_dead(server, "decode-0") == "process exited (exit code -9)"
    assert replica_rows(server)["decode-1"]["replicating_to"] == "prefill-0"
    moved_once = cluster(server)["controller"]
    assert moved_once["migrations"] > 0
    assert moved_once["resumed_from_replica"] == moved_once["migrations"]

    streams.wait_tokens(40)  # the moved requests decoded (and replicated) on decode-1
    second = row_of(server, "decode-1")
    assert second["assigned_requests"] > 0, second
    os.kill(second["pid"], signal.SIGKILL)
    assert wait_dead(server, "decode-1") == "process exited (exit code -9)"
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert after["migrations"] > moved_once["migrations"]
    assert after["resumed_from_replica"] == after["migrations"]
    assert after["failed"] == 0
    # Only the tokens after the last replicated one are recomputed: a few per move.
    assert after["recomputed_tokens"] < 8 * after["migrations"], after
    assert after["instance_failures"] == {"decode": 2}
    wait_clean(server, every_role=False)
    assert_no_replicas(server)
    metrics = prometheus(server)
    assert metrics["pdserve_migrations_total"] == after["migrations"]
    assert metrics["pdserve_resumed_from_replica_total"] == after["resumed_from_replica"]
    assert metrics["pdserve_recomputed_tokens_total"] == after["recomputed_tokens"]
    assert metrics['pdserve_instance_failures_total{role="decode"}'] == 2


def prometheus(server: Server) -> dict[str, float]:
    """The samples of GET /metrics by name (with labels)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
