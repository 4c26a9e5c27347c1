"""Engine configuration: one explicit, validated dataclass per component.

Nothing reads configuration from globals; an `EngineConfig` is built once (from the
CLI or by a caller) and passed down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from pdserve.kv.layout import DTYPE_SIZES
from pdserve.protocol.handoff import TransferMode
from pdserve.protocol.role import Role as Role  # where the wire carries it

# --quantization values; what each means for a given file: pdserve/model/loader.py.
QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0")
# `serve stub:RATE`: a benchmark's stub instances (pdserve/engine/stub.py), not a model.
STUB_PREFIX = "stub:"
# --activations values: how the quantized kernels take activations (pdserve/quant/linear.py);
# "auto" is "int8" where the weights are served in blocks and this CPU runs the int8
# kernels (AVX2), else "fp32" (model/loader.py `resolve_quantization`).
ACTIVATIONS = ("auto", "fp32", "int8")
# What "auto" resolves to, and what a quantized op takes.
OP_ACTIVATIONS = ("fp32", "int8")


def deployment_activations(requested: str, tensor_parallel_sizes: Iterable[int]) -> str:
    """What `--activations` comes to for every instance of a deployment whose instances
    have these tensor-parallel sizes: `requested`, but "auto" is "fp32" where any instance
    is tensor-parallel. Why: such an instance sums its ranks' partial products in another
    order than one process (docs/parallelism.md, "Exactness"); under fp32 activations the
    logits move by ~1e-4 and the greedy text stays one engine's, under int8 so small a
    move can cross an activation's rounding step (dx/2 of a block) and change the text.
    "auto" keeps every layout's text the same; `--activations int8` with tensor
    parallelism is still allowed (the text then is its layout's own). Applied to the whole
    deployment, so that no request is prefilled under one and decoded under the other."""
    if requested == "auto" and any(tp > 1 for tp in tensor_parallel_sizes):
        return "fp32"
    return requested


# What the KV pool holds (--kv-cache-dtype): "auto" is float16 under quantized weights
# (llama.cpp's default; the compiled attention widens it exactly as it reads, half the
# bytes of float32 to read, hold, swap and move; docs/benchmarks.md "An fp16 KV cache")
# and `dtype` under fp weights (vLLM's "auto").
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")

if TYPE_CHECKING:
    import torch


class PrefillPolicy(StrEnum):
    """Order of waiting prompts within a scheduling batch (TetriInfer §3.3.1)."""

    FCFS = "fcfs"  # arrival order (the default; no batch is sorted)
    SJF = "sjf"  # fewest tokens to compute first
    LJF = "ljf"  # most tokens to compute first


class DecodeAdmission(StrEnum):
    """When a request may join the running batch (TetriInfer §3.4; engine/admission.py)."""

    GREEDY = "greedy"  # whenever its prompt's blocks are free now (preemption is the net)
    RESERVE_STATIC = "reserve-static"  # its predicted total KV fits in free memory now
    RESERVE_DYNAMIC = "reserve-dynamic"  # memory is still free when the shortest job ends
    PAST_FUTURE = "past-future"  # the batch's peak future KV fits (LightLLM)


class PreemptionMode(StrEnum):
    SWAP = "swap"  # copy the victim's blocks to the host tier; resume exactly where it was
    RECOMPUTE = "recompute"  # drop its KV; re-prefill prompt + generated tokens later


CPU_PREFILL_TOKENS_WITH_DECODES = 128  # SchedulerConfig.max_prefill_tokens_with_decodes on CPU


@dataclass(frozen=True)
class SchedulerConfig:
    # Token budget of one step: prefill chunks and decodes together (Sarathi-style).
    max_num_batched_tokens: int = 512
    # At most this many requests hold KV and run at once.
    max_num_seqs: int = 64
    preemption_mode: PreemptionMode = PreemptionMode.SWAP
    # New requests are refused (EngineOverloadedError, HTTP 503) while this many
    # wait for admission; None: no limit.
    max_waiting_requests: int | None = None
    # Prefill order (engine/prefill_queue.py): arrivals wait in a raw queue; when the
    # scheduled queue is empty the oldest `prefill_sched_batch` of them are sorted by
    # `prefill_policy` and scheduled. A request is passed only by later arrivals of its
    # own batch (at most prefill_sched_batch - 1 of them): that is the starvation bound.
    prefill_policy: PrefillPolicy = PrefillPolicy.FCFS
    prefill_sched_batch: int = 16
    # Which waiting request may join the running batch (engine/admission.py): decode
    # instances apply it to prefilled requests, colocated ones to prompts.
    decode_admission: DecodeAdmission = DecodeAdmission.GREEDY
    # While requests are decoding, a step takes at most this many prompt tokens, so
    # their time between tokens stays near a decode step's instead of a 512-token
    # prefill's (Sarathi-Serve's stall-free batching); with nothing decoding a prompt
    # gets the whole budget (a prefill instance never decodes: its chunks are
    # unchanged). 0: no cap. None: the device's default, `CPU_PREFILL_TOKENS_WITH_DECODES`
    # on CPU (chosen by measurement on the chatbot workload: docs/benchmarks.md, "The
    # step budget under load"), no cap elsewhere (an accelerator prefills 512 tokens in
    # milliseconds; not measured here).
    max_prefill_tokens_with_decodes: int | None = None
    # Decode bursts (engine/core.py): while every running request is a greedy decode and
    # nothing waits, up to this many steps run in one compiled call and their tokens come
    # back together - a b=1 step spends ~0.4 ms of its ~3.5 in Python between steps. As
    # many as fit `decode_burst_ms` at the batch's measured step time, so a request that
    # arrives (or an abort) waits at most about that long. 1: off.
    decode_burst: int = 8
    decode_burst_ms: float = 25.0

    def prompt_cap(self, device: str) -> int | None:
        """Prompt tokens a step may take beside decodes on `device` (None: no cap)."""
        cap = self.max_prefill_tokens_with_decodes
        if cap is None:
            return CPU_PREFILL_TOKENS_WITH_DECODES if device == "cpu" else None
        return cap or None

    def __post_init__(self) -> None:
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_prefill_tokens_with_decodes is not None:
            _at_least("max_prefill_tokens_with_decodes", self.max_prefill_tokens_with_decodes, 0)
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("prefill_sched_batch", self.prefill_sched_batch, 1)
        _at_least("decode_burst", self.decode_burst, 1)
        if not self.decode_burst_ms > 0:
            raise ValueError(f"decode_burst_ms must be > 0, got {self.decode_burst_ms!r}")
        if self.max_waiting_requests is not None:
            _at_least("max_waiting_requests", self.max_waiting_requests, 0)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Device-tier KV memory; `num_blocks` overrides it when set (tests use tiny pools).
    kv_cache_memory_gib: float = 1.0
    num_blocks: int | None = None
    # Host-tier memory for swapped-out blocks; `num_host_blocks` overrides it.
    swap_space_gib: float = 1.0
    num_host_blocks: int | None = None
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        _at_least("block_size", self.block_size, 1)
        if self.num_blocks is not None:
            _at_least("num_blocks", self.num_blocks, 1)
        if self.num_host_blocks is not None:
            _at_least("num_host_blocks", self.num_host_blocks, 0)
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")


# The KV transports whose regions are /dev/shm segments another process can map: the only
# ones a parallel instance can move KV through (its workers compute in their segments).
SHARED_TRANSPORTS = ("shm", "auto")


@dataclass(frozen=True)
class TransferConfig:
    """KV hand-off between prefill and decode instances (kv/transfer)."""

    mode: TransferMode = TransferMode.PULL
    # "shm" (one host, one copy between the two pools), "tcp" (across hosts), "auto" (shm to
    # instances on the same node, tcp to the others: `serve --ray`), "inproc" (tests).
    transport: str = "shm"
    # Address the TCP transport listens on.
    host: str = "127.0.0.1"
    # auto: the node this instance runs on (a Ray node id, set by the Ray launcher; one host
    # without Ray is the one node "local").
    node: str = "local"
    # A transfer that has not finished after this long fails (the request is retried or fails).
    timeout_s: float = 30.0
    # Pull mode: how long a prefill instance keeps KV that no decode instance has claimed.
    lease_s: float = 60.0
    # TCP: crc32 of every payload, checked by the receiver.
    verify_checksum: bool = False
    # Fault injection (tests, benchmarks): per-transfer failure probability, added delay,
    # bandwidth cap in bytes/s; all off by default.
    fault_failure_rate: float = 0.0
    fault_delay_s: float = 0.0
    fault_bandwidth: float | None = None
    fault_seed: int | None = None
    # Which transfers the faults hit: "all", or "cache": only the copies of cluster-wide
    # caching (returns, prefix fetches: engine/features/cache_exchange.py), not the hand-offs.
    fault_scope: str = "all"

    def __post_init__(self) -> None:
        if self.transport not in ("shm", "tcp", "auto", "inproc"):
            raise ValueError(f"transport must be shm, tcp, auto or inproc, got {self.transport!r}")
        for name in ("timeout_s", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lease_s <= self.timeout_s:
            raise ValueError(
                f"lease_s ({self.lease_s}) must exceed timeout_s ({self.timeout_s}): a fetch "
                "must never outlive the lease of the KV it reads"
            )
        if not 0.0 <= self.fault_failure_rate <= 1.0:
            raise ValueError(f"fault_failure_rate must be in [0, 1], got {self.fault_failure_rate}")
        if self.fault_delay_s < 0:
            raise ValueError(f"fault_delay_s must be >= 0, got {self.fault_delay_s}")
        if self.fault_bandwidth is not None and self.fault_bandwidth <= 0:
            raise ValueError(f"fault_bandwidth must be > 0 bytes/s, got {self.fault_bandwidth}")
        if self.fault_scope not in ("all", "cache"):
            raise ValueError(f"fault_scope must be all or cache, got {self.fault_scope!r}")

    @property
    def injects_faults(self) -> bool:
        return bool(self.fault_failure_rate or self.fault_delay_s or self.fault_bandwidth)


@dataclass(frozen=True)
class EngineConfig:
    # HF folder, .gguf file, or None for the shipped SmolLM2.
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # How weights are held (QUANTIZATIONS): "none" fp in `dtype`;
    # "gguf" a GGUF file's blocks as they are; "q8_0"/"q4_0" fp weights quantized at
    # load; "auto" "gguf" where the file and this install allow it, else "none".
    quantization: str = "auto"
    # How the quantized kernels take activations (ACTIVATIONS): "int8" rounded per 32
    # values, integer products (llama.cpp's method: faster, not fp32's text;
    # pdserve/kernels/README.md; needs quantized weights and AVX2); "fp32" exact (the
    # fp32 model's text up to the order of the sums); "auto" (the default) int8 where it
    # can run, else fp32 - the gate that made it the default: docs/benchmarks.md,
    # "The quality gate for int8 activations".
    activations: str = "auto"
    # The KV pool's dtype (KV_CACHE_DTYPES); resolved by `kv_dtype`.
    kv_cache_dtype: str = "auto"
    role: Role = Role.COLOCATED
    # Context limit of one request (prompt + generation); None = the model's own,
    # lowered to what the KV pool can hold.
    max_model_len: int | None = None
    # Torch intra-op threads; None = all cores this process may use. With tensor
    # parallelism, the instance's: each rank takes an even share.
    num_threads: int | None = None
    # Ranks of this instance, each a process holding its share of every layer's heads and
    # MLP columns (pdserve/parallel, docs/parallelism.md); 1: the whole model in one.
    tensor_parallel_size: int = 1
    # Pipeline stages of this instance, each a run of the layers on its own T ranks; a
    # step's rows pass through them in micro-batches (engine/pipeline.py).
    pipeline_parallel_size: int = 1
    # DéjàVu's microbatch swapping on each pipeline stage (engine/mb_swap.py): the blocks of
    # its device staging area, two micro-batches' worth; every block lives in the pool
    # proper (host memory on a GPU). 0: off, a stage computes from its pool.
    microbatch_swap_blocks: int = 0
    # CPUs the engine process runs on (its affinity, set before the model loads);
    # None = those of the process that starts it. Keeps the engine off the cores the
    # HTTP front end (and a load generator) use.
    cpus: tuple[int, ...] | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # Names this instance in a cluster (KV region names, logs, load reports).
    instance_name: str = "engine"
    # Seconds between the load reports a cluster instance sends its controller.
    report_interval_s: float = 0.1
    # Token ids that end a generation (EOS and the generation config's). None: the engine
    # process reads them from the model's tokenizer; a front end that loaded the tokenizer
    # already passes them (building a GGUF tokenizer costs seconds per process).
    stop_token_ids: tuple[int, ...] | None = None
    # Output-length head file (pdserve/engine/length_head.py) read at load, checked against the
    # model; None: no predictions (length-aware policies fall back, docs/scheduling.md).
    length_predictor: str | None = None
    # A benchmark's stub instance (pdserve/engine/stub.py): no model runs, each running
    # request gets one token every 1 / stub_rate seconds. None: the model serves.
    stub_rate: float | None = None

    def __post_init__(self) -> None:
        if self.stub_rate is not None and not (0 < self.stub_rate < float("inf")):
            raise ValueError(f"stub_rate must be a number > 0, got {self.stub_rate}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.activations not in ACTIVATIONS:
            raise ValueError(
                f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        _check_device_name(self.device)
        if self.device != "cpu" and self.role is not Role.COLOCATED:
            raise ValueError(
                f"a {self.role.value} instance needs its KV pool in host memory (the KV "
                f"transports move host memory), so it runs on the cpu, not {self.device}"
            )
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 2)
        if self.num_threads is not None:
            _at_least("num_threads", self.num_threads, 1)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _at_least("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.microbatch_swap_blocks:
            if self.pipeline_parallel_size == 1:
                raise ValueError(
                    "microbatch_swap_blocks swaps a pipeline stage's micro-batches: it needs "
                    "pipeline_parallel_size > 1"
                )
            if self.microbatch_swap_blocks < 2 or self.microbatch_swap_blocks % 2:
                raise ValueError(
                    "microbatch_swap_blocks must be an even number >= 2 (two halves, one "
                    f"micro-batch each), got {self.microbatch_swap_blocks}"
                )
        if self.cpus is not None:
            if not self.cpus:
                raise ValueError("cpus must name at least one CPU (or be None)")
            for cpu in self.cpus:
                _at_least("each of cpus", cpu, 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        from pdserve.kv.transfer.layout import TORCH_DTYPES  # torch: only where it runs

        return TORCH_DTYPES[self.dtype]

    def kv_dtype(self, quantized: bool) -> str:
        """The KV pool's dtype for a model whose weights are (not) `quantized` (see
        KV_CACHE_DTYPES). ValueError (a usage error) for bfloat16 under quantized weights:
        their compiled attention reads float32 or float16."""
        if self.kv_cache_dtype == "auto":
            return "float16" if quantized else self.dtype
        if quantized and self.kv_cache_dtype == "bfloat16":
            raise ValueError(
                "--kv-cache-dtype bfloat16: quantized weights' compiled attention reads a "
                "float32 or float16 KV cache (or serve fp weights: --quantization none)"
            )
        return self.kv_cache_dtype

    @property
    def threads(self) -> int:
        return self.num_threads or len(self.cpus or os.sched_getaffinity(0))

    @property
    def world_size(self) -> int:
        """The instance's ranks: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def check_device(device: str) -> None:
    """ValueError (a usage error) naming the problem when `device` is not cpu, cuda or
    cuda:N, or torch cannot use it."""
    _check_device_name(device)
    if device == "cpu":
        return
    import torch  # here, not at the top: config is read where torch never loads

    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch {torch.__version__} sees no CUDA device (a CPU-only "
            "build of torch, or no GPU visible to this process)"
        )
    index, count = torch.device(device).index, torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(
            f"--device {device}: this process sees {count} CUDA device(s), cuda:0 to "
            f"cuda:{count - 1}"
        )


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _check_device_name(device: str) -> None:
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def parse_stub(model: str | None) -> float | None:
    """The tokens/s per request that `stub:RATE` names (a stub instance's rate); None for
    any other model name; ValueError when RATE is not a number > 0."""
    if model is None or not model.startswith(STUB_PREFIX):
        return None
    text = model[len(STUB_PREFIX) :]
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not 0 < rate < float("inf"):
        raise ValueError(
            f"{model}: a stub instance's rate must be a number of tokens/s per request > 0 "
            f"(e.g. stub:100), got {text!r}"
        )
    return rate
