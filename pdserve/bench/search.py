"""Goodput: the highest request rate whose SLO attainment meets the target (DistServe §6.1).

A search per server: the sweep's points are observed first; if none fails the range
is doubled upward, if none passes it is halved downward, else the bracket between
the highest passing rate below the lowest failing one is bisected. Each step asks
for one more run (`next_rate`), so the experiment can interleave the servers' runs.
Noise can make attainment non-monotonic in the rate; the bracket is always taken
below the lowest failing rate, so a lucky pass above a failure never counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.bench.config import SearchConfig

Status = Literal["bracketed", "above-range", "below-range"]


@dataclass(frozen=True)
class GoodputResult:
    goodput: float
    """Highest passing rate found (0 when nothing passed)."""
    status: Status
    """bracketed: a failing rate lies within rel_tol above (or probes ran out);
    above-range: nothing failed, goodput is a lower bound;
    below-range: nothing passed, the true goodput is below the lowest rate tried."""
    lowest_failing: float | None
    probes: tuple[tuple[float, float], ...]
    """Every (rate, attainment) observed, in order."""


class GoodputSearch:
    def __init__(self, config: SearchConfig) -> None:
        self.config = config
        self.observed: dict[float, float] = {}
        self.history: list[tuple[float, float]] = []
        self.probes_left = config.max_probes

    def observe(self, rate: float, attainment: float) -> None:
        self.observed[rate] = attainment
        self.history.append((rate, attainment))

    def _passes(self, rate: float) -> bool:
        return self.observed[rate] >= self.config.attainment_target - 1e-12

    def bracket(self) -> tuple[float | None, float | None]:
        """(highest passing rate below the lowest failing one, lowest failing rate)."""
        failing = [r for r in self.observed if not self._passes(r)]
        hi = min(failing) if failing else None
        passing = [r for r in self.observed if self._passes(r) and (hi is None or r < hi)]
        return (max(passing) if passing else None), hi

    def next_rate(self) -> float | None:
        """The next rate to run, None when done."""
        if self.probes_left <= 0 or not self.observed:
            return None
        lo, hi = self.bracket()
        if hi is None:
            rate = 2 * max(self.observed)
        elif lo is None:
            rate = hi / 2
        elif (hi - lo) / hi <= self.config.rel_tol:
            return None
        else:
            rate = (lo + hi) / 2
        self.probes_left -= 1
        return rate

    def result(self) -> GoodputResult:
        lo, hi = self.bracket()
        status: Status = "bracketed"
        if hi is None:
            status = "above-range"
        elif lo is None:
            status = "below-range"
        return GoodputResult(lo or 0.0, status, hi, tuple(self.history))
