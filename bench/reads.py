"""The machine's read floor measured by plain reads in C, compiled here (gcc, OpenMP, AVX2,
as bench_kernel_ab.py builds): what `bench_engine.py`'s floors and
`bench_step_skeleton.py` read with.

* `flat_read_bandwidth(nbytes)`: one read of `nbytes` on 2 MB pages, each thread a
  contiguous share, right after 64 MB of other reads (so nothing of it is in the 32 MB
  L3), the best of several. torch's `sum` was the probe before: it reads a 110 MB tensor
  at 0.7-0.8x of this loop's rate in the same minute, and a 4 GiB one at ~0.85x - a
  reduction in fp32 with its own arithmetic, not a read - so floors taken with it were
  too low a bar.
* `skeleton`: a decode step's reads op by op (see bench_step_skeleton.py), as the step
  lays them out and with each thread's parts end to end.
* `block_read_bandwidth(block, total)`: a read of `total` bytes as blocks of `block` (a
  paged KV pool's layer): in address order, shuffled, and shuffled with the next block
  asked for as `_attention.c` asks for it - the ceilings of a decode step's KV read.
* `fma_rate(threads)`: fp32 multiply-adds a second.
* `read_with_arithmetic(nbytes, threads, fmas)`: the flat read with `fmas` multiply-adds on
  every 32 bytes it loads, cold and with the bytes in L2: whether a core hides
  arithmetic under its stream (a cold rate near the lower of the pure read's and the
  hot rate) or pays for both (near their harmonic sum).
* `round_trip(n)`: a cache line's trip between the two threads and back, which tells
  where the machine put this VM's two cores: ~60 ns on one CCD (one L3, one link to
  memory: a flat read on two threads takes ~35-40 GB/s), ~300 ns on two (two links:
  ~60-70 GB/s, and every exchange between the threads crosses the fabric); on an Intel
  Xeon's mesh, 108-175 ns (`placement_kind`: "mesh").
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

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

/* Thread me's contiguous share (of nt) of p[0, n). */
static __m256i read_share(const char *p, int64_t n, int me, int nt, __m256i acc) {
    const int64_t part = n / nt / 128 * 128;
    return read_range(p + me * part, part, acc);
}

static char *pages(int64_t n) { /* on 2 MB pages, as the weights and the KV pool are */
    const int64_t huge = 2 << 20, size = (n + huge - 1) / huge * huge;
    char *p = aligned_alloc(huge, size);
    if (p == NULL) return NULL;
    madvise(p, size, MADV_HUGEPAGE);
    memset(p, 1, size);
    return p;
}

/* The best of `reps` reads of n bytes on `threads` threads (each a contiguous share),
 * each right after 64 MB of other reads, in seconds; -1 when the buffers could not be
 * had. */
double flat_read(int64_t n, int threads, int reps) {
    char *buf = pages(n), *other = pages(64 << 20);
    if (buf == NULL || other == NULL) return -1;
    double best = 1e9, sink = 0;
    for (int rep = 0; rep < reps; rep++) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            const int me = omp_get_thread_num(), nt = omp_get_num_threads();
            __m256i a = read_share(other, 64 << 20, me, nt, _mm256_setzero_si256());
#pragma omp barrier
            const double t0 = omp_get_wtime();
            a = read_share(buf, n, me, nt, a);
#pragma omp barrier
            const double t = omp_get_wtime() - t0;
            if (me == 0 && t < best) best = t;
            sink += _mm256_extract_epi32(a, 0);
        }
    }
    free(buf), free(other);
    return sink == 0.5 ? 0 : best; /* never 0: keeps the reads */
}

/* p[0, n) read as floats with `fmas` (even, >= 2) multiply-adds on each 32 bytes, in 8
 * chains held in registers; returns their sum's first lane. */
static float arith_range(const char *p, int64_t n, int fmas) {
    const __m256 m = _mm256_set1_ps(0.999f);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i + 128 <= n; i += 128) {
        const __m256 v0 = _mm256_load_ps((const float *)(p + i)),
                     v1 = _mm256_load_ps((const float *)(p + i + 32)),
                     v2 = _mm256_load_ps((const float *)(p + i + 64)),
                     v3 = _mm256_load_ps((const float *)(p + i + 96));
        for (int k = 0; k < fmas; k += 2) {
            a0 = _mm256_fmadd_ps(v0, m, a0), a1 = _mm256_fmadd_ps(v1, m, a1);
            a2 = _mm256_fmadd_ps(v2, m, a2), a3 = _mm256_fmadd_ps(v3, m, a3);
            a4 = _mm256_fmadd_ps(v0, m, a4), a5 = _mm256_fmadd_ps(v1, m, a5);
            a6 = _mm256_fmadd_ps(v2, m, a6), a7 = _mm256_fmadd_ps(v3, m, a7);
        }
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    return s[0];
}

/* Seconds of the best of `reps` passes over n bytes on `threads` threads (each a contiguous
 * share) with `fmas` (even, >= 2) multiply-adds on each 32 bytes (flat_read is the plain
 * read): cold (hot 0: right after 64 MB of other reads) or hot (the pass repeated over a
 * 256 KB share that stays in L2, its time scaled to n). -1 when the buffers could not be
 * had. */
double read_arith(int64_t n, int threads, int reps, int fmas, int hot) {
    const int64_t share = 256 << 10, m = hot ? share * threads : n;
    char *buf = pages(m), *other = pages(64 << 20);
    if (buf == NULL || other == NULL) return -1;
    double best = 1e9, sink = 0;
    for (int rep = 0; rep < reps; rep++) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            const int me = omp_get_thread_num(), nt = omp_get_num_threads();
            float acc = 0;
            __m256i a = read_share(other, 64 << 20, me, nt, _mm256_setzero_si256());
            const int64_t part = m / nt / 128 * 128, passes = hot ? n / m : 1;
            if (hot) acc += arith_range(buf + me * part, part, fmas); /* into L2 */
#pragma omp barrier
            const double t0 = omp_get_wtime();
            for (int64_t k = 0; k < passes; k++) {
                acc += arith_range(buf + me * part, part, fmas);
                __asm__ volatile("" ::: "memory"); /* each pass reads again */
            }
#pragma omp barrier
            const double t = (omp_get_wtime() - t0) * (double)n / (double)(passes * m);
            if (me == 0 && t < best) best = t;
            sink += _mm256_extract_epi32(a, 0) + acc;
        }
    }
    free(buf), free(other);
    return sink == 0.5 ? 0 : best; /* never 0: keeps the work */
}

/* Block b of `nb` in the order a read takes them: address order (order 0), or shuffled by
 * a fixed seed (1, 2), as a paged KV pool's blocks are for a sequence once the pool has
 * served a while. */
static int64_t *block_order(int64_t nb, int order) {
    int64_t *perm = malloc(sizeof(int64_t) * (size_t)nb);
    if (perm == NULL) return NULL;
    for (int64_t i = 0; i < nb; i++) perm[i] = i;
    uint64_t x = 88172645463325252ull;
    for (int64_t i = nb - 1; order != 0 && i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const int64_t j = (int64_t)(x % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    return perm;
}

/* The best of `reps` reads of `total` bytes as blocks of `block` bytes (a multiple of
 * 128) in `order` (block_order; 2: shuffled, and as each line of a block is read the same
 * line of the thread's next block is asked for into L2, as _attention.c asks for a key's
 * next block), each thread a contiguous share of the blocks, right after 64 MB of other
 * reads; seconds, -1 when the buffers could not be had. */
double block_read(int64_t block, int64_t total, int threads, int order, int reps) {
    const int64_t nb = total / block;
    char *buf = pages(nb * block), *other = pages(64 << 20);
    int64_t *perm = block_order(nb, order);
    if (buf == NULL || other == NULL || perm == NULL) {
        free(buf), free(other), free(perm);
        return -1;
    }
    double best = 1e9, sink = 0;
    for (int rep = 0; rep < reps; rep++) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
            const int me = omp_get_thread_num(), nt = omp_get_num_threads();
            __m256i a = read_share(other, 64 << 20, me, nt, _mm256_setzero_si256());
            const int64_t first = me * nb / nt, end = (me + 1) * nb / nt;
#pragma omp barrier
            const double t0 = omp_get_wtime();
            for (int64_t i = first; i < end; i++) {
                const char *p = buf + perm[i] * block;
                const char *next = order == 2 && i + 1 < end ? buf + perm[i + 1] * block : NULL;
                for (int64_t l = 0; l < block; l += 128) {
                    if (next != NULL) {
                        _mm_prefetch(next + l, _MM_HINT_T1);
                        _mm_prefetch(next + l + 64, _MM_HINT_T1);
                    }
                    a = read_range(p + l, 128, a);
                }
            }
#pragma omp barrier
            const double t = omp_get_wtime() - t0;
            if (me == 0 && t < best) best = t;
            sink += _mm256_extract_epi32(a, 0);
        }
    }
    free(buf), free(other), free(perm);
    return sink == 0.5 ? 0 : best; /* never 0: keeps the reads */
}

/* seg[i] bytes of kind kind[i], read in order; out: [0] the best flat read, [1] the best
 * op-by-op read (each op's bytes in two contiguous halves, one a thread, a barrier after
 * each op: the step's layout), [2] the best op-by-op read with each thread's halves laid
 * end to end instead (thread 0's half of every op, then thread 1's: a layout in which a
 * thread's stream runs on from one op into the next), [3 + k] the mean time of kind k's
 * segments per pass of [1] (seconds). */
int skeleton(const int64_t *seg, const int32_t *kind, int n, int kinds, int reps, double *out) {
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += (seg[i] + 255) / 256 * 256;
    char *buf = pages(total), *other = pages(64 << 20);
    if (buf == NULL || other == NULL) return -1;
    double best[3] = {1e9, 1e9, 1e9}, *per = out + 3, sink = 0;
    for (int k = 0; k < kinds; k++) per[k] = 0;
    for (int rep = 0; rep < reps; rep++) {
        for (int mode = 0; mode < 3; mode++) {
#pragma omp parallel num_threads(2) reduction(+ : sink)
            {
                const int me = omp_get_thread_num();
                __m256i a = read_share(other, 64 << 20, me, 2, _mm256_setzero_si256());
#pragma omp barrier
                const double t0 = omp_get_wtime();
                if (mode == 0) {
                    a = read_share(buf, total, me, 2, a);
#pragma omp barrier
                } else {
                    const char *p = mode == 1 ? buf : buf + me * (total / 2 / 128 * 128);
                    for (int i = 0; i < n; i++) {
                        const double ts = omp_get_wtime();
                        const int64_t padded = (seg[i] + 255) / 256 * 256;
                        if (mode == 1) {
                            a = read_share(p, seg[i], me, 2, a);
                            p += padded;
                        } else {
                            a = read_range(p, seg[i] / 2 / 128 * 128, a);
                            p += padded / 2;
                        }
#pragma omp barrier
                        if (me == 0 && mode == 1) per[kind[i]] += omp_get_wtime() - ts;
                    }
                }
                const double t = omp_get_wtime() - t0;
                if (me == 0 && t < best[mode]) best[mode] = t;
                sink += _mm256_extract_epi32(a, 0);
            }
        }
    }
    for (int k = 0; k < kinds; k++) per[k] /= reps;
    out[0] = best[0], out[1] = best[1], out[2] = best[2];
    free(buf), free(other);
    return sink == 0.5; /* never: keeps the reads */
}

/* 12 independent chains of 8-lane multiply-adds: with the two constants, 14 of AVX2's 16
 * vector registers (16 chains spilled to the stack, and the loop measured the spills:
 * about a fifth of the FMA units' rate on a Zen 3). */
static float chains(int64_t n) {
    __m256 a0 = _mm256_set1_ps(1.000f), a1 = _mm256_set1_ps(1.001f), a2 = _mm256_set1_ps(1.002f),
           a3 = _mm256_set1_ps(1.003f), a4 = _mm256_set1_ps(1.004f), a5 = _mm256_set1_ps(1.005f),
           a6 = _mm256_set1_ps(1.006f), a7 = _mm256_set1_ps(1.007f), a8 = _mm256_set1_ps(1.008f),
           a9 = _mm256_set1_ps(1.009f), a10 = _mm256_set1_ps(1.010f), a11 = _mm256_set1_ps(1.011f);
    const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    for (int64_t k = 0; k < n; k++) {
        a0 = _mm256_fmadd_ps(a0, m, c), a1 = _mm256_fmadd_ps(a1, m, c);
        a2 = _mm256_fmadd_ps(a2, m, c), a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c), a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c), a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c), a9 = _mm256_fmadd_ps(a9, m, c);
        a10 = _mm256_fmadd_ps(a10, m, c), a11 = _mm256_fmadd_ps(a11, m, c);
    }
    const __m256 s = _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                      _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))),
        _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    return s[0];
}

/* Seconds a cache line takes to go from one thread to the other and back (two threads,
 * each waiting for the other's write before its own; the mean of n such round trips).
 * About 60 ns here when the two cores share an L3 (one CCD) and about 300 ns when they
 * do not: the machine placing this VM's two cores on two CCDs (an Intel mesh: 108-175
 * ns). -1 when OpenMP gave one thread (each would wait for a write that never comes). */
double round_trip(int64_t n) {
    static volatile int64_t line[8] __attribute__((aligned(64)));
    line[0] = 0;
    double t = -1;
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
        const int64_t trips = omp_get_num_threads() == 2 ? n : 0;
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int64_t i = 0; i < trips; i++) {
            while (line[0] != 2 * i + me) _mm_pause();
            line[0] = 2 * i + me + 1;
        }
        if (me == 0 && trips > 0) t = (omp_get_wtime() - t0) / n;
    }
    return t;
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
    return s == 0.5f ? 0 : 12.0 * 8 * 2 * n * threads / t;
}
"""


