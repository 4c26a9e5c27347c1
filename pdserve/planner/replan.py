"""Replanning (DistServe §4.4 "Replanning"; the `distserve` flip policy acts on it).

Two entries:

- `ProfileSplitPlanner`: the running cluster's window of finished requests
  (cluster/evidence.py `ObservedWindow`) is fitted as a trace - its (prompt, output)
  pairs resampled, its rate - exactly as `pdserve plan --workload window.jsonl` fits the
  same rows, and the planner's high-affinity search on this machine's measured profile
  says what one prefill and one decode instance serve within the SLOs and how many of
  each the rate needs (`SplitAdvice`; cluster/replanning.py decides from it). The
  cluster is one node of `instances` devices: a pdserve instance on a CPU profile is one
  process (TP and PP 1).
- `advise_replan`: a placement search's view - the planning workload reshaped to
  observed means, the current placement re-measured on it, whether it is within
  `tolerance` of the best per-device goodput.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.cluster.evidence import ObservedWindow
from pdserve.cluster.replanning import SplitAdvice
from pdserve.planner.candidates import InstanceKnobs
from pdserve.planner.hardware import ClusterSpec, HardwareProfile
from pdserve.planner.model_spec import ModelSpec, PlanInputError
from pdserve.planner.plan import disagg_system, explain_unmeetable
from pdserve.planner.search import (
    Placement,
    SearchContext,
    SLOTarget,
    high_affinity_placements,
    run_tasks,
    search,
)
from pdserve.planner.simulator import simulate
from pdserve.planner.workload import SimWorkload, TraceFit


@dataclass(frozen=True)
class ProfileSplitPlanner:
    """The `distserve` policy's planner (module doc): `pdserve plan` on the window."""

    spec: ModelSpec
    hw: HardwareProfile
    slo: SLOTarget
    knobs: InstanceKnobs = field(default_factory=InstanceKnobs)
    num_requests: int = 200  # simulated per trial (`--num-requests`)
    seed: int = 0

    def advise(self, window: ObservedWindow, prefill: int, decode: int) -> SplitAdvice:
        if not window.requests:
            raise PlanInputError("no finished requests in the window")
        ctx = self.context(window, prefill + decode)
        best = search(ctx, "high", workers=1, colocated=False).best_disaggregated
        if best is None:
            raise PlanInputError(explain_unmeetable(ctx))
        pre, dec = best.results
        sizing = best.instances_for(window.rate)
        # the running split simulated whole on one node (KV over the node's link)
        system = disagg_system(
            ctx, pre.task.par, dec.task.par, prefill, decode, ctx.cluster.intra_node_bandwidth
        )
        running = simulate(system, ctx.workload.with_rate(window.rate))
        return SplitAdvice(
            pre.goodput,
            dec.goodput,
            sizing["prefill"],
            sizing["decode"],
            running.attainment(self.slo.ttft, self.slo.tpot),
            self.slo.ttft,
            self.slo.tpot,
        )

    def context(self, window: ObservedWindow, instances: int) -> SearchContext:
        """What `pdserve plan --workload W --nodes 1 --devices-per-node N` searches, W
        being `window.trace_rows()` written as JSONL."""
        fit = TraceFit(
            "observed window",
            np.asarray([r.prompt_len for r in window.requests], dtype=np.int64),
            np.asarray([r.output_len for r in window.requests], dtype=np.int64),
            window.rate,
        )
        workload = fit.sample(self.num_requests, self.seed, 1.0)
        cluster = ClusterSpec.one_node(self.hw, instances)
        return SearchContext(self.spec, self.hw, cluster, self.knobs, self.slo, workload)


@dataclass(frozen=True)
class WorkloadStats:
    rate: float  # requests/s
    mean_input: float  # prompt tokens
    mean_output: float  # generated tokens

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.mean_input >= 1 and self.mean_output >= 1):
            raise PlanInputError(
                f"workload statistics need rate > 0 and mean lengths >= 1, got {self}"
            )


@dataclass(frozen=True)
class ReplanAdvice:
    keep: bool  # the current placement is within tolerance of the best
    current_per_device: float
    best_per_device: float
    best: Placement
    instances: dict[str, int]  # the best placement's instances for the observed rate

    @property
    def ratio(self) -> float:
        return self.current_per_device / self.best_per_device if self.best_per_device else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "keep": self.keep,
            "ratio": self.ratio,
            "current_per_device": self.current_per_device,
            "best_per_device": self.best_per_device,
            "best": self.best.to_dict(),
            "instances": self.instances,
        }


def reshape_workload(w: SimWorkload, stats: WorkloadStats, max_context: int) -> SimWorkload:
    """The same arrival pattern and length shapes, scaled to the observed means (each
    request's prompt + output kept within the model's context)."""
    inp = _scale(w.input_lens, stats.mean_input, max_context - 1)
    out = _scale(w.output_lens, stats.mean_output, max_context)
    out = np.minimum(out, np.maximum(1, max_context - inp))
    return dataclasses.replace(w, input_lens=inp, output_lens=out, name=f"{w.name} (observed)")


def _scale(lens: np.ndarray, mean: float, hi: int) -> np.ndarray:
    scaled = np.rint(lens * (mean / float(lens.mean())))
    return np.clip(scaled, 1, hi).astype(np.int64)


def advise_replan(
    ctx: SearchContext,
    current: Placement,
    stats: WorkloadStats,
    tolerance: float = 0.1,
    affinity: str = "both",
    workers: int | None = None,
) -> ReplanAdvice:
    if not 0 <= tolerance < 1:
        raise PlanInputError(f"tolerance must be in [0, 1), got {tolerance}")
    new_ctx = dataclasses.replace(
        ctx, workload=reshape_workload(ctx.workload, stats, ctx.spec.max_context)
    )
    now = remeasure(new_ctx, current, workers)
    outcome = search(new_ctx, affinity, workers)
    best = outcome.best
    if best is None:
        raise PlanInputError("no placement meets the SLOs for the observed workload")
    if now.per_device_goodput >= best.per_device_goodput:
        best = now  # the search's tolerance can rank the incumbent a hair lower: keep it
    keep = now.per_device_goodput >= (1 - tolerance) * best.per_device_goodput
    return ReplanAdvice(
        keep, now.per_device_goodput, best.per_device_goodput, best, best.instances_for(stats.rate)
    )


def remeasure(ctx: SearchContext, placement: Placement, workers: int | None = None) -> Placement:
    """`placement`'s configurations simulated again on `ctx`'s workload."""
    results = run_tasks(ctx, [r.task for r in placement.results], workers)
    if placement.kind.startswith("disaggregated (high"):
        p, d = results
        if p.goodput <= 0 or d.goodput <= 0:
            return Placement(placement.kind, tuple(results), 0.0)
        return high_affinity_placements(results)[0]
    (r,) = results
    return Placement(placement.kind, (r,), r.per_device)
