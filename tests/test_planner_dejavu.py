"""DéjàVu App. D: the prompt/token machine split, equation by equation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main as cli_main
from pdserve.planner.dejavu import (
    balanced_split,
    best_integer_split,
    dejavu_split,
    disaggregation_helps,
    inverse_throughput_colocated,
    inverse_throughputs,
    min_prompt_depth,
    min_token_depth,
)
from pdserve.planner.hardware import datasheet_profile
from pdserve.planner.model_spec import PRESETS, PlanInputError


def test_memory_bounds_eq2_eq3() -> None:
    # L = 10 layers, C0 = 1, W0 = 4, K0 = 0.5, M = 20 (any unit)
    assert min_prompt_depth(10, 1.0, 4.0, 20.0) == 3  # ceil(10 * 5 / 20)
    assert min_token_depth(10, 4.0, 1.0, 0.5, 20.0) == 8  # ceil(40 / (20 - 15))
    assert min_token_depth(10, 4.0, 1.5, 0.5, 20.0) is None  # M <= L (C0 + K0)


def test_throughput_equations_eq4_to_eq7() -> None:
    d, y, t, n = 4, 10.0, 1.0, 100
    assert inverse_throughput_colocated(d, y, t, n) == pytest.approx(3 * 9 / 4 + 10 + 100)
    assert inverse_throughputs(d, 1, 3, y, t, n, 1.0) == pytest.approx((40.0, 400 / 3))
    d_p, d_t = balanced_split(d, y, t, n, 1.0)
    assert d_t == pytest.approx(4 * 100 / 110)
    assert d_p == pytest.approx(4 * 10 / 110)
    i_p, i_t = inverse_throughputs(d, d_p, d_t, y, t, n, 1.0)  # type: ignore[arg-type]
    assert i_p == pytest.approx(i_t)


def test_eq5_condition_and_its_boundary() -> None:
    # D = 4, m = 1: Y/t must exceed 3 / (4 - 1) = 1
    assert disaggregation_helps(4, 1.01, 1.0, 1.0)
    assert not disaggregation_helps(4, 1.0, 1.0, 1.0)
    # m = 1.5: bound 3 / (4 * 0.5 - 1) = 3
    assert disaggregation_helps(4, 3.01, 1.0, 1.5) and not disaggregation_helps(4, 3.0, 1.0, 1.5)
    # m >= 2 - 1/D: no Y/t is enough; m >= 2: never
    assert not disaggregation_helps(4, 1e9, 1.0, 1.75)
    assert not disaggregation_helps(4, 1e9, 1.0, 2.0)


@pytest.mark.parametrize(("lo_p", "lo_t"), [(1, 1), (2, 1), (1, 5), (3, 4)])
def test_integer_split_is_the_argmin_within_the_bounds(lo_p: int, lo_t: int) -> None:
    d, y, t, n, m = 10, 30.0, 0.5, 200, 1.2
    got = best_integer_split(d, lo_p, lo_t, y, t, n, m)
    assert got is not None
    brute = min(
        (max(inverse_throughputs(d, p, d - p, y, t, n, m)), p)
        for p in range(1, d)
        if p >= lo_p and d - p >= lo_t
    )
    assert got == (brute[1], d - brute[1])
    assert best_integer_split(d, 6, 5, y, t, n, m) is None


def test_opt66b_on_four_a100_machines_splits_evenly_like_the_paper() -> None:
    # DejaVu Table 3 (OPT-66B, 4 x A100-80GB per machine, prompt 1000): 4 machines ->
    # ((2p, 32b), (2p, 32b)). Our datasheet-estimated Y and t give the same split and
    # micro-batch. (With 8 and 16 machines we get 3/5 and 7/9 where the paper has 4/4 and
    # 8/8: its token counts follow the LMSys trace with early stops, which lighten the
    # token pipeline; we assume every request generates N tokens.)
    plan = dejavu_split(PRESETS["opt-66b"], datasheet_profile("a100"), 4, 4, 1000, 200)
    assert (plan.prompt_depth, plan.token_depth, plan.microbatch) == (2, 2, 32)
    assert plan.eq5_holds and plan.speedup > 1
    assert plan.min_prompt_depth + plan.min_token_depth <= 4
    d = plan.to_dict()
    assert d["throughput_rps"] == pytest.approx(32 / max(plan.i_prompt_s, plan.i_token_s))
    assert "datasheet ESTIMATE" in plan.describe()


def test_bad_inputs_name_the_numbers() -> None:
    hw = datasheet_profile("a100")
    with pytest.raises(PlanInputError, match="needs >= 2 machines, got 1"):
        dejavu_split(PRESETS["opt-13b"], hw, 1, 8, 100, 10)
    with pytest.raises(PlanInputError, match=r"streaming overhead m must be >= 1, got 0\.5"):
        dejavu_split(PRESETS["opt-13b"], hw, 2, 8, 100, 10, streaming_overhead=0.5)
    with pytest.raises(PlanInputError, match=r"weights 347.9 GB > 2 machines x 72.0 GB usable"):
        dejavu_split(PRESETS["opt-175b"], hw, 2, 1, 100, 10)


def test_cli_dejavu_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dj.json"
    argv = ["plan", "--planner", "dejavu", "--model", "opt-66b", "--hardware", "a100"]
    argv += ["--nodes", "4", "--devices-per-node", "4", "--output", str(out)]
    assert cli_main(argv) == 0
    assert "D_p = 2, D_t = 2" in capsys.readouterr().out
    assert json.loads(out.read_text())["prompt_depth"] == 2
