"""Instances as Ray actors on the nodes of a Ray cluster: `pdserve serve --ray` (docs/deploy.md).

Ray is on the control path only. It places each instance's process on a node with the
resources the instance needs (one actor per instance, its CPUs / GPUs / memory as the
actor's resource request, pinned to a node when a placement names one), and it tells
when that process or its node is gone. Everything else is the embedded launch's:
`Instance` (cluster/instance.py) talks to the engine over ZeroMQ - TCP sockets the front
end binds on its node's address, which the actor is given - and KV moves between
instances through the auto transport (kv/transfer/auto.py): shared memory between two
instances on one node, TCP between nodes.

An actor's `run` is the engine's whole life (`run_engine_process`, as in a spawned
child); the `ObjectRef` of that call is what liveness reads: pending while the engine
runs, a value (its exit code) once it returned, a `RayActorError` once Ray saw the actor
or its node die. Heartbeat silence is still watched by `Instance` as for any instance,
so a node that vanishes is seen by whichever comes first.

An instance of one rank is one actor: its resource request is granted on a single node,
all or nothing. An instance of T x P ranks first reserves a placement group, one bundle
per rank on one node (cluster/ray_ranks.py); its engine actor runs in bundle 0 and
starts the other ranks as actors in the others.

The actors are owned by the server's Ray driver: if the server exits, Ray ends them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import state as ray_state
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
)

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.instance import EngineProcess
from pdserve.cluster.placement import PlacedInstance
from pdserve.cluster.ray_ranks import bundle_options, first_line, rank_bundles, spawn_in_group
from pdserve.config import EngineConfig
from pdserve.engine.ranks import rank_threads
from pdserve.errors import EngineDeadError
from pdserve.model.source import resolve_model

_GIB = 1 << 30
RUNTIME_BYTES = _GIB // 2  # an engine process beyond its weights and KV: torch, buffers


@dataclass(frozen=True)
class RayNode:
    """One node of the Ray cluster, as Ray reports it."""

    node_id: str
    address: str  # the node's IP
    alive: bool
    cpus: float
    gpus: float
    memory_bytes: float
    head: bool  # the Ray head node


@dataclass(frozen=True)
class Resources:
    """What one instance asks Ray for (`instance_resources`)."""

    cpus: int
    gpus: int
    memory_bytes: int


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ("auto", "host:port", "ray://..."), or start a
    local one-node cluster when None and RAY_ADDRESS is unset."""
    if not ray.is_initialized():
        ray.init(
            address=address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            namespace="pdserve",
        )


HEAD_RESOURCE = "node:__internal_head__"  # what Ray puts in the head node's resources
NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id


def all_nodes() -> list[RayNode]:
    """Every node Ray knows, dead ones included (the one reading of `ray.nodes()`)."""
    found = []
    for n in ray.nodes():
        res = n.get("Resources", {})
        found.append(
            RayNode(
                node_id=n["NodeID"],
                address=n["NodeManagerAddress"],
                alive=bool(n.get("Alive")),
                cpus=res.get("CPU", 0.0),
                gpus=res.get("GPU", 0.0),
                memory_bytes=res.get("memory", 0.0),
                head=HEAD_RESOURCE in res,
            )
        )
    return found


def nodes() -> list[RayNode]:
    """The alive nodes in placement order (a placement's node index): the head node
    first, then the others by node id."""
    return sorted((n for n in all_nodes() if n.alive), key=lambda n: (not n.head, n.node_id))


def free_nodes() -> list[RayNode]:
    """The alive nodes with what they have free now (Ray's DeveloperAPI
    `available_resources_per_node`: what its actors and tasks do not hold)."""
    free = ray_state.available_resources_per_node()
    return [
        dataclasses.replace(
            n,
            cpus=free.get(n.node_id, {}).get("CPU", 0.0),
            gpus=free.get(n.node_id, {}).get("GPU", 0.0),
            memory_bytes=free.get(n.node_id, {}).get("memory", 0.0),
        )
        for n in nodes()
    ]


