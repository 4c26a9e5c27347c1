"""Token-length distributions the workloads draw from (seeded numpy generators).

A log-normal is the usual fit for prompt and answer lengths of chat and document
datasets (long right tail); it is truncated, not clipped, to its bounds so that no
mass piles up at a bound. `median()` is the truncated distribution's exact median,
which the tests compare with seeded samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdserve.workload.errors import WorkloadInputError


@dataclass(frozen=True)
class LengthDist:
    """Integers in [lo, hi]: fixed (lo == hi), uniform, or log-normal(median, sigma)."""

    lo: int
    hi: int
    median_param: float | None = None
    """Median of the untruncated log-normal; None: uniform on [lo, hi]."""
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise WorkloadInputError(f"impossible length range [{self.lo}, {self.hi}]")
        if self.median_param is not None and not (self.median_param > 0 and self.sigma > 0):
            raise WorkloadInputError("a log-normal length needs a positive median and sigma")

    @classmethod
    def fixed(cls, n: int) -> LengthDist:
        return cls(n, n)

    @classmethod
    def lognormal(cls, median: float, sigma: float, lo: int, hi: int) -> LengthDist:
        return cls(lo, hi, median, sigma)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.lo == self.hi:
            return [self.lo] * n
        if self.median_param is None:
            return [int(v) for v in rng.integers(self.lo, self.hi + 1, size=n)]
        return self._truncated_lognormal(rng, n)

    def _truncated_lognormal(self, rng: np.random.Generator, n: int) -> list[int]:
        """Draw, keep what rounds into [lo, hi], repeat: exact truncation."""
        assert self.median_param is not None
        a, b = self._bound_quantiles()
        if b - a < 1e-4:
            raise WorkloadInputError(f"length range [{self.lo}, {self.hi}] is almost never drawn")
        mu = math.log(self.median_param)
        kept: list[int] = []
        while len(kept) < n:
            draw = np.rint(rng.lognormal(mu, self.sigma, size=int((n - len(kept)) / (b - a)) + 16))
            kept.extend(int(v) for v in draw[(draw >= self.lo) & (draw <= self.hi)])
        return kept[:n]

    def _bound_quantiles(self) -> tuple[float, float]:
        assert self.median_param is not None
        mu = math.log(self.median_param)

        def cdf(x: float) -> float:
            return _norm_cdf((math.log(x) - mu) / self.sigma)

        # Integers are rounded from the continuous draw: [lo - 0.5, hi + 0.5) rounds into range.
        return cdf(max(self.lo - 0.5, 0.5)), cdf(self.hi + 0.5)

    def median(self) -> float:
        """The median of the distribution as sampled (truncation included)."""
        if self.median_param is None:
            return (self.lo + self.hi) / 2
        a, b = self._bound_quantiles()
        z = _norm_ppf((a + b) / 2)
        return float(
            min(max(math.exp(math.log(self.median_param) + self.sigma * z), self.lo), self.hi)
        )

    def describe(self) -> str:
        if self.lo == self.hi:
            return f"{self.lo}"
        if self.median_param is None:
            return f"uniform[{self.lo}, {self.hi}]"
        shape = f"lognormal(median={self.median_param:g}, sigma={self.sigma:g})"
        return f"{shape} in [{self.lo}, {self.hi}], median as drawn {self.median():.0f}"


def _norm_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _norm_ppf(p: float) -> float:
    """Inverse of the standard normal CDF by bisection on erf (no scipy dependency)."""
    p = min(max(p, 1e-15), 1 - 1e-15)
    lo, hi = -40.0, 40.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _norm_cdf(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
