"""bench/bench_caching.py's pure parts: the settings and their order, per-turn TTFT,
medians over repeats, paired ratios, the tables and the plot. No server runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_caching as bc


def row(group: str, setting: str, repeat: int, **values: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict.fromkeys(bc.KEYS)
    base.update(group=group, setting=setting, repeat=repeat, experiment="x", ttft_by_turn_ms=[])
    base.update(values)
    return base


def test_every_setting_has_two_threads_and_names_its_topology() -> None:
    for name in bc.EXPERIMENTS:
        for case in bc.cases(name):
            flags = case.setting.flags
            assert flags[-2:] == ("--num-threads", "2")
            assert "--prefill" in flags and "--decode" in flags  # bench_recovery's base overridden
    fig8 = bc.cases("fig8")
    assert [(c.group, c.setting.name) for c in fig8[:4]] == [
        ("chat", "PD"),
        ("chat", "PD-CC"),
        ("chat", "1P1D"),
        ("chat", "1P1D-CC"),
    ]
    assert [c.group for c in fig8] == ["chat"] * 4 + ["docqa"] * 4 + ["react"] * 4
    assert "--no-prefix-cache" in fig8[0].setting.flags
    assert "--no-prefix-cache" not in fig8[3].setting.flags
    fig14 = bc.cases("fig14")
    assert [(c.group, c.setting.name) for c in fig14] == [
        (g, r) for g in ("docqa", "docqa share 2") for r in ("least-load", "session", "prefix")
    ]
    assert all(c.setting.flags[:4] == ("--prefill", "2", "--decode", "1") for c in fig14)
    ablation = bc.cases("ablation")
    assert [c.setting.name for c in ablation] == [
        "no cache",
        "PD-Caching-1",
        "PD-Caching-2",
        "PD-Caching-3",
    ]
    assert ablation[2].setting.flags[4:6] == ("--pd-caching", "2")
    assert {c.load.session_turns for c in ablation} == {5}


def test_ttft_by_turn_averages_successful_requests_per_turn() -> None:
    recs = [
        {"turn": 0, "success": True, "ttft_s": 0.1},
        {"turn": 0, "success": True, "ttft_s": 0.3},
        {"turn": 1, "success": False, "ttft_s": None},
        {"turn": 2, "success": True, "ttft_s": 0.05},
        {"turn": 2, "success": False, "ttft_s": 9.0},
    ]
    assert bc.ttft_by_turn(recs) == pytest.approx([200.0, None, 50.0])  # type: ignore[arg-type]
    assert bc.ttft_by_turn([]) == []


def test_medians_over_repeats_and_paired_ratios() -> None:
    rows = [
        row("docqa", "1P1D", 0, mean_ttft_ms=1000.0, prefix_cache_hit_rate=0.0),
        row("docqa", "1P1D-CC", 0, mean_ttft_ms=300.0, prefix_cache_hit_rate=0.8),
        row("docqa", "1P1D", 1, mean_ttft_ms=2000.0),
        row("docqa", "1P1D-CC", 1, mean_ttft_ms=1000.0),
        row("docqa", "1P1D", 2, mean_ttft_ms=4000.0),
        row("docqa", "1P1D-CC", 2, mean_ttft_ms=1600.0),
        row("docqa", "1P1D", 3, mean_ttft_ms=500.0),  # its pair is missing: no ratio
        row("chat", "1P1D", 0, mean_ttft_ms=1.0),
    ]
    assert bc.median_of(rows, "docqa", "1P1D", "mean_ttft_ms") == 1500.0
    assert bc.median_of(rows, "docqa", "1P1D-CC", "prefix_cache_hit_rate") == 0.8
    assert bc.median_of(rows, "docqa", "PD", "mean_ttft_ms") is None
    # per-repeat ratios 0.3, 0.5, 0.4: median 0.4 (the ratio of medians would be 0.667)
    assert bc.paired_ratio(rows, "docqa", "1P1D-CC", "1P1D", "mean_ttft_ms") == pytest.approx(0.4)
    assert bc.paired_ratio(rows, "docqa", "1P1D-CC", "1P1D", "p99_ttft_ms") is None


def test_median_by_turn_pads_missing_turns() -> None:
    rows = [
        row("chat", "A", 0, ttft_by_turn_ms=[100.0, 200.0, 300.0]),
        row("chat", "A", 1, ttft_by_turn_ms=[110.0, None]),
        row("chat", "A", 2, ttft_by_turn_ms=[90.0, 220.0]),
    ]
    assert bc.median_by_turn(rows, "chat", "A") == [100.0, 210.0, 300.0]


def test_fig8_table_rows_ratios_and_target() -> None:
    rows = []
    for rep, scale in enumerate((1.0, 2.0)):
        for setting, ttft in (
            ("PD", 800.0),
            ("PD-CC", 400.0),
            ("1P1D", 1000.0),
            ("1P1D-CC", 450.0),
        ):
            rows.append(
                row(
                    "docqa",
                    setting,
                    rep,
                    mean_ttft_ms=ttft * scale,
                    p99_ttft_ms=2 * ttft * scale,
                    mean_e2el_ms=1000 + ttft * scale,
                    p99_e2el_ms=3000.0,
                    prefix_cache_hit_rate=0.0 if "CC" not in setting else 0.75,
                )
            )
    t = bc.fig8_table(rows)
    assert t.header == (
        "workload",
        "setting",
        "mean JCT ms",
        "p99 JCT ms",
        "mean TTFT ms",
        "p99 TTFT ms",
        "hit rate",
    )
    assert [r[1] for r in t.rows] == [
        "PD",
        "PD-CC",
        "1P1D",
        "1P1D-CC",
        "1P1D-CC / 1P1D",
        "PD-CC / PD",
        "1P1D / PD",
    ]
    assert t.rows[3] == ["docqa", "1P1D-CC", "1,675", "3,000", "675", "1,350", "75.0%"]
    assert t.rows[4][4] == "0.45 (-55%)" and t.rows[4][3] == "1.00 (+0%)"
    assert t.rows[5][4] == "0.50 (-50%)"
    assert "target mean TTFT 1P1D-CC/1P1D <= 0.50 on docqa: 0.45, met" in t.notes
    md = t.markdown().splitlines()
    assert md[0].startswith("| workload") and set(md[1]) == {"|", "-"}
    assert len({len(line) for line in md}) == 1  # padded columns


def test_ablation_table_and_plot(tmp_path: Path) -> None:
    rows = [
        row("chat", "no cache", 0, ttft_by_turn_ms=[100.0, 300.0], mean_ttft_ms=200.0),
        row("chat", "PD-Caching-3", 0, ttft_by_turn_ms=[100.0, 120.0], mean_ttft_ms=110.0),
    ]
    t = bc.ablation_table(rows)
    assert t.header[:3] == ("setting", "turn 1 TTFT ms", "turn 2 TTFT ms")
    assert t.rows[0] == ["no cache", "100", "300", "200", "-", "-"]
    assert t.rows[1] == ["PD-Caching-1", "-", "-", "-", "-", "-"]
    assert t.rows[3] == ["PD-Caching-3", "100", "120", "110", "0.55 (-45%)", "-"]
    png = bc.plot_ablation(rows, tmp_path / "p.png")
    assert png is not None and png.stat().st_size > 10_000
    assert bc.plot_ablation([], tmp_path / "none.png") is None
