"""`ClusterConfig`: how many instances of each role, and how the controller routes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from pdserve.cluster.placement import PlacedInstance, check_roles, counts, in_launch_order
from pdserve.config import EngineConfig, Role, SchedulerConfig


class Routing(StrEnum):
    """How the controller picks the instance that prefills a request (cluster/routing.py)."""

    LEAST_LOAD = "least-load"  # shortest prefill queue, blind to caches
    SESSION = "session"  # a session (the `user` field / X-Session-Id) sticks to instances
    PREFIX = "prefix"  # global prompt trees: the most cached prefix, unless its queue is long


class DecodePolicy(StrEnum):
    """Which decode instance takes a prefilled request (cluster/policies.py)."""

    LEAST_LOADED = "least-loaded"  # fewest requests assigned (DistServe)
    POWER_OF_TWO = "power-of-two"  # two random instances with room, the less loaded
    # TetriInfer §3.3.4: two random instances with room for the predicted length, the one
    # whose heavy:light ratio would be lower.
    LENGTH_AWARE = "length-aware"
    RANDOM = "random"  # any instance with room (Fig. 19's baseline)
    IMBALANCE = "imbalance"  # heavy decodes all to one instance (Fig. 19's worst case)


# The transition watcher's policies (cluster/watcher.py).
FLIP_POLICIES = ("none", "tetriinfer", "distserve")


@dataclass(frozen=True)
class ClusterConfig:
    # Instances started on this machine. prefill + decode > 0 means disaggregated serving;
    # otherwise `colocated` instances each run both phases (data parallel).
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    decode_policy: DecodePolicy = DecodePolicy.LEAST_LOADED
    # An instance that has sent nothing (outputs, load reports, heartbeats) for this long
    # is marked dead: new requests avoid it and its requests are moved or failed. A
    # thread of every instance sends a heartbeat each `report_interval_s` (0.1 s) whatever
    # its step loop does, so 1 s is ten missed in a row (docs/fault-tolerance.md).
    instance_timeout_s: float = 1.0
    # A request whose KV hand-off failed (both instances alive) is run again at most this
    # often: from its prompt, or after its streamed tokens (cluster/recovery.py).
    max_retries: int = 1
    # A request whose instance died is moved to a live one at most this often (--max-migrations).
    max_migrations: int = 2
    # DéjàVu KV replication (--kv-replication): every instance that decodes streams its
    # requests' KV to a peer, so a lost request resumes from the replica (cluster/replication.py).
    replicate: bool = False
    # Seed of the power-of-two choice (tests); None: random.
    seed: int | None = None
    # Prefill instances: tokens per prefill-only chunk (TetriInfer ChunkSize); None: the
    # engine's max_num_batched_tokens.
    prefill_chunk_size: int | None = None
    # (tensor, pipeline) parallel sizes of prefill and of decode instances (--prefill-tp,
    # --prefill-pp, --decode-tp, --decode-pp); None: the engine config's.
    prefill_parallel: tuple[int, int] | None = None
    decode_parallel: tuple[int, int] | None = None
    # DéjàVu's microbatch swapping (--microbatch-swap-blocks S): every instance of more than
    # one pipeline stage swaps through a staging area of S blocks a stage; 0: off. Set
    # here, not on the engine config, because one cluster mixes pipeline instances with
    # one-stage ones (which take none: `instance_config`).
    microbatch_swap_blocks: int = 0
    # Cluster-wide caching (docs/caching.md). `routing`: see Routing. `pd_caching`
    # (MemServe §5.1, with a prefix cache): 1 caches at prefill instances only, 2 also at
    # decode instances (the prompt KV received and the answers' KV), 3 also returns each
    # finished request's prompt + answer KV to the prefill instance that prefilled it.
    routing: Routing = Routing.PREFIX
    pd_caching: int = 3
    # Global prompt trees: entries not refreshed by an instance's events or a routed
    # request for this long are forgotten (MemServe's TTL: the fallback for lost events);
    # at most this many (block, instance) entries per tree, least recently refreshed first.
    prefix_ttl_s: float = 300.0
    prefix_tree_max_entries: int = 1_000_000
    # Decode instances under prefix/session routing: the instance holding the longest
    # prefix is chosen while it runs at most this many more requests than the least loaded.
    decode_balance: int = 2
    # PD-Caching-3: returns copying into one prefill instance at once; more are dropped.
    max_returns_in_flight: int = 2
    # Prefix routing, disaggregated: copy a longer cached prefix from another instance
    # before a prefill when that is cheaper than computing it (cluster/routing.py).
    prefix_fetch: bool = True
    # A request whose prefill instance is receiving a copy of more of its prompt (its own
    # prefix fetch, or a return: the previous turn's answer) waits for that copy at most
    # this long, then is prefilled anyway (cluster/cache_copies.py).
    kv_wait_s: float = 2.0
    # Session routing: sessions remembered (least recently used forgotten first).
    max_sessions: int = 100_000
    # Decode dispatch: a request predicted to generate at least this many tokens is a
    # heavy decode (TetriInfer: 128, ShareGPT's median answer); docs/scheduling.md.
    heavy_decode_tokens: int = 128
    # A dead instance is started again (a new process, on its node if that is still alive)
    # and rejoins empty once ready (`serve --ray --ray-restart`); a lone engine is not.
    restart_dead: bool = False
    # Which node each instance runs on and the devices it holds (cluster/placement.py), in
    # launch order (prefill, decode, colocated); () : wherever the launcher puts them.
    placement: tuple[PlacedInstance, ...] = ()
    # Instance flip (cluster/flip.py): a flip whose instance has not drained and switched
    # within this long is given up (the instance serves in its old role again).
    flip_timeout_s: float = 60.0
    # The transition watcher (cluster/watcher.py): which policy flips instances by itself
    # (FLIP_POLICIES; "none": only by hand), how often it looks, and the tetriinfer
    # policy's settings: a role under `flip_idle_load` for `flip_idle_s` seconds while the
    # other averages `flip_busy_load` (or keeps requests queued) gives it an instance.
    flip_policy: str = "none"
    replan_interval_s: float = 10.0
    flip_idle_load: float = 0.1
    flip_idle_s: float = 60.0
    flip_busy_load: float = 0.8
    # The distserve policy (cluster/replanning.py): the window of finished requests it
    # replans for, the goodput gain a flip must promise (0.2: the best split serves 1.2x
    # the running one's rate within the SLOs), and the fewest requests it judges on.
    replan_window_s: float = 60.0
    replan_gain: float = 0.2
    replan_min_requests: int = 20
    # Scaling (cluster/scaling.py): the fewest and the most instances the distserve policy
    # may run (it adds an instance of the role no split can serve, removes an idle one when
    # one fewer serves the rate); None: the number started (no scaling that way).
    min_instances: int | None = None
    max_instances: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_colocated", "max_retries", "max_migrations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.disaggregated:
            if self.num_prefill < 1 or self.num_decode < 1:
                raise ValueError(
                    "disaggregated serving needs at least one prefill and one decode instance, "
                    f"got --prefill {self.num_prefill} --decode {self.num_decode}"
                )
            if self.num_colocated:
                raise ValueError("--colocated cannot be combined with --prefill/--decode")
        elif self.num_colocated < 1:
            raise ValueError(
                "at least one instance is needed (--colocated K or --prefill/--decode)"
            )
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {self.prefill_chunk_size}")
        if self.pd_caching not in (1, 2, 3):
            raise ValueError(f"pd_caching must be 1, 2 or 3, got {self.pd_caching!r}")
        if self.prefix_ttl_s <= 0:
            raise ValueError(f"prefix_ttl_s must be > 0, got {self.prefix_ttl_s}")
        for name in (
            "prefix_tree_max_entries",
            "max_sessions",
            "max_returns_in_flight",
            "heavy_decode_tokens",
            "replan_min_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replan_gain < 0:
            raise ValueError(f"replan_gain must be >= 0, got {self.replan_gain}")
        if self.decode_balance < 0:
            raise ValueError(f"decode_balance must be >= 0, got {self.decode_balance}")
        if self.flip_policy not in FLIP_POLICIES:
            raise ValueError(
                f"unknown flip policy {self.flip_policy!r} (choose {' or '.join(FLIP_POLICIES)})"
            )
        for name in ("replan_interval_s", "flip_idle_s", "replan_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("flip_idle_load", "flip_busy_load"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not self.flip_timeout_s > 0:
            raise ValueError(f"flip_timeout_s must be > 0, got {self.flip_timeout_s}")
        if self.kv_wait_s <= 0:
            raise ValueError(f"kv_wait_s must be > 0, got {self.kv_wait_s}")
        if self.instance_timeout_s <= 0:
            raise ValueError(f"instance_timeout_s must be > 0, got {self.instance_timeout_s}")
        lo, hi = self.scale_bounds
        if not 1 <= lo <= self.num_instances <= hi:
            raise ValueError(
                f"instance bounds must hold 1 <= min ({lo}) <= the instances started "
                f"({self.num_instances}) <= max ({hi})"
            )
        if hi > 1 and self.num_instances == 1:
            raise ValueError(
                "a server of one engine does not scale: start two instances or more "
                "(--colocated K, --prefill/--decode) to use --max-instances"
            )
        if self.placement:
            self._check_placement()

    def _check_placement(self) -> None:
        placement = list(self.placement)
        check_roles(placement, "placement")
        if placement != in_launch_order(placement):
            raise ValueError(
                "placement: instances must be in launch order (prefill, decode, colocated)"
            )
        n = counts(placement)
        have = (n[Role.PREFILL], n[Role.DECODE], n[Role.COLOCATED])
        want = (self.num_prefill, self.num_decode, self.num_colocated)
        if have != want:
            raise ValueError(
                f"the placement has {have[0]} prefill, {have[1]} decode and {have[2]} colocated "
                f"instances, the flags ask for {want[0]}, {want[1]} and {want[2]}"
            )

    @property
    def disaggregated(self) -> bool:
        return bool(self.num_prefill or self.num_decode)

    @property
    def num_instances(self) -> int:
        """The instances started (scaling may change how many run later)."""
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def scale_bounds(self) -> tuple[int, int]:
        """(fewest, most) instances the distserve policy may run."""
        lo, hi = self.min_instances, self.max_instances
        return (
            self.num_instances if lo is None else lo,
            self.num_instances if hi is None else hi,
        )


def instance_configs(cluster: ClusterConfig, engine: EngineConfig) -> list[EngineConfig]:
    """One EngineConfig per instance: role, name, and its share of the CPU threads (or, with
    a placement, the devices and the tensor x pipeline ranks it names)."""
    roles = (
        [Role.PREFILL] * cluster.num_prefill
        + [Role.DECODE] * cluster.num_decode
        + [Role.COLOCATED] * cluster.num_colocated
    )
    even = even_threads(cluster, engine)
    shares = [p.devices for p in cluster.placement] if cluster.placement else [even] * len(roles)
    counts: dict[Role, int] = {}
    configs = []
    placed: list[tuple[int, int] | None] = [(p.tp, p.pp) for p in cluster.placement]
    placed = placed or [None] * len(roles)
    for role, threads, ranks in zip(roles, shares, placed, strict=True):
        index = counts[role] = counts.get(role, -1) + 1
        name = "engine" if len(roles) == 1 else f"{role.value}-{index}"
        configs.append(instance_config(cluster, engine, role, name, threads, ranks))
    return configs


def even_threads(cluster: ClusterConfig, engine: EngineConfig) -> int:
    """An instance's share of the engine's threads when the start splits them evenly
    (and the threads of an instance added later: cluster/scaling.py)."""
    return max(1, engine.threads // cluster.num_instances)


def instance_config(
    cluster: ClusterConfig,
    engine: EngineConfig,
    role: Role,
    name: str,
    threads: int,
    ranks: tuple[int, int] | None = None,
) -> EngineConfig:
    """The EngineConfig of one `role` instance named `name` running `threads` threads on
    `ranks` (tensor, pipeline; default: the role's, else the engine's)."""
    scheduler, cache = role_scheduler(cluster, engine, role), engine.cache
    if role is Role.DECODE and cluster.pd_caching == 1:  # PD-Caching-1: caching at P only
        cache = dataclasses.replace(cache, enable_prefix_cache=False)
    parallel = {Role.PREFILL: cluster.prefill_parallel, Role.DECODE: cluster.decode_parallel}
    tp, pp = (
        ranks or parallel.get(role) or (engine.tensor_parallel_size, engine.pipeline_parallel_size)
    )
    return dataclasses.replace(
        engine,
        role=role,
        instance_name=name,
        num_threads=threads,
        scheduler=scheduler,
        cache=cache,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        microbatch_swap_blocks=cluster.microbatch_swap_blocks if pp > 1 else 0,
    )


def role_scheduler(cluster: ClusterConfig, engine: EngineConfig, role: Role) -> SchedulerConfig:
    """The scheduler settings of a `role` instance (at start, and after a flip to `role`):
    a prefill instance's token budget per step is the prefill chunk size."""
    if role is Role.PREFILL and cluster.prefill_chunk_size is not None:
        return dataclasses.replace(
            engine.scheduler, max_num_batched_tokens=cluster.prefill_chunk_size
        )
    return engine.scheduler
