"""Prefill order: FCFS vs SJF vs LJF at two scheduling-batch sizes (TetriInfer Fig. 16, left
and right): the average time a prompt waits before its prefill starts.

    .venv/bin/python bench/bench_prefill_policy.py [--rate 5 --requests 200 --repeats 3]

One real engine over the shipped SmolLM2 (2 threads, chunked prefill with the default
512-token budget, prefix cache off), fed ShareGPT-shaped prompts (`chatbot` profile:
median 70 tokens, up to 1,024; random token ids) at Poisson arrival times in real time;
every request generates one token, so the engine does prefill work only, as a prefill
instance does. The same seeded prompts and arrival times go to every setting; settings
alternate within each repeat. Waiting = arrival -> first scheduled (the engine's
`queue_time`); reported per setting: mean and p90 waiting, and the mean prefill latency
(arrival -> first token), medians over repeats, with the ratio to FCFS of the same repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pdserve.config import CacheConfig, EngineConfig, PrefillPolicy, SchedulerConfig
from pdserve.engine.engine import Engine, load_model
from pdserve.model.source import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.workload.profiles import PROFILES, draw_lengths

SETTINGS = [
    (PrefillPolicy.FCFS, 16),
    (PrefillPolicy.SJF, 16),
    (PrefillPolicy.LJF, 16),
    (PrefillPolicy.SJF, 128),
    (PrefillPolicy.LJF, 128),
]


def run(engine: Engine, prompts: list[list[int]], offsets: np.ndarray) -> dict[str, float]:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.monotonic()
    waits: list[float] = []
    ttfts: list[float] = []
    k = 0
    while k < len(prompts) or engine.has_unfinished():
        now = time.monotonic() - start
        while k < len(prompts) and offsets[k] <= now:
            engine.add_request(prompts[k], params, f"r{k}")
            engine.core.requests[f"r{k}"].times.arrival = start + float(offsets[k])
            k += 1
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.metrics is not None:
                    waits.append(out.metrics.queue_time or 0.0)
                    ttfts.append(out.metrics.ttft or 0.0)
        elif k < len(prompts):
            time.sleep(max(0.0, float(offsets[k]) - (time.monotonic() - start)))
    return {
        "mean_wait": statistics.fmean(waits),
        "p90_wait": float(np.percentile(waits, 90)),
        "mean_ttft": statistics.fmean(ttfts),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = resolve_model(None)
    base = EngineConfig(num_threads=2, cache=CacheConfig(enable_prefix_cache=False))
    model = load_model(base)
    tokenizer = Tokenizer.from_model_path(path)
    drawn = draw_lengths(PROFILES["chatbot"], args.requests, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    vocab = model.config.vocab_size
    prompts = [rng.integers(100, vocab, int(n)).tolist() for n in drawn.inputs]
    offsets = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))
    print(
        f"{args.requests} prompts (mean {np.mean(drawn.inputs):.0f} tokens) at {args.rate} req/s "
        f"over {offsets[-1]:.0f} s; {args.repeats} repeats"
    )
    results: dict[tuple[PrefillPolicy, int], list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for r in range(args.repeats):
        order = SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]
        for policy, batch in order:
            sched = SchedulerConfig(prefill_policy=policy, prefill_sched_batch=batch)
            engine = Engine(
                EngineConfig(num_threads=2, scheduler=sched, cache=base.cache), model, tokenizer
            )
            results[(policy, batch)].append(run(engine, prompts, offsets))
            print(f"  repeat {r + 1}: {policy.value} batch {batch}: {results[(policy, batch)][-1]}")
    fcfs = results[(PrefillPolicy.FCFS, 16)]
    print(
        "\nsetting        mean wait ms  p90 wait ms  mean TTFT ms  wait vs FCFS (median of repeats)"
    )
    for (policy, batch), rows in results.items():
        ratio = statistics.median(
            row["mean_wait"] / base_row["mean_wait"]
            for row, base_row in zip(rows, fcfs, strict=True)
        )
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(
            f"{policy.value} b={batch:<4}  {med['mean_wait'] * 1e3:>12.0f}  "
            f"{med['p90_wait'] * 1e3:>11.0f}  {med['mean_ttft'] * 1e3:>12.0f}  {ratio:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
