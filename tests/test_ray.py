"""Instances placed and supervised by Ray across nodes (`serve --ray`, docs/deploy.md).

A real Ray cluster on this machine (Ray's own `cluster_utils.Cluster`: a head node with 3
logical CPUs and a worker node with 2, each with its own raylet: room for two servers'
instances at once and a restarted one) serves the shipped model with the prefill
instance on the head and the decode instance on the worker. Its greedy outputs must be
exactly those of an undisturbed colocated engine (helpers/reference.py) and its KV must
have crossed between the nodes over TCP (the auto transport's route counters); a
placement written by `pdserve plan` from this machine's profile starts as written; and
killing a worker node's raylet under 16 concurrent streams loses none of them. Scaling
(cluster/scaling.py): an instance added while serving is placed by Ray and serves, one
removed under 16 streams loses none of them, and the distserve policy adds and removes
instances as the observed workload needs. A TP 2 instance holds one STRICT_PACK placement
group of a bundle per rank, its worker rank a Ray actor; that rank SIGKILLed under 16
streams is one instance failure, every stream ends with the reference text, and no rank
actor or placement group is left. The tests share the cluster and each leaves
it as it found it: the node-kill test adds a node of its own and kills that one, so
every test runs alone and in any order.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from helpers.elastic import Paced, elastic, roles
from helpers.reference import Expected, greedy, run
from helpers.server import Server, row_of, stop, wait_clean, wait_dead, wait_for
from helpers.streams import Streams
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table
from test_disagg_server import PROMPTS, complete, mixed_prompts
from test_replan_policy import PROFILE, TPOT, TTFT
from test_scaling import add, gone, leave_under_load

from pdserve.engine.engine import Engine

STREAMS = 16
STREAM_TOKENS = 64
_OBJECT_STORE = 80 << 20  # per node: Ray's minimum is 75 MiB; pdserve moves nothing through it


def stream_bodies() -> list[dict]:
    return [
        {
            "prompt": p,
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        for p in mixed_prompts(STREAMS + 7)[7:]
    ]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Cluster, str, str]]:
    """(cluster, head node id, worker node id). Node death is noticed by Ray within ~3 s
    (health checks every 1 s, 3 misses)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 3,
            "object_store_memory": _OBJECT_STORE,
            "include_dashboard": False,
            "_system_config": {
                "health_check_initial_delay_ms": 0,
                "health_check_period_ms": 1000,
                "health_check_failure_threshold": 3,
            },
        },
    )
    worker = cluster.add_node(num_cpus=2, object_store_memory=_OBJECT_STORE)
    cluster.wait_for_nodes()
    yield cluster, cluster.head_node.node_id, worker.node_id
    cluster.shutdown()


def ray_server(cluster: Cluster, *args: str) -> Server:
    return Server(
        "--ray",
        "--ray-address",
        cluster.address,
        "--kv-cache-memory-gib",
        "0.25",
        "--enable-debug-endpoints",
        *args,
    )


def write_placement(path: Path, *instances: tuple[str, int], devices: int = 1) -> Path:
    doc = {"instances": [{"role": r, "node": n, "devices": devices} for r, n in instances]}
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def reference(served_engine: Engine) -> tuple[list[str], list[Expected]]:
    """An undisturbed colocated engine's answers: the batch of PROMPTS (16 tokens), and
    the 16 streams."""
    streams = run(served_engine, stream_bodies())
    assert all(out.finish_reason == "length" for out in streams)
    return greedy(served_engine, PROMPTS, 16), streams


