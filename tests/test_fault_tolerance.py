"""No stream lost when an instance dies: migration by recompute, and resume from KV
replicas, under real failures (docs/fault-tolerance.md).

A workload of N concurrent requests of MAX_TOKENS tokens - half streamed, half not; a
quarter seeded sampling at temperature 0.8, the rest greedy - runs while an instance is
SIGKILLed or SIGSTOPped. Every request must end normally with exactly the text, finish
reason and token counts of an undisturbed colocated run of the same workload in this
process (`reference`, helpers/reference.py); then the controller's counters are checked
and every live pool must be clean (nothing used, held, reserved, replicated) with no
shared-memory segment left behind.

Each test starts the cluster it kills instances of (so each runs alone, in any order):
- `--prefill 2 --decode 2` (migration by recompute): prefill-0 killed mid-prefill; or
  decode-0 killed and, once its requests run on decode-1, decode-1 stopped - the same
  requests move twice and only the prefill instances are left to run them whole.
- `--prefill 1 --decode 2 --kv-replication`: the replica bookkeeping while a source is
  stopped; then it is killed and, once its requests run on decode-1, decode-1 killed:
  the same requests move twice, resuming from replicas both times (the second time from
  decode-1's replicas on prefill-0).
The load is sized to reach every branch (queued and mid-prefill prompts on a victim,
streamed and whole replies, greedy and seeded, requests moved twice, clients leaving
while their requests move); the 64 x 96-token runs are bench/bench_recovery.py's.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable

import psutil
import pytest
from helpers.reference import Expected, run
from helpers.server import (
    Server,
    cluster,
    prometheus,
    row_of,
    wait_clean,
    wait_dead,
    wait_for,
)
from helpers.streams import Outcome, Streams
from test_disagg_server import mixed_prompts

from pdserve.engine.engine import Engine

N = 16
MAX_TOKENS = 64


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


@pytest.fixture(scope="module")
def reference(served_engine: Engine) -> list[Expected]:
    """The workload on an undisturbed colocated engine: greedy and seeded outputs do not
    depend on the deployment, so every cluster must give exactly these."""
    results = run(served_engine, bodies())
    assert all(r.finish_reason == "length" for r in results)
    assert all(r.completion_tokens == MAX_TOKENS for r in results)
    return results


def assert_identical(results: list[Outcome], reference: list[Expected]) -> None:
    """Every request ended normally with the reference's text, finish reason and token
    counts."""
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        assert (got.status, got.error) == (200, None), (i, got)
        assert got.text == want.text, (i, got.text, want.text)
        assert got.finish_reason == want.finish_reason, (i, got)
        assert got.usage is not None, (i, got)
        usage = (got.usage["prompt_tokens"], got.usage["completion_tokens"])
        assert usage == (want.prompt_tokens, want.completion_tokens), (i, got.usage)
        assert got.usage["total_tokens"] == sum(usage), (i, got.usage)


def test_a_killed_prefill_instance_loses_no_stream(
    start: Callable[..., Server], reference: list[Expected]
) -> None:
    """prefill-0 stopped, then the workload arrives over ~1.6 s: the prompts the controller
    routes to the victim (ties go to prefill-0) wait there, queued or mid-prefill, when
    it is killed; the others run on prefill-1. Silence is not death here
    (--instance-timeout 60): it dies of the kill."""
    server = start("--prefill", "2", "--decode", "2", "--instance-timeout", "60")
    pid = row_of(server, "prefill-0")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        streams = Streams(server.url, bodies(), stagger_s=0.05)
        wait_for(lambda: row_of(server, "prefill-0", 0.1)["assigned_prefill_tokens"] > 0)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert wait_dead(server, "prefill-0") == "process exited (exit code -9)"
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert after["migrations"] > 0
    assert after["failed"] == 0
    assert after["instance_failures"] == {"prefill": 1}
    wait_clean(server)


def test_decode_instances_killed_and_stopped_lose_no_stream(
    start: Callable[..., Server], reference: list[Expected]
) -> None:
    """decode-0 SIGKILLed once every stream has 8 tokens (stopped first, so the requests
    it holds are exactly those that move); then, once the moved requests decoded on
    decode-1, decode-1 SIGSTOPped: silent past --instance-timeout (8 s), it is marked
    dead and killed (a stopped process dies of SIGKILL) and reaped before its requests
    move, so the SIGCONT that follows finds no process. Requests move twice
    (--max-migrations 2); no decode instance left, the prefill instances run them whole.
    Clients that leave while their requests move are aborted wherever they went."""
    server = start("--prefill", "2", "--decode", "2", "--instance-timeout", "8")
    streams = Streams(server.url, bodies())
    leaving = Streams(server.url, [{**b, "max_tokens": 400, "stream": True} for b in bodies()[:8]])
    streams.wait_tokens(8)
    leaving.wait_tokens(8)
    pid = row_of(server, "decode-0")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:  # stopped, it ends nothing it holds (its counters not waited for)
        first = row_of(server, "decode-0", stats_timeout=0.1)
    finally:
        os.kill(pid, signal.SIGKILL)
    leaving.disconnect()
    assert first["alive"] and first["assigned_requests"] > 0, first
    assert wait_dead(server, "decode-0") == "process exited (exit code -9)"
    once = cluster(server)["controller"]
    # Every request the victim held moved once (at its death); none failed.
    assert once["migrations"] == first["assigned_requests"], (first, once)
    assert once["failed"] == 0, once
    # what they recomputed counts at each one's first output after the move
    wait_for(lambda: cluster(server)["controller"]["recomputed_tokens"] > 0)

    streams.wait_tokens(MAX_TOKENS // 2)
    second = row_of(server, "decode-1")
    assert second["assigned_requests"] > 0, second
    os.kill(second["pid"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    reason = wait_dead(server, "decode-1")
    assert reason is not None and reason.startswith("sent nothing for "), reason
    assert time.monotonic() - stopped_at >= 8.0
    with contextlib.suppress(psutil.NoSuchProcess):  # reaped by the controller already
        psutil.wait_procs([psutil.Process(second["pid"])], timeout=30)
    with pytest.raises(ProcessLookupError):
        os.kill(second["pid"], signal.SIGCONT)

    assert_identical(streams.results(), reference)
    assert all(o.finish_reason is None for o in leaving.results())
    after = cluster(server)["controller"]
    assert after["migrations"] > once["migrations"]
    assert after["failed"] == 0
    assert after["instance_failures"] == {"decode": 2}
    wait_clean(server, every_role=False)
    alive = [r["name"] for r in cluster(server)["instances"] if r["alive"]]
    assert alive == ["prefill-0", "prefill-1"]


def test_a_stopped_decode_instance_is_dead_at_the_default_timeout_and_nothing_else_is(
    start: Callable[..., Server], reference: list[Expected]
) -> None:
    """The default --instance-timeout (1 s) under the workload: decode-0 SIGSTOPped once
    every stream has 8 tokens is marked dead as a stopped process (the controller reads
    its state: a late heartbeat of a live instance is not a death), its requests move -
    their recompute spread over prefill-0 and decode-1 (pull mode) - and every text is
    the reference's. No other instance is taken for dead meanwhile, though the machine's
    two cores are shared by the front end, three instances and this client."""
    server = start("--prefill", "1", "--decode", "2")
    streams = Streams(server.url, bodies())
    streams.wait_tokens(8)
    victim = row_of(server, "decode-0")
    os.kill(victim["pid"], signal.SIGSTOP)
    reason = wait_dead(server, "decode-0")
    assert reason is not None
    assert re.fullmatch(r"sent nothing for \d+\.\d s: its process is stopped", reason), reason
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert after["instance_failures"] == {"decode": 1}, after
    assert after["failed"] == 0 and after["migrations"] > 0, after
    # the moved requests' recompute went to both: some handed off by prefill-0
    assert 0 < after["recomputed_on_prefill"] < after["migrations"], after
    assert after["recomputed_tokens"] > 0
    wait_clean(server)


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
    start: Callable[..., Server], reference: list[Expected]
) -> None:
    """decode-0 is stopped while its holder decode-1 runs on: the front end's
    replicated-through figures for decode-1 then equal decode-1's own records. decode-0
    is killed (stopped, with --instance-timeout 600 only the kill ends it): its requests
    resume on decode-1 from their replicas; the ring rearranged, decode-1 replicates to
    prefill-0; once the moved requests decoded there decode-1 is killed too, and the same
    requests move a second time (--max-migrations 2), resuming on prefill-0 from decode-1's
    replicas. Every text equals the undisturbed run; afterwards no replica is left.
    Silence is not death here (the test stops a source for a while)."""
    server = start(
        "--prefill", "1", "--decode", "2", "--kv-replication", "--instance-timeout", "600"
    )
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

    streams.wait_tokens(MAX_TOKENS // 2)  # the moved requests decoded (and replicated) there
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
