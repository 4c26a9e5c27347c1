"""What `pdserve plan` prints and writes: a text report, a JSON file, a plot."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.planner.plan import PlanResult, attainment_curve
from pdserve.planner.search import Placement


def render_plan(result: PlanResult, elapsed_s: float) -> str:
    c = result.ctx
    lines = [
        f"model {c.spec.name}: weights {c.spec.weight_bytes / 1e9:.1f} GB, KV "
        f"{c.spec.kv_bytes_per_token / 1e6:.3f} MB/token",
        f"hardware {c.hw.label}; cluster {c.cluster.nodes} node(s) x "
        f"{c.cluster.devices_per_node} device(s) of {c.cluster.device_memory_bytes / 1e9:g} GB",
        f"workload {c.workload.name} ({len(c.workload.arrivals)} simulated requests per trial); "
        f"SLO TTFT {c.slo.ttft:g} s, TPOT {c.slo.tpot:g} s at {c.slo.attainment:.0%}",
    ]
    if c.hw.is_estimate:
        lines.append(
            "NOTE: the hardware profile is a datasheet ESTIMATE (peak x efficiency factors), "
            "not a measurement: every figure below inherits its error"
        )
    best = result.chosen
    lines += ["", f"chosen: {best.describe()}", f"  goodput {_pd(best)} per device"]
    dis, colo = result.outcome.best_disaggregated, result.outcome.best_colocated
    lines.append(
        f"best disaggregated: {dis.describe()}, {_pd(dis)} per device"
        if dis
        else "best disaggregated: none meets the SLOs"
    )
    if colo is not None:
        gain = result.gain_over_colocated
        lines.append(
            f"best colocated: {colo.describe()}, {_pd(colo)} per device"
            + (f" -> disaggregated/colocated {gain:.2f}x" if gain else "")
        )
    else:
        lines.append("best colocated: none meets the SLOs")
    lines += [f"note: {n}" for n in result.outcome.notes]
    if result.rate is not None and result.sizing is not None:
        lines.append(f"for {result.rate:g} req/s: {_sizing(result.sizing)}")
        if result.colocated_sizing:
            lines.append(f"  colocated would need: {_sizing(result.colocated_sizing)}")
        if result.verified_attainment is not None:
            lines.append(
                f"  whole-cluster simulation at {result.rate:g} req/s: "
                f"{result.verified_attainment:.1%} of requests meet both SLOs"
            )
    runner = [p for p in result.outcome.ranked if p is not best][:5]
    if runner:
        lines.append("runner-ups:")
        lines += [f"  {p.describe()}: {_pd(p)} per device" for p in runner]
    lines.append(f"searched {result.outcome.tasks} configurations in {elapsed_s:.1f} s")
    return "\n".join(lines)


def frontend_load(result: PlanResult) -> tuple[float, float]:
    """(requests/s, streamed tokens/s) the plan's cluster serves: `--rate` when given,
    else the chosen placement's goodput on every device; tokens at the workload's mean
    output length. All of them pass through one front end (pdserve's HTTP process)."""
    c = result.ctx
    rate = result.rate
    if rate is None:
        rate = result.chosen.per_device_goodput * c.cluster.num_devices
    return rate, rate * float(c.workload.output_lens.mean())


def frontend_line(result: PlanResult, sustained_tokens_s: float) -> str:
    """What one front end makes of the plan: the cluster's streamed tokens/s against
    `sustained_tokens_s` (bench/bench_frontend.py's figure for the host that runs it),
    a WARNING past it - every stream then waits for the front end. The plan's verified
    attainment (the sized cluster simulated with it: simulator.FrontEnd) counts that
    wait; the search's per-device goodput, one instance at a time, does not."""
    rate, tokens = frontend_load(result)
    if tokens <= sustained_tokens_s:
        return (
            f"front end: at {rate:.4g} req/s the cluster streams ~{tokens:.4g} tokens/s, "
            f"{tokens / sustained_tokens_s:.0%} of the {sustained_tokens_s:.4g} one front "
            "end sustains"
        )
    return (
        f"WARNING: at {rate:.4g} req/s the cluster streams ~{tokens:.4g} tokens/s (mean "
        f"output {tokens / rate:.0f} tokens), beyond the {sustained_tokens_s:.4g} tokens/s "
        "one front end sustains (--frontend-tokens-per-s): its queue adds to every TTFT "
        "and TPOT (the verified attainment above counts it); run more front ends, each "
        "for part of the instances"
    )


def _pd(p: Placement) -> str:
    return f"{p.per_device_goodput:.4g} req/s"


def _sizing(s: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in s.items())


def write_plan_files(
    result: PlanResult, output: Path, plot: Path | None, elapsed_s: float
) -> list[Path]:
    d = result.to_dict()
    d["search_seconds"] = elapsed_s
    written = []
    if plot is not None:
        d["curves"] = _curves(result)
        _plot(d["curves"], result, plot)
        written.append(plot)
    output.write_text(json.dumps(d, indent=2, default=str) + "\n")
    written.insert(0, output)
    return written


def _curves(result: PlanResult) -> dict[str, dict[str, list[float]]]:
    """Attainment vs per-device rate for the chosen and the best colocated placement,
    each sized for the same reference rate."""
    placements = {}
    if result.outcome.best_disaggregated is not None:
        placements["disaggregated"] = result.outcome.best_disaggregated
    if result.outcome.best_colocated is not None:
        placements["colocated"] = result.outcome.best_colocated
    ref = result.rate or _reference_rate(result.chosen)
    curves = {}
    for name, p in placements.items():
        devices = p.instances_for(ref)["devices"]
        per_device = [p.per_device_goodput * f for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
        rates = [x * devices for x in per_device]
        curves[name] = {
            "per_device_rate": per_device,
            "attainment": attainment_curve(result.ctx, p, ref, rates),
            "devices": [float(devices)],
        }
    return curves


def _reference_rate(p: Placement) -> float:
    return max(r.goodput for r in p.results)


def _plot(curves: dict[str, dict[str, list[float]]], result: PlanResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        ax.plot(c["per_device_rate"], [100 * a for a in c["attainment"]], marker="o", label=name)
    ax.axhline(100 * result.ctx.slo.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("rate per device (requests/s)")
    ax.set_ylabel("SLO attainment (%)")
    est = " (datasheet estimate)" if result.ctx.hw.is_estimate else ""
    ax.set_title(f"{result.ctx.spec.name} on {result.ctx.hw.name}{est}", fontsize=9)
    ax.set_ylim(0, 102)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
