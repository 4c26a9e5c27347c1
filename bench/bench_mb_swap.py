"""Microbatch swapping on this machine: the batch it makes room for, and what its copies cost.

    .venv/bin/python bench/bench_mb_swap.py [--quantization gguf] [--streams 16]
        [--rounds 3] [--json out.json]

A PP 2 engine of the shipped model (two stages of one thread) serves `--streams` greedy
requests of 100 prompt tokens and 64 generated (11 blocks of 16 each), offered at once,
under a KV budget per stage of half of them (`--streams` / 2 x 11 blocks), three ways:

- `pool`: no swapping, the stage's pool is the budget: half the streams run at a time,
  the rest wait (or are preempted);
- `swap`: microbatch swapping with the budget as the staging area and a pool twice its
  size: every stream runs at once, in micro-batches of a staging half each;
- `swap-half`: the same staging with only half the streams offered (the batch `pool`
  holds): swapping's own cost at an equal batch.

Rounds alternate; prints medians of the generated tokens per second and, for the swap
runs, the driver stage's copy time per step against the step (its `MicrobatchSwap.copy_s`
over the steps, the copies overlapping the compute on another thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.engine import Engine
from pdserve.protocol.sampling_params import SamplingParams

PROMPT, GENERATED, BLOCK = 100, 64, 16
BLOCKS_PER_STREAM = -(-(PROMPT + GENERATED) // BLOCK)


def measure(quant: str, way: str, streams: int) -> dict[str, float]:
    budget = streams // 2 * BLOCKS_PER_STREAM
    swap = way != "pool"
    config = EngineConfig(
        quantization=quant,
        num_threads=2,
        pipeline_parallel_size=2,
        max_model_len=(PROMPT + GENERATED) // BLOCK * BLOCK + BLOCK,
        microbatch_swap_blocks=2 * (budget // 2) if swap else 0,
        cache=CacheConfig(
            block_size=BLOCK,
            num_blocks=2 * budget if swap else budget,
            enable_prefix_cache=False,
        ),
    )
    engine = Engine.from_config(config)
    try:
        offered = streams // 2 if way == "swap-half" else streams
        gen = torch.Generator().manual_seed(offered)
        prompts = [
            torch.randint(100, 40000, (PROMPT,), generator=gen).tolist() for _ in range(offered)
        ]
        params = SamplingParams(max_tokens=GENERATED, temperature=0.0, ignore_eos=True)
        stage = engine.core.runner.stage
        assert stage is not None
        for p in prompts:
            engine.add_request(p, params)
        start, steps, step_s = time.perf_counter(), 0, 0.0
        copy0 = stage.swap.copy_s if stage.swap else 0.0
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            step_s += time.perf_counter() - t0
            steps += 1
        wall = time.perf_counter() - start
        copy = (stage.swap.copy_s - copy0) if stage.swap else 0.0
        return {
            "tokens_per_s": offered * GENERATED / wall,
            "step_s": step_s / steps,
            "copy_per_step_s": copy / steps,
            "peak_blocks": float(stage.swap.peak_blocks if stage.swap else budget),
        }
    finally:
        engine.core.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ways = ("pool", "swap", "swap-half")
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for way in ways:
            for k, v in measure(args.quantization, way, args.streams).items():
                results.setdefault(way, {}).setdefault(k, []).append(v)
    med = {w: {k: statistics.median(v) for k, v in r.items()} for w, r in results.items()}
    budget = args.streams // 2 * BLOCKS_PER_STREAM
    print(
        f"{args.quantization}, PP 2, {args.streams} streams of {PROMPT} + {GENERATED} "
        f"tokens, a stage's KV budget {budget} blocks; medians of {args.rounds} rounds"
    )
    for way in ways:
        m = med[way]
        line = (
            f"{way:9s} {m['tokens_per_s']:.1f} tokens/s "
            f"({m['tokens_per_s'] / med['pool']['tokens_per_s']:.2f}x pool's), step "
            f"{m['step_s'] * 1e3:.1f} ms"
        )
        if way != "pool":
            line += (
                f", copies {m['copy_per_step_s'] * 1e3:.2f} ms a step "
                f"({m['copy_per_step_s'] / m['step_s']:.1%}), most blocks staged "
                f"{m['peak_blocks']:.0f}"
            )
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
