/* Quantized matrix products for pdserve: y[M,N] = x[M,K] @ W[N,K]^T with W in a GGUF
 * block format, held in one of five layouts (below), never expanded to fp32 in memory.
 *
 * The method: each weight block is dequantized in registers (or, for a GEMM, into a
 * per-thread buffer of a few columns that every row of a pass then reads from L1) to the
 * exact fp32 values gguf-py's dequantization gives - q*d, (q-8)*d or q*d+m: q*d is
 * exact in fp32 (a small integer times a scale of at most 18 significant bits), so one
 * rounding at most, the same as numpy's - and multiplied by the fp32 activations with FMAs. So the result is
 * the fp32 product with the dequantized weights (what `--quantization none` computes)
 * up to the order of the sums: no activation rounding at all. (llama.cpp rounds
 * activations to int8 to use integer dot products; on SmolLM2 that moved logits by ~0.2
 * and flipped near-tied greedy tokens. An int16 variant kept fp32's accuracy but ran a
 * GEMM at ~60% of oneDNN's fp32 rate; this one at 64-88% (bench/bench_quant_kernels.py;
 * pdserve/kernels/README.md).)
 *
 * Contract - batch invariance: every output element y[m, n] is computed by the same
 * sequence of float operations whatever M is, wherever m and n fall in a tile, and
 * however the work is split between threads: 8 lanes, lane l summing k = l, l+8, ... in
 * order by FMA, then one fixed horizontal sum. So what a projection gives a row does not
 * depend on what else shares its step; the prologues (RMSNorm, SwiGLU) and the residual
 * add work on one row at a time too, and so does the attention (_attention.c): a whole
 * quantized layer is row-invariant. The file is built with -ffp-contract=off so the
 * compiler cannot fuse differently in different tiles; the FMAs are the explicit ones.
 *
 * Weight layouts (made in Python from the file's blocks, pdserve/quant/formats.py),
 * row n of N, blocks of 32 values along K:
 *   I8    int8 q [N][K], scale d [N][K/32]: q*d              (Q8_0; Q5_0 as q-16)
 *   Q4    nibbles [N][K/2], d [N][K/32]: (q-8)*d             (Q4_0)
 *   Q4M   nibbles [N][K/2], d and minimum m [N][K/32]: q*d+m (Q4_1; Q4_K as d*sc, -dmin*m)
 *   I8_16 int8 q [N][K], d [N][K/16], a scale per 16: q*d    (Q6_K as q-32, d*sc)
 *   U8M   uint8 q [N][K], d and m [N][K/32]: q*d+m           (Q5_1; Q5_K as d*sc, -dmin*m)
 * Nibbles are in GGUF's order per block (byte j holds value j in its low nibble and value
 * j+16 in its high one). Scales and minimums are fp32 (the file's fp16 converted once at
 * load - an fp16 conversion per block was ~1/5 of a GEMV's instructions - or the K
 * formats' products, exact in fp32).
 *
 * Threads: OpenMP over output columns. pdserve imports torch before this module, so
 * the libgomp.so.1 already loaded (torch's) is the one used: one thread pool, sized by
 * torch.set_num_threads.
 */
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

#ifdef PHASES /* see _kernels.h */
#include <stdio.h>
double phase_ns[9], phase_t0;
long phase_calls[2];
__attribute__((destructor)) static void phase_report(void) {
    static const char *names[9] = {"qkv", "rope", "scores", "softmax", "values",
                                   "o", "gate_up", "down", "head"};
    const long calls = phase_calls[0] ? phase_calls[0] : phase_calls[1] ? phase_calls[1] : 1;
    double total = 0;
    fprintf(stderr, "PHASES, us per call over %ld calls (%s):", calls,
            phase_calls[0] ? "fused_layers_team" : "paged_attention");
    for (int k = 0; k < 9; k++) {
        total += phase_ns[k];
        fprintf(stderr, " %s %.1f", names[k], phase_ns[k] / 1e3 / (double)calls);
    }
    fprintf(stderr, " total %.1f\n", total / 1e3 / (double)calls);
}
#endif

#define FEW_ROWS 4 /* below this many rows, weights are dequantized straight into registers */

/* ---- prologues: what the product reads in place of x ------------------------------- */

/* 1 / sqrt(mean(x^2) + eps) over a row of K (a multiple of 32) floats. */
INLINE float rms_scale(const float *x, int64_t K, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return 1.0f / sqrtf(hsum8(acc) / (float)K + eps);
}

KERNEL static void prologue_row(const Prologue *pre, const float *x, int64_t K, float *out) {
    if (pre->kind == PRE_RMSNORM) {
        const __m256 r = _mm256_set1_ps(rms_scale(x, K, pre->eps));
        for (int64_t i = 0; i < K; i += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), r);
            _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_loadu_ps(pre->w + i)));
        }
    } else { /* PRE_SWIGLU */
        const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
        for (int64_t i = 0; i < K; i += 8) {
            const __m256 g = _mm256_loadu_ps(x + i);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, neg))));
            _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(x + K + i)));
        }
    }
}

