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
* the served step (`Engine.step()`, its median).

Also the machine's fp32 multiply-add rate on one and two threads (16 independent FMA
chains per thread), and from it the attention's compute floor: its 4 * H * D * context
FLOPs a layer (scores and value sums) on two threads, at that rate. The skeleton and
the rate are a small C program compiled here (gcc, OpenMP, AVX2), as bench_kernel_ab.py builds.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode_step import served_engine
from bench_engine import DECODE_CONTEXT, DECODE_STEPS, ours_decode

from pdserve.model.base import CausalLM
from pdserve.quant.linear import QuantLinear

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static __m256i read_range(const char *p, int64_t n, __m256i acc) {
    for (int64_t i = 0; i + 128 <= n; i += 128) {
        acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + i)));
        acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + i + 32)));
        acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + i + 64)));
        acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    return acc;
}

static char *pages(int64_t n) { /* on 2 MB pages, as the weights and the KV pool are */
    const int64_t huge = 2 << 20, size = (n + huge - 1) / huge * huge;
    char *p = aligned_alloc(huge, size);
    if (p == NULL) return NULL;
    madvise(p, size, MADV_HUGEPAGE);
    memset(p, 1, size);
    return p;
}

/* seg[i] bytes of kind kind[i], read in order; out: [0] the best flat read, [1] the best
 * op-by-op read, [2 + k] the mean time of kind k's segments per pass (seconds). */
int skeleton(const int64_t *seg, const int32_t *kind, int n, int kinds, int reps, double *out) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (seg[i] + 255) / 256 * 256;
    char *buf = pages(total), *other = pages(64 << 20);
    if (buf == NULL || other == NULL) return -1;
    double flat = 1e9, ops = 1e9, *per = out + 2, sink = 0;
    for (int k = 0; k < kinds; k++) per[k] = 0;
    for (int rep = 0; rep < reps; rep++) {
        for (int mode = 0; mode < 2; mode++) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
            {
                const int me = omp_get_thread_num();
                const char *mine = other + (int64_t)me * (32 << 20);
                __m256i a = read_range(mine, 32 << 20, _mm256_setzero_si256());
#pragma omp barrier
                const double t0 = omp_get_wtime();
                if (mode == 0) {
                    const int64_t half = total / 2 / 128 * 128;
                    a = read_range(buf + me * half, half, a);
#pragma omp barrier
                } else {
                    const char *p = buf;
                    for (int i = 0; i < n; i++) {
                        const int64_t half = seg[i] / 2 / 128 * 128;
                        const double ts = omp_get_wtime();
                        a = read_range(p + me * half, half, a);
                        p += (seg[i] + 255) / 256 * 256;
#pragma omp barrier
                        if (me == 0) per[kind[i]] += omp_get_wtime() - ts;
                    }
                }
                const double t = omp_get_wtime() - t0;
                if (me == 0 && mode == 0 && t < flat) flat = t;
                if (me == 0 && mode == 1 && t < ops) ops = t;
                sink += _mm256_extract_epi32(a, 0);
            }
        }
    }
    for (int k = 0; k < kinds; k++) per[k] /= reps;
    out[0] = flat, out[1] = ops;
    free(buf), free(other);
    return sink == 0.5; /* never: keeps the reads */
}

static float chains(int64_t n) {
    __m256 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm256_set1_ps(1.0f + i * 1e-3f);
    const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t k = 0; k < n; k++)
        for (int i = 0; i < 16; i++) a[i] = _mm256_fmadd_ps(a[i], m, c);
    float s = 0;
    for (int i = 0; i < 16; i++) s += a[i][0];
    return s;
}

/* fp32 FLOP/s of `threads` threads, each running 16 independent FMA chains (8 reach
 * about 2/3 of that here: the multiply-add's latency, not its throughput, bounds them). */
double fma_rate(int threads) {
    const int64_t n = 10000000;
    float s = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : s)
    s += chains(n);
    const double t = omp_get_wtime() - t0;
    return s == 0.5f ? 0 : 16.0 * 8 * 2 * n * threads / t;
}
"""

KINDS = ("q/k/v", "KV", "o", "gate/up", "down", "LM head")


def build() -> ctypes.CDLL:
    """SOURCE compiled and loaded (the library stays mapped after its folder is gone)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-skeleton-") as d:
        src, so = Path(d) / "skeleton.c", Path(d) / "skeleton.so"
        src.write_text(SOURCE)
        flags = ["-O2", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run(["gcc", *flags, str(src), "-o", str(so)], check=True)
        lib = ctypes.CDLL(str(so))
    lib.skeleton.restype = ctypes.c_int
    lib.fma_rate.restype = ctypes.c_double
    lib.fma_rate.argtypes = [ctypes.c_int]
    return lib


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
    out = (ctypes.c_double * (2 + len(KINDS)))()
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
    ours_decode(engine, 1)  # warm-up
    for _ in range(args.rounds):
        time.sleep(0.2)  # the step's OpenMP threads stop spinning first
        skeletons.append(run_skeleton(lib, segments, reps=10))
        steps.append(ours_decode(engine, 1) / 1000)
    time.sleep(0.2)
    rate1, rate2 = max(lib.fma_rate(1) for _ in range(3)), max(lib.fma_rate(2) for _ in range(3))
    mc = model.config
    attn_flops = 4 * mc.num_attention_heads * mc.head_dim * context * mc.num_hidden_layers
    flat = statistics.median(s[0] for s in skeletons)
    ops = statistics.median(s[1] for s in skeletons)
    step = statistics.median(steps)
    ratios = [t / s[0] for t, s in zip(steps, skeletons, strict=True)]
    print(f"decode b=1, --activations {args.activations}, context {context}: {total / 1e6:.1f} "
          f"MB a step ({len(segments)} reads); medians of {args.rounds} rounds")  # fmt: skip
    print(f"  flat cold read       {flat * 1e3:6.2f} ms ({total / flat / 1e9:.1f} GB/s)")
    print(f"  op-by-op skeleton    {ops * 1e3:6.2f} ms ({ops / flat:.2f}x the flat read)")
    print(f"  served step          {step * 1e3:6.2f} ms ({statistics.median(ratios):.2f}x the "
          f"flat read, paired per round: {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
    per = [statistics.median(s[2 + k] for s in skeletons) for k in range(len(KINDS))]
    parts = ", ".join(f"{name} {t * 1e3:.2f}" for name, t in zip(KINDS, per, strict=True))
    print(f"  skeleton per op, ms a step: {parts}")
    print(f"  fp32 FMA rate: {rate1 / 1e9:.1f} GFLOP/s on one thread, {rate2 / 1e9:.1f} on two; "
          f"the attention's {attn_flops / 1e6:.1f} MFLOP a step take "
          f"{attn_flops / rate2 * 1e3:.2f} ms on two threads at that rate")  # fmt: skip
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
