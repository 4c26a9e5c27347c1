"""DéjàVu App. D: how many machines to give prompt processing and token generation.

A throughput planner for pipeline-parallel deployments without latency SLOs
(DéjàVu §4.2.1 and App. D). D machines, each a tensor-parallel group and one
pipeline stage, are split into a prompt pipeline of depth D_p and a token pipeline
of depth D_t (D_p + D_t = D). The prompt pipeline streams each micro-batch's KV
cache to the token pipeline, which generates the remaining tokens.

Symbols (App. D): L layers; W0 one layer's weights; C0 and K0 one layer's KV cache
of a micro-batch of b requests for its prompt and for its N generated tokens; M one
machine's usable memory; Y and t the per-stage time of one micro-batch's prompt and
of one of its token-generation steps when the model is spread over all D machines;
m >= 1 the prompt slowdown from KV streaming. I are inverse throughputs (seconds
per micro-batch).

- eq. 2 (memory, prompt pipeline):  D_p >= ceil(L (C0 + W0) / M)
- eq. 3 (memory, token pipeline):   D_t >= L W0 / (M - L (C0 + K0)), none if M <= L (C0 + K0)
- eq. 4 (one pipeline doing both):  I_c = (D-1)(Y-t)/D + Y + N t
- disaggregated:                    I_p = m D Y / D_p, I_t = N D t / D_t, I_dis = max(I_p, I_t)
- eq. 5 (disaggregation helps):     Y/t > (D-1) / (D(2-m) - 1); needs D(2-m) > 1, so m < 2
- eq. 6, 7 (I_p = I_t):             D_t = D N t / (m Y + N t), D_p = D m Y / (m Y + N t)

(Eq. 1 of §4.2.1 is eq. 6 and 7 together.) The functions in the first part take
plain numbers. `dejavu_split` derives them from a `ModelSpec` and `HardwareProfile`:

- W0 = `layer_weight_bytes`, C0 = b * prompt_len * `kv_bytes_per_token_per_layer`,
  K0 = b * new_tokens * `kv_bytes_per_token_per_layer` (App. D counts only the
  decoder layers; the embeddings enter only the "weights fit at all" check).
- M = devices_per_machine * device memory * 0.9 (headroom) unless given.
- Y, t from the latency model (`step_cost` with tp = devices_per_machine, pp = D):
  Y = one prefill of b prompts through the D-deep pipeline / D (a stage's time plus
  its share of the activation sends between stages), t likewise for one decode step
  of the b requests at the average context prompt_len + new_tokens / 2. When the L
  layers do not split evenly into D stages, a stage is given L / D (fractional)
  layers: everything in a stage's time except the fixed per-step overhead c3 is
  proportional to its layers (weights, FLOPs, KV reads, all-reduces; the LM head is
  spread evenly over the stages, as `step_cost` does), so the stage time is
  c3 + (T_1 - c3) / D with T_1 the full model's step time on one machine, plus the
  same activation-send share. This equals the pp = D result exactly when D divides
  L (a test checks it).
- b is searched over `microbatch_sizes`; each b that passes eq. 2 and 3 gets its best
  integer split, and the b with the highest disaggregated throughput b / I_dis wins
  (like the configurations of the paper's Tables 2-5). The colocated baseline is
  reported at the same b (ratio I_c / I_dis) and at its own best b; its memory check
  is eq. 3 with D_t = D (D micro-batches in flight on one D-deep pipeline).

Like the paper, I_p and I_t scale Y and t by D / D_p and D / D_t, so the per-stage
overhead and the activation sends scale along with the compute. Every request is
assumed to generate N tokens (no early stops).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.latency import Parallelism, step_cost
from pdserve.planner.model_spec import ModelSpec, PlanInputError

GB = 1e9
MEMORY_HEADROOM = 0.9  # share of device memory the planner lets weights and KV use
DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_PP_BANDWIDTH = 25e9 / 8  # bytes/s between machines (25 Gbit/s)


class MemoryBoundError(PlanInputError):
    """Eq. 3 admits no token pipeline depth: the KV alone fills a machine."""


# ---- the equations, on plain numbers --------------------------------------------------


def min_prompt_depth(layers: int, c0: float, w0: float, memory: float) -> int:
    """Eq. 2: D_p >= ceil(L (C0 + W0) / M) (at least 1)."""
    return max(1, math.ceil(layers * (c0 + w0) / memory))


def token_depth_bound(layers: int, w0: float, c0: float, k0: float, memory: float) -> float:
    """Eq. 3, real-valued: L W0 / (M - L (C0 + K0)).

    Raises `MemoryBoundError` (with the numbers) when M <= L (C0 + K0): each of the
    D_t micro-batches in flight keeps KV for all L layers on the pipeline, so the KV
    alone fills a machine however deep the pipeline is."""
    kv = layers * (c0 + k0)
    if memory <= kv:
        raise MemoryBoundError(
            f"eq. 3: M = {memory / GB:.1f} GB <= L (C0 + K0) = {layers} x "
            f"({c0 / GB:.3f} + {k0 / GB:.3f}) GB = {kv / GB:.1f} GB"
        )
    return layers * w0 / (memory - kv)


def min_token_depth(layers: int, w0: float, c0: float, k0: float, memory: float) -> int:
    """Eq. 3 as an integer depth (at least 1); raises `MemoryBoundError` as above."""
    return max(1, math.ceil(token_depth_bound(layers, w0, c0, k0, memory)))


def inverse_throughput_colocated(d: int, y: float, t: float, n: int) -> float:
    """Eq. 4: I_c = (D-1)(Y-t)/D + Y + N t."""
    return (d - 1) * (y - t) / d + y + n * t


def inverse_throughputs(
    d: int, d_p: float, d_t: float, y: float, t: float, n: int, m: float
) -> tuple[float, float]:
    """(I_p, I_t) = (m D Y / D_p, N D t / D_t): the prompt and token pipelines."""
    return m * d * y / d_p, n * d * t / d_t


def eq5_threshold(d: int, m: float) -> float:
    """Eq. 5's bound on Y/t, (D-1) / (D(2-m) - 1); inf when D(2-m) <= 1 (no Y/t is enough)."""
    denom = d * (2 - m) - 1
    return (d - 1) / denom if denom > 0 else math.inf


