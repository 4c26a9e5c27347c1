"""bench/bench_recovery.py's pure helpers, without servers or the model's tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_recovery as br


def fake_ids(text: str) -> list[int]:
    """A BOS, then one token per word and a second one for words longer than 4 letters."""
    return [0] + [t for w in text.split() for t in ([1, 2] if len(w) > 4 else [1])]


@pytest.mark.parametrize("n", [2, 3, 20, 37, 60, 500])
def test_exact_prompt_has_exactly_n_tokens(n: int) -> None:
    for offset in range(3):
        assert len(fake_ids(br.exact_prompt(fake_ids, n, offset))) == n


def test_exact_prompt_refuses_an_impossible_count() -> None:
    with pytest.raises(ValueError):
        br.exact_prompt(fake_ids, 1)  # the BOS alone is 1; any word adds more


def test_mixed_lengths_stay_in_range_and_vary() -> None:
    lengths = br.mixed_lengths(64, 20, 60)
    assert len(lengths) == 64 and min(lengths) >= 20 and max(lengths) <= 60
    assert len(set(lengths)) > 30


def test_gap_figures() -> None:
    arrivals = [0.0, 0.1, 0.2, 1.5, 1.6]
    assert br.max_gap(arrivals) == pytest.approx(1.3)
    assert br.kill_gap(arrivals, 0.25) == pytest.approx(1.3)
    assert br.kill_gap(arrivals, 2.0) is None
    assert br.first_after(arrivals, 0.25) == 1.5
    assert br.gaps_before(arrivals, 0.25) == pytest.approx([0.1, 0.1])
    assert br.tpot(arrivals) == pytest.approx(0.4)
    assert br.tpot([1.0]) is None


def test_stall_figures_pick_streams_by_the_gap_heuristic() -> None:
    victim = br.StreamRecord(arrivals=[0.0, 0.1, 0.2, 2.0, 2.1])
    survivor = br.StreamRecord(arrivals=[0.05, 0.15, 0.25, 0.35, 0.45])
    normal, kill, after, recovery, on_victim = br.stall_figures([victim, survivor], 0.22, 3.0)
    assert normal == pytest.approx(0.1)
    assert kill == pytest.approx([1.8, 0.1])
    assert after == pytest.approx([1.8, 0.1])
    assert recovery == pytest.approx([1.78, 0.03])
    assert on_victim == [True, False]


def test_rotated_and_ratio() -> None:
    assert br.rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert br.ratio(3.0, 2.0) == 1.5 and br.ratio(None, 2.0) is None and br.ratio(1.0, 0.0) is None


def test_summaries_use_the_same_repeats_baseline() -> None:
    def run(config: str, repeat: int, latency: float, text: str = "t") -> dict:
        return {
            "config": config,
            "repeat": repeat,
            "latency_s": latency,
            "stall_s": 0.1,
            "detection_s": None,
            "recovery_s": None,
            "text": text,
            "error": None,
        }

    runs = [run("baseline", 0, 10), run("recompute", 0, 12), run("baseline", 1, 20)]
    runs += [run("recompute", 1, 26, text="other")]
    rows = {r["config"]: r for r in br.summarize_fig10(runs)}
    assert rows["recompute"]["vs_baseline"] == pytest.approx(1.25)  # median of 1.2, 1.3
    assert rows["recompute"]["text_equal"] is False
    assert rows["baseline"]["text_equal"] is True

    over = [
        {"config": c, "level": 4, "repeat": rep, "tpot_s": [t, t], "ok": 2}
        for c, rep, t in [("off", 0, 0.10), ("on", 0, 0.11), ("off", 1, 0.20), ("on", 1, 0.20)]
    ]
    (row,) = br.summarize_overhead(over, [4])
    assert row["ratio"] == pytest.approx(0.155 / 0.15)
    assert row["ratio_per_repeat_median"] == pytest.approx(1.05)
    assert row["failed"] == 0


def test_parse_args_refuses_bad_choices() -> None:
    with pytest.raises(SystemExit):
        br.parse_args(["--parts", "fig11"])
    with pytest.raises(SystemExit):
        br.parse_args(["--fig10-kill-at", "1000"])
    args = br.parse_args(["--parts", "stall", "--fig10-configs", "baseline,restart"])
    assert args.parts == ["stall"] and args.fig10_configs == ["baseline", "restart"]
