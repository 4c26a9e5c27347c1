"""The highest rate at which a simulated system still meets its SLO attainment target.

Attainment falls (not always strictly) as the rate grows, so the search brackets the
answer by doubling or halving from a first guess, then bisects the bracket to a
relative tolerance: DistServe Alg. 1's "binary search for the max rate".
"""

from __future__ import annotations

from collections.abc import Callable

MIN_RATE = 1e-6
MAX_RATE = 1e7


def max_rate(
    attainment_at: Callable[[float], float],
    target: float,
    guess: float,
    rel_tol: float = 0.02,
) -> float:
    """Largest rate (requests/s, within `rel_tol`) whose attainment is >= target; 0.0 if
    none above MIN_RATE is."""
    guess = min(max(guess, MIN_RATE), MAX_RATE)
    lo, hi = _bracket(attainment_at, target, guess)
    if lo == 0.0:
        return 0.0
    while hi - lo > rel_tol * lo:
        mid = 0.5 * (lo + hi)
        if attainment_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def _bracket(
    attainment_at: Callable[[float], float], target: float, r: float
) -> tuple[float, float]:
    """(passing rate, failing rate) around the answer; (0, r) when nothing passes."""
    if attainment_at(r) >= target:
        while r < MAX_RATE:
            nxt = 2.0 * r
            if attainment_at(nxt) < target:
                return r, nxt
            r = nxt
        return r, r
    while r > MIN_RATE:
        nxt = 0.5 * r
        if attainment_at(nxt) >= target:
            return nxt, r
        r = nxt
    return 0.0, r