def disaggregation_helps(d: int, y: float, t: float, m: float) -> bool:
    """Eq. 5: Y/t > (D-1) / (D(2-m) - 1), with m in [1, 2).

    It compares I_c with I_dis at eq. 6/7's real-valued split. Stricter than m < 2:
    the bound is finite only while m < 2 - 1/D."""
    return 1 <= m < 2 and y / t > eq5_threshold(d, m)


def balanced_split(d: int, y: float, t: float, n: int, m: float) -> tuple[float, float]:
    """Eq. 7 and 6: real-valued (D_p, D_t) with I_p = I_t."""
    return d * m * y / (m * y + n * t), d * n * t / (m * y + n * t)


def best_integer_split(
    d: int, lo_p: int, lo_t: int, y: float, t: float, n: int, m: float
) -> tuple[int, int] | None:
    """(D_p, D_t) minimising max(I_p, I_t) over every integer split with D_p >= lo_p and
    D_t >= lo_t (ties: fewer prompt machines); None when lo_p + lo_t > D."""
    best: tuple[float, int] | None = None
    for d_p in range(max(1, lo_p), d - max(1, lo_t) + 1):
        cost = max(inverse_throughputs(d, d_p, d - d_p, y, t, n, m))
        if best is None or cost < best[0]:
            best = (cost, d_p)
    return None if best is None else (best[1], d - best[1])


# ---- from a model and hardware ------------------------------------------------------