@pytest.fixture(scope="module")
def pd_server(
    ray_cluster: tuple[Cluster, str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Prefill on the head node (0), decode on the worker node (1); dead instances are
    started again (--ray-restart)."""
    cluster, _, _ = ray_cluster
    path = write_placement(tmp_path_factory.mktemp("ray") / "p.json", ("prefill", 0), ("decode", 1))
    server = ray_server(
        cluster, "--placement", str(path), "--instance-timeout", "5", "--ray-restart"
    )
    yield server
    stop(server)


def status(server: Server) -> dict:
    code, reply = server.get("/cluster/status")
    assert code == 200, reply
    return reply


def routes(server: Server) -> dict[str, tuple[int, int]]:
    """Per live instance: (KV transfers it sent through shm, over tcp)."""
    code, reply = server.get("/debug/cluster?stats_timeout=10")
    assert code == 200, reply
    return {
        r["name"]: (r["stats"]["kv_routes_shm"], r["stats"]["kv_routes_tcp"])
        for r in reply["instances"]
        if r["alive"]
    }


def test_prefill_and_decode_on_two_nodes_equal_the_single_host_server(
    reference: tuple[list[str], list[Expected]],
    ray_cluster: tuple[Cluster, str, str],
    pd_server: Server,
) -> None:
    _, head, worker = ray_cluster
    view = status(pd_server)
    assert view["launcher"] == "ray"
    placed = {i["name"]: (i["role"], i["node"], i["alive"]) for i in view["instances"]}
    assert placed == {"prefill-0": ("prefill", head, True), "decode-0": ("decode", worker, True)}
    # (a node another test added and killed may be listed, dead)
    nodes = {n["node"]: n["instances"] for n in view["nodes"] if n["alive"]}
    assert nodes == {head: ["prefill-0"], worker: ["decode-0"]}

    before = routes(pd_server)
    assert complete(pd_server, PROMPTS, 16) == reference[0]
    # Each prompt's KV was pulled by the decode instance from the other node, over TCP;
    # nothing went through shared memory (no two instances share a node).
    moved = routes(pd_server)
    pulled = tuple(a - b for a, b in zip(moved["decode-0"], before["decode-0"], strict=True))
    assert pulled == (0, len(PROMPTS)), (before, moved)
    assert moved["prefill-0"][0] == 0, moved
    wait_clean(pd_server)


def test_cluster_status_command_prints_nodes_and_instances(
    ray_cluster: tuple[Cluster, str, str], pd_server: Server
) -> None:
    _, head, worker = ray_cluster
    cmd = [sys.executable, "-m", "pdserve.cli", "cluster", "status", "--url", pd_server.url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "launcher: ray"
    rows = {
        line.split()[0]: line.split() for line in lines if line.startswith(("prefill", "decode"))
    }
    assert rows["prefill-0"][1:4] == ["prefill", head[:12], "alive"]
    assert rows["decode-0"][1:4] == ["decode", worker[:12], "alive"]
    assert any(line.startswith(head[:12]) and line.rstrip().endswith("prefill-0") for line in lines)
    js = json.loads(subprocess.run([*cmd, "--json"], capture_output=True, timeout=60).stdout)
    assert [(i["name"], i["node"]) for i in js["instances"]] == [
        ("prefill-0", head),
        ("decode-0", worker),
    ]
    gone = subprocess.run(
        [*cmd[:-1], "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60
    )
    assert gone.returncode == 1
    assert gone.stderr.startswith("pdserve: error: cannot read http://127.0.0.1:9/cluster/status")


def test_a_planned_placement_starts_as_written(
    ray_cluster: tuple[Cluster, str, str],
    reference: tuple[list[str], list[Expected]],
    tmp_path: Path,
) -> None:
    """`pdserve profile` on this machine, `pdserve plan` for 2 nodes x 1 device, and the
    plan's placement started on the two Ray nodes: the controller runs exactly its
    instances, roles and nodes, and answers as the single-host server."""
    cluster, head, worker = ray_cluster
    profile = tmp_path / "profile.json"
    run = [sys.executable, "-m", "pdserve.cli"]
    subprocess.run(
        [*run, "profile", "--quick", "--repeats", "1", "--threads", "1", "--output", str(profile)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    plan = tmp_path / "plan.json"

    def make_plan(rate: float) -> subprocess.CompletedProcess[bytes]:
        argv = [
            *run, "plan", "--hardware", str(profile), "--nodes", "2", "--devices-per-node", "1",
            "--ttft", "30", "--tpot", "2", "--rate", f"{rate:.4f}", "--workers", "1",
            "--num-requests", "100", "--no-plot", "--output", str(plan),
        ]  # fmt: skip
        return subprocess.run(argv, capture_output=True, timeout=600)

    # A placement over both nodes: at a low rate when the plan is disaggregated (a prefill
    # and a decode instance), else at a rate from the plan's own per-device goodput that
    # needs two instances (the profile's speed varies from run to run on this shared
    # machine, and the best kind with it). SLOs loose enough for any profile this test
    # can measure: the fp32 fallback's (kernels off, 1 thread: the workload's longest
    # prompts take over 2 s to prefill) and a slow, busy CI machine's (one measured 40 ms
    # per output token, and TTFT 5 s met by no placement).
    assert make_plan(0.01).returncode == 0
    per_device = json.loads(plan.read_text())["chosen"]["per_device_goodput"]
    written: list[dict] = json.loads(plan.read_text())["placement"]["instances"]
    tried: list[str] = []
    for factor in (1.5, 1.2, 1.9, 1.1, 1.7):
        if len(written) == 2:
            break
        made = make_plan(factor * per_device)
        tried.append(f"{factor}x: rc {made.returncode} {made.stdout.decode()[-300:]}")
        written = (
            json.loads(plan.read_text())["placement"]["instances"] if made.returncode == 0 else []
        )
    assert sorted(p["node"] for p in written) == [0, 1], (written, tried)
    server = ray_server(cluster, "--placement", str(plan))
    try:
        ids = [head, worker]
        want = sorted((p["role"], ids[p["node"]]) for p in written)
        got = sorted((i["role"], i["node"]) for i in status(server)["instances"])
        assert got == want, (written, status(server))
        assert complete(server, PROMPTS[:8], 16) == reference[0][:8]
    finally:
        stop(server)


@pytest.mark.parametrize(
    ("placement", "devices", "message"),
    [
        (
            [("prefill", 0), ("decode", 2)],
            1,
            "the placement uses 3 nodes, the Ray cluster has 2 alive",
        ),
        ([("prefill", 0)], 1, "disaggregated serving needs prefill and decode instances"),
        ([("colocated", 1)], 3, "instance engine needs 3 CPUs, 0 GPUs and"),
    ],
)
def test_a_placement_the_cluster_cannot_hold_exits_2(
    ray_cluster: tuple[Cluster, str, str],
    tmp_path: Path,
    placement: list[tuple[str, int]],
    devices: int,
    message: str,
) -> None:
    cluster, _, _ = ray_cluster
    path = write_placement(tmp_path / "p.json", *placement, devices=devices)
    args = ["--ray", "--ray-address", cluster.address, "--placement", str(path)]
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--port", "9", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve: error: "), out.stderr
    assert "Traceback" not in out.stderr
    assert message in last, last


def rank_actors() -> list[int]:
    """The pids of the processes running a parallel instance's worker rank under Ray (Ray
    titles an actor's process after the method it runs)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"ray::RankActor.run"):
                pids.append(int(entry.name))
    return pids


def test_a_tensor_parallel_instance_holds_one_placement_group_and_survives_its_rank_kill(
    ray_cluster: tuple[Cluster, str, str], exact_engine: Engine, tmp_path: Path
) -> None:
    """A placement's TP 2 prefill instance on the head node (2 CPUs, a bundle of 1 CPU per
    rank, STRICT_PACK) hands its two ranks' KV over TCP to a TP 1 decode instance on the
    worker node under 16 streams; its worker rank's actor is SIGKILLed once every stream
    has 8 tokens: one instance failure, every stream ends with the undisturbed engine's
    text (fp32 activations': a deployment with a tensor-parallel instance serves them by
    default, config.py `deployment_activations`), and nothing is left: no rank actor, no
    placement group."""
    want_texts = [out.text for out in run(exact_engine, stream_bodies())]
    cluster, head, worker = ray_cluster
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "instances": [
                    {"role": "prefill", "node": 0, "devices": 2, "tp": 2},
                    {"role": "decode", "node": 1, "devices": 1},
                ]
            }
        )
    )
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    server = ray_server(cluster, "--placement", str(path), "--instance-timeout", "5")
    try:
        row = row_of(server, "prefill-0")
        assert (row["node"], row["tensor_parallel_size"]) == (head, 2), row
        assert row_of(server, "decode-0")["node"] == worker
        groups = [
            g for g in placement_group_table().values() if g["name"].startswith("pdserve-ranks")
        ]
        assert [(g["strategy"], g["state"], len(g["bundles"])) for g in groups] == [
            ("STRICT_PACK", "CREATED", 2)
        ], groups
        assert set(groups[0]["bundles_to_node_id"].values()) == {head}
        assert groups[0]["bundles"][1] == {"CPU": 1.0, "memory": groups[0]["bundles"][0]["memory"]}
        (rank,) = rank_actors()

        before = routes(server)
        streams = Streams(server.url, stream_bodies())
        streams.wait_tokens(8)
        # every stream's KV pulled across the nodes over TCP, one move from each prefill
        # rank's pool (its own KV heads)
        moved = routes(server)
        pulled = tuple(a - b for a, b in zip(moved["decode-0"], before["decode-0"], strict=True))
        assert pulled == (0, 2 * STREAMS), (before, moved)
        os.kill(rank, signal.SIGKILL)
        reason = wait_dead(server, "prefill-0")
        assert reason is not None and "rank 1" in reason, reason
        results = streams.results()
        for i, (got, want) in enumerate(zip(results, want_texts, strict=True)):
            assert (got.status, got.error, got.finish_reason) == (200, None, "length"), (i, got)
            assert got.text == want, (i, got.text, want)
        _, reply = server.get("/debug/cluster")
        assert reply["controller"]["instance_failures"] == {"prefill": 1}
        wait_clean(server, every_role=False)
        deadline = time.monotonic() + 30
        while (
            rank_actors()
            or placement_group_table()[groups[0]["placement_group_id"]]["state"] != "REMOVED"
        ):
            assert time.monotonic() < deadline, (rank_actors(), placement_group_table())
            time.sleep(0.2)
    finally:
        stop(server)
        ray.shutdown()


