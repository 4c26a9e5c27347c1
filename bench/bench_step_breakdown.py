"""Where a decode step's time goes, by part, at several batch sizes.

    .venv/bin/python bench/bench_step_breakdown.py [--model PATH] [--batches 1,8,16,32]
        [--context 256] [--steps 24] [--quantization gguf] [--activations fp32]

Runs the engine as `bench_engine.py` does (prompts of `--context` random tokens
prefilled first, then decode steps timed) with timers around each part of a step: the
four projections of the layers (qkv with its RMSNorm, o, gate/up with its RMSNorm,
down with SwiGLU), the attention (RoPE, KV write and attention: one compiled call per
layer), the LM head, the step's attention metadata (block tables, key ranges), the
final norm, embedding and Python between the calls ("forward, rest"), sampling, and
what is left of `Engine.step` (scheduling, block tables, metadata, Python). Each part
is the median over steps of its summed time in a step, in ms; the projections also in
GMAC/s, to read against `bench_quant_kernels.py`'s product rates. The timers add a
few microseconds per call (~150 calls a step); the step's total is measured with them.
To time each call the layers go one call at a time (`CausalLM.layers_in_one_call` off):
a served step makes all of them one compiled call (model/fused.py), which saves most of
"forward, rest" - `bench_engine.py` times that step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import torch

import pdserve.engine.core as core_mod
import pdserve.engine.model_runner as runner_mod
import pdserve.model.layers as layers_mod
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import ModelRunner
from pdserve.model.layers import DecoderLayer
from pdserve.model.source import resolve_model
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.quant.linear import QuantLinear

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")


class Timers:
    """Summed seconds per part within the current step; one dict per finished step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, part: Callable[..., str] | str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            name = part(*args) if callable(part) else part
            self.current[name] += time.perf_counter() - t
            return out

        return timed

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def layers(engine: Engine) -> list[DecoderLayer]:
    return cast(list[DecoderLayer], list(engine.core.model.layers))


def op_names(engine: Engine) -> dict[int, str]:
    """id(QuantLinear) -> which projection it is."""
    names = {id(engine.core.model.lm_head_op): "lm_head"}
    for layer in layers(engine):
        ops = layer.fused_ops()
        if ops is None:
            raise SystemExit("the model is not on the compiled path (quantized, kernels built)")
        for name, op in zip(PROJECTIONS, ops, strict=False):
            names[id(op)] = name
    return names


def instrument(engine: Engine, timers: Timers) -> None:
    names = op_names(engine)
    run = QuantLinear.run
    QuantLinear.run = timers.wrap(lambda op, *a: names[id(op)], run)  # type: ignore[method-assign]
    layers_mod.row_attention = timers.wrap("attention", layers_mod.row_attention)
    core_mod.sample = timers.wrap("sampling", core_mod.sample)
    ModelRunner.execute = timers.wrap("forward", ModelRunner.execute)  # type: ignore[method-assign]
    runner_mod.AttentionMetadata.build = staticmethod(  # type: ignore[method-assign]
        timers.wrap("metadata", runner_mod.AttentionMetadata.build)
    )


def macs_per_row(engine: Engine) -> dict[str, int]:
    """Multiply-adds of each projection for one row (all layers)."""
    out: dict[str, int] = defaultdict(int)
    for layer in layers(engine):
        for name, op in zip(PROJECTIONS, layer.fused_ops() or (), strict=False):
            out[name] += op.in_features * op.out_features
    head = cast(QuantLinear, engine.core.model.lm_head_op)
    out["lm_head"] = head.in_features * head.out_features
    return out


def decode_steps(engine: Engine, timers: Timers, batch: int, context: int, steps: int) -> None:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(100, 40000, (context,)).tolist(), params)
    core = engine.core
    while core.scheduler.waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in core.scheduler.running
    ):
        engine.step()
    timers.steps.clear()
    timers.current.clear()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        timers.current["step"] += time.perf_counter() - t
        timers.end_step()


def summarize(timers: Timers, batch: int, macs: dict[str, int]) -> dict[str, float]:
    full = [s for s in timers.steps if s.get("sampling")]  # the last step samples nothing
    med = {k: statistics.median(s.get(k, 0.0) for s in full) * 1000 for k in full[0]}
    proj = sum(med.get(p, 0.0) for p in PROJECTIONS)
    med["forward, rest"] = med["forward"] - proj - med.get("attention", 0.0) - med["metadata"]
    med["engine, rest"] = med["step"] - med["forward"] - med.get("sampling", 0.0)
    for p in PROJECTIONS:
        if med.get(p):
            med[f"{p} GMAC/s"] = macs[p] * batch / (med[p] / 1000) / 1e9
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--activations", default="fp32", choices=("fp32", "int8"))
    args = ap.parse_args()
    cfg = EngineConfig(
        model=str(resolve_model(args.model)),
        quantization=args.quantization,
        activations=args.activations,
        # No prompt cap: every batch is prefilled whole before its decode steps are timed.
        scheduler=SchedulerConfig(
            max_num_batched_tokens=4096, max_num_seqs=128, max_prefill_tokens_with_decodes=0
        ),
        cache=CacheConfig(kv_cache_memory_gib=2.0, enable_prefix_cache=False),
    )
    engine = Engine.from_config(dataclasses.replace(cfg))
    engine.core.model.layers_in_one_call = False  # each call timed (see the docstring)
    timers = Timers()
    instrument(engine, timers)
    macs = macs_per_row(engine)
    batches = [int(b) for b in args.batches.split(",")]
    decode_steps(engine, timers, 4, args.context, 4)  # warm-up
    results = {}
    for b in batches:
        decode_steps(engine, timers, b, args.context, args.steps)
        results[b] = summarize(timers, b, macs)
    parts = ["step", "forward", *PROJECTIONS, "attention", "metadata", "forward, rest"]
    parts += ["sampling"]
    parts += ["engine, rest"]
    print(
        f"decode step breakdown, ms (medians of {args.steps} steps), context ~{args.context}, "
        f"{torch.get_num_threads()} threads, --quantization {args.quantization}, "
        f"--activations {args.activations}"
    )
    print(f"{'part':<16}" + "".join(f"{'b=' + str(b):>10}" for b in batches))
    for p in parts:
        print(f"{p:<16}" + "".join(f"{results[b].get(p, 0.0):>10.2f}" for b in batches))
    for p in PROJECTIONS:
        key = f"{p} GMAC/s"
        print(f"{key:<16}" + "".join(f"{results[b].get(key, 0.0):>10.1f}" for b in batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
