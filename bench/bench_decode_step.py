"""The median time of a served decode step, batch 1, for comparing two trees.

    .venv/bin/python bench/bench_decode_step.py [--activations int8] [--rounds 4]
    cd /tmp/old && PYTHONPATH=/tmp/old /work/main/.venv/bin/python \\
        /work/main/bench/bench_decode_step.py       # a worktree of another commit

The shipped model as `--quantization gguf` (with `--activations`); `--rounds` requests
of 256 random prompt tokens, one at a time, each decoding 128 greedy tokens; prints the
median of their `Engine.step()` times after each prefill. Whole steps as served (the
layers in one compiled call, metadata, LM head, sampling): what `bench_engine.py`'s b=1
row measures, in a process short enough to alternate with another tree's several times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import pdserve
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import resolve_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--activations", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cfg = EngineConfig(
        model=str(resolve_model(None)),
        quantization="gguf",
        activations=args.activations,
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_prefill_tokens_with_decodes=0),
        cache=CacheConfig(kv_cache_memory_gib=1.0, enable_prefix_cache=False),
    )
    engine = Engine.from_config(cfg)
    times = []
    for _ in range(args.rounds):
        params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        engine.add_request(torch.randint(100, 40000, (256,)).tolist(), params)
        engine.step()  # the prefill
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    where = pdserve.__file__.rsplit("/pdserve/", 1)[0]
    print(f"{where}: --activations {args.activations}, b=1 decode step median "
          f"{statistics.median(times) * 1e3:.2f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