def wait_restarted(server: Server, name: str, old_pid: int, timeout: float = 180.0) -> dict:
    """The status row of `name` once a new process (not `old_pid`) serves it."""
    deadline = time.monotonic() + timeout
    while True:
        row = next(i for i in status(server)["instances"] if i["name"] == name)
        if row["alive"] and row["pid"] != old_pid:
            return row
        assert time.monotonic() < deadline, f"{name} was not restarted: {row}"
        time.sleep(0.5)


def test_a_killed_instance_is_restarted_empty_and_serves(
    ray_cluster: tuple[Cluster, str, str],
    pd_server: Server,
    reference: tuple[list[str], list[Expected]],
) -> None:
    """--ray-restart: decode-0's actor process SIGKILLed while idle; Ray reports the
    actor dead, a new actor takes its place on the same (living) node and rejoins empty;
    the cluster then answers as before."""
    _, _, worker = ray_cluster
    before = next(i for i in status(pd_server)["instances"] if i["name"] == "decode-0")
    os.kill(before["pid"], signal.SIGKILL)
    reason = wait_dead(pd_server, "decode-0")
    assert reason is not None and reason.startswith(("Ray: ", "sent nothing for ")), reason
    row = wait_restarted(pd_server, "decode-0", before["pid"])
    assert (row["node"], row["running"] or 0, row["assigned_requests"]) == (worker, 0, 0), row
    assert complete(pd_server, PROMPTS, 16) == reference[0]
    _, reply = pd_server.get("/debug/cluster")
    assert reply["controller"]["instance_failures"] == {"decode": 1}
    assert reply["controller"]["instance_restarts"] == {"decode": 1}
    wait_clean(pd_server)


