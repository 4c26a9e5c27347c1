"""`pdserve profile`: the least-squares fit and real engine steps on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.tiny_models import make_tiny_model

from pdserve.cli import main as cli_main
from pdserve.planner.fit import fit_coefficients, fit_step_model, nnls
from pdserve.planner.hardware import load_profile
from pdserve.planner.latency import step_features
from pdserve.planner.model_spec import PRESETS, PlanInputError

SPEC = PRESETS["llama-2-7b"]


def _grid() -> list[tuple[int, int, int, int, int]]:
    rows = [(n, n * n, 1, 0, 0) for n in (16, 64, 256, 1024)]
    rows += [(2 * n, 2 * n * n, 2, 0, 0) for n in (32, 128)]
    rows += [(0, 0, 0, b, b * c) for b in (1, 8, 32) for c in (64, 512)]
    rows += [(n, n * n, 1, b, b * 100) for n, b in ((64, 4), (256, 16))]
    return rows


def test_fit_recovers_known_coefficients() -> None:
    truth = np.array([3e-12, 2e-11, 4e-3, 1e-11, 5e-11, 6e-12])  # c1..c6
    feats = np.array([step_features(SPEC, *r) for r in _grid()])
    times = feats @ truth
    res = fit_coefficients(feats, times, SPEC.weight_bytes, bandwidth=500e9)
    c = res.coefficients
    for got, want in zip((c.c1, c.c2, c.c5, c.c6), truth[[0, 1, 4, 5]], strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    intercept = truth[2] + truth[3] * SPEC.weight_bytes
    assert c.c3 + c.c4 * SPEC.weight_bytes == pytest.approx(intercept, rel=1e-6)
    assert c.c4 == pytest.approx(1 / 500e9)  # from the bandwidth: under 90% of the intercept
    assert np.abs(res.train_errors).max() < 1e-6
    # a slower copy bandwidth would claim more than the intercept: c4 is capped at 90%
    slow = fit_coefficients(feats, times, SPEC.weight_bytes, bandwidth=50e9).coefficients
    assert slow.c4 * SPEC.weight_bytes == pytest.approx(0.9 * intercept, rel=1e-6)


def test_fit_on_skewed_noise_keeps_the_measured_total() -> None:
    """Steps slowed by right-skewed noise (as on a shared machine): relative least
    squares alone would land below the mean; the fit's totals equal the measured ones."""
    truth = np.array([3e-12, 2e-11, 4e-3, 1e-11, 5e-11, 6e-12])
    feats = np.array([step_features(SPEC, *r) for r in _grid() * 20])
    rng = np.random.default_rng(0)
    times = feats @ truth * (1 + rng.exponential(0.3, len(feats)))
    res = fit_coefficients(feats, times, SPEC.weight_bytes, bandwidth=500e9)
    c = res.coefficients
    full = np.array([c.c1, c.c2, c.c3, c.c4, c.c5, c.c6])
    assert (feats @ full).sum() == pytest.approx(times.sum(), rel=1e-9)
    assert res.mean_scale > 1.0
    assert res.stats()["mean_scale"] == res.mean_scale


def test_fit_finds_the_knee_of_decode_steps() -> None:
    """Steps made by a model with a knee of 6 rows: the search over knees finds it, and
    with it the coefficients; the plain linear model (knee 0) fits worse."""
    truth = np.array([3e-12, 2e-11, 4e-3, 1e-11, 5e-11, 6e-12])
    counts = _grid() + [(0, 0, 0, b, b * 200) for b in (2, 4, 6, 12, 16, 64)]
    feats = np.array([step_features(SPEC, *r, knee=6) for r in counts])
    times = feats @ truth
    res = fit_step_model(SPEC, counts, times, bandwidth=500e9)
    c = res.coefficients
    assert c.knee == 6.0
    for got, want in zip((c.c1, c.c2, c.c5, c.c6), truth[[0, 1, 4, 5]], strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert np.abs(res.train_errors).max() < 1e-6
    assert res.stats()["knee"] == 6.0
    linear = fit_step_model(SPEC, counts, times, bandwidth=500e9, knees=(0,))
    assert linear.coefficients.knee == 0.0 and linear.objective > 1e3 * res.objective


def test_nnls_is_non_negative_and_optimal() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 6))
    b = a @ np.array([1.0, -2.0, 0.5, 0.0, -0.1, 3.0]) + rng.normal(scale=0.1, size=40)
    x = nnls(a, b)
    assert (x >= 0).all() and (x == 0).any()
    grad = a.T @ (b - a @ x)
    assert np.allclose(grad[x > 0], 0, atol=1e-8)  # KKT: free coordinates are stationary
    assert (grad[x == 0] <= 1e-8).all()  # and no bound one wants to grow


def test_fit_refuses_data_that_cannot_separate_the_coefficients() -> None:
    feats = np.array([step_features(SPEC, 0, 0, 0, 8, 8 * c) for c in (64, 128, 256)] * 2)
    feats[:, 0] = feats[:, 1] = 0
    feats[:, 4] = feats[:, 5] * 2  # context proportional to the decode FLOPs
    with pytest.raises(PlanInputError, match="cannot separate the coefficients"):
        fit_coefficients(feats, np.ones(len(feats)), SPEC.weight_bytes, 50e9)


def test_profile_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    out = tmp_path / "profile.json"
    argv = ["profile", str(model), "--quick", "--repeats", "1", "--threads", "1"]
    assert cli_main([*argv, "--output", str(out)]) == 0
    assert "held-out median" in capsys.readouterr().out
    hw = load_profile(str(out))
    assert hw.kind == "measured" and not hw.is_estimate
    points = json.loads(out.read_text())["fit"]["points"]
    counts = [tuple(p["counts"]) for p in points]
    # a prefill-only step of 4 prompts of 8 tokens: 32 tokens, 4 x 8^2 units, 4 finishing
    assert (32, 256, 4, 0, 0) in counts
    # the first decode step of 4 requests with 32-token prompts: each attends over 33
    assert (0, 0, 0, 4, 4 * 33) in counts and (0, 0, 0, 4, 4 * 36) in counts
    # a mixed step: 2 decodes (16-token prompts, second decode step) + a 16-token prompt
    assert (16, 256, 1, 2, 2 * 18) in counts
    assert sum(p["heldout"] for p in points) >= 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/model"], "no such model file or folder"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--dtype", "int8"], "--dtype must be float32"),
    ],
)
def test_profile_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli_main(["profile", *args, "--output", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()