def driver_address() -> str:
    """The address this node is reached at by the others (where the front end binds)."""
    return ray.util.get_node_ip_address()


def instance_resources(config: EngineConfig) -> Resources:
    """An instance's request, all its ranks': their threads as CPUs, one GPU per rank on
    a CUDA engine, and memory for its KV budget, its weights and each rank's runtime. Ray
    uses it to choose nodes; it is not a limit. Weights: the model file's size, times 8
    for fp32 from a GGUF (4-bit blocks dequantized), times 2 for a GGUF's blocks as the
    kernels hold them (5/6-bit values widened to bytes and fp32 scales: up to 1.8x the
    file, pdserve/quant), times 3 with `--activations int8` (the int8 records beside the
    blocks: up to 2.5x)."""
    weights = resolve_model(config.model)
    size = sum(f.stat().st_size for f in ([weights] if weights.is_file() else weights.iterdir()))
    if weights.suffix == ".gguf":
        int8 = config.activations != "fp32"  # "auto": int8 where it runs (the larger)
        size *= 8 if config.quantization == "none" else 3 if int8 else 2
    kv = int(config.cache.kv_cache_memory_gib * _GIB)
    world = config.world_size
    return Resources(
        cpus=rank_threads(config) * world,
        gpus=world if config.device.startswith("cuda") else 0,
        memory_bytes=kv + size + RUNTIME_BYTES * world,
    )


def check_fits(requests: list[tuple[str, Resources, RayNode | None]], found: list[RayNode]) -> None:
    """ValueError naming the instance, its request and the node when a pinned instance
    cannot fit its node, or an unpinned one fits no node: refused before anything starts
    (Ray would otherwise leave the actor pending forever)."""
    for name, res, node in requests:
        candidates = [node] if node is not None else found
        if not any(_fits(res, n) for n in candidates):
            where = f"node {node.node_id[:12]} ({node.address})" if node else "any node"
            raise ValueError(
                f"instance {name} needs {res.cpus} CPUs, {res.gpus} GPUs and "
                f"{res.memory_bytes / _GIB:.1f} GiB of memory: more than {where} of the Ray "
                f"cluster has ({_describe(candidates)})"
            )


def _fits(res: Resources, node: RayNode) -> bool:
    return res.cpus <= node.cpus and res.gpus <= node.gpus and res.memory_bytes <= node.memory_bytes


def _describe(found: list[RayNode]) -> str:
    return "; ".join(
        f"{n.node_id[:12]}: {n.cpus:g} CPUs, {n.gpus:g} GPUs, {n.memory_bytes / _GIB:.1f} GiB"
        for n in found
    )


def nodes_of(placement: list[PlacedInstance], found: list[RayNode]) -> list[RayNode]:
    """The Ray node of each placed instance; ValueError if the placement names a node index
    the cluster does not have."""
    needed = max(p.node for p in placement) + 1
    if needed > len(found):
        raise ValueError(
            f"the placement uses {needed} nodes, the Ray cluster has {len(found)} alive "
            f"({_describe(found)})"
        )
    return [found[p.node] for p in placement]


class EngineActor:
    """The Ray actor an instance's engine runs in (one process, one engine)."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, pid) of this actor's process."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, report: bool) -> int:
        """The engine's life, as in a spawned child; returns its exit code."""
        from pdserve.engine.engine_process import run_engine_process

        spawn = spawn_in_group if config.world_size > 1 else None
        try:
            run_engine_process(config, input_addr, output_addr, report, spawn=spawn)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0


_RemoteEngineActor = ray.remote(EngineActor)
_actor_ids = itertools.count()