def node_index(node_id: str, head: str, alive: list[str]) -> int:
    """A node's index in a placement: the head first, then the others by node id
    (`ray_launch.nodes`)."""
    return 1 + sorted(n for n in alive if n != head).index(node_id) if node_id != head else 0


def test_killing_a_worker_node_loses_no_stream(
    ray_cluster: tuple[Cluster, str, str],
    reference: tuple[list[str], list[Expected]],
    tmp_path: Path,
) -> None:
    """A node added for this test holds the decode instance of a server of its own
    (prefill on the head); its raylet SIGKILLed once every stream has 8 tokens: the decode
    instance on it is seen dead (by Ray, by its silence or by its exit), its requests move
    to the head node's prefill instance, which runs them whole; every stream ends with the
    reference text. With --ray-restart, decode-0 then starts again on a node still alive."""
    cluster, head, worker = ray_cluster
    node = cluster.add_node(num_cpus=2, object_store_memory=_OBJECT_STORE)
    cluster.wait_for_nodes()
    index = node_index(node.node_id, head, [head, worker, node.node_id])
    path = write_placement(tmp_path / "p.json", ("prefill", 0), ("decode", index))
    server = ray_server(
        cluster, "--placement", str(path), "--instance-timeout", "5", "--ray-restart"
    )
    try:
        assert row_of(server, "decode-0")["node"] == node.node_id
        streams = Streams(server.url, stream_bodies())
        streams.wait_tokens(8)
        assert row_of(server, "decode-0")["assigned_requests"] > 0
        node.kill_raylet()
        reason = wait_dead(server, "decode-0")
        # Ray's word, its silence, or its own end: an engine exits once the process it
        # serves (an actor's: its raylet) is gone (runtime.ended).
        seen = ("Ray: ", "sent nothing for ", "process exited (exit code 0)")
        assert reason is not None and reason.startswith(seen), reason
        results = streams.results()
        for i, (got, want) in enumerate(zip(results, reference[1], strict=True)):
            assert (got.status, got.error, got.finish_reason) == (200, None, "length"), (i, got)
            assert got.text == want.text, (i, got.text, want.text)
        wait_clean(server, every_role=False)
        deadline = time.monotonic() + 30
        while next(n for n in status(server)["nodes"] if n["node"] == node.node_id)["alive"]:
            assert time.monotonic() < deadline, "Ray never reported the killed node dead"
            time.sleep(0.5)
        _, reply = server.get("/debug/cluster")
        assert reply["controller"]["instance_failures"] == {"decode": 1}
        assert reply["controller"]["failed"] == 0
        row = wait_restarted(server, "decode-0", -1)
        # On a node still alive: the head's third CPU, or the shared worker's when the
        # module's other server is not holding it (the tests run in any order).
        assert row["node"] in (head, worker), row
        assert complete(server, PROMPTS[:8], 16) == reference[0][:8]
    finally:
        stop(server)
        cluster.remove_node(node, allow_graceful=False)


