"""Replanning hook (DistServe §4.3 "Replanning"; TetriInfer's instance flip uses it).

A running cluster reports what it has recently seen (arrival rate, mean prompt and
output lengths). `advise_replan` reshapes the planning workload to those means,
re-measures the current placement on it, reruns the search, and says whether the
current placement is still within `tolerance` of the best per-device goodput and,
if not, what the new placement and its instance counts for the observed rate are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.planner.model_spec import PlanInputError
from pdserve.planner.search import (
    Placement,
    SearchContext,
    high_affinity_placements,
    run_tasks,
    search,
)
from pdserve.planner.workload import SimWorkload


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