class RayLauncher:
    """Makes `RayEngineProcess`es: the `Launcher` of `serve --ray` (cluster/instance.py)."""

    kind = "ray"

    def __init__(self, bind_host: str, start_timeout_s: float = 300.0) -> None:
        self.bind_host: str | None = bind_host
        self.start_timeout_s = start_timeout_s
        self.pinned: dict[str, RayNode] = {}  # instance name -> the node it is pinned to
        self._started: set[str] = set()  # instance names given a process so far

    def process(
        self, config: EngineConfig, input_addr: str, output_addr: str, report: bool
    ) -> EngineProcess:
        name = config.instance_name
        restart = name in self._started
        self._started.add(name)
        return RayEngineProcess(
            config,
            input_addr,
            output_addr,
            report,
            self.pinned.get(name),
            self.start_timeout_s,
            soft=restart,
        )

    def room(self, config: EngineConfig, running: list[EngineConfig]) -> str | None:
        """Some alive node has the instance's request free (Ray's own account of what
        its actors hold: `running` is already in it)."""
        res = instance_resources(config)
        free = free_nodes()
        if any(_fits(res, n) for n in free):
            return None
        return (
            f"an instance needs {res.cpus} CPUs, {res.gpus} GPUs and "
            f"{res.memory_bytes / _GIB:.1f} GiB of memory; no node of the Ray cluster has "
            f"that free ({_describe(free)})"
        )

    def nodes(self) -> list[dict[str, object]]:
        """Every node Ray knows, dead ones included (a node that died stays listed)."""
        keys = ("node", "address", "alive", "cpus", "gpus")
        return [
            dict(zip(keys, (n.node_id, n.address, n.alive, n.cpus, n.gpus), strict=True))
            for n in all_nodes()
        ]


