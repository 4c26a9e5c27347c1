"""DéjàVu App. D: how many machines to give prompt processing and token generation.

A throughput planner for pipeline-parallel deployments without latency SLOs. D
machines (each a tensor-parallel group, one pipeline stage per machine) are split
into a prompt pipeline of depth D_p and a token pipeline of depth D_t. With Y the
per-stage prompt time of one micro-batch and t its per-stage time per generated
token when the model is spread over all D machines, and N tokens generated per
request:

- eq. 2 (memory, prompt pipeline):  D_p >= ceil(L (C0 + W0) / M)
- eq. 3 (memory, token pipeline):   D_t >= L W0 / (M - L (C0 + K0))
- eq. 4 (one pipeline doing both):  I_c = (D-1)(Y-t)/D + Y + N t
- disaggregated:                    I_p = m D Y / D_p, I_t = N D t / D_t, I = max(I_p, I_t)
- eq. 5 (disaggregation helps):     Y/t > (D-1) / (D(2-m) - 1), needs m in [1, 2)
- eq. 6, 7 (I_p = I_t):             D_t = D N t / (m Y + N t), D_p = D m Y / (m Y + N t)

I are inverse throughputs (seconds per micro-batch); W0 is one layer's weights,
C0 and K0 one layer's prompt and generated-token KV for a micro-batch, M a machine's
usable memory, m >= 1 the KV streaming overhead. The integer split minimises
max(I_p, I_t) over every split allowed by eq. 2 and 3; eq. 6/7's real-valued split
is reported beside it. Y and t come from the latency model: the model's full time on
one machine's tensor-parallel group, divided by D (per-stage time of a D-deep
pipeline, the per-stage overhead included once per stage).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.latency import Parallelism, step_cost
from pdserve.planner.model_spec import ModelSpec, PlanInputError

GB = 1e9


# ---- the equations, on plain numbers --------------------------------------------------


def min_prompt_depth(layers: int, c0: float, w0: float, memory: float) -> int:
    """Eq. 2."""
    return max(1, math.ceil(layers * (c0 + w0) / memory))


def min_token_depth(layers: int, w0: float, c0: float, k0: float, memory: float) -> int | None:
    """Eq. 3; None when even one layer per machine cannot hold the KV (M <= L(C0+K0))."""
    room = memory - layers * (c0 + k0)
    if room <= 0:
        return None
    return max(1, math.ceil(layers * w0 / room))


def inverse_throughput_colocated(d: int, y: float, t: float, n: int) -> float:
    """Eq. 4."""
    return (d - 1) * (y - t) / d + y + n * t


def inverse_throughputs(
    d: int, d_p: int, d_t: int, y: float, t: float, n: int, m: float
) -> tuple[float, float]:
    """(I_p, I_t) of the prompt and token pipelines."""
    return m * d * y / d_p, n * d * t / d_t


def disaggregation_helps(d: int, y: float, t: float, m: float) -> bool:
    """Eq. 5 (false whenever m >= 2 - 1/D: the right side has no positive bound)."""
    denom = d * (2 - m) - 1
    return m >= 1 and denom > 0 and y / t > (d - 1) / denom


def balanced_split(d: int, y: float, t: float, n: int, m: float) -> tuple[float, float]:
    """Eq. 6 and 7: real-valued (D_p, D_t) with I_p = I_t."""
    d_t = d * n * t / (m * y + n * t)
    return d - d_t, d_t


def best_integer_split(
    d: int, lo_p: int, lo_t: int, y: float, t: float, n: int, m: float
) -> tuple[int, int] | None:
    """(D_p, D_t) minimising max(I_p, I_t) with D_p >= lo_p, D_t >= lo_t; None if none."""
    best: tuple[float, int] | None = None
    for d_p in range(lo_p, d - lo_t + 1):
        cost = max(inverse_throughputs(d, d_p, d - d_p, y, t, n, m))
        if best is None or cost < best[0]:
            best = (cost, d_p)
    return None if best is None else (best[1], d - best[1])


# ---- from a model and hardware ------------------------------------------------------


@dataclass(frozen=True)
class DejavuPlan:
    model: str
    hardware: str
    hardware_is_estimate: bool
    machines: int
    devices_per_machine: int
    machine_memory_gb: float
    prompt_len: int
    new_tokens: int
    microbatch: int
    streaming_overhead: float
    w0_gb: float
    c0_gb: float
    k0_gb: float
    y_s: float
    t_s: float
    min_prompt_depth: int
    min_token_depth: int
    prompt_depth: int
    token_depth: int
    balanced_prompt_depth: float
    balanced_token_depth: float
    i_colocated_s: float
    i_prompt_s: float
    i_token_s: float
    eq5_holds: bool

    @property
    def i_disaggregated_s(self) -> float:
        return max(self.i_prompt_s, self.i_token_s)

    @property
    def speedup(self) -> float:
        return self.i_colocated_s / self.i_disaggregated_s

    @property
    def throughput(self) -> float:
        """Requests/s of the disaggregated pipelines."""
        return self.microbatch / self.i_disaggregated_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            i_disaggregated_s=self.i_disaggregated_s,
            speedup=self.speedup,
            throughput_rps=self.throughput,
            colocated_throughput_rps=self.microbatch / self.i_colocated_s,
        )
        return d

    def describe(self) -> str:
        est = " (datasheet ESTIMATE)" if self.hardware_is_estimate else ""
        return "\n".join(
            [
                f"DejaVu split (App. D) for {self.model} on {self.machines} machines x "
                f"{self.devices_per_machine} {self.hardware}{est}",
                f"  prompt {self.prompt_len} tokens, {self.new_tokens} generated, micro-batch "
                f"{self.microbatch}, streaming overhead m = {self.streaming_overhead:g}",
                f"  per stage: Y = {1e3 * self.y_s:.2f} ms prompt, t = {1e3 * self.t_s:.3f} ms "
                f"per token (Y/t = {self.y_s / self.t_s:.1f})",
                f"  memory bounds: D_p >= {self.min_prompt_depth} (eq. 2), D_t >= "
                f"{self.min_token_depth} (eq. 3)",
                f"  split: D_p = {self.prompt_depth}, D_t = {self.token_depth} (eq. 6/7 give "
                f"{self.balanced_prompt_depth:.2f} / {self.balanced_token_depth:.2f})",
                f"  inverse throughput per micro-batch: one pipeline {self.i_colocated_s:.3f} s "
                f"(eq. 4); disaggregated max(I_p {self.i_prompt_s:.3f}, I_t {self.i_token_s:.3f})"
                f" = {self.i_disaggregated_s:.3f} s -> {self.speedup:.2f}x, "
                f"{self.throughput:.3g} req/s",
                f"  eq. 5 (disaggregation helps): {'holds' if self.eq5_holds else 'does not hold'}",
            ]
        )


def dejavu_split(
    spec: ModelSpec,
    hw: HardwareProfile,
    machines: int,
    devices_per_machine: int,
    prompt_len: int,
    new_tokens: int,
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    streaming_overhead: float = 1.1,
    machine_memory_bytes: float | None = None,
    pp_bandwidth: float = 25e9 / 8,
) -> DejavuPlan:
    """The best micro-batch size and split (highest disaggregated throughput)."""
    _check(machines, devices_per_machine, prompt_len, new_tokens, streaming_overhead)
    memory = machine_memory_bytes or devices_per_machine * hw.device_memory_bytes * 0.9
    if spec.num_layers * spec.layer_weight_bytes > machines * memory:
        raise PlanInputError(
            f"{spec.name}: weights {spec.num_layers * spec.layer_weight_bytes / GB:.1f} GB > "
            f"{machines} machines x {memory / GB:.1f} GB usable = {machines * memory / GB:.1f} GB"
        )
    plans = [
        p
        for b in microbatch_sizes
        if (p := _plan(spec, hw, machines, devices_per_machine, prompt_len, new_tokens, b,
                       streaming_overhead, memory, pp_bandwidth)) is not None
    ]  # fmt: skip
    if not plans:
        raise PlanInputError(
            f"{spec.name}: no micro-batch size in {list(microbatch_sizes)} fits the memory "
            f"bounds (eq. 2, 3) on {machines} machines of {memory / GB:.1f} GB"
        )
    return max(plans, key=lambda p: p.throughput)


def _check(machines: int, per: int, prompt: int, new: int, m: float) -> None:
    if machines < 2:
        raise PlanInputError(f"a prompt/token split needs >= 2 machines, got {machines}")
    if per < 1 or prompt < 1 or new < 1:
        raise PlanInputError(
            f"devices per machine, prompt and new tokens must be >= 1, got {per}, {prompt}, {new}"
        )
    if m < 1:
        raise PlanInputError(f"streaming overhead m must be >= 1, got {m}")


def _plan(
    spec: ModelSpec,
    hw: HardwareProfile,
    d: int,
    per: int,
    prompt: int,
    new: int,
    b: int,
    m: float,
    memory: float,
    pp_bw: float,
) -> DejavuPlan | None:
    layers, kv = spec.num_layers, spec.kv_bytes_per_token_per_layer
    w0, c0, k0 = spec.layer_weight_bytes, b * prompt * kv, b * new * kv
    lo_p = min_prompt_depth(layers, c0, w0, memory)
    lo_t = min_token_depth(layers, w0, c0, k0, memory)
    if lo_t is None or lo_p + lo_t > d:
        return None
    cost = step_cost(spec, hw.coefficients, Parallelism(per, 1), hw.interconnect(pp_bw))
    y = cost.prefill_time([prompt] * b) / d
    t = cost.decode_time(b, b * (prompt + new // 2)) / d
    split = best_integer_split(d, lo_p, lo_t, y, t, new, m)
    assert split is not None
    i_p, i_t = inverse_throughputs(d, split[0], split[1], y, t, new, m)
    bal_p, bal_t = balanced_split(d, y, t, new, m)
    return DejavuPlan(
        spec.name, hw.name, hw.is_estimate, d, per, memory / GB, prompt, new, b, m,
        w0 / GB, c0 / GB, k0 / GB, y, t, lo_p, lo_t, split[0], split[1], bal_p, bal_t,
        inverse_throughput_colocated(d, y, t, new), i_p, i_t, disaggregation_helps(d, y, t, m),
    )  # fmt: skip
