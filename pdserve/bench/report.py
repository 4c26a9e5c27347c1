"""The terminal report: one row per (server, rate), goodput, ratios, failures."""

from __future__ import annotations

from typing import Any

from pdserve.bench.results import rate_text

COLUMNS = (
    ("server", "target", "s"),
    ("rate", "rate", "r"),
    ("ok/sent", None, "n"),
    ("req/s", "request_throughput", ".2f"),
    ("out tok/s", "output_throughput", ".1f"),
    ("TTFT p50", "median_ttft_ms", ".1f"),
    ("TTFT p99", "p99_ttft_ms", ".1f"),
    ("TPOT p50", "median_tpot_ms", ".2f"),
    ("TPOT p99", "p99_tpot_ms", ".2f"),
    ("ITL p50", "median_itl_ms", ".2f"),
    ("E2E p50", "median_e2el_ms", ".1f"),
    ("attain", "attainment", "%"),
    ("cache hit", "prefix_cache_hit_rate", "%"),
    ("lag p99", "p99_lag_ms", ".2f"),
)


def render(doc: dict[str, Any]) -> str:
    w = doc["workload"]
    out = [f"workload {w['name']}: {w['num_requests']} requests, {w['num_sessions']} sessions"]
    out.append("latencies in ms; rate in requests/s (inf: all at once); lag: client delay")
    out.append(_table([_row(a) for a in doc["aggregates"]]))
    out.extend(_goodput_lines(doc))
    out.extend(_scale_lines(doc))
    if doc.get("comparison"):
        out.append(_comparison(doc["comparison"]))
    out.extend(_failure_lines(doc))
    return "\n".join(out)


def _row(agg: dict[str, Any]) -> list[str]:
    s = agg["summary"]
    cells = []
    for _, key, fmt in COLUMNS:
        if fmt == "s":
            cells.append(str(agg["target"]))
        elif fmt == "r":
            cells.append(rate_text(agg["rate"]) + ("*" if agg["phase"] == "search" else ""))
        elif fmt == "n":
            cells.append(f"{s['completed']}/{s['num_requests']}")
        else:
            cells.append(_num(s.get(key or ""), fmt))
    return cells


def _num(v: Any, fmt: str) -> str:
    if not isinstance(v, int | float) or v != v:
        return "-"
    if fmt == "%":
        return f"{100 * v:.1f}%"
    return format(v, fmt)


def _table(rows: list[list[str]], header: tuple[str, ...] | None = None) -> str:
    head = list(header or (c[0] for c in COLUMNS))
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(h.rjust(wd) for h, wd in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(wd) for c, wd in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _goodput_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for label, g in doc.get("goodput", {}).items():
        bound = {
            "above-range": " (lower bound: no rate failed)",
            "below-range": " (every rate tried failed)",
        }.get(g["status"], "")
        out.append(
            f"goodput {label}: {g['goodput_rps']:.3g} req/s at {100 * g['attainment_target']:g}%"
            f" attainment, {g['per_instance_rps']:.3g} req/s per instance"
            f" ({g['num_instances']}){bound}  (* = search probe)"
        )
    return out


def _scale_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for label, curves in doc.get("slo_scale", {}).items():
        for c in curves:
            m = c["min_scale"]
            text = "never (failures)" if m is None else f"{m:.3g}"
            out.append(
                f"tightest SLO scale meeting the target, {label} @ "
                f"{rate_text(c['rate'])} req/s: {text}"
            )
    return out


def _comparison(cmp: dict[str, Any]) -> str:
    base = cmp["baseline"]
    rows = cmp["rows"]
    labels = list(rows[0]["values"]) if rows else []
    others = [lab for lab in labels if lab != base]
    head = ("rate", "metric", *labels, *(f"{o}/{base}" for o in others))
    table = []
    for r in rows:
        fmt = "%" if r["metric"] in ("attainment", "prefix_cache_hit_rate") else ".3g"
        vals = [_num(r["values"][lab], fmt) for lab in labels]
        ratios = [_num(r["ratios"][o], ".3f") for o in others]
        table.append([rate_text(r["rate"]), r["title"], *vals, *ratios])
    text = "comparison (ratio > 1: more of the metric than the baseline)\n" + _table(table, head)
    g = cmp.get("goodput")
    if g:
        parts = ", ".join(f"{o}/{base} = {_num(g['ratios'][o], '.3f')}" for o in others)
        text += f"\ngoodput ratio: {parts}"
    return text


def _failure_lines(doc: dict[str, Any]) -> list[str]:
    out = []
    for a in doc["aggregates"]:
        errs = a["summary"].get("errors") or {}
        if errs:
            what = ", ".join(f"{k}: {v}" for k, v in sorted(errs.items()))
            out.append(f"failed requests {a['target']} @ {rate_text(a['rate'])}: {what}")
    return out