class RayEngineProcess:
    """An instance's engine in a Ray actor: what `Instance` needs of a process."""

    def __init__(
        self,
        config: EngineConfig,
        input_addr: str,
        output_addr: str,
        report: bool,
        node: RayNode | None,
        start_timeout_s: float,
        soft: bool = False,
    ) -> None:
        """`node`: the node it must run on; `soft`: only preferably (a restart: its node
        may be the one that died, and Ray may not have noticed yet)."""
        self.config = config
        self._soft = soft
        self._addrs = (input_addr, output_addr, report)
        self._pinned = node
        self._start_timeout_s = start_timeout_s
        self._actor: Any = None  # the actor's handle, once created
        self._group: PlacementGroup | None = None  # a parallel instance's ranks' reservation
        self._run: Any = None  # the ObjectRef of its `run`, once started
        self._node = ""
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._exit: tuple[int | None, str] | None = None  # (exit code, reason) once ended

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def node(self) -> str:
        return self._node

    @property
    def exitcode(self) -> int | None:
        return self._ended()[0] if self._done() else None

    def start(self) -> None:
        """Create the actor (blocking until Ray placed it; a parallel instance's placement
        group first), then start the engine in it with this node's identity for the auto
        transport. EngineDeadError if Ray cannot place it within the start timeout."""
        res = instance_resources(self.config)
        need = (
            f"{res.cpus} CPUs, {res.gpus} GPUs, {res.memory_bytes / _GIB:.1f} GiB"
            f"{' on one node' if self.config.world_size > 1 else ''}"
        )
        if self.config.world_size > 1:
            self._group = self._reserve(res, need)
            options = bundle_options(self._group, 0)
        else:
            strategy: Any = (
                NodeAffinitySchedulingStrategy(self._pinned.node_id, soft=self._soft)
                if self._pinned is not None
                else "DEFAULT"
            )
            options = {
                "num_cpus": res.cpus,
                "num_gpus": res.gpus,
                "memory": res.memory_bytes,
                "scheduling_strategy": strategy,
            }
        actor: Any = _RemoteEngineActor.options(
            name=self._unique("pdserve"), max_restarts=0, **options
        ).remote()
        self._actor = actor
        try:
            node, address, self._pid = ray.get(actor.where.remote(), timeout=self._start_timeout_s)
        except GetTimeoutError:
            self.kill()
            raise EngineDeadError(
                f"Ray placed no actor for {self.config.instance_name} within "
                f"{self._start_timeout_s:g} s (it asked for {need})"
            ) from None
        except RayActorError as e:
            raise EngineDeadError(f"the Ray actor died before starting: {first_line(e)}") from None
        self._node = node
        transfer = dataclasses.replace(self.config.transfer, node=node, host=address)
        config = dataclasses.replace(self.config, transfer=transfer, cpus=None)
        self._run = actor.run.remote(config, *self._addrs)

    def _unique(self, prefix: str) -> str:
        """A name of this instance's for Ray: the front end's pid and a count (a restarted
        instance gets new ones)."""
        return f"{prefix}-{self.config.instance_name}-{os.getpid()}-{next(_actor_ids)}"

    def _reserve(self, res: Resources, need: str) -> PlacementGroup:
        """A parallel instance's placement group (cluster/ray_ranks.py), on its pinned node
        (only preferably for a restart), once Ray has reserved it."""
        bundles = rank_bundles(self.config, res.memory_bytes)
        pin: dict[str, Any] = {}
        if self._pinned is not None and self._soft:
            pin["_soft_target_node_id"] = self._pinned.node_id
        elif self._pinned is not None:
            pin["bundle_label_selector"] = [{NODE_ID_LABEL: self._pinned.node_id}] * len(bundles)
        pg = placement_group(bundles, "STRICT_PACK", self._unique("pdserve-ranks"), **pin)
        if not pg.wait(self._start_timeout_s):
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            raise EngineDeadError(
                f"Ray reserved no placement group for {self.config.instance_name} within "
                f"{self._start_timeout_s:g} s (it asked for {need})"
            )
        return pg

    def is_alive(self) -> bool:
        return self._run is not None and not self._done()

    def kill(self) -> None:
        # Each raises when it is already gone (its node died): nothing left to end.
        if self._actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._actor, no_restart=True)
        if self._group is not None:  # ends the ranks' actors in it too
            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
            self._group = None

    def join(self, timeout: float | None = None) -> None:
        if self._run is not None:
            ray.wait([self._run], timeout=timeout, fetch_local=False)
            if self._done():
                self.kill()  # the engine returned; the idle actor would hold its resources

    def cpu_seconds(self) -> float | None:
        """Not read across nodes: silence alone decides (cluster/instance.py)."""
        return None

    def stopped(self) -> bool:
        return False

    def exit_reason(self) -> str:
        return self._ended()[1]

    def _done(self) -> bool:
        if self._run is None:
            return False
        ready, _ = ray.wait([self._run], timeout=0, fetch_local=False)
        return bool(ready)

    def _ended(self) -> tuple[int | None, str]:
        with self._lock:
            if self._exit is None:
                try:
                    code = ray.get(self._run, timeout=5)
                    self._exit = (code, f"process exited (exit code {code})")
                except RayError as e:  # the actor or its node died; or `run` raised
                    self._exit = (None, f"Ray: {first_line(e)}")
            return self._exit


def make_launcher(
    address: str | None, cluster: ClusterConfig, configs: list[EngineConfig]
) -> RayLauncher:
    """Join the Ray cluster, pin each instance to its placement's node (if any) and check
    that every instance fits a node; the launcher `Cluster.start` then uses."""
    connect(address)
    found = nodes()
    pinned: list[RayNode | None] = [None] * len(configs)
    if cluster.placement:
        for c, p in zip(configs, cluster.placement, strict=True):
            if c.device.startswith("cuda") and p.devices != p.world_size:
                raise ValueError(
                    f"placement: instance {c.instance_name} names {p.devices} GPUs for "
                    f"{p.tp} x {p.pp} ranks; on a GPU engine each rank holds one GPU"
                )
        pinned = list(nodes_of(list(cluster.placement), found))
    check_fits(
        [(c.instance_name, instance_resources(c), n) for c, n in zip(configs, pinned, strict=True)],
        found,
    )
    launcher = RayLauncher(driver_address())
    launcher.pinned = {
        c.instance_name: n for c, n in zip(configs, pinned, strict=True) if n is not None
    }
    return launcher