/* out[M][K] = P(x) row by row. */
KERNEL static void prologue_rows(const Prologue *pre, const float *x, int64_t ldx, int64_t M,
                                 int64_t K, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) prologue_row(pre, x + m * ldx, K, out + m * K);
}

/* ---- dequantization --------------------------------------------------------------------- */

/* Block b of weight row n (values 32b .. 32b+31) as 4 x 8 floats. */
INLINE void weight_block(const QWeight *w, int64_t n, int64_t b, const int T, __m256 v[4]) {
    if (T == I8 || T == I8_16 || T == U8M) {
        const uint8_t *p = w->qs + n * w->K + b * QK;
        const float *ds = T == I8_16 ? w->d + (n * w->B + b) * 2 : w->d + n * w->B + b;
        const __m256 d0 = _mm256_broadcast_ss(ds), d1 = _mm256_broadcast_ss(ds + (T == I8_16));
        const __m256 c = T == U8M ? _mm256_broadcast_ss(w->m + n * w->B + b) : _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const __m128i raw = _mm_loadl_epi64((const __m128i *)(p + 8 * i));
            const __m256 q = _mm256_cvtepi32_ps(T == U8M ? _mm256_cvtepu8_epi32(raw)
                                                         : _mm256_cvtepi8_epi32(raw));
            /* q*d is exact; U8M adds m with one rounding, as numpy's d*q + m does. */
            v[i] = T == U8M ? _mm256_fmadd_ps(q, d0, c) : _mm256_mul_ps(q, i < 2 ? d0 : d1);
        }
        return;
    }
    const __m256 d = _mm256_broadcast_ss(w->d + n * w->B + b);
    const uint8_t *p = w->qs + n * (w->K / 2) + b * (QK / 2);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    const __m256i q[4] = {_mm256_and_si256(b0, low), _mm256_and_si256(b1, low),
                          _mm256_srli_epi32(b0, 4), _mm256_srli_epi32(b1, 4)};
    /* Q4: q*d - 8d = (q-8)*d exactly (-8d is exact, and so is the result: a 4-bit
     * integer times an fp16); Q4M: q*d + m, one rounding (q*d is exact). */
    const __m256 c = T == Q4 ? _mm256_mul_ps(_mm256_set1_ps(-8.0f), d)
                             : _mm256_broadcast_ss(w->m + n * w->B + b);
    for (int i = 0; i < 4; i++) v[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), d, c);
}

/* Columns [n0, n0 + rn) dequantized into buf [rn][K]. */
INLINE void dequantize_columns(const QWeight *w, int64_t n0, int rn, float *buf, const int T) {
    for (int j = 0; j < rn; j++) {
        for (int64_t b = 0; b < w->B; b++) {
            __m256 v[4];
            weight_block(w, n0 + j, b, T, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(buf + j * w->K + b * QK + 8 * i, v[i]);
        }
    }
}

/* ---- the micro-kernels --------------------------------------------------------------- */

/* Store (or add to y) the horizontal sums of RM x RN accumulators. */
INLINE void store_tile(__m256 acc[4][4], float *y, int64_t ldy, int64_t m0, int64_t n0,
                       int accumulate, const int RM, const int RN) {
    for (int i = 0; i < RM; i++) {
        for (int j = 0; j < RN; j++) {
            float *out = y + (m0 + i) * ldy + n0 + j;
            *out = accumulate ? *out + hsum8(acc[i][j]) : hsum8(acc[i][j]);
        }
    }
}

/* Few rows: each weight block is dequantized into registers and used by the RM rows. */
INLINE void tile_direct(const QWeight *w, const float *x, int64_t ldx, int64_t m0, int64_t n0,
                        float *y, int64_t ldy, int accumulate, const int T, const int RM,
                        const int RN) {
    __m256 acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    /* The next tile's weights, a line per block ahead of need (the hardware prefetcher
     * did not keep up with the 4 interleaved row streams of a tile). */
    const int has_m = T == Q4M || T == U8M, scales = T == I8_16 ? 2 : 1;
    const int64_t row_bytes = T == Q4 || T == Q4M ? w->K / 2 : w->K;
    const char *next_qs = (const char *)(w->qs + (n0 + RN) * row_bytes);
    const char *next_d = (const char *)(w->d + (n0 + RN) * w->B * scales);
    const char *next_m = has_m ? (const char *)(w->m + (n0 + RN) * w->B) : NULL;
    const int64_t qs_lines = RN * row_bytes / 64;
    const int64_t d_lines = (RN * w->B * scales * 4 + 63) / 64, m_lines = (RN * w->B * 4 + 63) / 64;
    for (int64_t b = 0; b < w->B; b++) {
        for (int64_t l = b * qs_lines / w->B; l < (b + 1) * qs_lines / w->B; l++)
            _mm_prefetch(next_qs + 64 * l, _MM_HINT_T0);
        if (b < d_lines) _mm_prefetch(next_d + 64 * b, _MM_HINT_T0);
        if (has_m && b < m_lines) _mm_prefetch(next_m + 64 * b, _MM_HINT_T0);
        for (int j = 0; j < RN; j++) {
            __m256 v[4];
            weight_block(w, n0 + j, b, T, v);
            for (int i = 0; i < RM; i++) {
                const float *xp = x + (m0 + i) * ldx + b * QK;
                for (int c = 0; c < 4; c++)
                    acc[i][j] = _mm256_fmadd_ps(v[c], _mm256_loadu_ps(xp + 8 * c), acc[i][j]);
            }
        }
    }
    store_tile(acc, y, ldy, m0, n0, accumulate, RM, RN);
}

/* Many rows: RM rows x RN columns from the dequantized columns in buf [RN][K]. The same
 * FMAs in the same order as tile_direct, so the two give the same bits. */
INLINE void tile_buffered(const float *buf, int64_t K, const float *x, int64_t ldx, int64_t m0,
                          int64_t n0, float *y, int64_t ldy, int accumulate, const int RM,
                          const int RN) {
    __m256 acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 v[3];
        for (int j = 0; j < RN; j++) v[j] = _mm256_loadu_ps(buf + j * K + k);
        for (int i = 0; i < RM; i++) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * ldx + k);
            for (int j = 0; j < RN; j++) acc[i][j] = _mm256_fmadd_ps(v[j], xv, acc[i][j]);
        }
    }
    store_tile(acc, y, ldy, m0, n0, accumulate, RM, RN);
}

