"""Summaries, SLO attainment and the SLO scale, from request records.

Definitions (docs/bench.md), as `vllm bench serve` and SGLang's `bench_serving`:
TTFT from send to the first text chunk; TPOT = (E2E - TTFT) / (output tokens - 1);
ITL every gap between text chunks, pooled over requests; E2E from send to the end
of the stream. Percentiles interpolate linearly (numpy's default, as vLLM). Summary
latencies are in milliseconds under vLLM's key names.

SLO attainment (DistServe §6.1): the fraction of all requests sent, failed ones
included, that met every objective set. A request with a single output token has
no TPOT and meets any TPOT objective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdserve.bench.config import SLO
from pdserve.bench.records import RequestRecord

PHASES = ("queue", "prefill", "transfer", "decode_queue", "decode")
"""Server-reported phases (`pdserve_timings`), summed into the breakdown plot."""


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 and std, in the unit given; None for no values."""
    if not values:
        return dict.fromkeys(("mean", "median", "p90", "p99", "std"))
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "median": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "std": float(a.std()),
    }


def meets(r: RequestRecord, slo: SLO) -> tuple[bool, bool, bool]:
    """(TTFT met, TPOT met, E2E met); a failed request meets nothing."""
    if not r.success or r.ttft is None or r.e2e is None:
        return False, False, False
    tpot = r.tpot
    return (
        slo.ttft_s is None or r.ttft <= slo.ttft_s,
        slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s,
        slo.e2e_s is None or r.e2e <= slo.e2e_s,
    )


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of the requests that met every objective (0 for no requests)."""
    if not records:
        return 0.0
    return sum(all(meets(r, slo)) for r in records) / len(records)


def request_scale(r: RequestRecord, slo: SLO) -> float:
    """The smallest SLO scale at which this request meets every objective (inf if failed)."""
    if not r.success or r.ttft is None or r.e2e is None:
        return math.inf
    ratios = [0.0]
    tpot = r.tpot
    if slo.ttft_s is not None:
        ratios.append(r.ttft / slo.ttft_s)
    if slo.tpot_s is not None and tpot is not None:
        ratios.append(tpot / slo.tpot_s)
    if slo.e2e_s is not None:
        ratios.append(r.e2e / slo.e2e_s)
    return max(ratios)


def attainment_at_scales(
    records: Sequence[RequestRecord], slo: SLO, scales: Iterable[float]
) -> list[float]:
    """Attainment with every objective times each scale (DistServe Fig. 8, second row):
    the latencies of one run at a fixed rate do not depend on the objectives."""
    need = [request_scale(r, slo) for r in records]
    n = len(need) or 1
    return [sum(x <= s for x in need) / n for s in scales]


def min_slo_scale(records: Sequence[RequestRecord], slo: SLO, target: float) -> float | None:
    """The smallest scale whose attainment reaches `target`, exactly: the
    ceil(target * n)-th smallest per-request scale. None if failures prevent it."""
    if not records:
        return None
    need = sorted(request_scale(r, slo) for r in records)
    k = math.ceil(target * len(need) - 1e-9)
    value = need[max(k, 1) - 1]
    return None if math.isinf(value) else value


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: SLO | None
) -> dict[str, Any]:
    """One point's summary: counts, throughput, latency distributions (ms), attainment."""
    ok = [r for r in records if r.success]
    dur = duration_s if duration_s > 0 else math.nan
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "input_throughput": in_tok / dur,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
    }
    out.update(_latencies(ok))
    out["prefix_cache_hit_rate"] = prefix_cache_hit_rate(ok)
    out.update(_server_breakdown(ok))
    sent = [1000 * r.lag for r in records if not math.isnan(r.sent_at)]
    out.update(_prefixed("lag_ms", distribution(sent)))
    out["errors"] = _error_counts(records)
    if slo is not None and slo.is_set:
        out.update(_slo_summary(records, slo, dur))
    return out


def _latencies(ok: Sequence[RequestRecord]) -> dict[str, float | None]:
    ms = 1000.0
    series = {
        "ttft": [ms * r.ttft for r in ok if r.ttft is not None],
        "tpot": [ms * t for r in ok if (t := r.tpot) is not None],
        "itl": [ms * g for r in ok for g in r.itl],
        "e2el": [ms * r.e2e for r in ok if r.e2e is not None],
    }
    out: dict[str, float | None] = {}
    for name, values in series.items():
        out.update(_prefixed(f"{name}_ms", distribution(values)))
    return out


def prefix_cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """sum(cached_tokens) / sum(server prompt tokens) over the successful requests whose
    server reported both; None when none did."""
    pairs = [
        (r.cached_tokens, r.server_prompt_tokens)
        for r in records
        if r.success and r.cached_tokens is not None and r.server_prompt_tokens
    ]
    total = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / total if total else None


def _prefixed(suffix: str, dist: dict[str, float | None]) -> dict[str, float | None]:
    return {f"{stat}_{suffix}": v for stat, v in dist.items()}


def _server_breakdown(ok: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Mean server-reported phase times (ms) over the requests that report each phase."""
    out: dict[str, float | None] = {}
    for phase in (*PHASES, "e2e"):
        values = [
            1000.0 * float(v)
            for r in ok
            if r.server_timings and isinstance(v := r.server_timings.get(phase), int | float)
        ]
        out[f"mean_server_{phase}_ms"] = float(np.mean(values)) if values else None
    return out


def _slo_summary(records: Sequence[RequestRecord], slo: SLO, dur: float) -> dict[str, Any]:
    n = len(records) or 1
    flags = [meets(r, slo) for r in records]
    good = sum(all(f) for f in flags)
    return {
        "attainment": good / n,
        "attainment_ttft": sum(f[0] for f in flags) / n,
        "attainment_tpot": sum(f[1] for f in flags) / n,
        "attainment_e2e": sum(f[2] for f in flags) / n,
        "request_goodput": good / dur,  # vLLM's "goodput": requests meeting the SLO per second
    }


def _error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            key = (r.error or "unknown").split(":")[0]
            counts[key] = counts.get(key, 0) + 1
    return counts
