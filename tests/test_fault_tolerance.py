"""No stream lost when an instance dies: migration by recompute under real failures.

One cluster (`--prefill 2 --decode 3`, real processes, shared-memory KV) serves a
workload of 64 concurrent requests of 96 tokens - half streamed, half not; a quarter
seeded sampling at temperature 0.8, the rest greedy - once undisturbed (the reference),
then again while one instance is SIGKILLed or SIGSTOPped. Every request must end
normally with exactly the reference text, finish reason and usage; then the controller's
counters are checked and every live pool must be clean (nothing used, held, reserved)
with no shared-memory segment left behind. The tests run in order on the shared cluster,
each killing one more instance (decode-0, prefill-0, decode-1 stopped), so each asserts
its victim is alive when it starts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def ft_cluster() -> Iterator[Server]:
    before = pdkv_segments()
    server = Server(
        "--prefill",
        "2",
        "--decode",
        "3",
        "--instance-timeout",
        "4",
        "--enable-debug-endpoints",
    )
    yield server
    stop(server)
    leaked = pdkv_segments() - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


@pytest.fixture(scope="module")
def reference(ft_cluster: Server) -> list[Outcome]:
    """The workload on the whole, undisturbed cluster."""
    results = Streams(ft_cluster.url, bodies()).results()
    for out in results:
        assert out.status == 200 and out.error is None, out
        assert out.finish_reason == "length" and out.usage["completion_tokens"] == MAX_TOKENS
    wait_clean(ft_cluster)
    return results


def assert_identical(results: list[Outcome], reference: list[Outcome]) -> None:
    """Every request ended normally with the reference's text, finish reason and usage."""
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        assert (got.status, got.error) == (200, None), (i, got)
        assert got.text == want.text, (i, got.text, want.text)
        assert (got.finish_reason, got.usage) == (want.finish_reason, want.usage), i


def test_a_killed_decode_instance_loses_no_stream(
    ft_cluster: Server, reference: list[Outcome]
) -> None:
    server = ft_cluster
    before = cluster(server)["controller"]
    streams = Streams(server.url, bodies())
    streams.wait_tokens(8)
    victim = row_of(server, "decode-0")
    assert victim["alive"] and victim["assigned_requests"] > 0, victim
    os.kill(victim["pid"], signal.SIGKILL)
    assert wait_dead(server, "decode-0") == "process exited (exit code -9)"
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    moved = after["migrations"] - before["migrations"]
    # Every request the victim held moved once (some may have finished before the
    # controller noticed the death, none more than once); none failed.
    assert 0 < moved <= victim["assigned_requests"], (victim, after)
    assert after["failed"] == before["failed"]
    assert after["recomputed_tokens"] > before["recomputed_tokens"]
    assert after["instance_failures"] == {"decode": 1}
    wait_clean(server)


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
    assert after["instance_failures"] == {"decode": 1, "prefill": 1}
    wait_clean(server)


def test_a_stopped_decode_instance_is_fenced_and_its_streams_resume(
    ft_cluster: Server, reference: list[Outcome]
) -> None:
    """SIGSTOP: silent past --instance-timeout (4 s), it is marked dead and killed (a
    stopped process dies of SIGKILL), its requests resume elsewhere; the SIGCONT that
    follows finds nothing to wake and changes no output."""
    server = ft_cluster
    before = cluster(server)["controller"]
    streams = Streams(server.url, bodies())
    streams.wait_tokens(8)
    victim = row_of(server, "decode-1")
    assert victim["alive"] and victim["assigned_requests"] > 0, victim
    os.kill(victim["pid"], signal.SIGSTOP)
    stopped_at = time.monotonic()
    reason = wait_dead(server, "decode-1")
    assert reason is not None and reason.startswith("sent nothing for "), reason
    assert time.monotonic() - stopped_at >= 4.0
    with pytest.raises(ProcessLookupError):  # fenced: the process is gone
        os.kill(victim["pid"], signal.SIGCONT)
    assert_identical(streams.results(), reference)
    after = cluster(server)["controller"]
    assert after["migrations"] > before["migrations"]
    assert after["failed"] == before["failed"]
    assert after["instance_failures"] == {"decode": 2, "prefill": 1}
    wait_clean(server)