/* Rows [m0, m1) against the RN (<= 3) columns in buf: tiles of 4 rows, then the rest. */
#define ROW_TILES(RN)                                                                         \
    do {                                                                                      \
        int64_t m = m0;                                                                       \
        for (; m + 4 <= m1; m += 4) tile_buffered(buf, K, x, ldx, m, n, y, ldy, acc, 4, RN); \
        switch (m1 - m) {                                                                     \
            case 3: tile_buffered(buf, K, x, ldx, m, n, y, ldy, acc, 3, RN); break;           \
            case 2: tile_buffered(buf, K, x, ldx, m, n, y, ldy, acc, 2, RN); break;           \
            case 1: tile_buffered(buf, K, x, ldx, m, n, y, ldy, acc, 1, RN); break;           \
        }                                                                                     \
    } while (0)

KERNEL static void rows_buffered(const float *buf, int64_t K, const float *x, int64_t ldx,
                                 int64_t m0, int64_t m1, int64_t n, int rn, float *y,
                                 int64_t ldy, int acc) {
    switch (rn) {
        case 3: ROW_TILES(3); break;
        case 2: ROW_TILES(2); break;
        default: ROW_TILES(1); break;
    }
}

#define DIRECT(T, RM)                                                                         \
    do {                                                                                      \
        switch (rn) {                                                                         \
            case 4: tile_direct(w, x, ldx, m, n, y, ldy, acc, T, RM, 4); break;               \
            case 3: tile_direct(w, x, ldx, m, n, y, ldy, acc, T, RM, 3); break;               \
            case 2: tile_direct(w, x, ldx, m, n, y, ldy, acc, T, RM, 2); break;               \
            default: tile_direct(w, x, ldx, m, n, y, ldy, acc, T, RM, 1); break;              \
        }                                                                                     \
    } while (0)

/* All M (< FEW_ROWS) rows against columns [n, n + rn), rn <= 4. */
KERNEL static void rows_direct(const QWeight *w, const float *x, int64_t ldx, int64_t M,
                               int64_t n, int rn, float *y, int64_t ldy, int acc) {
    const int64_t m = 0;
#define DIRECT_ROWS(T)                               \
    do {                                             \
        switch (M) {                                 \
            case 3: DIRECT(T, 3); break;             \
            case 2: DIRECT(T, 2); break;             \
            default: DIRECT(T, 1); break;            \
        }                                            \
    } while (0)
    switch (w->type) {
        case I8: DIRECT_ROWS(I8); break;
        case Q4: DIRECT_ROWS(Q4); break;
        case Q4M: DIRECT_ROWS(Q4M); break;
        case I8_16: DIRECT_ROWS(I8_16); break;
        default: DIRECT_ROWS(U8M); break;
    }
}

KERNEL static void dequantize_any(const QWeight *w, int64_t n, int rn, float *buf) {
    switch (w->type) {
        case I8: dequantize_columns(w, n, rn, buf, I8); break;
        case Q4: dequantize_columns(w, n, rn, buf, Q4); break;
        case Q4M: dequantize_columns(w, n, rn, buf, Q4M); break;
        case I8_16: dequantize_columns(w, n, rn, buf, I8_16); break;
        default: dequantize_columns(w, n, rn, buf, U8M); break;
    }
}

/* Few rows: 4 columns per tile, weights straight from their blocks; each thread a
 * contiguous run of tiles (`Runs`). */
