"""Open-loop arrival times: Poisson, gamma with a burstiness factor, or all at once.

Offsets are drawn once at 1 request/s and divided by the rate, so every rate point of
a sweep (and every server of a comparison) gets the same pattern, only stretched:
differences between points are the rate's, not the random draw's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from pdserve.workload.errors import WorkloadInputError

ArrivalKind = Literal["poisson", "gamma", "burst"]


@dataclass(frozen=True)
class ArrivalProcess:
    """How request arrival times are drawn (the bench's `ArrivalConfig` adds its cap)."""

    kind: ArrivalKind = "poisson"
    burstiness: float = 1.0
    """Gamma shape: 1 is Poisson, below 1 burstier, above 1 more regular (vLLM's meaning)."""

    def __post_init__(self) -> None:
        if not self.burstiness > 0:
            raise WorkloadInputError(f"--burstiness must be positive, got {self.burstiness}")


def unit_offsets(n: int, process: ArrivalProcess, seed: int) -> np.ndarray:
    """Arrival times at 1 request/s: the first request at 0, then gamma intervals of
    mean 1 (shape = burstiness; shape 1 is the exponential of a Poisson process)."""
    if process.kind == "burst" or n <= 1:
        return np.zeros(n)
    rng = np.random.default_rng([seed, 0xA77])  # its own stream: workloads don't shift it
    shape = 1.0 if process.kind == "poisson" else process.burstiness
    intervals = rng.gamma(shape, 1.0 / shape, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(intervals)])


def offsets_at(unit: np.ndarray, rate: float | None) -> np.ndarray:
    """Seconds after the start at `rate` requests/s; None: everything at 0."""
    if rate is None:
        return np.zeros(len(unit))
    return unit / rate