def test_instances_added_and_removed_through_ray_serve_and_lose_nothing(
    ray_cluster: tuple[Cluster, str, str],
    reference: tuple[list[str], list[Expected]],
) -> None:
    """Scaling by hand on a Ray cluster (cluster/scaling.py): `POST /admin/instances`
    starts decode-1 as an actor wherever Ray has room; it serves (the streams' texts are
    the reference's, and it pulled KV for some of them); then the original decode-0 leaves
    while every stream is mid-way - its requests move to decode-1 with their KV, none is
    lost - and its actor process is gone."""
    cluster, head, worker = ray_cluster
    server = ray_server(cluster, "--prefill", "1", "--decode", "1", "--instance-timeout", "5")
    try:
        status_code, report = add(server, "decode")
        assert status_code == 200, report
        assert (report["action"], report["instance"], report["role"]) == (
            "add",
            "decode-1",
            "decode",
        )
        assert report["node"] in (head, worker) and report["seconds"] > 0, report
        placed = {i["name"]: (i["role"], i["node"]) for i in status(server)["instances"]}
        assert placed["decode-1"] == ("decode", report["node"]), placed
        assert sorted(placed) == ["decode-0", "decode-1", "prefill-0"]

        before = routes(server)
        results = Streams(server.url, stream_bodies()).results()
        for i, (got, want) in enumerate(zip(results, reference[1], strict=True)):
            assert (got.status, got.error, got.text) == (200, None, want.text), (i, got)
        took = routes(server)
        assert sum(took["decode-1"]) > sum(before["decode-1"]), (before, took)

        streams, _, pid = leave_under_load(server, "decode-0", stream_bodies())
        for i, (got, want) in enumerate(zip(streams.results(), reference[1], strict=True)):
            assert (got.status, got.error, got.text) == (200, None, want.text), (i, got)
        assert sorted(i["name"] for i in status(server)["instances"]) == ["decode-1", "prefill-0"]
        wait_for(lambda: gone(pid))
        _, reply = server.get("/debug/cluster")
        counters = reply["controller"]
        assert (counters["migrations"], counters["failed"]) == (0, 0), counters
        wait_clean(server)
    finally:
        stop(server)


