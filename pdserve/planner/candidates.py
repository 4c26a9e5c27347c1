"""Which parallel configurations can hold a model, and the instance each one makes.

An instance of parallelism (tp, pp) spreads the weights over tp * pp devices; what is
left of their usable memory holds KV. A configuration is feasible when the weights
fit and the KV room holds at least one longest request (model context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.parallel.split import split_problem
from pdserve.planner.hardware import ClusterSpec, HardwareProfile
from pdserve.planner.latency import Parallelism, StepCost, step_cost
from pdserve.planner.model_spec import ModelSpec, PlanInputError
from pdserve.planner.simulator import InstanceSpec

GB = 1e9


@dataclass(frozen=True)
class InstanceKnobs:
    """Engine settings every simulated instance shares (from the CLI)."""

    max_batch_size: int = 256  # decode / colocated running requests
    prefill_batch_tokens: int = 512  # L_m: prefill batch budget (DistServe §4.3)
    colocated_chunk_tokens: int = 512  # colocated chunked-prefill step budget


def divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


def tp_options(spec: ModelSpec, devices_per_node: int, max_tp: int | None = None) -> list[int]:
    """Tensor-parallel sizes inside one node that pdserve can split the model into (whole
    GQA groups and MLP column blocks per rank, evenly or not: `split_problem`). They need
    not divide the node: DistServe places a TP-3 prefill and a TP-4 decode segment in
    one 8-device node for OPT-175B (Table 3). `max_tp` caps them (1 for hardware
    whose profile has no all-reduce link, e.g. a CPU profile)."""
    top = devices_per_node if max_tp is None else min(max_tp, devices_per_node)
    kv, columns = spec.num_kv_heads, spec.intermediate_size
    return [tp for tp in range(1, top + 1) if split_problem(kv, columns, 1, tp, 1) is None]


def kv_capacity_tokens(spec: ModelSpec, par: Parallelism, usable_per_device: float) -> int:
    """Tokens of KV an instance holds after its weights (0 or less: does not fit)."""
    room = par.devices * usable_per_device - spec.weight_bytes
    return int(room // spec.kv_bytes_per_token) if room > 0 else 0


def fits(spec: ModelSpec, par: Parallelism, usable_per_device: float) -> bool:
    return kv_capacity_tokens(spec, par, usable_per_device) >= spec.max_context


def instance_cost(
    spec: ModelSpec, hw: HardwareProfile, par: Parallelism, cluster: ClusterSpec
) -> StepCost:
    """Pipeline stages inside a node talk over the node's link, across nodes over the
    network; a pipeline wider than one node pays the slower one."""
    stage_devices = par.tp * par.pp
    pp_bw = (
        cluster.intra_node_bandwidth
        if stage_devices <= cluster.devices_per_node
        else cluster.inter_node_bandwidth
    )
    return step_cost(spec, hw.coefficients, par, hw.interconnect(pp_bw))


def make_instance(
    spec: ModelSpec,
    hw: HardwareProfile,
    par: Parallelism,
    cluster: ClusterSpec,
    knobs: InstanceKnobs,
    *,
    chunked: bool = True,
    colocated: bool = False,
) -> InstanceSpec:
    budget = knobs.colocated_chunk_tokens if colocated else knobs.prefill_batch_tokens
    return InstanceSpec(
        cost=instance_cost(spec, hw, par, cluster),
        kv_capacity_tokens=kv_capacity_tokens(spec, par, cluster.usable_memory),
        max_batch_size=knobs.max_batch_size,
        max_batch_tokens=budget,
        chunked=chunked,
    )


def parallel_configs(
    spec: ModelSpec,
    cluster: ClusterSpec,
    max_devices: int | None = None,
    max_tp: int | None = None,
    max_pp: int | None = None,
) -> list[Parallelism]:
    """Every (tp, pp) with tp inside a node (at most `max_tp`), pp splitting the layers
    evenly (at most `max_pp` stages), the model fitting in memory, and at most
    `max_devices` devices (default: the cluster). pdserve serves uneven pipelines too,
    but their first stage sets the pace with no device saved: the search leaves them out."""
    limit = cluster.num_devices if max_devices is None else max_devices
    out = []
    for tp in tp_options(spec, cluster.devices_per_node, max_tp):
        stages = limit // tp if max_pp is None else min(max_pp, limit // tp)
        for pp in divisors_up_to(spec.num_layers, stages):
            par = Parallelism(tp, pp)
            if fits(spec, par, cluster.usable_memory):
                out.append(par)
    return out


def explain_no_fit(spec: ModelSpec, cluster: ClusterSpec) -> str:
    """Why no configuration fits, with the numbers."""
    need = spec.weight_bytes + spec.max_context * spec.kv_bytes_per_token
    per = cluster.usable_memory
    devices = math.ceil(need / per)
    return (
        f"{spec.name} does not fit: weights {spec.weight_bytes / GB:.1f} GB + KV of one "
        f"{spec.max_context}-token request {spec.max_context * spec.kv_bytes_per_token / GB:.2f} "
        f"GB need {need / GB:.1f} GB, i.e. at least {devices} devices of "
        f"{cluster.device_memory_bytes / GB:g} GB x {cluster.memory_utilization:g} headroom = "
        f"{per / GB:.1f} GB usable; the cluster has {cluster.nodes} x "
        f"{cluster.devices_per_node} = {cluster.num_devices} devices"
        + (
            ""
            if devices > cluster.num_devices
            else " (with tensor parallelism within a node and pipeline stages splitting the "
            f"{spec.num_layers} layers evenly, no split reaches that)"
        )
    )


def require_some(spec: ModelSpec, cluster: ClusterSpec, configs: list[Parallelism]) -> None:
    if not configs:
        raise PlanInputError(explain_no_fit(spec, cluster))
