"""Scaling by hand, on real clusters on this machine (cluster/scaling.py, docs/elastic.md):
`POST /admin/instances` and `DELETE /admin/instances/{name}` (on a Ray cluster:
tests/test_ray.py).

Under load (`--prefill 1 --decode 2`, the fault-tolerance workload: 16 requests of 64
tokens, half streamed, a quarter seeded at temperature 0.8), decode-1 leaves while every
stream is mid-way: its requests move to decode-0 with their KV, none is aborted, every
text equals an undisturbed colocated run's, its process is gone, and a decode instance
added in its room serves 16 of the requests again with the same texts; the pools are
clean. Each refusal's status and exact body, nothing changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from helpers.reference import run
from helpers.server import (
    KEY,
    Server,
    auth,
    cluster,
    prometheus,
    row_of,
    wait_clean,
    wait_for,
)
from helpers.streams import Streams
from test_fault_tolerance import assert_identical, bodies
from test_flip import error, roles

from pdserve.cluster.instance import LocalLauncher
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine


def add(server: Server, role: object, key: str | None = KEY) -> tuple[int, dict]:
    return server.post("/admin/instances", json.dumps({"role": role}).encode(), key=key)


def remove(server: Server, name: str, key: str | None = KEY) -> tuple[int, dict]:
    return server.request("DELETE", f"/admin/instances/{name}", headers=auth(key))


def leave_under_load(server: Server, name: str, load: list[dict]) -> tuple[Streams, dict, int]:
    """Decode instance `name` removed once every stream of `load` has 8 tokens and every
    request is on a decode instance (no prefill instance runs, queues or holds one: what
    `name` holds then changes only by the removal): (the streams, the removal's report,
    the instance's pid). Every request it held moved."""
    streams = Streams(server.url, load)
    streams.wait_tokens(8)

    def on_decode_instances() -> bool:
        prefill = [r for r in cluster(server)["instances"] if r["role"] == "prefill"]
        held = ("num_running", "num_waiting", "num_held")
        return all(r["stats"][f] == 0 for r in prefill if r["alive"] for f in held)

    wait_for(on_decode_instances)
    row = row_of(server, name)
    held, pid = row["assigned_requests"], row["pid"]
    assert held > 0
    status, report = remove(server, name)
    assert status == 200, report
    assert (report["action"], report["instance"], report["role"]) == ("remove", name, "decode")
    assert report["moved"] == held, (report, held)
    assert 0 <= report["drain_s"] <= report["seconds"]
    return streams, report, pid


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == b"Z"


def test_a_decode_instance_leaves_under_load_and_nothing_is_lost(
    start: Callable[..., Server], served_engine: Engine
) -> None:
    # --kv-wait 30: a move's copy is waited for even when a loaded machine answers slowly.
    server = start("--prefill", "1", "--decode", "2", "--kv-wait", "30")
    before = roles(server)
    assert remove(server, "decode-7") == (
        404,
        error(404, "no instance named 'decode-7' (the instances: prefill-0, decode-0, decode-1)"),
    )
    assert remove(server, "prefill-0") == (
        409,
        error(409, "prefill-0 is the last live prefill instance: the cluster needs one"),
    )
    assert add(server, "bogus") == (
        400,
        error(400, "role: Input should be 'colocated', 'prefill' or 'decode'", "role"),
    )
    # Room on this machine: its cores (or the threads the instances started with, if
    # more) less the running instances' threads (each the start's even share). On a
    # 2-core machine (CI's) the three instances hold all 3: refused.
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 3)
    budget = max(cores, 3 * share)
    if 4 * share > budget:
        assert add(server, "decode") == (
            409,
            error(
                409,
                f"no room for another decode instance: an instance of {share} threads does "
                f"not fit: the running instances run {3 * share} of the {budget} threads "
                f"this machine's {cores} cores (or the instances started, if more) allow",
            ),
        )
        fresh = "decode-2"
    else:  # a machine with cores to spare: the instance starts, and leaves
        status, report = add(server, "decode")
        assert (status, report["instance"], report["role"]) == (200, "decode-2", "decode")
        assert remove(server, "decode-2")[0] == 200
        fresh = "decode-3"  # a name is never given twice
    assert roles(server) == before

    reference = run(served_engine, bodies())
    streams, report, pid = leave_under_load(server, "decode-1", bodies())
    assert roles(server) == {"prefill-0": "prefill", "decode-0": "decode"}
    assert_identical(streams.results(), reference)
    wait_for(lambda: gone(pid))
    moved = cluster(server)["controller"]
    assert (moved["migrations"], moved["retries"], moved["failed"]) == (0, 0, 0), moved
    assert moved["caching"]["kv_moves_failed"] == 0, moved["caching"]
    assert remove(server, "decode-0") == (
        409,
        error(409, "decode-0 is the last live decode instance: the cluster needs one"),
    )
    # the room decode-1 left takes a new decode instance, which serves
    status, report = add(server, "decode")
    assert status == 200, report
    assert (report["action"], report["instance"], report["role"]) == ("add", fresh, "decode")
    assert roles(server) == {"prefill-0": "prefill", "decode-0": "decode", fresh: "decode"}
    assert_identical(Streams(server.url, bodies()[:16]).results(), reference[:16])
    assert row_of(server, fresh)["stats"]["num_steps"] > 0
    wait_clean(server)
    elastic = cluster(server)["controller"]["elastic"]
    scaled = [(r["action"], r["instance"]) for r in elastic["scaling"]]
    assert scaled[-2:] == [("remove", "decode-1"), ("add", fresh)], scaled
    metrics = prometheus(server)
    assert metrics['pdserve_instances_scaled_total{action="remove"}'] == len(scaled) // 2
    assert metrics['pdserve_instances_scaled_total{action="add"}'] == len(scaled) // 2
    assert 'pdserve_instance_role{instance="decode-1",role="decode"}' not in metrics
    assert metrics[f'pdserve_instance_role{{instance="{fresh}",role="decode"}}'] == 1


