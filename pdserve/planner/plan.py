"""One planning run: search, size for the rate, verify by whole-cluster simulation.

`make_plan` is what `pdserve plan` and the replanning hook call. It returns a
`PlanResult`: the chosen disaggregated placement, the best colocated one, the
runner-ups, the instance counts for the requested rate, and the attainment a
simulation of the whole sized cluster gives at that rate (the search judges each
phase alone; this checks the assembled system).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.placement import lay_out
from pdserve.config import Role
from pdserve.planner.candidates import make_instance
from pdserve.planner.latency import Parallelism
from pdserve.planner.model_spec import PlanInputError
from pdserve.planner.search import Placement, SearchContext, SearchOutcome, search
from pdserve.planner.simulator import ColocatedSystem, DisaggSystem, simulate


@dataclass
class PlanResult:
    ctx: SearchContext
    outcome: SearchOutcome
    rate: float | None
    sizing: dict[str, int] | None  # chosen placement's instances for `rate`
    colocated_sizing: dict[str, int] | None
    disaggregated_sizing: dict[str, int] | None  # the best disaggregated one's, for `rate`
    verified_attainment: float | None  # whole sized cluster simulated at `rate`

    chosen: Placement  # best per-device goodput (that serves `rate` on the cluster)

    @property
    def gain_over_colocated(self) -> float | None:
        """Best disaggregated per-device goodput over the best colocated one."""
        colo, dis = self.outcome.best_colocated, self.outcome.best_disaggregated
        if colo is None or dis is None or colo.per_device_goodput <= 0:
            return None
        return dis.per_device_goodput / colo.per_device_goodput

    def to_dict(self) -> dict[str, Any]:
        c = self.ctx
        colo = self.outcome.best_colocated
        return {
            "model": c.spec.to_dict(),
            "hardware": c.hw.to_dict(),
            "hardware_is_estimate": c.hw.is_estimate,
            "cluster": {
                "nodes": c.cluster.nodes,
                "devices_per_node": c.cluster.devices_per_node,
                "device_memory_gb": c.cluster.device_memory_bytes / 1e9,
                "intra_node_bandwidth_gbps": c.cluster.intra_node_bandwidth / 1e9,
                "inter_node_bandwidth_gbps": c.cluster.inter_node_bandwidth / 1e9,
                "memory_utilization": c.cluster.memory_utilization,
            },
            "workload": c.workload.name,
            "num_simulated_requests": len(c.workload.arrivals),
            "slo": {"ttft_s": c.slo.ttft, "tpot_s": c.slo.tpot, "attainment": c.slo.attainment},
            "knobs": vars(c.knobs),
            "chosen": self.chosen.to_dict(),
            "best_disaggregated": _dict(self.outcome.best_disaggregated),
            "best_colocated": _dict(colo),
            "gain_over_colocated": self.gain_over_colocated,
            "runner_ups": [p.to_dict() for p in self.outcome.ranked[1:6]],
            "notes": self.outcome.notes,
            "colocated_runner_ups": [p.to_dict() for p in self.outcome.colocated[1:4]],
            "rate": self.rate,
            "instances": self.sizing,
            "colocated_instances": self.colocated_sizing,
            "disaggregated_instances": self.disaggregated_sizing,
            "verified_attainment": self.verified_attainment,
            "tasks": self.outcome.tasks,
            **self.placement(),
        }

    def placement(self) -> dict[str, Any]:
        """`placement`: the sized instances laid out on the cluster's nodes, the file
        `pdserve serve --ray --placement` starts (cluster/placement.py); None with
        `placement_note` saying why when there is none to start."""
        if self.sizing is None:
            return _no_placement("no --rate: the plan sizes no cluster")
        try:
            groups = _instance_groups(self.chosen, self.sizing)
            c = self.ctx.cluster
            placed = lay_out(groups, c.nodes, c.devices_per_node)
        except ValueError as e:
            return _no_placement(str(e))
        return {"placement": {"instances": [p.to_dict() for p in placed]}, "placement_note": None}


def make_plan(
    ctx: SearchContext,
    rate: float | None,
    affinity: str = "both",
    workers: int | None = None,
    progress_factory: Callable[[int], Callable[[int], None]] | None = None,
) -> PlanResult:
    outcome = search(ctx, affinity, workers, progress_factory)
    ranked = outcome.ranked
    if not ranked:
        raise PlanInputError(explain_unmeetable(ctx))
    if rate is None:
        return PlanResult(ctx, outcome, None, None, None, None, None, ranked[0])
    fitting = [p for p in ranked if _devices(p, rate) <= ctx.cluster.num_devices]
    if not fitting:
        raise PlanInputError(explain_rate(ctx, ranked[0], rate, _devices(ranked[0], rate)))
    chosen = fitting[0]  # the best placement that serves `rate` on this cluster
    colo = outcome.best_colocated
    colo_sizing = colo.instances_for(rate) if colo is not None else None
    dis = outcome.best_disaggregated
    dis_sizing = dis.instances_for(rate) if dis is not None else None
    system = build_system(ctx, chosen, rate)
    verified = simulate(system, ctx.workload.with_rate(rate), frontend=ctx.frontend).attainment(
        ctx.slo.ttft, ctx.slo.tpot
    )
    return PlanResult(
        ctx, outcome, rate, chosen.instances_for(rate), colo_sizing, dis_sizing, verified, chosen
    )


def _no_placement(why: str) -> dict[str, Any]:
    return {"placement": None, "placement_note": why}


def _instance_groups(p: Placement, sizing: dict[str, int]) -> list[list[tuple[Role, int, int]]]:
    """The sized instances as groups of (role, tp, pp) that share a node (one instance per
    group, but a low-affinity unit's segments together)."""
    if p.kind == "colocated":
        (r,) = p.results
        return [[(Role.COLOCATED, *_ranks(r.task.par))]] * sizing["colocated"]
    if p.kind.startswith("disaggregated (high"):
        pre, dec = p.results
        return [[(Role.PREFILL, *_ranks(pre.task.par))]] * sizing["prefill"] + [
            [(Role.DECODE, *_ranks(dec.task.par))]
        ] * sizing["decode"]
    (r,) = p.results
    assert r.task.decode_par is not None
    unit = [(Role.PREFILL, *_ranks(r.task.par))] * r.task.num_prefill + [
        (Role.DECODE, *_ranks(r.task.decode_par))
    ] * r.task.num_decode
    return [unit] * sizing["units"]


def _ranks(par: Parallelism) -> tuple[int, int]:
    return par.tp, par.pp


def _dict(p: Placement | None) -> dict[str, Any] | None:
    return p.to_dict() if p is not None else None


def _devices(p: Placement, rate: float) -> int:
    return p.instances_for(rate)["devices"]


def build_system(
    ctx: SearchContext, placement: Placement, rate: float
) -> DisaggSystem | ColocatedSystem:
    """The whole cluster `placement` sizes for `rate`, as the simulator takes it."""
    spec, hw, cluster, knobs = ctx.spec, ctx.hw, ctx.cluster, ctx.knobs
    n = placement.instances_for(rate)
    if placement.kind == "colocated":
        (r,) = placement.results
        inst = make_instance(
            spec, hw, r.task.par, cluster, knobs, chunked=r.task.chunked, colocated=True
        )
        return ColocatedSystem((inst,) * n["colocated"])
    if placement.kind.startswith("disaggregated (high"):
        p, d = placement.results
        pre_par, dec_par = p.task.par, d.task.par
        bandwidth = cluster.inter_node_bandwidth
    else:
        (r,) = placement.results
        assert r.task.decode_par is not None
        pre_par, dec_par = r.task.par, r.task.decode_par
        bandwidth = cluster.intra_node_bandwidth
    return disagg_system(ctx, pre_par, dec_par, n["prefill"], n["decode"], bandwidth)


def disagg_system(
    ctx: SearchContext,
    pre_par: Parallelism,
    dec_par: Parallelism,
    prefill: int,
    decode: int,
    bandwidth: float,
) -> DisaggSystem:
    """`prefill` instances of `pre_par` and `decode` of `dec_par`, KV moved at
    `bandwidth`, as the simulator takes them."""
    spec, hw, cluster, knobs = ctx.spec, ctx.hw, ctx.cluster, ctx.knobs
    pre = make_instance(spec, hw, pre_par, cluster, knobs, chunked=False)
    dec = make_instance(spec, hw, dec_par, cluster, knobs)
    return DisaggSystem((pre,) * prefill, (dec,) * decode, spec.kv_bytes_per_token, bandwidth)


def attainment_curve(
    ctx: SearchContext, placement: Placement, size_rate: float, rates: list[float]
) -> list[float]:
    """Attainment of the cluster sized for `size_rate`, at each of `rates`."""
    system = build_system(ctx, placement, size_rate)
    return [
        simulate(system, ctx.workload.with_rate(r), frontend=ctx.frontend).attainment(
            ctx.slo.ttft, ctx.slo.tpot
        )
        for r in rates
    ]


def explain_unmeetable(ctx: SearchContext) -> str:
    """Why no configuration meets the SLOs: the zero-load latencies of the fastest one."""
    from pdserve.planner.candidates import instance_cost, parallel_configs

    w = ctx.workload
    prompt = int(sorted(w.input_lens)[len(w.input_lens) // 2])
    configs = parallel_configs(ctx.spec, ctx.cluster, max_tp=ctx.max_tp, max_pp=ctx.max_pp) or [
        Parallelism()
    ]
    best_ttft = min(
        (instance_cost(ctx.spec, ctx.hw, p, ctx.cluster).prefill_time([prompt]), str(p))
        for p in configs
    )
    best_tpot = min(
        (instance_cost(ctx.spec, ctx.hw, p, ctx.cluster).decode_time(1, prompt), str(p))
        for p in configs
    )
    return (
        f"no placement meets TTFT {ctx.slo.ttft:g} s and TPOT {ctx.slo.tpot:g} s for "
        f"{ctx.slo.attainment:.0%} of requests: even with no queueing, the fastest "
        f"configuration takes {best_ttft[0]:.3g} s ({best_ttft[1]}) to prefill the median "
        f"prompt of {prompt} tokens and {best_tpot[0]:.3g} s ({best_tpot[1]}) per output "
        f"token on {ctx.hw.label}"
    )


def explain_rate(ctx: SearchContext, best: Placement, rate: float, devices: int) -> str:
    cap = best.per_device_goodput * ctx.cluster.num_devices
    return (
        f"--rate {rate:g} req/s is beyond this cluster: the best placement "
        f"({best.describe()}) serves {best.per_device_goodput:.3g} req/s per device, so it "
        f"needs {devices} devices; the cluster has {ctx.cluster.num_devices} "
        f"(at most about {cap:.3g} req/s)"
    )