KERNEL static void gemv(const QWeight *w, const float *x, int64_t ldx, int64_t M, float *y,
                        int64_t ldy, int acc, int threads) {
    FOR_EACH_RUN_ITEM(threads, (w->N + 3) / 4, t, {
        const int64_t n = t * 4;
        rows_direct(w, x, ldx, M, n, n + 4 <= w->N ? 4 : (int)(w->N - n), y, ldy, acc);
    });
}

/* Many rows: 3 columns per tile dequantized into a per-thread buffer (12 KB at K = 1024,
 * in L1), then read by the rows of a pass; passes of rows sized so that they stay in
 * L2 while every column goes by. bufs: threads x 3K floats. The tiles are handed out in
 * dynamic chunks, 4 per thread: on a shared machine a thread that loses its core for a
 * while then holds back one chunk, not half the product (a GEMV walks `Runs` instead,
 * _kernels.h: the same protection, and each thread's weights one sequential stream).
 * Which thread computes a column never changes its value. */
KERNEL static void gemm(const QWeight *w, const float *x, int64_t ldx, int64_t M, float *y,
                        int64_t ldy, int acc, int threads, float *bufs) {
    const int64_t K = w->K, tiles = (w->N + 2) / 3;
    int64_t pass = (256 * 1024 / 4) / K; /* rows whose activations fill ~256 KB */
    pass = pass < 16 ? 16 : pass > 256 ? 256 : pass;
#pragma omp parallel num_threads(threads)
    {
        float *buf = bufs + (int64_t)THREAD_ME * 3 * K;
        for (int64_t m0 = 0; m0 < M; m0 += pass) {
            const int64_t m1 = m0 + pass < M ? m0 + pass : M;
#pragma omp for schedule(dynamic, chunk_of(tiles, threads, 4))
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n = t * 3;
                const int rn = n + 3 <= w->N ? 3 : (int)(w->N - n);
                dequantize_any(w, n, rn, buf);
                rows_buffered(buf, K, x, ldx, m0, m1, n, rn, y, ldy, acc);
            }
        }
    }
}

/* P(x) for M rows of K into a new buffer *xt (the caller frees it), *x and *ldx then
 * pointing at it; nothing for PRE_NONE (*xt NULL). Returns -1 when the buffer could not
 * be allocated. */
static int apply_prologue(const Prologue *pre, const float **x, int64_t *ldx, int64_t M,
                          int64_t K, float **xt, int threads) {
    *xt = NULL;
    if (pre->kind == PRE_NONE) return 0;
    if ((*xt = malloc(sizeof(float) * (size_t)(M * K))) == NULL) return -1;
    prologue_rows(pre, *x, *ldx, M, K, *xt, threads);
    *x = *xt;
    *ldx = K;
    return 0;
}

/* y (+)= P(x) @ W^T. Returns -1 when scratch memory could not be allocated. */
int qlinear(const QWeight *w, const Prologue *pre, const float *x, int64_t ldx,
            int64_t M, float *y, int64_t ldy, int acc, int threads) {
    float *xt, *bufs = NULL;
    if (apply_prologue(pre, &x, &ldx, M, w->K, &xt, threads) != 0) return -1;
    int rc = 0;
    if (M < FEW_ROWS) {
        gemv(w, x, ldx, M, y, ldy, acc, threads);
    } else if ((bufs = aligned_alloc(64, (size_t)((threads * 3 * w->K * 4 + 63) / 64 * 64)))) {
        gemm(w, x, ldx, M, y, ldy, acc, threads, bufs);
    } else {
        rc = -1;
    }
    free(bufs);
    free(xt);
    return rc;
}

/* ---- a stack of fused layers in one call --------------------------------------------- */

/* y (+)= P(x) @ W^T for W packed by pack_int8 (_int8.c). */
int qlinear_int8_pre(const uint8_t *W, int kind, int64_t N, int64_t K,
                     const Prologue *pre, const float *x, int64_t ldx, int64_t M,
                     float *y, int64_t ldy, int acc, int threads) {
    float *xt;
    if (apply_prologue(pre, &x, &ldx, M, K, &xt, threads) != 0) return -1;
    const int rc = qlinear_int8(W, kind, N, K, x, ldx, M, y, ldy, acc, threads);
    free(xt);
    return rc;
}

/* y (+)= P(x) @ W^T for W packed into fp32 panels (_dense.c). */
int dense_linear_pre(const float *W, int64_t N, int64_t K, const Prologue *pre, const float *x,
                     int64_t ldx, int64_t M, float *y, int64_t ldy, int acc, int threads) {
    float *xt;
    if (apply_prologue(pre, &x, &ldx, M, K, &xt, threads) != 0) return -1;
    dense_linear(W, N, K, x, ldx, M, y, ldy, acc, threads);
    free(xt);
    return 0;
}

/* y (+)= P(x) @ W^T (+ bias) for every part of op: the prologue once, then each part's
 * call - the operations QuantLinear.run makes, so the same bits. */
