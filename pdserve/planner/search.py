"""Goodput-optimal placement: DistServe Alg. 1 (high node-affinity) and Alg. 2 (low),
and the colocated baseline searched the same way (DistServe's "vLLM++").

Every candidate is one *task*: a parallel configuration whose maximum rate meeting
the SLO attainment target is found by simulation and bisection (`goodput.max_rate`).
Tasks are independent, so they run on a process pool, one per core.

- Alg. 1 (`high`): prefill and decode configurations are searched separately with
  single-instance simulations (`simulate_prefill` judges TTFT, `simulate_decode`
  TPOT); the best of each by per-device goodput is replicated to the target rate.
  KV moves over the inter-node network, assumed fast (InfiniBand).
- Alg. 2 (`low`): both phases share the pipeline depth pp; stage i of every prefill
  and decode instance sits in node i, so KV moves only over the node's link. Inside a
  node, `n_p` prefill segments of tp_p devices and `n_d` decode segments of tp_d
  devices share the node's M devices; each (pp, n_p, tp_p, n_d, tp_d) unit is
  simulated whole (prefill, transfer, decode) and replicated.
- Colocated: one instance per (tp, pp), with chunked prefill (our engine) and with
  whole-prompt prefill-first batching (vLLM's default), both SLOs judged together.

Per-device goodput is the placement's rate at the target divided by its devices.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.planner.candidates import (
    InstanceKnobs,
    explain_no_fit,
    fits,
    make_instance,
    parallel_configs,
    require_some,
    tp_options,
)
from pdserve.planner.goodput import max_rate
from pdserve.planner.hardware import ClusterSpec, HardwareProfile
from pdserve.planner.latency import Parallelism
from pdserve.planner.model_spec import ModelSpec, PlanInputError
from pdserve.planner.simulator import (
    ColocatedSystem,
    DisaggSystem,
    FrontEnd,
    InstanceSpec,
    SimResult,
    simulate,
    simulate_decode,
    simulate_prefill,
)
from pdserve.planner.workload import SimWorkload


@dataclass(frozen=True)
class SLOTarget:
    ttft: float  # seconds
    tpot: float  # seconds
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft > 0 and self.tpot > 0):
            raise PlanInputError(f"SLOs must be > 0 s, got TTFT {self.ttft} and TPOT {self.tpot}")
        if not 0 < self.attainment <= 1:
            raise PlanInputError(f"attainment must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True)
class SearchContext:
    """Everything a task needs; pickled once per task to the worker processes."""

    spec: ModelSpec
    hw: HardwareProfile
    cluster: ClusterSpec
    knobs: InstanceKnobs
    slo: SLOTarget
    workload: SimWorkload  # at 1 request/s; every rate rescales the same arrivals
    rel_tol: float = 0.02
    # The one front end the whole sized cluster streams through (None: free). The search
    # prices one instance (or unit) at a time and scales, so it leaves the front end out:
    # a cluster-wide resource; the plan's check of the sized cluster takes it in.
    frontend: FrontEnd | None = None

    @property
    def max_tp(self) -> int | None:
        """1 when the hardware has no all-reduce link (a CPU profile), else no cap."""
        return 1 if self.hw.tp_bandwidth <= 0 else None

    @property
    def max_pp(self) -> int | None:
        """1 when the hardware has no measured link between ranks (a CPU profile: its
        stage hand-off cost is not measured, so pipelines are not searched), else no
        cap: datasheet GPU profiles keep DistServe's pipeline search (its Table 3)."""
        return 1 if self.hw.tp_bandwidth <= 0 else None


@dataclass(frozen=True)
class Task:
    kind: str  # "prefill" | "decode" | "colocated" | "pair"
    par: Parallelism  # prefill/decode/colocated config; for "pair": pp and tp_p
    chunked: bool = True  # colocated only
    decode_par: Parallelism | None = None  # "pair": the decode segment config
    num_prefill: int = 1  # "pair": prefill segments per node
    num_decode: int = 1  # "pair": decode segments per node

    @property
    def devices(self) -> int:
        if self.kind == "pair":
            assert self.decode_par is not None
            return self.num_prefill * self.par.devices + self.num_decode * self.decode_par.devices
        return self.par.devices

    def label(self) -> str:
        if self.kind == "pair":
            return (
                f"{self.num_prefill}x prefill {self.par} + {self.num_decode}x decode "
                f"{self.decode_par} per pipeline"
            )
        if self.kind == "colocated":
            return f"colocated {self.par} ({'chunked' if self.chunked else 'prefill-first'})"
        return f"{self.kind} {self.par}"