def stage_times(
    spec: ModelSpec,
    hw: HardwareProfile,
    machines: int,
    devices_per_machine: int,
    prompt_len: int,
    new_tokens: int,
    microbatch: int,
    pp_bandwidth: float = DEFAULT_PP_BANDWIDTH,
    force_proportional: bool = False,
) -> tuple[float, float]:
    """(Y, t): per-stage prompt time and token-step time of one micro-batch on a
    D-deep pipeline (see the module docstring). `force_proportional` uses the
    uneven-layers model even when D divides L (to check that the two agree)."""
    d, b = machines, microbatch
    prompts = [prompt_len] * b
    context = round(b * (prompt_len + new_tokens / 2))  # the micro-batch's KV mid-generation
    if spec.num_layers % d == 0 and not force_proportional:
        par = Parallelism(devices_per_machine, d)
        cost = step_cost(spec, hw.coefficients, par, hw.interconnect(pp_bandwidth))
        return cost.prefill_time(prompts) / d, cost.decode_time(b, context) / d
    full = step_cost(spec, hw.coefficients, Parallelism(devices_per_machine, 1), hw.interconnect(0))
    c3 = hw.coefficients.c3
    sends = (d - 1) / d * spec.hidden_size * spec.dtype_bytes / pp_bandwidth  # per token
    return (
        c3 + (full.prefill_time(prompts) - c3) / d + sends * b * prompt_len,
        c3 + (full.decode_time(b, context) - c3) / d + sends * b,
    )


@dataclass(frozen=True)
class MicrobatchOption:
    """One micro-batch size b: its best split, or why none fits."""

    microbatch: int
    y_s: float
    t_s: float
    min_prompt_depth: int  # eq. 2
    min_token_depth: int | None  # eq. 3; None: no depth works
    prompt_depth: int | None  # None: no split fits
    token_depth: int | None
    throughput_rps: float | None  # disaggregated, b / I_dis
    colocated_throughput_rps: float | None  # b / I_c; None: a D-deep pipeline's KV does not fit
    infeasible: str | None  # why no split fits, with the numbers