static int run_op(const Op *op, const Prologue *pre, const float *x, int64_t ldx, int64_t M,
                  float *y, int64_t ldy, int acc, int threads) {
    float *xt;
    if (apply_prologue(pre, &x, &ldx, M, op->K, &xt, threads) != 0) return -1;
    const Prologue none = {PRE_NONE, NULL, 0.0f};
    int rc = 0;
    for (int64_t i = 0; i < op->parts && rc == 0; i++) {
        const Part *p = &op->part[i];
        float *yp = (float *)((char *)y + p->offset);
        if (p->layout == PART_DENSE) {
            dense_linear((const float *)(intptr_t)p->qs, p->rows, op->K, x, ldx, M, yp, ldy, acc,
                         threads);
        } else if (p->layout == PART_INT8) {
            rc = qlinear_int8((const uint8_t *)(intptr_t)p->qs, (int)p->d, p->rows, op->K, x, ldx,
                              M, yp, ldy, acc, threads);
        } else {
            const QWeight w = {(int)p->layout, (const uint8_t *)(intptr_t)p->qs,
                               (const float *)(intptr_t)p->d, (const float *)(intptr_t)p->m,
                               p->rows, op->K, op->K / QK};
            rc = qlinear(&w, &none, x, ldx, M, yp, ldy, acc, threads);
        }
    }
    free(xt);
    if (rc == 0 && op->bias) {
        const float *b = (const float *)(intptr_t)op->bias;
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < op->N; n++) y[m * ldy + n] += b[n];
    }
    return rc;
}

/* Layer i's K cache (v = 0) or V cache (v = 1). */
static char *layer_kv(const Step *s, int64_t i, int v) {
    return (char *)s->kv + (2 * i + v) * s->kv_layer * (s->kv16 ? 2 : 4);
}

/* out[i] = the prologue `pre` of row rows[i] of x, i < n, on one thread: rms_norm_rows
 * and the tail's final norm. */
void norm_rows_of(const Prologue *pre, const float *x, int64_t ldx, const int64_t *rows,
                  int64_t n, int64_t K, float *out) {
    for (int64_t i = 0; i < n; i++) prologue_row(pre, x + rows[i] * ldx, K, out + i * K);
}

static void tail_norm(const Tail *t, const float *h, int64_t hidden) {
    norm_rows_of(&t->norm, h, hidden, t->rows, t->n, hidden, t->hidden);
}

/* The index of the first largest of x[0, n), n > 0, as numpy's and torch's argmax pick
 * it: equal maxima (+0 and -0 too) go to the first; a NaN counts as the largest, so the
 * first NaN when there is one. A greedy step's token, taken where the LM head has just
 * left the logits in cache (numpy's argmax of a 49k row after the step: ~50 us). */
KERNEL static int64_t argmax_row(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        top = _mm256_max_ps(top, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float m = hmax8(top);
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t i = j; i < n; i++) {
        if (x[i] != x[i]) any_nan = 1;
        else if (x[i] > m) m = x[i];
    }
    const __m256 want = _mm256_set1_ps(m);
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                   : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
        if (hit != 0) return j + __builtin_ctz((unsigned)hit);
    }
    for (int64_t i = j; i < n; i++)
        if (any_nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;
}

/* out[i] = argmax_row of row i of x [rows][ld], its first n floats. */
void argmax_rows(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < rows; i++) out[i] = argmax_row(x + i * ld, n);
}

/* ---- a decode step's layers on one thread team --------------------------------------- */

/* A step of up to this many rows (a decode of 1-3 sequences) runs all its layers in one
 * OpenMP parallel region, a barrier where each call returned: the ~150 products and
 * attention calls of SmolLM2's step each opened a region, whose fork and join cost ~1.2
 * us more than a barrier. Whole b=1 steps 1.05-1.07x (bench/bench_kernel_ab.py --step
 * --whole). Few rows also take the exact kernel's register path (FEW_ROWS), so every
 * part is one kind of item: 16 columns (int8) or 4 (exact). */
#define TEAM_ROWS (FEW_ROWS - 1)

typedef struct { /* one thread's scratch */
    float *xt;    /* the prologue's rows: [TEAM_ROWS][cap] */
    Rows8 a;      /* those rows rounded to int8 */
    float *q;     /* a LONE step's rotated query and key heads (LONE_ROPE, _attention.c) */
    float warmed; /* the sum attention_warm returned (kept, so its loads stay) */
} Mine;

/* WARM: in a step of one decode row, each thread reads its part of the next layer's KV
 * (attention_warm) before its part of this layer's down projection. The attention alone
 * reads its ~200 KB a layer (fp16, 256 tokens) at ~13 GB/s: a thread's K records and V
 * lanes are ~800 lines each, asked for a block ahead, latency-bound. Read among the
 * weights' stream they arrive at ~40 GB/s and wait in L2 (the down and q/k/v weights
 * that stream past them are ~0.45 MB a thread). Each read is a load, not a prefetch: a
 * prefetch of the same lines gained nothing (0.99-1.01x). Layers of b=1 steps
 * 1.02-1.05x on one CCD, 1.03x on two (bench_kernel_ab.py --step); before gate/up
 * instead, the same (1.00x); spread over the down's items, the same (0.99-1.02x). */

