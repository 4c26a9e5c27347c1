"""A parallel instance's ranks under `serve --ray`: one placement group per instance, one
bundle per rank, all on one node (docs/deploy.md, docs/parallelism.md).

`rank_bundles` is what an instance of T x P ranks reserves: a bundle per rank (its share
of the instance's threads as CPUs, one GPU each on a CUDA engine, its share of the
memory), with the STRICT_PACK strategy - the ranks share memory (their KV pools in
/dev/shm, the CPU sums, the rendezvous on 127.0.0.1), so they must share a node, and Ray
grants the whole group or none of it. The engine's actor (the driver, rank 0) runs in
bundle 0; the driver starts ranks 1.. itself (`spawn_in_group`, the `Spawn` its
`RankGroup` uses) as `RankActor`s in bundles 1..: each gets exactly its bundle's
resources (on a GPU node Ray makes its one GPU the process's only visible device), and
each connects back to the driver over a TCP socket on 127.0.0.1 to receive its config,
then runs `worker_main` as a local worker does.

Lifetimes: the rank actors are owned by the driver's process, so Ray ends them when it
dies; they also leave when the driver's process is gone (`worker_main`), and the
placement group is removed when the instance ends (`RayEngineProcess`), which ends
anything left in it.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import socket
import time
import traceback
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.config import EngineConfig
from pdserve.engine.ranks import RankProcess, rank_threads, worker_main
from pdserve.parallel import group


def rank_bundles(config: EngineConfig, memory_bytes: int) -> list[dict[str, float]]:
    """The placement group's bundles of a `config` instance whose ranks need
    `memory_bytes` together: one per rank, in rank order."""
    world = config.world_size
    bundle = {"CPU": float(rank_threads(config)), "memory": float(memory_bytes // world)}
    if config.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(world)]


class RankActor:
    """The Ray actor a worker rank runs in (one process, one rank)."""

    def run(self, address: tuple[str, int], rank: int, port: int, driver: int) -> int:
        """Connect to the driver at `address`, say this process's pid, receive the
        config and run the rank until the driver closes it. A rank that fails exits its
        process, as a local worker does, so the driver sees it gone at once."""
        try:
            conn = mpc.Connection(socket.create_connection(address).detach())
            conn.send(os.getpid())
            worker_main(conn, conn.recv(), rank, port, driver)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        return 0


_RemoteRankActor = ray.remote(RankActor)


class RayRank:
    """A worker rank in a `RankActor` (`RankProcess`): on the driver's node, so its pid
    is watched through /proc as a local worker's is; Ray says how it ended."""

    def __init__(self, actor: Any, run: Any, pid: int) -> None:
        self._actor, self._run, self._pid = actor, run, pid

    @property
    def pid(self) -> int:
        return self._pid

    def ended(self, wait_s: float) -> str | None:
        if not group.gone(self._pid):
            return None
        ready, _ = ray.wait([self._run], timeout=wait_s, fetch_local=False)
        if not ready:
            return "exited"
        try:
            return f"exited with status {ray.get(self._run)}"
        except RayError as e:
            return f"ended (Ray: {first_line(e)})"

    def stop(self, grace_s: float) -> None:
        ray.wait([self._run], timeout=grace_s, fetch_local=False)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self._actor, no_restart=True)


def bundle_options(pg: PlacementGroup, index: int) -> dict[str, Any]:
    """The Ray options of an actor that takes bundle `index` of `pg`: what the bundle
    reserves, and scheduling into it."""
    bundle = pg.bundle_specs[index]
    return {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "memory": bundle.get("memory", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, index),
    }


def spawn_in_group(ranks: range, port: int) -> tuple[list[RankProcess], list[mpc.Connection]]:
    """Ranks `ranks` as `RankActor`s in this actor's placement group, bundle i for rank
    i (the engine actor's `Spawn`); returns once each has connected. RuntimeError naming
    the rank if one ends, or does not connect within `group.WAIT_LIMIT_S`."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("a parallel instance under Ray runs in a placement group; none found")
    started = []
    for rank in ranks:
        listener = socket.create_server(("127.0.0.1", 0))
        actor: Any = _RemoteRankActor.options(max_restarts=0, **bundle_options(pg, rank)).remote()
        run = actor.run.remote(listener.getsockname(), rank, port, os.getpid())
        started.append((rank, listener, actor, run))
    procs: list[RankProcess] = []
    pipes = []
    try:
        for rank, listener, actor, run in started:
            conn = _accept(listener, run, rank)
            procs.append(RayRank(actor, run, int(conn.recv())))
            pipes.append(conn)
    except BaseException:
        for _, _, actor, _ in started:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        raise
    finally:
        for _, listener, _, _ in started:
            listener.close()
    return procs, pipes


def _accept(listener: socket.socket, run: Any, rank: int) -> mpc.Connection:
    """Rank `rank`'s connection, once its actor has started and connected."""
    listener.settimeout(0.2)
    deadline = time.monotonic() + group.WAIT_LIMIT_S
    while time.monotonic() < deadline:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            ready, _ = ray.wait([run], timeout=0, fetch_local=False)
            if ready:
                try:
                    code = ray.get(run)
                    why = f"it returned {code}"
                except RayError as e:
                    why = first_line(e)
                raise RuntimeError(
                    f"rank {rank}'s Ray actor ended before it started: {why}"
                ) from None
            continue
        sock.settimeout(None)
        return mpc.Connection(sock.detach())
    raise RuntimeError(f"rank {rank}'s Ray actor did not start within {group.WAIT_LIMIT_S:.0f} s")


def first_line(e: BaseException) -> str:
    """The line of Ray's (long) message that says why, else its first."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = [line for line in lines if "because" in line]
    return (why or lines or [type(e).__name__])[0]
