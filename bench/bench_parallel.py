"""Parallel instances on this machine: TP 2 and PP 2 against TP 1 at equal total threads.

    .venv/bin/python bench/bench_parallel.py [--quantization gguf,none]
        [--layouts 1x1,2x1,1x2] [--threads 2] [--rounds 3] [--json out.json]

For each weight setting and layout (TxP: tensor x pipeline ranks) it builds an in-process
engine of the shipped model on `--threads` threads in all (TP 1 one process; TP 2 or PP 2
two ranks of half the threads), alternating over `--rounds`, and times: a 512-token
prefill (`max_tokens` 1), a single greedy stream's decode step and a batch of 8 streams'
(64 tokens, TPOT from the engine's own step loop). Then the communication alone, as a
decode step meets it, two ranks of one thread, 2,000 times: the all-reduce of a [1,
hidden] fp32 tensor (`group.all_reduce_sum`, shared memory; two per layer per step: 60
per SmolLM2 step under TP 2) and a stage's hand-off of [1, hidden] rows (`group.send` /
`recv`, one way: two per micro-batch per step under PP 2). Prints medians and each
layout's time over TP 1's.
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

PROMPT_TOKENS, DECODE_TOKENS, BATCH, REPEATS = 512, 64, 8, 2000


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


def _batch_tpot(engine: Engine, prompts: list[list[int]]) -> float:
    """The mean time between decode steps of `prompts` decoding together."""
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    steps: list[float] = []
    while engine.has_unfinished():
        outs = engine.step()
        if outs and all(len(o.token_ids) > 1 for o in outs):
            steps.append(time.perf_counter())
    return (steps[-1] - steps[0]) / (len(steps) - 1)


def measure(quant: str, tp: int, pp: int, threads: int) -> dict[str, float]:
    config = EngineConfig(
        quantization=quant,
        num_threads=threads,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    engine = Engine.from_config(config)
    try:
        gen = torch.Generator().manual_seed(tp * 10 + pp)
        ids = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist()
        _run(engine, ids[:32], 4)  # warm up
        prefill = _run(engine, ids, 1)[0]
        decode = _run(engine, ids[:16], DECODE_TOKENS)
        tpot = (decode[-1] - decode[0]) / (len(decode) - 1)
        batch = _batch_tpot(engine, [ids[16 * i : 16 * i + 16] for i in range(BATCH)])
        return {"prefill_s": prefill, "tpot_s": tpot, "batch_tpot_s": batch}
    finally:
        engine.core.close()


def _comm_rank(rank: int, port: int, hidden: int, rows: tuple[int, ...], out: mp.Queue) -> None:
    torch.set_num_threads(1)
    group.join(rank, 2, port)
    found: dict[str, list[float]] = {"reduce": [], "handoff": []}
    for n in rows:
        t = torch.randn(n, hidden)

        def reduce(t: torch.Tensor = t) -> None:
            group.all_reduce_sum(t)

        def ping_pong(t: torch.Tensor = t) -> None:  # two one-way hand-offs
            if rank == 0:
                group.send(t, 1).wait()
                group.recv(t, 1)
            else:
                group.recv(t, 0)
                group.send(t, 0).wait()

        for name, op, per in (("reduce", reduce, 1), ("handoff", ping_pong, 2)):
            for _ in range(100):
                op()
            start = time.perf_counter()
            for _ in range(REPEATS):
                op()
            found[name].append((time.perf_counter() - start) / REPEATS / per)
    if rank == 0:
        out.put(found)
    group.leave()


def communication(hidden: int = 576, rows: tuple[int, ...] = (1,)) -> dict[str, list[float]]:
    """Seconds of one all-reduce ("reduce") and one one-way stage hand-off ("handoff") of
    [n, hidden] fp32 between two ranks of one thread, for each n in `rows`."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = group.free_port()
    procs = [ctx.Process(target=_comm_rank, args=(r, port, hidden, rows, out)) for r in range(2)]
    for p in procs:
        p.start()
    found: dict[str, list[float]] = out.get(timeout=300)
    for p in procs:
        p.join(30)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="gguf,none")
    ap.add_argument("--layouts", default="1x1,2x1,1x2", help="TxP, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    results: dict[str, dict[str, list[float]]] = {}
    for quant in args.quantization.split(","):
        for _ in range(args.rounds):
            for tp, pp in layouts:
                r = measure(quant, tp, pp, args.threads)
                for k, v in r.items():
                    results.setdefault(f"{quant} {tp}x{pp}", {}).setdefault(k, []).append(v)
    comm = communication()
    reduce_s, handoff_s = comm["reduce"][0], comm["handoff"][0]
    print(f"threads {args.threads} in all; medians of {args.rounds} rounds, alternating")
    for quant in args.quantization.split(","):
        base = {k: statistics.median(v) for k, v in results[f"{quant} 1x1"].items()}
        for tp, pp in layouts:
            med = {k: statistics.median(v) for k, v in results[f"{quant} {tp}x{pp}"].items()}
            print(
                f"{quant:5s} TP {tp} x PP {pp}: prefill {PROMPT_TOKENS} "
                f"{med['prefill_s'] * 1e3:.0f} ms ({med['prefill_s'] / base['prefill_s']:.2f}x)"
                f", TPOT b=1 {med['tpot_s'] * 1e3:.1f} ms "
                f"({med['tpot_s'] / base['tpot_s']:.2f}x), b={BATCH} "
                f"{med['batch_tpot_s'] * 1e3:.1f} ms "
                f"({med['batch_tpot_s'] / base['batch_tpot_s']:.2f}x)"
            )
    print(
        f"[1, 576] fp32 between 2 ranks: all-reduce {reduce_s * 1e6:.0f} us, one-way stage "
        f"hand-off {handoff_s * 1e6:.0f} us"
    )
    if args.json:
        with open(args.json, "w") as f:
            out = {"results": results, "all_reduce_s": reduce_s, "handoff_s": handoff_s}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