/* The largest K of any op of the layers: the scratch rows' width. */
static int64_t widest_input(const Layer *layers, int64_t n) {
    int64_t cap = 0;
    for (int64_t i = 0; i < n; i++) {
        const Op *ops[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int k = 0; k < 4; k++) cap = ops[k]->K > cap ? ops[k]->K : cap;
    }
    return cap;
}

/* A part's item: a group of 16 columns (int8), a panel of 16 (dense) or a tile of 4
 * (exact, as gemv). */
static int64_t part_width(const Part *p) { return p->layout < 0 ? 16 : 4; }
static int64_t part_items(const Part *p) { return (p->rows + part_width(p) - 1) / part_width(p); }

/* What one thread does of run_op: the prologue and the int8 rounding of the op's rows
 * for itself (a few rows: cheaper than a barrier), then the items it takes from each
 * part's runs, each item's bias added as it is done; then the team's barrier. Each
 * output gets run_op's operations (the same kernels, prologue and bias add per
 * element after its product), so the same bits. */
static void op_team(const Op *op, const Prologue *pre, const float *x, int64_t ldx, int64_t M,
                    float *y, int64_t ldy, int acc, Mine *mine, const Runs *runs, int me) {
    if (pre->kind != PRE_NONE) {
        for (int64_t m = 0; m < M; m++) prologue_row(pre, x + m * ldx, op->K, mine->xt + m * op->K);
        x = mine->xt, ldx = op->K;
    }
    int rounded = 0;
    for (int64_t i = 0; i < op->parts; i++) {
        const Part *p = &op->part[i];
        float *yp = (float *)((char *)y + p->offset);
        const int64_t col0 = p->offset / (int64_t)sizeof(float), width = part_width(p);
        if (p->layout == PART_INT8 && !rounded) int8_round_rows(x, ldx, M, op->K, &mine->a), rounded = 1;
        const QWeight w = {(int)p->layout, (const uint8_t *)(intptr_t)p->qs,
                           (const float *)(intptr_t)p->d, (const float *)(intptr_t)p->m,
                           p->rows, op->K, op->K / QK};
        Claim claim = {0, 0};
        for (int64_t t; (t = runs_take(runs[i], me, &claim)) >= 0;) {
            const int64_t n0 = t * width, cols = n0 + width <= p->rows ? width : p->rows - n0;
            if (p->layout == PART_DENSE)
                dense_panel((const float *)(intptr_t)p->qs, p->rows, op->K, x, ldx, M, t, yp, ldy,
                            acc);
            else if (p->layout == PART_INT8)
                int8_group(w.qs, (int)p->d, &mine->a, M, t, yp, ldy, p->rows, acc);
            else
                rows_direct(&w, x, ldx, M, n0, (int)cols, yp, ldy, acc);
            if (op->bias) {
                const float *b = (const float *)(intptr_t)op->bias + col0;
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = n0; n < n0 + cols; n++) yp[m * ldy + n] += b[n];
            }
        }
    }
#pragma omp barrier
}

/* fused_layers for a step of at most TEAM_ROWS rows on `threads` threads in one region:
 * per layer the team's barriers stand where the calls returned. Every part's work runs
 * (see `Runs`) are laid out before the region, a line per thread for each part of each
 * op of each layer. */