def test_the_distserve_policy_scales_out_and_in_through_ray(
    ray_cluster: tuple[Cluster, str, str], tmp_path: Path
) -> None:
    """`--flip-policy distserve --min-instances 2 --max-instances 3` on 1P:1D with the
    planner's test profile (tests/test_replan_policy.py: its answers depend on the
    requests' lengths, not on this machine's speed). 200-token answers at 0.5 req/s need
    1 prefill + 2 decode instances: no split of 2 serves, and a decode instance is added
    (a Ray actor); then 64-token answers at 1 req/s need 1 + 1, and the least loaded
    decode instance is drained and removed. Every request of both phases is answered.
    The rates are the lowest that give these answers: the machine must finish requests
    as fast as they come (an 8 s window needs 3 finished), and a slow CI machine beside
    Ray's own processes decoded 200 tokens/s too slowly to."""
    cluster, _, _ = ray_cluster
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    server = ray_server(
        cluster, "--prefill", "1", "--decode", "1", "--instance-timeout", "5",
        "--flip-policy", "distserve", "--flip-profile", str(profile),
        "--slo-ttft", repr(TTFT), "--slo-tpot", repr(TPOT), "--replan-interval", "0.5",
        "--replan-window", "8", "--replan-min-requests", "3",
        "--min-instances", "2", "--max-instances", "3",
    )  # fmt: skip
    try:
        prompt = [100 + j for j in range(20)]  # token ids: exactly 20 prompt tokens
        long = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        with Paced(server, long, rate=0.5):
            wait_for(lambda: len(elastic(server)["decisions"]) == 1, timeout=240)
        [out] = elastic(server)["decisions"]
        assert (out["action"], out["role"], out["instance"], out["flipped"]) == (
            "add",
            "decode",
            None,
            True,
        ), out
        assert out["outcome"].startswith("added decode-1 in "), out
        assert out["reason"].startswith("no split of 2 instances serves "), out
        assert roles(server) == {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}

        short = {**long, "max_tokens": 64}
        with Paced(server, short, rate=1.0):
            wait_for(lambda: len(elastic(server)["decisions"]) == 2, timeout=240)
        back = elastic(server)["decisions"][1]
        assert (back["action"], back["role"], back["flipped"]) == ("remove", "decode", True), back
        assert back["instance"] in ("decode-0", "decode-1"), back
        assert back["reason"].endswith("is removed (at least 2)"), back
        assert sorted(roles(server).values()) == ["decode", "prefill"]
        scaled = [(r["action"], r["instance"]) for r in elastic(server)["scaling"]]
        assert scaled == [("add", "decode-1"), ("remove", back["instance"])]
        _, reply = server.get("/debug/cluster")
        assert (reply["controller"]["migrations"], reply["controller"]["failed"]) == (0, 0)
        wait_clean(server)
    finally:
        stop(server)