def build() -> ctypes.CDLL:
    """SOURCE compiled and loaded (the library stays mapped after its folder is gone)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-skeleton-") as d:
        src, so = Path(d) / "skeleton.c", Path(d) / "skeleton.so"
        src.write_text(SOURCE)
        flags = ["-O2", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
        subprocess.run(["gcc", *flags, str(src), "-o", str(so)], check=True)
        lib = ctypes.CDLL(str(so))
    lib.skeleton.restype = ctypes.c_int
    lib.flat_read.restype = ctypes.c_double
    lib.flat_read.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.read_arith.restype = ctypes.c_double
    lib.read_arith.argtypes = [ctypes.c_int64] + [ctypes.c_int] * 4
    lib.fma_rate.restype = ctypes.c_double
    lib.fma_rate.argtypes = [ctypes.c_int]
    lib.block_read.restype = ctypes.c_double
    lib.block_read.argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_int] * 3
    lib.round_trip.restype = ctypes.c_double
    lib.round_trip.argtypes = [ctypes.c_int64]
    return lib


# Round trips on an AMD EPYC here: 60-70 ns with both cores on one CCD, 300-340 ns across
# two. An Intel Xeon's mesh (stop 48) put them 108-175 ns apart, steadily: no CCDs, and
# neither of those bands, so a single cut at 150 ns read it as "moving" between them.
ONE_CCD_TRIP = 100e-9
TWO_CCD_TRIP = 250e-9


def placement_kind(trip: float) -> str:
    """The band of a round trip: one CCD, two CCDs, mesh (between them), unknown (-1)."""
    if trip < 0:
        return "unknown"
    if trip < ONE_CCD_TRIP:
        return "one CCD"
    return "two CCDs" if trip > TWO_CCD_TRIP else "mesh"


def placement(trip: float) -> str:
    """Where the machine put this VM's two cores, from a cache line's round trip between
    them (`round_trip`): ~60 ns on one CCD, ~300 ns across two, ~110-175 on a mesh."""
    kind = placement_kind(trip)
    if kind == "unknown":
        return "cores unknown (OpenMP gave one thread)"
    where = "a mesh, no CCDs" if kind == "mesh" else kind
    return f"cores on {where} (round trip {trip * 1e9:.0f} ns)"


def flat_read_bandwidth(lib: ctypes.CDLL, nbytes: int, threads: int, reps: int = 5) -> float:
    """Bytes/s of the best of `reps` cold reads of `nbytes` (see the module docstring)."""
    best = lib.flat_read(nbytes, threads, reps)
    if best < 0:
        raise MemoryError(f"flat_read: could not allocate {nbytes} bytes")
    return float(nbytes / best)


def read_with_arithmetic(
    lib: ctypes.CDLL, nbytes: int, threads: int, fmas: int, reps: int = 3
) -> tuple[float, float]:
    """Bytes/s of the flat read with `fmas` multiply-adds on every 32 bytes: (cold, hot)."""
    if fmas < 2 or fmas % 2:
        raise ValueError(f"fmas must be even and at least 2, got {fmas}")
    rates = []
    for hot in (0, 1):
        best = lib.read_arith(nbytes, threads, reps, fmas, hot)
        if best < 0:
            raise MemoryError(f"read_arith: could not allocate {nbytes} bytes")
        rates.append(float(nbytes / best))
    return rates[0], rates[1]


BLOCK_ORDERS = ("in address order", "shuffled", "shuffled, next block asked for")


def block_read_bandwidth(
    lib: ctypes.CDLL, block: int, total: int, threads: int, reps: int = 3
) -> dict[str, float]:
    """Bytes/s of the best of `reps` cold reads of `total` bytes as `block`-byte blocks, in
    each of BLOCK_ORDERS (see `block_read` in SOURCE)."""
    rates = {}
    for order, name in enumerate(BLOCK_ORDERS):
        best = lib.block_read(block, total, threads, order, reps)
        if best < 0:
            raise MemoryError(f"block_read: could not allocate {total} bytes")
        rates[name] = float(total // block * block / best)
    return rates