static int fused_layers_team(const Layer *layers, int64_t n, const Step *s, const Tail *tail,
                             int threads) {
    const Op *head = tail->n > 0 ? tail->head : NULL;
    const int64_t widest = widest_input(layers, n), T = s->T;
    const int64_t cap = head != NULL && head->K > widest ? head->K : widest;
    const int64_t n_runs = (n * 4 + 1) * MAX_PARTS; /* the head's runs last */
    uint64_t *words = aligned_alloc(64, sizeof(uint64_t) * RUN_STRIDE * (size_t)(n_runs * threads));
    Runs *runs = malloc(sizeof(Runs) * (size_t)n_runs);
    Mine *mine = calloc((size_t)threads, sizeof(Mine));
    int rc = words == NULL || runs == NULL || mine == NULL ? -1 : 0;
    const int64_t heads = (layers[0].H + layers[0].Hkv) * layers[0].D; /* n > 0 here */
    for (int t = 0; rc == 0 && t < threads; t++) {
        mine[t].q = malloc(sizeof(float) * (size_t)heads);
        mine[t].xt = malloc(sizeof(float) * (size_t)(TEAM_ROWS * cap));
        if (!mine[t].xt || !mine[t].q || rows8_init(&mine[t].a, TEAM_ROWS, cap) != 0) rc = -1;
    }
    /* One plan serves every layer: only q, the caches and the output differ. */
    AttnPlan plan = {0};
    if (rc == 0) {
        const Layer *l = &layers[0];
        const Attn shape = {s->qkv, l->qkv.N, s->kv, s->kv, l->H, l->Hkv, l->D, s->bs, s->rows,
                            s->tables, s->ldt, s->att, l->H * l->D, (float)l->scale, s->kv16};
        rc = attention_plan(&plan, &shape, T, threads);
    }
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        const Op *ops[4] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up, &layers[i].down};
        for (int k = 0; k < 4; k++)
            for (int64_t j = 0; j < ops[k]->parts; j++) {
                const int64_t r = (i * 4 + k) * MAX_PARTS + j;
                runs[r] = runs_init(words + r * threads * RUN_STRIDE, threads, part_items(&ops[k]->part[j]));
            }
    }
    const Runs *head_runs = runs + n * 4 * MAX_PARTS;
    for (int64_t j = 0; rc == 0 && head != NULL && j < head->parts; j++) {
        const int64_t r = n * 4 * MAX_PARTS + j;
        runs[r] = runs_init(words + r * threads * RUN_STRIDE, threads, part_items(&head->part[j]));
    }
    if (rc == 0) {
#pragma omp parallel num_threads(threads)
        {
            const int me = THREAD_ME;
            Mine *my = &mine[me];
            float warmed = 0.0f;
            PHASE_START(0);
            for (int64_t i = 0; i < n; i++) {
                const Layer *l = &layers[i];
                const Runs *lr = runs + i * 4 * MAX_PARTS;
                const int64_t hidden = l->o.N;
                const Prologue norm1 = {PRE_RMSNORM, (const float *)(intptr_t)l->norm1, (float)l->eps1};
                const Prologue norm2 = {PRE_RMSNORM, (const float *)(intptr_t)l->norm2, (float)l->eps2};
                const Prologue none = {PRE_NONE, NULL, 0.0f}, swiglu = {PRE_SWIGLU, NULL, 0.0f};
                char *kc = layer_kv(s, i, 0), *vc = layer_kv(s, i, 1);
                op_team(&l->qkv, &norm1, s->h, hidden, T, s->qkv, l->qkv.N, 0, my, lr, me);
                PHASE(0);
                Attn a = {s->qkv, l->qkv.N, kc, vc, l->H, l->Hkv, l->D, s->bs, s->rows,
                          s->tables, s->ldt, s->att, l->H * l->D, (float)l->scale, s->kv16};
                if (plan.lone) { /* no barrier: each thread reads what it wrote (LONE_ROPE) */
                    lone_rope_write_kv(&plan, &a, s->qkv, s->positions[0], s->cos, s->sin,
                                       s->slots[0], my->q, me);
                    a.q = my->q, a.ldq = l->H * l->D;
                } else {
#pragma omp single
                    rope_write_kv(s->qkv, l->qkv.N, T, l->H, l->Hkv, l->D, s->positions, s->cos,
                                  s->sin, kc, vc, s->kv16, s->slots);
                }
                PHASE(1);
                attention_team(&plan, &a);
                op_team(&l->o, &none, s->att, l->H * l->D, T, s->h, hidden, 1, my, lr + MAX_PARTS,
                        me);
                PHASE(5);
                op_team(&l->gate_up, &norm2, s->h, hidden, T, s->gate_up, l->gate_up.N, 0, my,
                        lr + 2 * MAX_PARTS, me);
                PHASE(6);
                if (plan.lone && i + 1 < n) {
                    const Attn next = {s->qkv, l->qkv.N, layer_kv(s, i + 1, 0),
                                       layer_kv(s, i + 1, 1), l->H, l->Hkv, l->D, s->bs,
                                       s->rows, s->tables, s->ldt, s->att, l->H * l->D,
                                       (float)l->scale, s->kv16};
                    warmed += attention_warm(&plan, &next, me); /* see WARM */
                }
                op_team(&l->down, &swiglu, s->gate_up, l->gate_up.N, T, s->h, hidden, 1, my,
                        lr + 3 * MAX_PARTS, me);
                PHASE(7);
            }
            const int64_t hidden = layers[n - 1].o.N;
#pragma omp single
            tail_norm(tail, s->h, hidden);
            if (head != NULL) {
                const Prologue none = {PRE_NONE, NULL, 0.0f};
                op_team(head, &none, tail->hidden, hidden, tail->n, tail->logits, head->N, 0, my,
                        head_runs, me);
                PHASE(8);
                if (tail->argmax != NULL) {
#pragma omp single nowait
                    argmax_rows(tail->logits, head->N, tail->n, head->N, tail->argmax);
                }
            }
            my->warmed = warmed;
        }
    }
    attention_plan_free(&plan);
    for (int t = 0; mine != NULL && t < threads; t++) {
        free(mine[t].xt), free(mine[t].q);
        rows8_free(&mine[t].a);
    }
    free(mine);
    free(runs);
    free(words);
    return rc;
}

/* DecoderLayer.forward_fused for layers [0, n): the same calls in the same order; then the
 * tail (the final norm of its rows, the LM head over them: rms_norm_rows's and
 * QuantLinear.run's operations). */
