"""Least-squares fit of the latency coefficients (pure numpy; no engine).

Each measured step is a row of features (`latency.step_features`, coefficient order
c1..c6) and a time. The fit minimises *relative* error (every row divided by its
time, so a 20 ms decode step counts as much as a 2 s prefill) under c >= 0
(Lawson-Hanson non-negative least squares).

c3 (fixed per step) and c4 (per weight byte) multiply columns that are both constant
for one model, so only their sum is identifiable from one model's steps: the fit
finds the intercept, and `split_intercept` gives c4 the share the machine's measured
memory bandwidth implies (at most 90% of it), c3 the rest.

The knee (`latency.decode_rows`) enters the features, not the coefficients: the fit
is repeated for every candidate knee in `KNEES` and keeps the one with the least
relative squared error (`fit_step_model`).

Relative error alone would bias the fit low on noisy steps (a step 40% slow costs
more than one 40% fast is worth), while queueing depends on the *mean* service time:
so the fitted coefficients are finally scaled together until the predicted total of
the fitted steps equals their measured total (`mean_scale`, 1.0 on noise-free data).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.planner.latency import Coefficients, step_features
from pdserve.planner.model_spec import ModelSpec, PlanInputError

# Columns of step_features: c1 prompt FLOPs, c2 attention, c3 one, c4 weight bytes,
# c5 KV bytes, c6 decode FLOPs. Fitted: all but c4 (folded into the intercept c3).
FITTED = (0, 1, 2, 4, 5)
# Candidate knees (decode rows a step's weight read covers). A CPU's ridge is a few
# rows; a profile measured on a GPU would need a longer list.
KNEES = tuple(range(0, 65))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson & Hanson, 1974)."""
    _, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-12 * max(1.0, float(np.abs(w).max()))
    for _ in range(max_iter):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


@dataclass(frozen=True)
class FitResult:
    coefficients: Coefficients
    train_errors: np.ndarray  # relative errors of the fitted rows
    heldout_errors: np.ndarray  # relative errors of rows never used to fit
    mean_scale: float = 1.0  # the factor that made predicted and measured totals equal
    objective: float = 0.0  # sum of squared relative errors of the fit (before scaling)

    def stats(self) -> dict[str, float]:
        def q(a: np.ndarray, p: float) -> float:
            return float(np.percentile(np.abs(a), p)) if len(a) else float("nan")

        return {
            "train_median_rel_error": q(self.train_errors, 50),
            "train_p90_rel_error": q(self.train_errors, 90),
            "heldout_median_rel_error": q(self.heldout_errors, 50),
            "heldout_p90_rel_error": q(self.heldout_errors, 90),
            "train_points": len(self.train_errors),
            "heldout_points": len(self.heldout_errors),
            "mean_scale": self.mean_scale,
            "knee": self.coefficients.knee,
        }


def fit_coefficients(
    features: np.ndarray,
    times: np.ndarray,
    weight_bytes: float,
    bandwidth: float,
    heldout: np.ndarray | None = None,
    knee: float = 0.0,
) -> FitResult:
    """Fit on the rows not marked `heldout`; report relative errors of both sets.
    `features` are `step_features` computed with `knee`, which the result carries."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != 6 or len(x) != len(y):
        raise PlanInputError("features must be an (n, 6) array with one time per row")
    held = np.zeros(len(y), dtype=bool) if heldout is None else np.asarray(heldout, dtype=bool)
    train = ~held
    cols = list(FITTED)
    a = x[train][:, cols]
    used = [i for i, c in enumerate(cols) if np.any(a[:, i] != 0)]
    if np.linalg.matrix_rank(a[:, used]) < len(used):
        raise PlanInputError(
            "the measured steps cannot separate the coefficients: profile prefill-only, "
            "decode-only and mixed steps of several sizes"
        )
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    rel = a / scale / y[train, None]
    sol = np.zeros(len(cols))
    sol[used] = nnls(rel[:, used], np.ones(int(train.sum())))
    coef = sol / scale
    objective = float(np.sum(((a @ coef) / y[train] - 1.0) ** 2))
    fitted = float((a @ coef).sum())
    mean_scale = float(y[train].sum()) / fitted if fitted > 0 else 1.0
    c1, c2, intercept, c5, c6 = coef * mean_scale
    c3, c4 = split_intercept(float(intercept), weight_bytes, bandwidth)
    coeffs = Coefficients(float(c1), float(c2), c3, c4, float(c5), float(c6), float(knee))
    full = np.array([c1, c2, c3, c4, c5, c6])
    pred = x @ full
    err = (pred - y) / y
    return FitResult(coeffs, err[train], err[held], mean_scale, objective)


def fit_step_model(
    spec: ModelSpec,
    counts: Sequence[tuple[int, int, int, int, int]],
    times: np.ndarray,
    bandwidth: float,
    heldout: np.ndarray | None = None,
    knees: Sequence[float] = KNEES,
) -> FitResult:
    """The best fit over `knees`: steps given as (prompt tokens, attention units,
    prompts finishing, decode tokens, context tokens) and their times. A knee whose
    features cannot separate the coefficients is skipped; if every one fails, the
    first failure is raised."""
    base = np.array([step_features(spec, *c) for c in counts])  # knee 0
    c = np.asarray(counts, dtype=np.float64).reshape(-1, 5)
    prompt, decode = c[:, 0], c[:, 3]
    per_row = step_features(spec, 0, 0, 0, 1, 0)[5]  # decode FLOPs of one row
    best: FitResult | None = None
    error: PlanInputError | None = None
    for knee in knees:
        feats = base.copy()  # only the c6 column depends on the knee (`decode_rows`)
        rows = np.maximum(prompt + decode - knee, 0) - np.maximum(prompt - knee, 0)
        feats[:, 5] = per_row * rows
        try:
            res = fit_coefficients(feats, times, spec.weight_bytes, bandwidth, heldout, knee)
        except PlanInputError as e:
            error = error or e
            continue
        if best is None or res.objective < best.objective:
            best = res
    if best is None:
        raise error or PlanInputError("no candidate knee to fit")
    return best


def split_intercept(intercept: float, weight_bytes: float, bandwidth: float) -> tuple[float, float]:
    """(c3, c4) summing to `intercept` for this model: c4 from the bandwidth, capped."""
    if weight_bytes <= 0 or bandwidth <= 0 or intercept <= 0:
        return max(intercept, 0.0), 0.0
    c4 = min(1.0 / bandwidth, 0.9 * intercept / weight_bytes)
    return intercept - c4 * weight_bytes, c4
