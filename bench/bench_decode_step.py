"""The time of a served decode step (or a prefill's rate), for comparing two trees, the KV
pool's pages, or decode bursts on and off.

    .venv/bin/python bench/bench_decode_step.py [--activations int8] [--rounds 4] [--batch 1]
    .venv/bin/python bench/bench_decode_step.py --prefill 2048 --rounds 5
    cd /tmp/old && PYTHONPATH=/tmp/old /work/main/.venv/bin/python \\
        /work/main/bench/bench_decode_step.py       # a worktree of another commit
    .venv/bin/python bench/bench_decode_step.py --kv-pages --rounds 12
    .venv/bin/python bench/bench_decode_step.py --bursts --activations int8 --rounds 12

The shipped model as `--quantization gguf` (with `--activations`); `--rounds` rounds of
`--batch` requests of 256 random prompt tokens, each decoding 128 greedy tokens; prints
the mean time of their decode steps after the prefill (a decode burst's steps counted
one by one). Whole steps as served (the layers, final norm and LM head in one compiled
call, metadata, sampling, decode bursts where the engine takes them): what
`bench_engine.py`'s decode rows measure, in a process short enough to alternate with
another tree's several times.

`--prefill N`: instead, `--rounds` prefills of N random prompt tokens (`bench_engine.py`'s
prefill rows: one step, the first token sampled); prints their median rate.

`--bursts`: the same engine's rounds alternate between one step a call
(`--decode-burst 1`) and decode bursts (the default); prints each round's time a step
and the median of the paired ratios, and on how many rounds' ends the cores sat on two
CCDs (bench/reads.py).

`--kv-pages`: the same engine's rounds alternate between its KV pool (on 2 MB pages,
`pdserve/memory.py`) and a copy on ordinary pages (`torch.zeros`, what the pool was
before); prints each round's medians and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

import pdserve
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.model.source import resolve_model

sys.path.insert(0, str(Path(__file__).parent))
import reads
from bench_engine import ours_decode, ours_prefill  # the engine benchmark's own loops


def served_engine(activations: str, decode_burst: int = SchedulerConfig.decode_burst) -> Engine:
    """The shipped model as `pdserve serve --quantization gguf --activations ...` loads it;
    prompts prefill whole, before decodes join (bench_engine.py's decode rows).
    `decode_burst` 1: one step a call (a harness that times or swaps a step's call)."""
    cfg = EngineConfig(
        model=str(resolve_model(None)),
        quantization="gguf",
        activations=activations,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=4096,
            max_prefill_tokens_with_decodes=0,
            decode_burst=decode_burst,
        ),
        cache=CacheConfig(kv_cache_memory_gib=1.0, enable_prefix_cache=False),
    )
    return Engine.from_config(cfg)


def decode_round(engine: Engine, batch: int) -> float:
    """`batch` requests prefilled, then 128 steps decoding together: ms a step (a decode
    burst's steps counted one by one)."""
    return ours_decode(engine, batch, steps=127)


def bursts_ab(engine: Engine, rounds: int, batch: int) -> None:
    """See the module docstring (`--bursts`)."""
    scheduler = engine.core.scheduler
    configs = {
        "one step a call": dataclasses.replace(scheduler.config, decode_burst=1),
        "bursts": scheduler.config,
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    trips = []
    for i in range(rounds):
        for name in list(configs) if i % 2 == 0 else list(configs)[::-1]:
            scheduler.config = configs[name]
            times[name].append(decode_round(engine, batch))
        trips.append(reads.build().round_trip(20000))
    scheduler.config = configs["bursts"]
    for name, ts in times.items():
        print(f"{name}, b={batch}: " + " ".join(f"{t:.2f}" for t in ts) + " ms a step")
    ratios = [a / b for a, b in zip(times["one step a call"], times["bursts"], strict=True)]
    two = sum(reads.placement_kind(t) == "two CCDs" for t in trips)
    print(f"bursts faster by {statistics.median(ratios):.3f}x (median of paired ratios, "
          f"{min(ratios):.3f}-{max(ratios):.3f}); cores on two CCDs after {two} of "
          f"{rounds} rounds")  # fmt: skip


def kv_pages_ab(engine: Engine, rounds: int, batch: int) -> None:
    """See the module docstring (`--kv-pages`)."""
    cache = engine.core.runner.cache
    pages = {"2 MB": cache.device_tensor, "4 KB": torch.zeros_like(cache.device_tensor)}
    times: dict[str, list[float]] = {name: [] for name in pages}
    for i in range(rounds):
        for name in list(pages) if i % 2 == 0 else list(pages)[::-1]:
            cache.device_tensor = pages[name]  # each round prefills its own KV
            times[name].append(decode_round(engine, batch))
    cache.device_tensor = pages["2 MB"]
    for name, ts in times.items():
        print(f"KV on {name} pages, b={batch}: " + " ".join(f"{t:.2f}" for t in ts) + " ms")
    ratios = [a / b for a, b in zip(times["4 KB"], times["2 MB"], strict=True)]
    print(f"2 MB pages faster by {statistics.median(ratios):.3f}x (median of paired ratios, "
          f"{min(ratios):.3f}-{max(ratios):.3f})")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--activations", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-pages", action="store_true", help="the pool's pages, A/B")
    ap.add_argument("--bursts", action="store_true", help="decode bursts on and off, A/B")
    ap.add_argument("--prefill", type=int, default=0, help="prompt tokens: time prefills")
    args = ap.parse_args()
    engine = served_engine(args.activations)
    where = pdserve.__file__.rsplit("/pdserve/", 1)[0]
    if args.kv_pages:
        kv_pages_ab(engine, args.rounds, args.batch)
        return 0
    if args.bursts:
        bursts_ab(engine, args.rounds, args.batch)
        return 0
    if args.prefill:
        ours_prefill(engine, 128)  # warm-up
        rates = [ours_prefill(engine, args.prefill) for _ in range(args.rounds)]
        print(f"{where}: --activations {args.activations}, prefill {args.prefill} tokens "
              f"median {statistics.median(rates):.0f} tok/s")  # fmt: skip
        return 0
    times = [decode_round(engine, args.batch) for _ in range(args.rounds)]
    print(f"{where}: --activations {args.activations}, b={args.batch} decode step median "
          f"{statistics.median(times):.2f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
