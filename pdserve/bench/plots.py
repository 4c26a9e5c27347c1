"""PNG plots from a results document (matplotlib, no display needed).

attainment_vs_rate.png      SLO attainment vs rate, target line, goodput marked
attainment_vs_slo_scale.png attainment vs SLO scale at each swept rate
ttft_cdf.png, tpot_cdf.png  CDFs over successful requests, one curve per (server, rate)
latency_breakdown.png       mean server phases (queue, prefill, transfer, decode queue, decode) and
                            the rest of the client-seen E2E; or TTFT / decode without them
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from pdserve.bench.metrics import PHASES
from pdserve.bench.results import rate_text

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]


def plot_all(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for name, fn in (
        ("attainment_vs_rate.png", _attainment_vs_rate),
        ("attainment_vs_slo_scale.png", _attainment_vs_scale),
        ("ttft_cdf.png", lambda d, ax: _cdf(d, ax, "ttft_s", "TTFT")),
        ("tpot_cdf.png", lambda d, ax: _cdf(d, ax, "tpot_s", "TPOT")),
        ("latency_breakdown.png", _breakdown),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
        try:
            if fn(doc, ax):
                fig.tight_layout()
                fig.savefig(out_dir / name)
                made.append(out_dir / name)
        finally:
            plt.close(fig)
    return made


def _labels(doc: dict[str, Any]) -> list[str]:
    return [t["label"] for t in doc["targets"]]


def _slo_text(doc: dict[str, Any]) -> str:
    s = doc["slo"]
    parts = [f"{k.split('_')[0].upper()} {v:g} ms" for k, v in s.items() if k.endswith("_ms") and v]
    return ", ".join(parts)


def _attainment_vs_rate(doc: dict[str, Any], ax: Axes) -> bool:
    target = doc["slo"]["attainment_target"]
    drew = False
    for i, label in enumerate(_labels(doc)):
        pts = sorted(
            (a["rate"], a["summary"])
            for a in doc["aggregates"]
            if a["target"] == label and a["rate"] is not None and "attainment" in a["summary"]
        )
        if not pts:
            continue
        drew = True
        color = _COLORS[i % len(_COLORS)]
        rates = [r for r, _ in pts]
        for key, style, what in (
            ("attainment", "-o", "both"),
            ("attainment_ttft", ":", "TTFT"),
            ("attainment_tpot", "--", "TPOT"),
        ):
            ys = [100 * (s.get(key) or 0.0) for _, s in pts]
            ax.plot(rates, ys, style, color=color, label=f"{label}: {what}", markersize=4)
        g = doc.get("goodput", {}).get(label)
        if g and g["goodput_rps"] > 0:
            ax.axvline(g["goodput_rps"], color=color, alpha=0.6, linewidth=1)
            ax.annotate(
                f"goodput {label}\n{g['goodput_rps']:.3g} req/s",
                (g["goodput_rps"], 5),
                color=color,
                fontsize=8,
                rotation=90,
                ha="right",
                va="bottom",
            )
    if not drew:
        return False
    ax.axhline(
        100 * target, color="gray", linestyle="--", linewidth=1, label=f"target {100 * target:g}%"
    )
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"SLO attainment vs rate ({_slo_text(doc)})", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    return True


def _attainment_vs_scale(doc: dict[str, Any], ax: Axes) -> bool:
    target = doc["slo"]["attainment_target"]
    drew = False
    for i, (label, curves) in enumerate(doc.get("slo_scale", {}).items()):
        for j, c in enumerate(curves):
            if not c["scales"]:
                continue
            drew = True
            color = _COLORS[(i * 3 + j) % len(_COLORS)]
            ys = [100 * a for a in c["attainment"]]
            ax.plot(
                c["scales"],
                ys,
                "-o",
                color=color,
                markersize=4,
                label=f"{label} @ {rate_text(c['rate'])} req/s",
            )
            if c["min_scale"] is not None:
                ax.axvline(c["min_scale"], color=color, alpha=0.5, linewidth=1)
    if not drew:
        return False
    ax.axhline(
        100 * target, color="gray", linestyle="--", linewidth=1, label=f"target {100 * target:g}%"
    )
    ax.set_xlabel(f"SLO scale (x {_slo_text(doc)})")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(
        "SLO attainment vs SLO scale (vertical: tightest scale meeting the target)", fontsize=10
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return True


def _cdf(doc: dict[str, Any], ax: Axes, key: str, name: str) -> bool:
    drew = False
    for i, ((label, rate), runs) in enumerate(_groups(doc).items()):
        values = np.sort(
            [
                1000 * v
                for run in runs
                for r in run["records"]
                if r["success"] and (v := r.get(key)) is not None
            ]
        )
        if len(values) == 0:
            continue
        drew = True
        ys = np.arange(1, len(values) + 1) / len(values)
        ax.step(
            values,
            ys,
            where="post",
            color=_COLORS[i % len(_COLORS)],
            label=f"{label} @ {rate_text(rate)} req/s",
        )
    if not drew:
        return False
    ax.set_xlabel(f"{name} (ms)")
    ax.set_ylabel("fraction of successful requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{name} CDF", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return True


def _groups(doc: dict[str, Any]) -> dict[tuple[str, Any], list[dict[str, Any]]]:
    out: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for run in doc["runs"]:
        out.setdefault((run["target"], run["rate"]), []).append(run)
    return out


def _breakdown(doc: dict[str, Any], ax: Axes) -> bool:
    names, stacks = [], []
    order = {t["label"]: i for i, t in enumerate(doc["targets"])}
    rows = sorted(doc["aggregates"], key=lambda a: (order.get(a["target"], 0), a["rate"] or 1e18))
    for a in reversed(rows):  # barh draws bottom-up: first server, lowest rate on top
        s = a["summary"]
        if s.get("mean_e2el_ms") is None:
            continue
        names.append(f"{a['target']} @ {rate_text(a['rate'])}")
        stacks.append(_segments(s))
    if not names:
        return False
    keys = list(dict.fromkeys(k for st in stacks for k in st))
    left = np.zeros(len(names))
    for i, k in enumerate(keys):
        widths = np.array([st.get(k, 0.0) for st in stacks])
        ax.barh(names, widths, left=left, color=_COLORS[i % len(_COLORS)], label=k)
        left += widths
    ax.set_xlabel("mean time per request (ms)")
    ax.set_ylabel("server @ rate (requests/s)")
    ax.set_title("Latency breakdown (server-reported phases where available)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    ax.grid(alpha=0.3, axis="x")
    return True


def _segments(s: dict[str, Any]) -> dict[str, float]:
    phases = {p: s.get(f"mean_server_{p}_ms") for p in PHASES}
    reported = {p: v for p, v in phases.items() if v is not None}
    e2e = float(s["mean_e2el_ms"])
    if not reported:
        ttft = float(s.get("mean_ttft_ms") or 0.0)
        return {"TTFT (client)": ttft, "E2E - TTFT (client)": max(e2e - ttft, 0.0)}
    out = {f"{p} (server)": float(v) for p, v in reported.items()}
    out["client-seen rest (HTTP, detokenize, network)"] = max(e2e - sum(out.values()), 0.0)
    return out
