"""`pdserve bench` math on constructed timelines: TTFT/TPOT/ITL summaries, SLO
attainment, the SLO scale, the goodput bisection, arrivals. No server, no clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.config import SLO, ArrivalConfig, BenchInputError, SearchConfig
from pdserve.bench.metrics import (
    attainment,
    attainment_at_scales,
    meets,
    min_slo_scale,
    prefix_cache_hit_rate,
    request_scale,
    summarize,
)
from pdserve.bench.records import RequestRecord
from pdserve.bench.results import comparison
from pdserve.bench.search import GoodputSearch
from pdserve.workload.arrivals import offsets_at, unit_offsets


def rec(i: int, ttft: float | None, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
    r = RequestRecord(i, i, 0, prompt_len=10 * (i + 1), output_len=tokens, scheduled_at=0.0)
    r.sent_at, r.ttft, r.e2e, r.output_tokens, r.itl = 0.0, ttft, e2e, tokens, itl
    r.success = ttft is not None
    if not r.success:
        r.error = "http 500: boom"
    return r


def timeline() -> list[RequestRecord]:
    """A: 4 tokens, TPOT 1/15 s; B: 11 tokens, TPOT 0.1 s; C failed; D: one token."""
    return [
        rec(0, 0.2, 0.4, 4, [0.05, 0.05, 0.1]),
        rec(1, 0.5, 1.5, 11, [0.1] * 10),
        rec(2, None, 0.01, 0, []),
        rec(3, 0.3, 0.3, 1, []),
    ]


SLO_A = SLO(ttft_s=0.4, tpot_s=0.08)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    a, b, c, d = timeline()
    assert a.tpot == pytest.approx(0.2 / 3)
    assert b.tpot == pytest.approx(0.1)
    assert c.tpot is None and d.tpot is None  # failed; a single token has no TPOT


def test_summary_counts_throughput_and_percentiles() -> None:
    s = summarize(timeline(), 2.0, SLO_A)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 10 + 20 + 40  # failed requests' prompts don't count
    assert s["total_output_tokens"] == 16
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 8.0
    assert s["total_token_throughput"] == (70 + 16) / 2.0
    # TTFT over [200, 500, 300] ms, linear interpolation as numpy / vLLM
    assert s["mean_ttft_ms"] == pytest.approx(1000 / 3)
    assert s["median_ttft_ms"] == pytest.approx(300)
    assert s["p90_ttft_ms"] == pytest.approx(460)
    assert s["p99_ttft_ms"] == pytest.approx(496)
    assert s["mean_tpot_ms"] == pytest.approx((200 / 3 + 100) / 2)
    # ITLs pooled over requests: 50, 50, 100 and ten 100s
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_itl_ms"] == pytest.approx((50 + 50 + 100 + 1000) / 13)
    assert s["median_e2el_ms"] == pytest.approx(400)
    assert s["errors"] == {"http 500": 1}
    assert s["prefix_cache_hit_rate"] is None  # no server reported cached tokens


def test_prefix_cache_hit_rate_pools_tokens_of_successful_reporting_requests() -> None:
    a, b, c, d = timeline()
    a.server_prompt_tokens, a.cached_tokens = 100, 64
    b.server_prompt_tokens, b.cached_tokens = 300, 96
    c.server_prompt_tokens, c.cached_tokens = 500, 500  # failed: not counted
    d.server_prompt_tokens, d.cached_tokens = 700, None  # no details reported: not counted
    assert prefix_cache_hit_rate([a, b, c, d]) == (64 + 96) / (100 + 300)
    assert summarize([a, b, c, d], 1.0, None)["prefix_cache_hit_rate"] == 0.4
    assert prefix_cache_hit_rate([c, d]) is None
    back = RequestRecord.from_json(a.to_json())
    assert (back.cached_tokens, back.server_prompt_tokens) == (64, 100)
    assert RequestRecord.from_json({**d.to_json(), "cached_tokens": None}).cached_tokens is None


def test_attainment_counts_failures_as_misses_and_one_token_as_tpot_met() -> None:
    a, b, c, d = timeline()
    assert meets(a, SLO_A) == (True, True, True)
    assert meets(b, SLO_A) == (False, False, True)
    assert meets(c, SLO_A) == (False, False, False)
    assert meets(d, SLO_A) == (True, True, True)
    assert attainment(timeline(), SLO_A) == 0.5
    s = summarize(timeline(), 2.0, SLO_A)
    assert (s["attainment"], s["attainment_ttft"], s["attainment_tpot"]) == (0.5, 0.5, 0.5)
    assert s["request_goodput"] == 1.0  # vLLM's: 2 good requests / 2 s
    assert attainment(timeline(), SLO(e2e_s=0.35)) == 0.25  # only D ends by 0.35 s


def test_slo_scale_per_request_curve_and_exact_minimum() -> None:
    recs = timeline()
    assert [request_scale(r, SLO_A) for r in recs] == pytest.approx(
        [0.2 / 3 / 0.08, 1.25, math.inf, 0.75]
    )
    assert attainment_at_scales(recs, SLO_A, [0.7, 0.8, 0.9, 1.3, 100]) == [
        0.0,
        0.25,
        0.5,
        0.75,
        0.75,
    ]
    assert min_slo_scale(recs, SLO_A, 0.5) == pytest.approx(0.2 / 3 / 0.08)
    assert min_slo_scale(recs, SLO_A, 0.75) == pytest.approx(1.25)
    assert min_slo_scale(recs, SLO_A, 0.9) is None  # the failure can never meet it
    # the exact minimum is where the curve reaches the target
    m = min_slo_scale(recs, SLO_A, 0.75)
    assert m is not None
    assert attainment_at_scales(recs, SLO_A, [m, m * 0.999]) == [0.75, 0.5]


def step_attainment(threshold: float):  # type: ignore[no-untyped-def]
    return lambda rate: 1.0 if rate <= threshold else 0.5


def drive(search: GoodputSearch, f, sweep: list[float]) -> list[float]:  # type: ignore[no-untyped-def]
    for r in sweep:
        search.observe(r, f(r))
    probes = []
    while (r := search.next_rate()) is not None:
        probes.append(r)
        search.observe(r, f(r))
    return probes


def test_goodput_bisects_between_last_pass_and_first_fail() -> None:
    s = GoodputSearch(SearchConfig(0.9, max_probes=4, rel_tol=0.05))
    assert drive(s, step_attainment(3.3), [1, 2, 4, 8]) == [3, 3.5, 3.25, 3.375]
    res = s.result()
    assert (res.goodput, res.status, res.lowest_failing) == (3.25, "bracketed", 3.375)
    assert [r for r, _ in res.probes] == [1, 2, 4, 8, 3, 3.5, 3.25, 3.375]


def test_goodput_stops_at_the_tolerance() -> None:
    s = GoodputSearch(SearchConfig(0.9, max_probes=10, rel_tol=0.1))
    assert drive(s, step_attainment(3.3), [1, 2, 4, 8]) == [3, 3.5, 3.25]
    assert s.result().goodput == 3.25


def test_goodput_expands_up_and_down_when_not_bracketed() -> None:
    up = GoodputSearch(SearchConfig(0.9, max_probes=3, rel_tol=0.05))
    assert drive(up, step_attainment(5), [1, 2]) == [4, 8, 6]
    assert (up.result().goodput, up.result().lowest_failing) == (4, 6)
    down = GoodputSearch(SearchConfig(0.9, max_probes=2, rel_tol=0.05))
    assert drive(down, step_attainment(1.5), [4, 8]) == [2, 1]
    assert (down.result().goodput, down.result().status) == (1, "bracketed")
    none = GoodputSearch(SearchConfig(0.9, max_probes=0))
    assert drive(none, step_attainment(0.1), [1]) == []
    assert (none.result().goodput, none.result().status) == (0.0, "below-range")
    never = GoodputSearch(SearchConfig(0.9, max_probes=0))
    drive(never, step_attainment(100), [1, 2])
    assert (never.result().goodput, never.result().status) == (2, "above-range")


def test_goodput_ignores_a_lucky_pass_above_a_failure() -> None:
    s = GoodputSearch(SearchConfig(0.9, max_probes=0))
    for rate, att in ((1, 0.95), (2, 0.80), (3, 0.92)):
        s.observe(rate, att)
    assert s.bracket() == (1, 2)
    assert s.result().goodput == 1


def test_slo_parse_in_milliseconds_like_vllm_goodput() -> None:
    slo = SLO.parse(["ttft:250", "tpot:100", "e2el:5000"])
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (0.25, 0.1, 5.0)
    assert slo.scaled(2).ttft_s == 0.5 and slo.scaled(2).tpot_s == 0.2
    with pytest.raises(BenchInputError, match="expected ttft:MS"):
        SLO.parse(["latency:3"])
    with pytest.raises(BenchInputError, match="not a number"):
        SLO.parse(["ttft:fast"])
    with pytest.raises(BenchInputError, match="positive"):
        SLO.parse(["ttft:-1"])


def test_arrivals_poisson_gamma_and_burst() -> None:
    n = 20001
    poisson = unit_offsets(n, ArrivalConfig("poisson"), seed=7)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and len(poisson) == n
    assert abs(gaps.mean() - 1) < 0.03 and abs(gaps.std() - 1) < 0.05  # exponential: CV 1
    bursty = np.diff(unit_offsets(n, ArrivalConfig("gamma", burstiness=0.25), seed=7))
    assert abs(bursty.mean() - 1) < 0.06 and abs(bursty.std() / bursty.mean() - 2) < 0.15
    assert np.array_equal(poisson, unit_offsets(n, ArrivalConfig("poisson"), seed=7))
    assert np.array_equal(offsets_at(poisson, 4.0), poisson / 4.0)  # same pattern, stretched
    assert not offsets_at(poisson, None).any()
    assert not unit_offsets(5, ArrivalConfig("burst"), seed=7).any()


def test_comparison_ratios_against_the_first_server() -> None:
    summary_a = {"request_throughput": 2.0, "median_ttft_ms": 100.0, "attainment": 0.5}
    summary_b = {"request_throughput": 3.0, "median_ttft_ms": 50.0, "attainment": 0.0}
    doc = {
        "targets": [{"label": "A"}, {"label": "B"}],
        "aggregates": [
            {"target": "A", "rate": 1.0, "phase": "sweep", "summary": summary_a},
            {"target": "B", "rate": 1.0, "phase": "sweep", "summary": summary_b},
        ],
        "goodput": {"A": {"goodput_rps": 4.0}, "B": {"goodput_rps": 6.0}},
    }
    cmp = comparison(doc)
    assert cmp is not None and cmp["baseline"] == "A"
    by_metric = {r["metric"]: r for r in cmp["rows"]}
    assert by_metric["request_throughput"]["ratios"] == {"B": 1.5}
    assert by_metric["median_ttft_ms"]["ratios"] == {"B": 0.5}
    assert by_metric["attainment"]["ratios"] == {"B": 0.0}
    assert by_metric["p99_tpot_ms"]["ratios"] == {"B": None}  # missing on both
    assert cmp["goodput"]["ratios"] == {"B": 1.5}


def test_overhead_stats_subtract_the_stub_write_time() -> None:
    from pdserve.bench.overhead import overhead_stats

    a, b = rec(0, 0.5, 0.6, 2, [0.1]), rec(1, 0.25, 0.3, 2, [0.05])
    a.sent_at, b.sent_at = 1.0, 2.0
    a.server_timings = {"stub_sent_at": 101.4999}  # client saw the token at 100 + 1 + 0.5
    b.server_timings = {"stub_sent_at": 102.2497}
    a.lag, b.lag = 0.001, 0.003
    s = overhead_stats([a, b], t0=100.0, duration=4.0)
    assert s["achieved_rps"] == 0.5 and s["failed"] == 0
    assert s["overhead_p50_ms"] == pytest.approx(0.2)  # median of 0.1 and 0.3 ms
    assert s["lag_p50_ms"] == pytest.approx(2.0)