@dataclass(frozen=True)
class DejavuPlan:
    # inputs
    model: str
    hardware: str
    hardware_is_estimate: bool
    machines: int  # D
    devices_per_machine: int
    prompt_len: int
    new_tokens: int  # N
    microbatch_sizes: tuple[int, ...]
    streaming_overhead: float  # m
    machine_memory_gb: float  # M
    machine_memory_given: bool  # False: devices x device memory x 0.9
    pp_bandwidth_gbps: float  # GB/s between machines
    # the chosen micro-batch and its per-layer memory (App. D)
    microbatch: int  # b
    w0_gb: float
    c0_gb: float
    k0_gb: float
    # latency model, per stage of a D-deep pipeline
    y_s: float
    t_s: float
    stage_model: str  # "pp=D", or how uneven layers were spread
    # the split
    min_prompt_depth: int  # eq. 2
    min_token_depth: int  # eq. 3
    prompt_depth: int  # D_p
    token_depth: int  # D_t
    balanced_prompt_depth: float  # eq. 7
    balanced_token_depth: float  # eq. 6
    i_colocated_s: float  # eq. 4, same b
    colocated_fits: bool  # eq. 3 with D_t = D
    i_prompt_s: float
    i_token_s: float
    eq5_threshold: float  # bound on Y/t (inf: no Y/t is enough)
    eq5_holds: bool
    # the colocated baseline at its own best b (None: no b fits)
    colocated_best_microbatch: int | None
    colocated_best_throughput_rps: float | None
    options: tuple[MicrobatchOption, ...]  # every b searched

    @property
    def i_disaggregated_s(self) -> float:
        return max(self.i_prompt_s, self.i_token_s)

    @property
    def speedup(self) -> float:
        """I_c / I_dis at the same micro-batch: the throughput ratio."""
        return self.i_colocated_s / self.i_disaggregated_s

    @property
    def throughput(self) -> float:
        """Requests/s of the disaggregated pipelines, b / I_dis."""
        return self.microbatch / self.i_disaggregated_s

    @property
    def colocated_throughput(self) -> float:
        """Requests/s of one D-deep pipeline at the same b, b / I_c."""
        return self.microbatch / self.i_colocated_s

    @property
    def infeasible(self) -> tuple[str, ...]:
        """Why each micro-batch size left out does not fit."""
        return tuple(f"b={o.microbatch}: {o.infeasible}" for o in self.options if o.infeasible)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["microbatch_sizes"] = list(self.microbatch_sizes)
        d["options"] = [asdict(o) for o in self.options]
        if math.isinf(self.eq5_threshold):
            d["eq5_threshold"] = None  # JSON has no infinity
        d.update(
            i_disaggregated_s=self.i_disaggregated_s,
            speedup=self.speedup,
            throughput_rps=self.throughput,
            colocated_throughput_rps=self.colocated_throughput,
            infeasible=list(self.infeasible),
        )
        return d

    def describe(self) -> str:
        est = (
            " -- datasheet ESTIMATE (efficiency factors, not measurements)"
            if self.hardware_is_estimate
            else " (measured profile)"
        )
        mem = "given" if self.machine_memory_given else f"{self.devices_per_machine} x device x 0.9"
        bound = "none" if math.isinf(self.eq5_threshold) else f"{self.eq5_threshold:.3g}"
        colo = (
            f"b = {self.colocated_best_microbatch}: {self.colocated_best_throughput_rps:.3g} req/s"
            if self.colocated_best_throughput_rps is not None
            else "nothing: no b fits (eq. 3 with D_t = D)"
        )
        lines = [
            f"DejaVu prompt/token split (App. D) for {self.model}: {self.machines} machines x "
            f"{self.devices_per_machine} {self.hardware}{est}",
            f"  workload: prompt {self.prompt_len} tokens, N = {self.new_tokens} new tokens, "
            f"streaming overhead m = {self.streaming_overhead:g}",
            f"  micro-batch b = {self.microbatch} (best of "
            f"{', '.join(map(str, self.microbatch_sizes))} by b / I_dis)",
            f"  memory per layer: W0 = {self.w0_gb:.3f} GB, C0 = {self.c0_gb:.3f} GB, K0 = "
            f"{self.k0_gb:.3f} GB; M = {self.machine_memory_gb:.1f} GB per machine ({mem})",
            f"  per stage of a {self.machines}-deep pipeline ({self.stage_model}): Y = "
            f"{1e3 * self.y_s:.2f} ms prompt, t = {1e3 * self.t_s:.3f} ms per token "
            f"(Y/t = {self.y_s / self.t_s:.1f})",
            f"  memory bounds: D_p >= {self.min_prompt_depth} (eq. 2), D_t >= "
            f"{self.min_token_depth} (eq. 3)",
            f"  split: D_p = {self.prompt_depth}, D_t = {self.token_depth} (argmin of "
            f"max(I_p, I_t); eq. 7/6 give {self.balanced_prompt_depth:.2f} / "
            f"{self.balanced_token_depth:.2f})",
            f"  inverse throughput per micro-batch: I_c = {self.i_colocated_s:.3f} s (eq. 4"
            f"{'' if self.colocated_fits else ', its KV does not fit'}); I_p = "
            f"{self.i_prompt_s:.3f} s, I_t = {self.i_token_s:.3f} s -> I_dis = "
            f"{self.i_disaggregated_s:.3f} s",
            f"  throughput: {self.throughput:.3g} req/s disaggregated vs "
            f"{self.colocated_throughput:.3g} req/s colocated at b = {self.microbatch} "
            f"(I_c / I_dis = {self.speedup:.2f}); colocated at its best {colo}",
            f"  eq. 5: Y/t = {self.y_s / self.t_s:.3g} vs (D-1)/(D(2-m)-1) = {bound}: "
            f"disaggregation {'helps' if self.eq5_holds else 'does not help'} at eq. 6/7's "
            f"split; the integer split {'beats' if self.speedup > 1 else 'does not beat'} "
            "one pipeline",
        ]
        lines += [f"  not feasible: {r}" for r in self.infeasible]
        return "\n".join(lines)