@dataclass(frozen=True)
class TaskResult:
    task: Task
    goodput: float  # requests/s at the attainment target

    @property
    def per_device(self) -> float:
        return self.goodput / self.task.devices


# ---- one task: build the system, bisect its rate -------------------------------------


def run_task(ctx: SearchContext, task: Task) -> TaskResult:
    evaluate = attainment_function(ctx, task)
    guess = _first_guess(ctx, task)
    return TaskResult(task, max_rate(evaluate, ctx.slo.attainment, guess, ctx.rel_tol))


def attainment_function(ctx: SearchContext, task: Task) -> Callable[[float], float]:
    slo = ctx.slo
    sim = system_simulator(ctx, task)
    judged = {
        "prefill": (slo.ttft, None),
        "decode": (None, slo.tpot),
    }.get(task.kind, (slo.ttft, slo.tpot))

    def at(rate: float) -> float:
        return sim(ctx.workload.with_rate(rate)).attainment(*judged)

    return at


def system_simulator(ctx: SearchContext, task: Task) -> Callable[[SimWorkload], SimResult]:
    spec, hw, cluster, knobs = ctx.spec, ctx.hw, ctx.cluster, ctx.knobs
    if task.kind == "prefill":
        inst = make_instance(spec, hw, task.par, cluster, knobs, chunked=False)
        return lambda w: simulate_prefill(inst, w)
    if task.kind == "decode":
        inst = make_instance(spec, hw, task.par, cluster, knobs)
        return lambda w: simulate_decode(inst, w)
    if task.kind == "colocated":
        inst = make_instance(
            spec, hw, task.par, cluster, knobs, chunked=task.chunked, colocated=True
        )
        colo = ColocatedSystem((inst,))
        return lambda w: simulate(colo, w)
    assert task.decode_par is not None
    pre = make_instance(spec, hw, task.par, cluster, knobs, chunked=False)
    dec = make_instance(spec, hw, task.decode_par, cluster, knobs)
    system = DisaggSystem(
        (pre,) * task.num_prefill,
        (dec,) * task.num_decode,
        spec.kv_bytes_per_token,
        cluster.intra_node_bandwidth,
    )
    return lambda w: simulate(system, w)


def _first_guess(ctx: SearchContext, task: Task) -> float:
    """A rate near capacity: the inverse of the mean prompt time on the prefill side."""
    w = ctx.workload
    inst: InstanceSpec = make_instance(ctx.spec, ctx.hw, task.par, ctx.cluster, ctx.knobs)
    mean_in = float(w.input_lens.mean())
    mean_out = float(w.output_lens.mean())
    cost = inst.cost
    if task.kind == "decode":
        batch = max(1, min(ctx.knobs.max_batch_size, 32))
        step = cost.decode_time(batch, int(batch * (mean_in + mean_out / 2)))
        return batch / max(step * mean_out, 1e-9)
    prompt = cost.prefill_time([max(1, round(mean_in))]) / cost.stages
    return max(task.num_prefill, 1) / max(prompt, 1e-9)


# ---- enumeration (Alg. 1 / Alg. 2 / colocated) --------------------------------------


def high_affinity_tasks(
    spec: ModelSpec, cluster: ClusterSpec, max_tp: int | None = None, max_pp: int | None = None
) -> list[Task]:
    configs = parallel_configs(spec, cluster, max_tp=max_tp, max_pp=max_pp)
    require_some(spec, cluster, configs)
    return [Task(kind, par) for kind in ("prefill", "decode") for par in configs]