int fused_layers(const Layer *layers, int64_t n, const Step *s, const Tail *tail,
                 int threads) {
    if (threads >= TEAM_MIN_THREADS && s->T <= TEAM_ROWS && n > 0)
        return fused_layers_team(layers, n, s, tail, threads);
    for (int64_t i = 0; i < n; i++) {
        const Layer *l = &layers[i];
        const int64_t hidden = l->o.N;
        const Prologue norm1 = {PRE_RMSNORM, (const float *)(intptr_t)l->norm1, (float)l->eps1};
        const Prologue norm2 = {PRE_RMSNORM, (const float *)(intptr_t)l->norm2, (float)l->eps2};
        const Prologue none = {PRE_NONE, NULL, 0.0f}, swiglu = {PRE_SWIGLU, NULL, 0.0f};
        char *kc = layer_kv(s, i, 0), *vc = layer_kv(s, i, 1);
        int rc = run_op(&l->qkv, &norm1, s->h, hidden, s->T, s->qkv, l->qkv.N, 0, threads);
        if (rc != 0) return rc;
        rope_write_kv(s->qkv, l->qkv.N, s->T, l->H, l->Hkv, l->D, s->positions, s->cos, s->sin,
                      kc, vc, s->kv16, s->slots);
        const Attn a = {s->qkv, l->qkv.N, kc, vc, l->H, l->Hkv, l->D, s->bs, s->rows, s->tables,
                        s->ldt, s->att, l->H * l->D, (float)l->scale, s->kv16};
        if ((rc = paged_attention(&a, s->T, threads)) != 0) return rc;
        if ((rc = run_op(&l->o, &none, s->att, l->H * l->D, s->T, s->h, hidden, 1, threads))) return rc;
        if ((rc = run_op(&l->gate_up, &norm2, s->h, hidden, s->T, s->gate_up, l->gate_up.N, 0,
                         threads)))
            return rc;
        if ((rc = run_op(&l->down, &swiglu, s->gate_up, l->gate_up.N, s->T, s->h, hidden, 1,
                         threads)))
            return rc;
    }
    if (n == 0 || tail->n == 0) return 0;
    const int64_t hidden = layers[n - 1].o.N;
    tail_norm(tail, s->h, hidden);
    if (tail->head == NULL) return 0;
    const Prologue none = {PRE_NONE, NULL, 0.0f};
    const int rc = run_op(tail->head, &none, tail->hidden, hidden, tail->n, tail->logits,
                          tail->head->N, 0, threads);
    if (rc == 0 && tail->argmax != NULL)
        argmax_rows(tail->logits, tail->head->N, tail->n, tail->head->N, tail->argmax);
    return rc;
}

/* ---- a decode burst: several greedy steps in one call ---------------------------------- */

/* out[i] = the embedding of token ids[i]: embed_rows' operations, or an fp32 row's copy. */
void embed_ids(const QWeight *w, const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        if (w->type < 0)
            memcpy(out + i * w->K, (const float *)(const void *)w->qs + ids[i] * w->K,
                   sizeof(float) * (size_t)w->K);
        else
            dequantize_any(w, ids[i], 1, out + i * w->K);
    }
}

static int any_of(const int64_t *x, int64_t n, const int64_t *set, int64_t n_set) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n_set; j++)
            if (x[i] == set[j]) return 1;
    return 0;
}

/* Up to b->steps greedy decode steps: each embeds its tokens, runs fused_layers with its
 * own positions, slots and key ranges, every row sampling, and takes each row's argmax as
 * the next step's token - a step's operations, so each token is the one a step of its own
 * would give. Stops after a step that samples a token of b->stop. Returns the steps run
 * (their tokens are in b->tokens[1 ..]); *rc: fused_layers' code when it failed. */
int64_t decode_burst(const Layer *layers, int64_t n, const Step *s0, const Tail *t0,
                     const Burst *b, int threads, int *rc) {
    const int64_t T = s0->T;
    int64_t *sample = malloc(sizeof(int64_t) * (size_t)T);
    *rc = sample == NULL ? -1 : 0;
    for (int64_t t = 0; *rc == 0 && t < T; t++) sample[t] = t;
    int64_t done = 0;
    for (int64_t k = 0; *rc == 0 && k < b->steps; k++) {
        embed_ids(&b->embed, b->tokens + k * T, T, s0->h);
        Step s = *s0;
        s.positions = b->positions + k * T;
        s.slots = b->slots + k * T;
        s.rows = b->rows + 3 * k * T;
        Tail tail = *t0;
        tail.rows = sample;
        tail.n = T;
        tail.argmax = b->tokens + (k + 1) * T;
        *rc = fused_layers(layers, n, &s, &tail, threads);
        if (*rc != 0) break;
        done = k + 1;
        if (any_of(tail.argmax, T, b->stop, b->n_stop)) break;
        int64_t wide = 0; /* a head wider than the embedding: the token is Python's to look up */
        for (int64_t t = 0; t < T; t++) wide |= tail.argmax[t] >= b->embed.N;
        if (wide) break;
    }
    free(sample);
    return done;
}