def dejavu_split(
    spec: ModelSpec,
    hw: HardwareProfile,
    machines: int,
    devices_per_machine: int,
    prompt_len: int,
    new_tokens: int,
    microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCHES,
    streaming_overhead: float = 1.1,
    machine_memory_bytes: float | None = None,
    pp_bandwidth: float = DEFAULT_PP_BANDWIDTH,
) -> DejavuPlan:
    """The micro-batch size and prompt/token split with the highest throughput.

    pp_bandwidth: bytes/s between machines. Raises `PlanInputError` on bad inputs,
    when the weights alone exceed all machines' memory, or when no micro-batch size
    passes eq. 2 and 3 (each reason listed)."""
    sizes = tuple(microbatch_sizes)
    _check(machines, devices_per_machine, prompt_len, new_tokens, streaming_overhead, sizes)
    if not pp_bandwidth > 0:
        raise PlanInputError(f"pp_bandwidth must be > 0 bytes/s, got {pp_bandwidth}")
    if machine_memory_bytes is None:
        memory = devices_per_machine * hw.device_memory_bytes * MEMORY_HEADROOM
        mem_text = (
            f"{machines} machines x {devices_per_machine} x {hw.device_memory_bytes / GB:g} GB x "
            f"{MEMORY_HEADROOM:g}"
        )
    else:
        if not machine_memory_bytes > 0:
            raise PlanInputError(f"machine memory must be > 0 bytes, got {machine_memory_bytes}")
        memory = float(machine_memory_bytes)
        mem_text = f"{machines} machines x {memory / GB:.1f} GB"
    if spec.weight_bytes > machines * memory:
        raise PlanInputError(
            f"{spec.name}: weights {spec.weight_bytes / GB:.1f} GB > {mem_text} = "
            f"{machines * memory / GB:.1f} GB"
        )
    options = [
        _option(
            spec, machines, prompt_len, new_tokens, b, streaming_overhead, memory,
            stage_times(spec, hw, machines, devices_per_machine, prompt_len, new_tokens, b,
                        pp_bandwidth),
        )
        for b in sizes
    ]  # fmt: skip
    feasible = [o for o in options if o.throughput_rps is not None]
    if not feasible:
        reasons = "; ".join(f"b={o.microbatch}: {o.infeasible}" for o in options)
        raise PlanInputError(
            f"{spec.name}: no micro-batch size fits a prompt/token split on {machines} machines "
            f"of M = {memory / GB:.1f} GB: {reasons}"
        )
    best = max(feasible, key=lambda o: o.throughput_rps or 0.0)
    colo = [o for o in options if o.colocated_throughput_rps is not None]
    best_colo = max(colo, key=lambda o: o.colocated_throughput_rps or 0.0) if colo else None
    assert best.prompt_depth is not None and best.token_depth is not None
    assert best.min_token_depth is not None
    d, b, y, t = machines, best.microbatch, best.y_s, best.t_s
    n, m = new_tokens, streaming_overhead
    kv = spec.kv_bytes_per_token_per_layer
    i_p, i_t = inverse_throughputs(d, best.prompt_depth, best.token_depth, y, t, n, m)
    bal_p, bal_t = balanced_split(d, y, t, n, m)
    layers = spec.num_layers
    return DejavuPlan(
        model=spec.name,
        hardware=hw.name,
        hardware_is_estimate=hw.is_estimate,
        machines=d,
        devices_per_machine=devices_per_machine,
        prompt_len=prompt_len,
        new_tokens=n,
        microbatch_sizes=sizes,
        streaming_overhead=m,
        machine_memory_gb=memory / GB,
        machine_memory_given=machine_memory_bytes is not None,
        pp_bandwidth_gbps=pp_bandwidth / GB,
        microbatch=b,
        w0_gb=spec.layer_weight_bytes / GB,
        c0_gb=b * prompt_len * kv / GB,
        k0_gb=b * n * kv / GB,
        y_s=y,
        t_s=t,
        stage_model=(
            f"pp={d}"
            if layers % d == 0
            else f"{layers} layers do not split into {d} stages: {layers}/{d} per stage, "
            "cost proportional"
        ),
        min_prompt_depth=best.min_prompt_depth,
        min_token_depth=best.min_token_depth,
        prompt_depth=best.prompt_depth,
        token_depth=best.token_depth,
        balanced_prompt_depth=bal_p,
        balanced_token_depth=bal_t,
        i_colocated_s=inverse_throughput_colocated(d, y, t, n),
        colocated_fits=best.colocated_throughput_rps is not None,
        i_prompt_s=i_p,
        i_token_s=i_t,
        eq5_threshold=eq5_threshold(d, m),
        eq5_holds=disaggregation_helps(d, y, t, m),
        colocated_best_microbatch=best_colo.microbatch if best_colo else None,
        colocated_best_throughput_rps=best_colo.colocated_throughput_rps if best_colo else None,
        options=tuple(options),
    )