def test_a_server_of_one_engine_does_not_scale(keyed_server: Server) -> None:
    why = (
        "a server of one engine does not scale (nothing serves while its instance changes): "
        "start two instances or more (--colocated K, --prefill/--decode)"
    )
    assert add(keyed_server, "colocated", key=None)[0] == 401  # the API key is required
    assert remove(keyed_server, "engine", key=None)[0] == 401
    assert add(keyed_server, "colocated") == (409, error(409, why))
    assert remove(keyed_server, "engine") == (409, error(409, why))
    status, reply = keyed_server.get("/cluster/status", key=KEY)
    assert status == 200 and [r["name"] for r in reply["instances"]] == ["engine"], reply


def test_the_local_launcher_counts_the_cores_the_instances_hold() -> None:
    cores = len(os.sched_getaffinity(0))
    one = EngineConfig(num_threads=1)
    held = [EngineConfig(num_threads=cores - 1)] if cores > 1 else []
    assert LocalLauncher().room(one, held) is None
    assert LocalLauncher().room(one, [EngineConfig(num_threads=cores)]) == (
        f"an instance of 1 threads does not fit: the running instances run {cores} of the "
        f"{cores} threads this machine's {cores} cores (or the instances started, if more) allow"
    )
    # instances that started with more threads than cores: that many
    started = LocalLauncher(threads=cores + 2)
    assert started.room(one, [EngineConfig(num_threads=cores + 1)]) is None
    assert started.room(one, [EngineConfig(num_threads=cores + 2)]) is not None


def test_instance_bounds_that_cannot_hold_are_usage_errors() -> None:
    """Exit 2 with the reason before any instance starts."""
    cases = {
        ("--prefill", "1", "--decode", "2", "--max-instances", "2"): (
            "instance bounds must hold 1 <= min (3) <= the instances started (3) <= max (2)"
        ),
        ("--prefill", "1", "--decode", "1", "--min-instances", "0"): (
            "instance bounds must hold 1 <= min (0) <= the instances started (2) <= max (2)"
        ),
        ("--max-instances", "3",): (
            "a server of one engine does not scale: start two instances or more "
            "(--colocated K, --prefill/--decode) to use --max-instances"
        ),
    }  # fmt: skip
    for args, why in cases.items():
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (proc.returncode, proc.stderr) == (2, f"pdserve: error: {why}\n"), args
