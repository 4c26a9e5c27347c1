"""Engine speed vs HF transformers and the machine's floors, side by side in one run.

    .venv/bin/python bench/bench_engine.py [--model PATH] [--repeats 3] [--json out.json]
        [--quantization none,gguf,q8_0,gguf+int8,gguf@float32]

Measures on the same weights, dtype and thread count, for each --quantization (none:
fp32 dequantized from the file; gguf: the file's own blocks; q8_0 / q4_0: the fp32
weights requantized at load; a "+int8" suffix: those weights with `--activations int8`;
an "@DTYPE" suffix: that `--kv-cache-dtype`, else `auto`: fp16 under quantized weights),
against HF transformers in fp32:
* prefill throughput (tokens/s) at prompt lengths 128 / 512 / 2048, batch 1;
* decode step time (ms) at batch 1 / 8 / 32 / 64 with ~256 tokens of context;
* the machine's floors: memory bandwidth (bench/reads.py's plain reads of 1-4 GiB, the
  best of several),
  fp32 matmul rate (large square matmul), and from them the decode-step floor (the
  bytes that step must read / bandwidth: the weights in the format that setting reads
  - values and the scales the kernels read - and the KV cache its sequences attend,
  K and V of every layer in the pool's dtype over the mean context of the timed steps) and the
  prefill floor (FLOPs / fp32 matmul rate; the quantized kernels compute in fp32 too);
* beside the table, batch 1 against a second floor: a cold read of that step's bytes
  (`cold_read_bandwidth`, bench/reads.py's read after 64 MB of others), what the machine
  gives a stream of that size, taken between the timed runs (the median); and at the
  same moments the second core's share (`second_core_share`: two threads' FMA rate over
  one's), since the cores are shared with other tenants too, and where the two cores
  sat (`core_round_trip`: ~60 ns on one CCD, ~300 ns on two, when memory reads at
  ~2x; bench_step_skeleton.py).

Each figure is the median over `--repeats` runs; ours and HF's runs alternate so
machine drift hits both. Reported as ratios; absolute times are for context only.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import reads

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.model.base import CausalLM
from pdserve.model.config import ModelConfig
from pdserve.model.loader import iter_weights, quantize_weights
from pdserve.model.quantization import Quantization
from pdserve.model.registry import build_model
from pdserve.model.source import load_config, resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.quant.formats import QuantType
from pdserve.quant.linear import QuantLinear

PREFILL_LENS = (128, 512, 2048)
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXT = 256
DECODE_STEPS = 16


@dataclass
class Row:
    name: str
    ours: dict[str, float]  # by --quantization
    hf: float
    unit: str
    floors: dict[str, float] | None = None


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


# ---- machine floors ---------------------------------------------------------------


@functools.cache
def _reads() -> ctypes.CDLL:
    return reads.build()


def memory_bandwidth() -> tuple[float, float]:
    """(read, copy) bytes/s over buffers far larger than the 32 MiB L3.

    read: bench/reads.py's plain read of 1, 2 and 4 GiB (every byte once, as decode
    reads weights), the best of 5 at each size: the strictest floor to hold ourselves
    to. copy: a tensor copy, read + write bytes counted, the best of 5 at each size."""
    threads = torch.get_num_threads()
    best_read, best_copy = 0.0, 0.0
    for gib in (1, 2, 4):
        best_read = max(best_read, reads.flat_read_bandwidth(_reads(), gib << 30, threads))
        src = torch.ones(gib * 2**28)
        dst = torch.empty_like(src)
        copy = functools.partial(dst.copy_, src)
        best_copy = max(best_copy, 2 * src.numel() * 4 / _best_time(copy))
        del src, dst
    return best_read, best_copy


def cold_read_bandwidth(nbytes: int) -> float:
    """Bytes/s of one read of `nbytes` (a batch-1 decode step's weights and KV) right after
    64 MB of other reads (bench/reads.py): how a step's own stream finds memory now.
    `memory_bandwidth`'s best of GiB-sized reads, taken once at the start, is the
    strictest floor; this machine's bandwidth moves by 2x within minutes, so this one is
    taken between the timed runs (see main). The best of 5."""
    return reads.flat_read_bandwidth(_reads(), nbytes, torch.get_num_threads())


def second_core_share() -> float:
    """fp32 multiply-adds a second on two threads over one (bench/reads.py's 16 chains a
    thread, the best of 3 each): 2.0 when the second core computes as the first does. The
    cores are shared with the host's other tenants; a b=1 step computes as it reads, so
    it loses what the read floor does not (bench_step_skeleton.py shows it round by
    round)."""
    lib = _reads()
    one = max(lib.fma_rate(1) for _ in range(3))
    return max(lib.fma_rate(2) for _ in range(3)) / one


def core_round_trip() -> float:
    """Seconds a cache line takes from one of two threads to the other and back
    (bench/reads.py `round_trip`, the best of 3): ~60 ns when the machine put this VM's
    two cores on one CCD, ~300 ns on two, where the memory gives ~2x (a link a CCD)."""
    lib = _reads()
    return min(lib.round_trip(20000) for _ in range(3))


def _best_time(fn: Callable[[], object], runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_rate(n: int = 2048) -> float:
    """fp32 FLOP/s of a large square matmul: the best of torch's default kernel and
    oneDNN's packed-weight kernel (the one pdserve uses, model/linear.py)."""
    from pdserve.model.linear import PackedLinear

    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = PackedLinear(b, None)
    best = float("inf")
    for fn in (lambda: a @ b, lambda: packed(a)):
        fn()
        for _ in range(5):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step must read: every weight once (the tied LM head included),
    in the format each op reads (blocks for a quantized op, fp32 otherwise)."""
    cfg = model.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)]
    shapes = [(cfg.vocab_size, h), *layer * cfg.num_hidden_layers]
    ops = model.projection_ops()
    total = 4 * h * (2 * cfg.num_hidden_layers + 1)  # the norms
    for op, (n, k) in zip(ops, shapes, strict=True):
        total += op.nbytes if isinstance(op, QuantLinear) else 4 * n * k
    return total


def kv_bytes(cfg: ModelConfig, batch: int, elem: int) -> int:
    """Bytes of KV cache a decode step of `batch` sequences reads: K and V of every layer
    at the mean context of the timed steps, `elem` bytes each (the pool's dtype)."""
    context = DECODE_CONTEXT + DECODE_STEPS // 2
    return batch * cfg.num_hidden_layers * context * 2 * cfg.kv_size * elem


def engine_kv_bytes(e: Engine, batch: int) -> int:
    """kv_bytes in the engine's own pool dtype (an fp16 cache under quantized weights)."""
    return kv_bytes(e.core.model.config, batch, e.core.kv_layout.elem_size)


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens (projections, causal attention, LM head for 1)."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    proj = 2 * n * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i)
    attn = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * n * (n + 1) / 2
    return layers * (proj + attn) + 2 * cfg.vocab_size * h


# ---- pdserve ----------------------------------------------------------------------


def ours_prefill(engine: Engine, n: int) -> float:
    prompt = list(torch.randint(100, 40000, (n,)).tolist())
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - t)


def ours_decode(engine: Engine, batch: int, steps: int = DECODE_STEPS) -> float:
    """`batch` requests of DECODE_CONTEXT random tokens prefilled, then `steps` decode
    steps of them together: their mean, in ms (the steps of a decode burst count one by
    one: a burst's time over its steps)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(100, 40000, (DECODE_CONTEXT,)).tolist(), params)
    while len(engine.core.scheduler.waiting) or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.core.scheduler.running
    ):
        engine.step()  # prefill everything first
    seconds, steps = 0.0, 0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        seconds += time.perf_counter() - t
        steps += engine.core.bursts.last_steps  # a decode burst runs several (engine/bursts.py)
    return seconds / steps * 1000


# ---- HF transformers --------------------------------------------------------------


def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder_cfg = _hf_config_dict(load_config(path))
    config = AutoConfig.for_model(**folder_cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dict(iter_weights(path, torch.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing), missing
    model.tie_weights()
    return model.eval()


def _hf_config_dict(c: ModelConfig) -> dict[str, object]:
    return {
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
    }


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a timer reads it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_prefill(model: torch.nn.Module, n: int) -> float:
    device = next(model.parameters()).device
    ids = torch.randint(100, 40000, (1, n), device=device)
    _sync(device)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)  # type: ignore[operator]
    _sync(device)
    return n / (time.perf_counter() - t)


@torch.inference_mode()
def hf_decode(model: torch.nn.Module, batch: int) -> float:
    """Median step time of the loop `generate` runs: forward one token per sequence
    over HF's own DynamicCache, greedy pick. Equal-length prompts: no padding mask.
    On a GPU each step ends when its tokens are back on the host, as pdserve's steps do."""
    device = next(model.parameters()).device
    ids = torch.randint(100, 40000, (batch, DECODE_CONTEXT), device=device)
    out = model(ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    times = []
    for _ in range(DECODE_STEPS):
        t = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        nxt.cpu()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


# ---- main -------------------------------------------------------------------------


def make_engine(cfg: EngineConfig, setting: str) -> Engine:
    """none / gguf: as `pdserve serve --quantization` loads the file; q8_0 / q4_0: the
    file's fp32 weights requantized at load (what `--quantization q8_0` does for a HF
    folder), so every setting serves the same model. A "+int8" suffix: the same weights
    with `--activations int8`; an "@DTYPE" suffix: that `--kv-cache-dtype`; a "~N"
    suffix (last): `--decode-burst N` (~1: one step a call; default: the served default)."""
    setting, _, burst = setting.partition("~")
    if burst:
        cfg = dataclasses.replace(
            cfg, scheduler=dataclasses.replace(cfg.scheduler, decode_burst=int(burst))
        )
    setting, _, kv = setting.partition("@")
    quantization, _, activations = setting.partition("+")
    activations = activations or "fp32"
    cfg = dataclasses.replace(cfg, kv_cache_dtype=kv or "auto")
    if quantization in ("none", "gguf"):
        return Engine.from_config(
            dataclasses.replace(cfg, quantization=quantization, activations=activations)
        )
    assert cfg.model is not None
    torch.set_num_threads(cfg.threads)
    model = build_model(load_config(cfg.model), quantized=True)
    model.quantization = Quantization(quantization, activations=activations)
    model.load_weights(quantize_weights(iter_weights(cfg.model), QuantType.parse(quantization)))
    model.finalize()
    return Engine(cfg, model, Tokenizer.from_model_path(cfg.model))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantization", default="none,gguf,q8_0", help="comma-separated settings")
    args = ap.parse_args()
    path = str(resolve_model(args.model))
    cfg = EngineConfig(
        model=path,
        # No prompt cap while requests decode: the decode rows prefill their whole batch
        # first (with the CPU default of 128 prompt tokens per step, the first requests
        # finished before the last ones had prefilled, and b=32/64 measured fewer rows).
        scheduler=SchedulerConfig(
            max_num_batched_tokens=4096, max_num_seqs=128, max_prefill_tokens_with_decodes=0
        ),
        cache=CacheConfig(kv_cache_memory_gib=2.0, enable_prefix_cache=False),
    )
    torch.manual_seed(0)
    engines = {q: make_engine(cfg, q) for q in args.quantization.split(",")}
    hf = hf_model(path)
    mc = next(iter(engines.values())).core.model.config
    (bw, bw_copy), mm = memory_bandwidth(), matmul_rate()
    rows: list[Row] = []
    for n in PREFILL_LENS:
        for e in engines.values():
            ours_prefill(e, n)  # warm-up
        hf_prefill(hf, n)
        fns = {q: functools.partial(ours_prefill, e, n) for q, e in engines.items()}
        o, h = _alternate(fns, functools.partial(hf_prefill, hf, n), args.repeats)
        floor = n / (prefill_flops(mc, n) / mm)
        rows.append(Row(f"prefill {n} tok", o, h, "tok/s", {q: floor for q in engines}))
    step_bytes = {q: weight_bytes(e.core.model) + engine_kv_bytes(e, 1) for q, e in engines.items()}
    cold: dict[str, list[float]] = {q: [] for q in engines}
    second_core: list[float] = []  # fp32 FMA rate on two threads / on one, between runs
    trips: list[float] = []  # a cache line's round trip between the two cores, between runs

    def hf_then_cold_reads(b: int) -> float:
        """HF's decode step; at batch 1 then a cold read of each setting's step bytes,
        so that second floor is taken between the runs it is compared with."""
        t = hf_decode(hf, b)
        if b == 1:
            for q in engines:
                cold[q].append(cold_read_bandwidth(step_bytes[q]))
            second_core.append(second_core_share())
            trips.append(core_round_trip())
        return t

    for b in DECODE_BATCHES:
        fns = {q: functools.partial(ours_decode, e, b) for q, e in engines.items()}
        o, h = _alternate(fns, functools.partial(hf_then_cold_reads, b), args.repeats)
        floors = {
            q: (weight_bytes(e.core.model) + engine_kv_bytes(e, b)) / bw * 1000
            for q, e in engines.items()
        }
        rows.append(Row(f"decode b={b} ctx~{DECODE_CONTEXT}", o, h, "ms/step", floors))
    kv = {q: engine_kv_bytes(e, 1) for q, e in engines.items()}
    _print(rows, bw, mm, {q: weight_bytes(e.core.model) for q, e in engines.items()}, kv)
    b1 = next(r for r in rows if r.name.startswith("decode b=1 "))
    for q in engines:
        rate = statistics.median(cold[q])
        floor = step_bytes[q] / rate * 1000
        print(f"decode b=1, {q}: against a cold read of its {step_bytes[q] / 1e6:.0f} MB "
              f"({rate / 1e9:.1f} GB/s, the median of reads between the timed runs): "
              f"floor {floor:.2f} ms, ours/floor {floor / b1.ours[q]:.2f}")  # fmt: skip
    share = statistics.median(second_core)
    print(f"  the same moments: two threads multiply-added at {share:.2f}x one thread's rate"
          " (2.0: the second core was ours alone; a read floor does not see "
          "a core shared with another tenant, a step does)")  # fmt: skip
    two = sum(reads.placement_kind(t) == "two CCDs" for t in trips)
    print(
        f"  and the two cores sat on two CCDs at {two} of {len(trips)} of them (round trips "
        f"{', '.join(f'{t * 1e9:.0f}' for t in trips)} ns; ~60 on one CCD, ~300 on two, "
        "~110-175 on an Intel mesh)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "read_bandwidth_Bps": bw,
                    "cold_step_read_Bps": {q: statistics.median(v) for q, v in cold.items()},
                    "second_core_fma_share": statistics.median(second_core),
                    "core_round_trip_s": trips,
                    "copy_bandwidth_Bps": bw_copy,
                    "matmul_flops": mm,
                    "threads": torch.get_num_threads(),
                    "rows": [r.__dict__ for r in rows],
                },
                f,
                indent=2,
            )
    return 0


def _alternate(
    ours: dict[str, Callable[[], float]], hf: Callable[[], float], repeats: int
) -> tuple[dict[str, float], float]:
    """Each setting then HF, `repeats` times over; the medians."""
    o: dict[str, list[float]] = {q: [] for q in ours}
    h = []
    for _ in range(repeats):
        for q, fn in ours.items():
            o[q].append(fn())
        h.append(hf())
    return {q: statistics.median(v) for q, v in o.items()}, statistics.median(h)


def _print(
    rows: list[Row], bw: float, mm: float, weights: dict[str, int], kv: dict[str, int]
) -> None:
    sizes = ", ".join(f"{q} {n / 1e6:.0f} MB" for q, n in weights.items())
    kv_sizes = ", ".join(f"{q} {n / 1e6:.1f} MB" for q, n in kv.items())
    print(
        f"threads={torch.get_num_threads()}  read bandwidth={bw / 1e9:.1f} GB/s  "
        f"matmul={mm / 1e9:.1f} GFLOP/s  weights read per step: {sizes}; "
        f"KV read per step and sequence: {kv_sizes}"
    )
    print(
        f"| {'case':24} | {'setting':8} | {'pdserve':>9} | {'HF fp32':>9} | unit    | ours/HF "
        "| floor     | ours/floor |"
    )
    print("|" + "---|" * 8)
    for r in rows:
        higher_better = r.unit == "tok/s"
        for q, ours in r.ours.items():
            speed = ours / r.hf if higher_better else r.hf / ours
            floor = r.floors[q] if r.floors else None
            fl = f"{floor:9.1f}" if floor else "-"
            of = (ours / floor if higher_better else floor / ours) if floor else 0
            cells = [f"{r.name:24}", f"{q:8}", f"{ours:9.1f}", f"{r.hf:9.1f}", f"{r.unit:7}"]
            cells += [f"{speed:6.2f}x", fl, f"{of:9.2f}"]
            print("| " + " | ".join(cells) + " |")
    print("ours/HF > 1 means pdserve is faster; ours/floor is the fraction of the floor reached.")


if __name__ == "__main__":
    sys.exit(main())
