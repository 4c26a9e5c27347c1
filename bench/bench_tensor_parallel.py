"""Tensor parallelism on this machine: TP 2 against TP 1 at equal total threads.

    .venv/bin/python bench/bench_tensor_parallel.py [--quantization gguf,none]
        [--threads 2] [--rounds 3] [--json out.json]

For each weight setting it builds an in-process engine of the shipped model on all
`--threads` threads (TP 1) and one split over two ranks of half the threads each (TP 2,
`tensor_parallel_size=2`), alternating over `--rounds`, and times: a 512-token prefill
(`max_tokens` 1) and a single greedy stream's decode step (64 tokens, TPOT from the
engine's own step loop). Then the all-reduce alone, as a decode step meets it: two ranks
summing a [1, hidden] fp32 tensor with `group.all_reduce_sum` (shared memory), 2,000
times (two per layer per step: 60 per SmolLM2 step). Prints medians and TP 2 / TP 1;
the all-reduce's share of a TP 2 decode step is (60 x its time) / the step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.parallel import group
from pdserve.protocol.sampling_params import SamplingParams

PROMPT_TOKENS, DECODE_TOKENS, REDUCES = 512, 64, 2000


def _run(engine: Engine, prompt: list[int], max_tokens: int) -> list[float]:
    """The times at which each token of one greedy request arrived (seconds from start)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    start, seen, times = time.perf_counter(), 0, []
    while engine.has_unfinished():
        for out in engine.step():
            while seen < len(out.token_ids):
                times.append(time.perf_counter() - start)
                seen += 1
    return times


def measure(quant: str, tp: int, threads: int) -> dict[str, float]:
    engine = Engine.from_config(
        EngineConfig(quantization=quant, num_threads=threads, tensor_parallel_size=tp)
    )
    try:
        gen = torch.Generator().manual_seed(tp)
        ids = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist()
        _run(engine, ids[:32], 4)  # warm up
        prefill = _run(engine, ids, 1)[0]
        decode = _run(engine, ids[:16], DECODE_TOKENS)
        tpot = (decode[-1] - decode[0]) / (len(decode) - 1)
        return {"prefill_s": prefill, "tpot_s": tpot}
    finally:
        engine.core.close()


def _reduce_rank(rank: int, port: int, hidden: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    group.join(rank, 2, port)
    t = torch.randn(1, hidden)
    for _ in range(100):
        group.all_reduce_sum(t)
    start = time.perf_counter()
    for _ in range(REDUCES):
        group.all_reduce_sum(t)
    if rank == 0:
        out.put((time.perf_counter() - start) / REDUCES)
    group.leave()


def all_reduce_s(hidden: int = 576) -> float:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = group.free_port()
    procs = [ctx.Process(target=_reduce_rank, args=(r, port, hidden, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return float(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="gguf,none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for quant in args.quantization.split(","):
        for _ in range(args.rounds):
            for tp in (1, 2):
                r = measure(quant, tp, args.threads)
                for k, v in r.items():
                    results.setdefault(f"{quant} tp{tp}", {}).setdefault(k, []).append(v)
    reduce_s = all_reduce_s()
    print(f"threads {args.threads} in all; medians of {args.rounds} rounds, alternating")
    for quant in args.quantization.split(","):
        one, two = results[f"{quant} tp1"], results[f"{quant} tp2"]
        p1, p2 = statistics.median(one["prefill_s"]), statistics.median(two["prefill_s"])
        d1, d2 = statistics.median(one["tpot_s"]), statistics.median(two["tpot_s"])
        print(
            f"{quant:5s} prefill {PROMPT_TOKENS}: TP1 {p1 * 1e3:.0f} ms, TP2 {p2 * 1e3:.0f} ms "
            f"({p2 / p1:.2f}x); decode TPOT: TP1 {d1 * 1e3:.1f} ms, TP2 {d2 * 1e3:.1f} ms "
            f"({d2 / d1:.2f}x); 60 all-reduces {60 * reduce_s * 1e3:.1f} ms = "
            f"{60 * reduce_s / d2:.0%} of the TP2 step"
        )
    print(f"all-reduce of [1, 576] fp32 over 2 ranks: {reduce_s * 1e6:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "all_reduce_s": reduce_s}, f, indent=1)


if __name__ == "__main__":
    main()
