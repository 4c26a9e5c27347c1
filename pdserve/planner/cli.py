"""`pdserve plan`: how many prefill and decode instances, with what parallelism.

Bad input (a model that cannot fit, SLOs or a rate no placement meets, a malformed
profile, cluster or workload file) prints one line naming the numbers and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.planner.hardware import INTER_NODE_GBPS, MEMORY_UTILIZATION
from pdserve.planner.model_spec import PlanInputError

GB = 1e9


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a placement: instances, parallelism, goodput (DistServe Alg. 1/2, DejaVu)",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", default=None, help="preset (opt-13b, ...), config JSON, HF folder, .gguf"
    )
    p.add_argument(
        "--hardware", required=True, help="a100|h100|h200|v100 (datasheet) or profile JSON"
    )
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--cluster", default=None, help="cluster JSON (nodes, devices_per_node, ...)")
    p.add_argument("--device-memory", type=float, default=None, help="GB per device")
    p.add_argument("--intra-node-bandwidth", type=float, default=None, help="GB/s (NVLink)")
    p.add_argument(
        "--inter-node-bandwidth", type=float, default=INTER_NODE_GBPS, help="GB/s (25 Gbps)"
    )
    p.add_argument("--memory-utilization", type=float, default=MEMORY_UTILIZATION)
    p.add_argument("--dtype-bytes", type=int, default=None, help="override weight/KV width")
    p.add_argument("--workload", default="chatbot", help="bench workload name or trace file")
    p.add_argument("--num-requests", type=int, default=1000, help="simulated per trial")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--burstiness", type=float, default=None, help="gamma arrivals (default Poisson)"
    )
    p.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds")
    p.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--rate", type=float, default=None, help="requests/s to size the cluster for")
    p.add_argument("--affinity", choices=("high", "low", "both"), default="both")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--prefill-batch-tokens", type=int, default=512, help="L_m")
    p.add_argument("--chunk-size", type=int, default=512, help="colocated chunked-prefill budget")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--output", default="plan.json")
    p.add_argument("--plot", default=None, help="PNG (default: next to --output)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--frontend-tokens-per-s",
        type=float,
        default=None,
        help="streamed tokens/s one pdserve front end sustains on its host "
        "(bench/bench_frontend.py); warn when the plan's cluster streams more",
    )
    p.add_argument("--planner", choices=("distserve", "dejavu"), default="distserve")
    p.add_argument("--prompt-len", type=int, default=1000, help="dejavu: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=200, help="dejavu: generated tokens")
    p.add_argument("--streaming-overhead", type=float, default=1.1, help="dejavu: m")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanInputError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pdserve.planner.hardware import load_profile
    from pdserve.planner.model_spec import resolve_model_spec

    _check_numbers(args)
    hw = load_profile(args.hardware)
    spec = resolve_model_spec(args.model, args.dtype_bytes)
    cluster = _cluster(args, hw)
    if args.planner == "dejavu":
        return _run_dejavu(args, spec, hw, cluster)
    if args.ttft is None or args.tpot is None:
        raise PlanInputError("--ttft and --tpot are required (seconds) for the distserve planner")
    return _run_distserve(args, spec, hw, cluster)


def _check_numbers(args: argparse.Namespace) -> None:
    positive = {
        "--num-requests": args.num_requests,
        "--max-batch-size": args.max_batch_size,
        "--prefill-batch-tokens": args.prefill_batch_tokens,
        "--chunk-size": args.chunk_size,
    }
    for flag, v in positive.items():
        if v < 1:
            raise PlanInputError(f"{flag} must be >= 1, got {v}")
    checked = {
        "--rate": args.rate,
        "--ttft": args.ttft,
        "--tpot": args.tpot,
        "--frontend-tokens-per-s": args.frontend_tokens_per_s,
    }
    for flag, f in checked.items():
        if f is not None and not f > 0:
            raise PlanInputError(f"{flag} must be > 0, got {f}")
    if args.workers is not None and args.workers < 1:
        raise PlanInputError(f"--workers must be >= 1, got {args.workers}")


def _cluster(args: argparse.Namespace, hw: Any) -> Any:
    from pdserve.planner.hardware import ClusterSpec

    d: dict[str, Any] = {}
    if args.cluster:
        d = _read_cluster_file(Path(args.cluster))
    nodes = args.nodes if args.nodes is not None else d.get("nodes")
    per_node = (
        args.devices_per_node if args.devices_per_node is not None else d.get("devices_per_node")
    )
    if nodes is None or per_node is None:
        raise PlanInputError("give --nodes and --devices-per-node (or a --cluster file)")
    memory = args.device_memory if args.device_memory is not None else d.get("device_memory_gb")
    intra = args.intra_node_bandwidth or d.get("intra_node_bandwidth_gbps")
    inter = d.get("inter_node_bandwidth_gbps", args.inter_node_bandwidth)
    try:
        return ClusterSpec(
            nodes=int(nodes),
            devices_per_node=int(per_node),
            device_memory_bytes=float(memory) * GB
            if memory is not None
            else hw.device_memory_bytes,
            intra_node_bandwidth=float(intra) * GB if intra else hw.node_link,
            inter_node_bandwidth=float(inter) * GB,
            memory_utilization=float(d.get("memory_utilization", args.memory_utilization)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, PlanInputError):
            raise
        raise PlanInputError(f"cluster description: {e}") from None


def _read_cluster_file(path: Path) -> dict[str, Any]:
    known = {
        "nodes",
        "devices_per_node",
        "device_memory_gb",
        "intra_node_bandwidth_gbps",
        "inter_node_bandwidth_gbps",
        "memory_utilization",
    }
    try:
        d = json.loads(path.read_text())
    except OSError as e:
        raise PlanInputError(f"{path}: cannot read cluster file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise PlanInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise PlanInputError(f"{path}: a cluster file must be a JSON object")
    unknown = sorted(set(d) - known)
    if unknown:
        raise PlanInputError(f"{path}: unknown cluster fields {unknown} (known: {sorted(known)})")
    return d


def _run_distserve(args: argparse.Namespace, spec: Any, hw: Any, cluster: Any) -> int:
    from pdserve.planner.candidates import InstanceKnobs
    from pdserve.planner.plan import make_plan
    from pdserve.planner.search import SearchContext, SLOTarget
    from pdserve.planner.workload import sample_workload

    slo = SLOTarget(args.ttft, args.tpot, args.attainment)
    workload = sample_workload(args.workload, args.num_requests, 1.0, args.seed, args.burstiness)
    knobs = InstanceKnobs(args.max_batch_size, args.prefill_batch_tokens, args.chunk_size)
    from pdserve.planner.simulator import FrontEnd

    sustained = args.frontend_tokens_per_s
    frontend = FrontEnd(1.0 / sustained) if sustained is not None else None
    ctx = SearchContext(spec, hw, cluster, knobs, slo, workload, frontend=frontend)
    start = time.perf_counter()
    result = make_plan(ctx, args.rate, args.affinity, args.workers, _progress_bar)
    elapsed = time.perf_counter() - start
    from pdserve.planner.report import frontend_line, render_plan, write_plan_files

    print(render_plan(result, elapsed))
    if args.frontend_tokens_per_s is not None:
        print(frontend_line(result, args.frontend_tokens_per_s))
    written = write_plan_files(result, Path(args.output), _plot_path(args), elapsed)
    for path in written:
        print(f"wrote {path}")
    return 0


def _plot_path(args: argparse.Namespace) -> Path | None:
    if args.no_plot:
        return None
    return Path(args.plot) if args.plot else Path(args.output).with_suffix(".png")


def _progress_bar(total: int) -> Callable[[int], None]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="simulating configurations", unit="cfg", file=sys.stderr)

    def advance(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return advance


def _run_dejavu(args: argparse.Namespace, spec: Any, hw: Any, cluster: Any) -> int:
    from pdserve.planner.dejavu import dejavu_split

    plan = dejavu_split(
        spec,
        hw,
        machines=cluster.nodes,
        devices_per_machine=cluster.devices_per_node,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        streaming_overhead=args.streaming_overhead,
        machine_memory_bytes=cluster.usable_memory * cluster.devices_per_node,
        pp_bandwidth=cluster.inter_node_bandwidth,
    )
    print(plan.describe())
    out = Path(args.output)
    out.write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    print(f"wrote {out}")
    return 0