def colocated_tasks(
    spec: ModelSpec, cluster: ClusterSpec, max_tp: int | None = None, max_pp: int | None = None
) -> list[Task]:
    configs = parallel_configs(spec, cluster, max_tp=max_tp, max_pp=max_pp)
    require_some(spec, cluster, configs)
    return [Task("colocated", par, chunked) for par in configs for chunked in (True, False)]


def low_affinity_tasks(
    spec: ModelSpec, cluster: ClusterSpec, max_tp: int | None = None, max_pp: int | None = None
) -> list[Task]:
    """Alg. 2: pp stages, one per node; inside each node the prefill and decode segments
    of that stage (get_intra_node_configs)."""
    m = cluster.devices_per_node
    tasks = []
    for pp in range(1, min(cluster.nodes, max_pp or cluster.nodes) + 1):
        if spec.num_layers % pp:
            continue
        for tp_p in tp_options(spec, m, max_tp):
            for tp_d in tp_options(spec, m, max_tp):
                for n_p, n_d in _segment_counts(m, tp_p, tp_d):
                    pre, dec = Parallelism(tp_p, pp), Parallelism(tp_d, pp)
                    usable = cluster.usable_memory
                    if fits(spec, pre, usable) and fits(spec, dec, usable):
                        tasks.append(Task("pair", pre, True, dec, n_p, n_d))
    if not tasks:
        raise PlanInputError(
            "no low node-affinity placement: a prefill and a decode segment of the same "
            f"stage must share a node of {m} devices; " + explain_no_fit(spec, cluster)
        )
    return tasks


def _segment_counts(m: int, tp_p: int, tp_d: int) -> Iterator[tuple[int, int]]:
    """(n_p, n_d) with n_p*tp_p + n_d*tp_d <= m that use the node fully (no segment
    more of either kind would fit)."""
    for n_p in range(1, m // tp_p + 1):
        left = m - n_p * tp_p
        n_d = left // tp_d
        if n_d >= 1:
            yield n_p, n_d


# ---- running tasks --------------------------------------------------------------------


def run_tasks(
    ctx: SearchContext,
    tasks: list[Task],
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[TaskResult]:
    """Run every task; on `workers` processes (default: all cores) when more than one."""
    workers = workers or len(os.sched_getaffinity(0))
    if workers <= 1 or len(tasks) <= 1:
        results = []
        for t in tasks:
            results.append(run_task(ctx, t))
            if progress:
                progress(1)
        return results
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(run_task, ctx, t) for t in tasks]
        out = []
        for f in futures:
            out.append(f.result())
            if progress:
                progress(1)
        return out


# ---- placements -----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    kind: str  # "disaggregated (high affinity)", "disaggregated (low affinity)", "colocated"
    results: tuple[TaskResult, ...]  # high: (prefill, decode); low: (pair,); colocated: (one,)
    per_device_goodput: float

    def instances_for(self, rate: float) -> dict[str, int]:
        """Instances (and devices) of each kind to serve `rate` requests/s."""
        if self.kind.startswith("disaggregated (high"):
            p, d = self.results
            n_p, n_d = _replicas(rate, p.goodput), _replicas(rate, d.goodput)
            devices = n_p * p.task.devices + n_d * d.task.devices
            return {"prefill": n_p, "decode": n_d, "devices": devices}
        (r,) = self.results
        n = _replicas(rate, r.goodput)
        if r.task.kind == "pair":
            return {
                "prefill": n * r.task.num_prefill,
                "decode": n * r.task.num_decode,
                "units": n,
                "devices": n * r.task.devices,
            }
        return {"colocated": n, "devices": n * r.task.devices}

    def describe(self) -> str:
        parts = [r.task.label() for r in self.results]
        return f"{self.kind}: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "per_device_goodput": self.per_device_goodput,
            "configs": [
                {
                    "task": _task_dict(r.task),
                    "goodput": r.goodput,
                    "devices": r.task.devices,
                    "per_device": r.per_device,
                }
                for r in self.results
            ],
        }


def _task_dict(t: Task) -> dict[str, Any]:
    d = asdict(t)
    d["label"] = t.label()
    return d


def _replicas(rate: float, goodput: float) -> int:
    if goodput <= 0:
        raise PlanInputError("a configuration with zero goodput cannot be replicated")
    return max(1, math.ceil(rate / goodput - 1e-9))


