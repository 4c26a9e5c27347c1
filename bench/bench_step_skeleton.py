"""How far a batch-1 decode step can get toward its bandwidth floor on this machine: the
step's bytes read op by op with nothing computed, beside the served step, in one run.

    .venv/bin/python bench/bench_step_skeleton.py [--rounds 5] [--activations int8]

The shipped model served as `--quantization gguf` (with `--activations`), as
`bench_engine.py`'s decode b=1 row runs it (256 prompt tokens, then 16 steps). Three
figures, alternating round by round so that the machine's drift hits all of them:

* the flat floor: every byte the step reads (each op's weights, the KV of each layer at
  the steps' mean context, the LM head) as one read on two threads, right after 64 MB of
  other reads - `bench_engine.py`'s cold floor;
* the skeleton: the same bytes in the step's order, op by op (q/k/v, the layer's KV, o,
  gate/up, down; then the head), each op's bytes split in two contiguous halves between
  the two threads, a barrier after each op, nothing computed - what the step's ~150
  dependent reads cost on their own, the structure's floor;
* the served step (`Engine.step()`: its mean, a decode burst's steps one by one);
* the same flat read on one thread: whether the second core adds bandwidth. When it
  doubles it (this machine's "fast" memory, ~55-70 GB/s), the floor is two cores that
  do nothing but read, each at its own limit (27-35 GB/s here), and any time a core does
  not stream - the step's Python on one core, a barrier's wait, arithmetic on data in
  cache - adds to the step. When it adds little ("slow" memory, ~30-40 GB/s, shared with
  the host's other tenants), one core nearly fills the bus and the other's pauses are
  hidden. Each round is printed with its ratio, so the two regimes are told apart;
* the fp32 multiply-add rate on two threads against one, in each round too: the cores
  are shared with other tenants as well, and a round whose second thread computes at a
  fraction of the first's is one where a step, which computes, loses what a plain read
  does not;
* the flat read with 8 multiply-adds on every 32 bytes it loads, cold and in L2, in each
  round: whether two cores hide that much arithmetic under their streams (a cold rate
  near the lower of the flat read's and the in-L2 rate, printed as "overlapped") or pay
  for both ("added"). On two CCDs they hide it (stop 47, docs/benchmarks.md): the served
  step's excess over its read is in how its work is laid out, not in the cores;
* where the machine put the two cores, in each round: a cache line's round trip between
  them (`round_trip`) is ~60 ns when they share a CCD (one L3 and one link to memory)
  and ~300 ns when they sit on two. The "fast memory" above is the second case: each
  CCD brings its own link (~30-35 GB/s a core), and every exchange between the threads
  crosses the fabric. Seen here over ~1,400 rounds: a flat read above 50 GB/s came with
  two CCDs in all but a handful;
* the skeleton again with each thread's parts laid end to end (thread 0's half of every
  op, then thread 1's): what the step's reads would cost if a thread's stream ran on
  from one op into the next instead of jumping to the next op's half. With two CCDs the
  step's layout costs ~1.23x the flat read and this one ~1.12x; with one, ~1.02x both.

Also the machine's fp32 multiply-add rate on one and two threads (16 independent FMA
chains per thread), and from it the attention's compute floor: its 4 * H * D * context
FLOPs a layer (scores and value sums) on two threads, at that rate. The reads and the
rate are bench/reads.py's small C program, compiled here.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode_step import served_engine
from bench_engine import DECODE_CONTEXT, DECODE_STEPS, ours_decode
from reads import build, flat_read_bandwidth, placement, read_with_arithmetic

from pdserve.model.base import CausalLM
from pdserve.quant.linear import QuantLinear

KINDS = ("q/k/v", "KV", "o", "gate/up", "down", "LM head")
# Multiply-adds a 32 bytes in the read with arithmetic: in L2, two threads then run at about
# the two-CCD flat read's rate (~55 GB/s), where overlapped and added differ the most.
ARITH_FMAS = 8


def step_segments(model: CausalLM, context: int) -> list[tuple[int, int]]:
    """(bytes, kind) of each read of a b=1 decode step at `context` tokens, in order."""
    cfg = model.config
    ops = model.projection_ops()
    shapes = [(cfg.vocab_size, cfg.hidden_size)] + [
        (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (cfg.hidden_size, cfg.q_size),
        (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size),
    ] * cfg.num_hidden_layers  # fmt: skip
    sizes = [
        op.nbytes if isinstance(op, QuantLinear) else 4 * n * k
        for op, (n, k) in zip(ops, shapes, strict=True)
    ]
    kv = context * 2 * cfg.kv_size * 4
    segments: list[tuple[int, int]] = []
    for i in range(cfg.num_hidden_layers):
        qkv, o, gate_up, down = sizes[1 + 4 * i : 5 + 4 * i]
        segments += [(qkv, 0), (kv, 1), (o, 2), (gate_up, 3), (down, 4)]
    return [*segments, (sizes[0], 5)]


def run_skeleton(lib: ctypes.CDLL, segments: list[tuple[int, int]], reps: int) -> list[float]:
    n = len(segments)
    seg = (ctypes.c_int64 * n)(*(s for s, _ in segments))
    kind = (ctypes.c_int32 * n)(*(k for _, k in segments))
    out = (ctypes.c_double * (3 + len(KINDS)))()
    if lib.skeleton(seg, kind, n, len(KINDS), reps, out) < 0:
        raise MemoryError("skeleton: could not allocate its buffers")
    return list(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--activations", default="int8", choices=("fp32", "int8"))
    args = ap.parse_args()
    engine = served_engine(args.activations)
    model = engine.core.model
    context = DECODE_CONTEXT + DECODE_STEPS // 2
    segments = step_segments(model, context)
    total = sum(s for s, _ in segments)
    lib = build()
    skeletons: list[list[float]] = []
    steps: list[float] = []
    one_thread: list[float] = []  # bytes/s of the flat read on one thread
    fma: list[tuple[float, float]] = []  # FLOP/s on one and on two threads
    trips: list[float] = []  # seconds a cache line takes from one core to the other and back
    arith: list[tuple[float, float]] = []  # bytes/s of the read with ARITH_FMAS: cold, hot
    ours_decode(engine, 1)  # warm-up
    for _ in range(args.rounds):
        time.sleep(0.2)  # the step's OpenMP threads stop spinning first
        skeletons.append(run_skeleton(lib, segments, reps=10))
        one_thread.append(flat_read_bandwidth(lib, total, 1))
        fma.append((lib.fma_rate(1), lib.fma_rate(2)))
        trips.append(lib.round_trip(20000))
        arith.append(read_with_arithmetic(lib, total, 2, ARITH_FMAS))
        steps.append(ours_decode(engine, 1) / 1000)
    time.sleep(0.2)
    rate1, rate2 = max(lib.fma_rate(1) for _ in range(3)), max(lib.fma_rate(2) for _ in range(3))
    mc = model.config
    attn_flops = 4 * mc.num_attention_heads * mc.head_dim * context * mc.num_hidden_layers
    flat = statistics.median(s[0] for s in skeletons)
    ops = statistics.median(s[1] for s in skeletons)
    ends = statistics.median(s[2] for s in skeletons)
    step = statistics.median(steps)
    ratios = [t / s[0] for t, s in zip(steps, skeletons, strict=True)]
    print(f"decode b=1, --activations {args.activations}, context {context}: {total / 1e6:.1f} "
          f"MB a step ({len(segments)} reads); medians of {args.rounds} rounds")  # fmt: skip
    print(f"  flat cold read       {flat * 1e3:6.2f} ms ({total / flat / 1e9:.1f} GB/s)")
    print(f"  op-by-op skeleton    {ops * 1e3:6.2f} ms ({ops / flat:.2f}x the flat read)")
    print(f"  the same, each thread's parts end to end {ends * 1e3:.2f} ms ({ends / flat:.2f}x)")
    print(f"  served step          {step * 1e3:6.2f} ms ({statistics.median(ratios):.2f}x the "
          f"flat read, paired per round: {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
    rounds = zip(skeletons, one_thread, fma, trips, arith, steps, strict=True)
    for i, (sk, one, (f1, f2), trip, (cold, hot), t) in enumerate(rounds):
        two = total / sk[0]
        print(f"  round {i + 1}: {placement(trip)}; flat read {two / 1e9:.1f} GB/s on two "
              f"threads, {one / 1e9:.1f} on one ({two / one:.2f}x); FMA {f2 / f1:.2f}x on "
              f"two; skeleton {sk[1] / sk[0]:.2f}x (parts end to end {sk[2] / sk[0]:.2f}x), "
              f"served step {t / sk[0]:.2f}x the flat read; the read with {ARITH_FMAS} "
              f"multiply-adds a 32 bytes {cold / 1e9:.1f} GB/s cold, {hot / 1e9:.1f} in L2 "
              f"(overlapped: {min(two, hot) / 1e9:.1f}, added: "
              f"{1 / (1 / two + 1 / hot) / 1e9:.1f})")  # fmt: skip
    per = [statistics.median(s[3 + k] for s in skeletons) for k in range(len(KINDS))]
    parts = ", ".join(f"{name} {t * 1e3:.2f}" for name, t in zip(KINDS, per, strict=True))
    print(f"  skeleton per op, ms a step: {parts}")
    print(f"  fp32 FMA rate: {rate1 / 1e9:.1f} GFLOP/s on one thread, {rate2 / 1e9:.1f} on two; "
          f"the attention's {attn_flops / 1e6:.1f} MFLOP a step take "
          f"{attn_flops / rate2 * 1e3:.2f} ms on two threads at that rate")  # fmt: skip
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
