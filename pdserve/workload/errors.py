"""The one error this package raises."""

from __future__ import annotations


class WorkloadInputError(ValueError):
    """Bad workload input (a length range, a burstiness, a trace line); names the problem.

    `pdserve bench` raises it as its `BenchInputError` (a subclass), the planner as
    its `PlanInputError`; both exit with status 2."""