def high_affinity_placements(
    results: Iterable[TaskResult], max_devices: int | None = None
) -> list[Placement]:
    """Alg. 1: every prefill config x every decode config (one of each must fit in
    `max_devices`), best per-device goodput first. Without a device limit this is the
    best prefill with the best decode."""
    res = list(results)
    pre = [r for r in res if r.task.kind == "prefill" and r.goodput > 0]
    dec = [r for r in res if r.task.kind == "decode" and r.goodput > 0]
    out = [
        Placement("disaggregated (high affinity)", (p, d), _combined(p, d))
        for p in pre
        for d in dec
        if max_devices is None or p.task.devices + d.task.devices <= max_devices
    ]
    return sorted(out, key=lambda pl: -pl.per_device_goodput)


def _combined(p: TaskResult, d: TaskResult) -> float:
    """Per-device goodput of replicas of p and d serving the same rate: R / (R*dp/gp +
    R*dd/gd)."""
    return 1.0 / (p.task.devices / p.goodput + d.task.devices / d.goodput)


def _by_pd(r: TaskResult) -> float:
    return -r.per_device


def single_placements(results: Iterable[TaskResult], kind: str, label: str) -> list[Placement]:
    chosen = [r for r in results if r.task.kind == kind and r.goodput > 0]
    return [Placement(label, (r,), r.per_device) for r in sorted(chosen, key=_by_pd)]


@dataclass
class SearchOutcome:
    disaggregated: list[Placement] = field(default_factory=list)  # best first
    colocated: list[Placement] = field(default_factory=list)  # best first
    tasks: int = 0
    notes: list[str] = field(default_factory=list)  # why a kind of placement is missing

    @property
    def ranked(self) -> list[Placement]:
        """Every placement meeting the SLOs, best per-device goodput first."""
        return sorted(self.disaggregated + self.colocated, key=lambda p: -p.per_device_goodput)

    @property
    def best(self) -> Placement | None:
        ranked = self.ranked
        return ranked[0] if ranked else None

    @property
    def best_disaggregated(self) -> Placement | None:
        return self.disaggregated[0] if self.disaggregated else None

    @property
    def best_colocated(self) -> Placement | None:
        return self.colocated[0] if self.colocated else None


def search(
    ctx: SearchContext,
    affinity: str = "high",
    workers: int | None = None,
    progress_factory: Callable[[int], Callable[[int], None]] | None = None,
    colocated: bool = True,
) -> SearchOutcome:
    """Run Alg. 1 (`high`), Alg. 2 (`low`) or both, and the colocated search (unless
    `colocated` is False: a disaggregated cluster replanning its split)."""
    if affinity not in ("high", "low", "both"):
        raise PlanInputError(f"affinity must be high, low or both, got {affinity!r}")
    tasks: list[Task] = []
    notes = []
    if affinity in ("high", "both"):
        tasks += high_affinity_tasks(ctx.spec, ctx.cluster, ctx.max_tp, ctx.max_pp)
    if affinity in ("low", "both"):
        try:
            tasks += low_affinity_tasks(ctx.spec, ctx.cluster, ctx.max_tp, ctx.max_pp)
        except PlanInputError as e:
            if affinity == "low":
                raise
            notes.append(str(e))
    if colocated:
        tasks += colocated_tasks(ctx.spec, ctx.cluster, ctx.max_tp, ctx.max_pp)
    progress = progress_factory(len(tasks)) if progress_factory else None
    results = run_tasks(ctx, tasks, workers, progress)
    high = high_affinity_placements(results, ctx.cluster.num_devices)
    disagg = high + single_placements(results, "pair", "disaggregated (low affinity)")
    disagg.sort(key=lambda pl: -pl.per_device_goodput)
    colo = single_placements(results, "colocated", "colocated")
    if not high and any(t.kind == "prefill" for t in tasks):
        notes.append(
            "no high node-affinity placement: a prefill and a decode instance together need "
            f"more than the cluster's {ctx.cluster.num_devices} devices, or one phase meets "
            "no SLO"
        )
    return SearchOutcome(disagg, colo, len(tasks), notes)
