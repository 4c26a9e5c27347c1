"""The results document: every run with its records and summary, then the aggregates,
goodput, SLO-scale curves and ratios. Plain JSON, so plots and tables are rebuilt from
the file alone (`pdserve bench plot`). Latency summaries are in ms (vLLM's keys);
records in seconds (`*_s`)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench import metrics
from pdserve.bench.config import SLO, SearchConfig, Target
from pdserve.bench.records import RequestRecord
from pdserve.bench.search import GoodputResult
from pdserve.bench.workloads.spec import Workload

if TYPE_CHECKING:
    from pdserve.bench.runner import RunOutcome

FORMAT = "pdserve-bench/1"

COMPARED = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "median TTFT ms"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("median_tpot_ms", "median TPOT ms"),
    ("p99_tpot_ms", "p99 TPOT ms"),
    ("median_itl_ms", "median ITL ms"),
    ("median_e2el_ms", "median E2E ms"),
    ("attainment", "SLO attainment"),
    ("prefix_cache_hit_rate", "prefix cache hit rate"),
)
"""Metrics a comparison reports as ratios (server / baseline)."""


def rate_text(rate: float | None) -> str:
    return "inf" if rate is None else f"{rate:g}"


def new_document(
    settings: dict[str, Any], workload: Workload, slo: SLO, search: SearchConfig
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "settings": settings,
        "workload": {
            "name": workload.name,
            "num_requests": workload.num_requests,
            "num_sessions": len(workload.sessions),
            "params": workload.params,
        },
        "slo": slo_json(slo, search),
        "targets": [],
        "runs": [],
        "aggregates": [],
        "goodput": {},
        "slo_scale": {},
        "comparison": None,
        "complete": False,
    }


def slo_json(slo: SLO, search: SearchConfig) -> dict[str, Any]:
    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000.0

    return {
        "ttft_ms": ms(slo.ttft_s),
        "tpot_ms": ms(slo.tpot_s),
        "e2el_ms": ms(slo.e2e_s),
        "attainment_target": search.attainment_target,
    }


def slo_of(doc: dict[str, Any]) -> SLO:
    s = doc["slo"]

    def sec(v: float | None) -> float | None:
        return None if v is None else v / 1000.0

    return SLO(sec(s.get("ttft_ms")), sec(s.get("tpot_ms")), sec(s.get("e2el_ms")))


def target_json(
    t: Target, model: str | None, num_instances: int, card: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "label": t.label,
        "base_url": t.base_url,
        "endpoint": t.endpoint,
        "model": model,
        "num_instances": num_instances,
        "model_card": card,
    }


def add_run(
    doc: dict[str, Any],
    label: str,
    rate: float | None,
    repeat: int,
    phase: str,
    outcome: RunOutcome,
    slo: SLO,
) -> None:
    doc["runs"].append(
        {
            "target": label,
            "rate": rate,
            "repeat": repeat,
            "phase": phase,
            "t0_perf_counter": outcome.t0,
            "duration_s": outcome.duration_s,
            "summary": metrics.summarize(outcome.records, outcome.duration_s, slo),
            "records": [r.to_json() for r in outcome.records],
        }
    )


def add_goodput(
    doc: dict[str, Any], label: str, res: GoodputResult, instances: int, search: SearchConfig
) -> None:
    doc["goodput"][label] = {
        "goodput_rps": res.goodput,
        "per_instance_rps": res.goodput / instances,
        "num_instances": instances,
        "status": res.status,
        "lowest_failing_rps": res.lowest_failing,
        "attainment_target": search.attainment_target,
        "probes": [{"rate": r, "attainment": a} for r, a in res.probes],
    }


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_json(r) for r in run["records"]]


def pooled(doc: dict[str, Any]) -> dict[tuple[str, float | None], list[dict[str, Any]]]:
    """Runs grouped by (server, rate), in first-run order."""
    groups: dict[tuple[str, float | None], list[dict[str, Any]]] = {}
    for run in doc["runs"]:
        groups.setdefault((run["target"], run["rate"]), []).append(run)
    return groups


def finish(doc: dict[str, Any], slo: SLO, search: SearchConfig, scales: Sequence[float]) -> None:
    """Aggregates over repeats, SLO-scale curves and the comparison (recomputed whole)."""
    doc["aggregates"] = []
    doc["slo_scale"] = {}
    for (label, rate), runs in pooled(doc).items():
        recs = [r for run in runs for r in records_of(run)]
        duration = sum(run["duration_s"] for run in runs)
        summary = metrics.summarize(recs, duration, slo)
        phase = runs[0]["phase"]
        doc["aggregates"].append(
            {"target": label, "rate": rate, "phase": phase, "runs": len(runs), "summary": summary}
        )
        if slo.is_set and phase == "sweep":
            curve = {
                "rate": rate,
                "scales": list(scales),
                "attainment": metrics.attainment_at_scales(recs, slo, scales),
                "min_scale": metrics.min_slo_scale(recs, slo, search.attainment_target),
            }
            doc["slo_scale"].setdefault(label, []).append(curve)
    doc["comparison"] = comparison(doc)


def finish_loaded(doc: dict[str, Any]) -> None:
    """`finish` for a file a run left incomplete (interrupted): from its own settings."""
    scales = doc.get("settings", {}).get("plan", {}).get("slo_scales") or []
    target = doc["slo"]["attainment_target"]
    finish(doc, slo_of(doc), SearchConfig(attainment_target=target), scales)


def comparison(doc: dict[str, Any]) -> dict[str, Any] | None:
    """Every compared metric per sweep rate: values per server and ratio to the first."""
    labels = [t["label"] for t in doc["targets"]]
    if len(labels) < 2:
        return None
    base = labels[0]
    by_key = {(a["target"], a["rate"]): a["summary"] for a in doc["aggregates"]}
    rates = [a["rate"] for a in doc["aggregates"] if a["target"] == base and a["phase"] == "sweep"]
    rows = []
    for rate in rates:
        for key, title in COMPARED:
            values = {lab: by_key.get((lab, rate), {}).get(key) for lab in labels}
            rows.append(
                {
                    "rate": rate,
                    "metric": key,
                    "title": title,
                    "values": values,
                    "ratios": _ratios(values, base),
                }
            )
    goodput = {lab: g["goodput_rps"] for lab, g in doc["goodput"].items()}
    out: dict[str, Any] = {"baseline": base, "rows": rows}
    if len(goodput) == len(labels):
        out["goodput"] = {"values": goodput, "ratios": _ratios(dict(goodput), base)}
    return out


def _ratios(values: dict[str, Any], base: str) -> dict[str, float | None]:
    b = values.get(base)
    out: dict[str, float | None] = {}
    for lab, v in values.items():
        if lab == base:
            continue
        ok = isinstance(v, int | float) and isinstance(b, int | float) and b != 0
        out[lab] = v / b if ok else None
    return out


def save_json(doc: dict[str, Any], path: Path) -> None:
    """Atomically: a reader never sees half a file, a crash leaves the previous one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(_finite(doc), f, allow_nan=False)
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """NaN and infinities as null: strict JSON that every reader accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def load_json(path: Path) -> dict[str, Any]:
    from pdserve.bench.config import BenchInputError

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchInputError(f"{path}: cannot read results ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BenchInputError(f"{path}: not a pdserve bench results file")
    return doc