def _check(
    machines: int, per: int, prompt: int, new: int, m: float, sizes: tuple[int, ...]
) -> None:
    if machines < 2:
        raise PlanInputError(f"a prompt/token split needs >= 2 machines, got {machines}")
    if per < 1 or prompt < 1 or new < 1:
        raise PlanInputError(
            f"devices per machine, prompt and new tokens must be >= 1, got {per}, {prompt}, {new}"
        )
    if not m >= 1:
        raise PlanInputError(f"streaming overhead m must be >= 1, got {m}")
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise PlanInputError(f"micro-batch sizes must be integers >= 1, got {list(sizes)}")


def _option(
    spec: ModelSpec,
    d: int,
    prompt: int,
    new: int,
    b: int,
    m: float,
    memory: float,
    yt: tuple[float, float],
) -> MicrobatchOption:
    y, t = yt
    layers, kv = spec.num_layers, spec.kv_bytes_per_token_per_layer
    w0, c0, k0 = spec.layer_weight_bytes, b * prompt * kv, b * new * kv
    lo_p = min_prompt_depth(layers, c0, w0, memory)
    try:
        bound_t = token_depth_bound(layers, w0, c0, k0, memory)
    except MemoryBoundError as e:
        return MicrobatchOption(b, y, t, lo_p, None, None, None, None, None, str(e))
    lo_t = max(1, math.ceil(bound_t))
    colocated = b / inverse_throughput_colocated(d, y, t, new) if d >= bound_t else None
    split = best_integer_split(d, lo_p, lo_t, y, t, new, m)
    if split is None:
        why = (
            f"eq. 2 needs D_p >= ceil({layers} x ({c0 / GB:.3f} + {w0 / GB:.3f}) GB / "
            f"{memory / GB:.1f} GB) = {lo_p} and eq. 3 D_t >= {layers} x {w0 / GB:.3f} GB / "
            f"({memory / GB:.1f} - {layers * (c0 + k0) / GB:.1f}) GB = {bound_t:.2f} -> {lo_t}: "
            f"{lo_p} + {lo_t} > {d} machines"
        )
        return MicrobatchOption(b, y, t, lo_p, lo_t, None, None, None, colocated, why)
    i_dis = max(inverse_throughputs(d, split[0], split[1], y, t, new, m))
    return MicrobatchOption(b, y, t, lo_p, lo_t, split[0], split[1], b / i_dis, colocated, None)
