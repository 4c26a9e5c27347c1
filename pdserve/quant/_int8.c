/* Integer products for `--activations int8` (llama.cpp's method): y[M,N] = x[M,K] @ W^T
 * with each row of x rounded to int8 per block of 32 values and the weights' integer
 * values multiplied by them with AVX-512 VNNI (`vpdpbusd`: 64 byte products summed into
 * 16 int32 lanes per instruction, 4x the multiply-adds of an fp32 FMA).
 *
 * The method. Every weight block is u*d + m with u an unsigned byte (Q4_0: nibble, m =
 * -8d; Q4_1/Q4_K: nibble; Q8_0/Q5_0 and Q6_K (int8 q): u = q + 128, m = -128d; Q5_1/Q5_K:
 * u as is) and every activation block is dx*q, q = round(x * 127 / max|x|) in [-127, 127].
 * So a block's contribution to y[m, n] is
 *     dx * (d * isum + m * qsum),   isum = sum u*q (exact, int32),  qsum = sum q,
 * taken as acc += float(isum) * (d*dx); acc += m * (dx*qsum): two FMAs per block, in block
 * order (Q6_K, a scale per 16 values: two FMAs per half block). The only rounding of the
 * inputs is the activations' (at most dx/2 each); the rest is fp32 rounding of those
 * terms summed in order.
 *
 * Contract - batch invariance, as in _kernels.c: a row is quantized alone, and y[m, n] is
 * the same operations whatever the batch, the tile and the thread split (the integer
 * sums are exact; the float epilogue runs per output lane in block order). Columns are
 * the vector lanes, so there is no horizontal sum.
 *
 * Weight layout (made by pdserve/quant/linear.py `pack_int8`): columns in groups of 16
 * (the last padded with zero columns), each group a run of per-block records:
 *     record (g, b) = values (4 x 64 bytes nibbles | 8 x 64 bytes bytes), then d [16]
 *                     and m [16] as fp16 (64 bytes; SUB16: two such sets, 128 bytes -
 *                     values 0-15's, then values 16-31's)
 * 64 value bytes hold, for each of the 16 columns c, 4 consecutive k values (bytes c*4 ..
 * c*4+3): the operand of one vpdpbusd against 4 activation bytes broadcast. Nibble
 * records hold quads j (low nibbles) and j+4 (high) of the block in line j < 4. One
 * group's records are one sequential stream: 0.625 bytes per weight for the nibble
 * formats, 1.125 for the byte ones, 1.25 for SUB16. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_kernels.h"

#define A8_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"
#define A8 __attribute__((target(A8_TARGET)))
#define A8_INLINE static inline __attribute__((always_inline, target(A8_TARGET)))

#define QK 32
#define GROUP 16 /* output columns per group: one zmm lane each */

enum { BYTES = 0, NIBBLES = 1, SUB16 = 2 }; /* record kinds; linear.py's pack_int8 */

/* Asked once (each qlinear_int8 call checks it; a race only writes the same value). */
int int8_supported(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("avx512vnni");
    }
    return known;
}

/* ---- the activations -------------------------------------------------------------------- */

/* Rows8 (_kernels.h) holds, per row: q the values rounded; d [B] each block's scale dx =
 * max|x| / 127; s [B] dx * sum q; h [2B] dx * sum q of each half block (the SUB16 kind's). */

/* One row: blocks of 32 rounded to int8 (nearest, ties to even) by 127 / max|x|. */
A8 static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s,
                            float *h) {
    for (int64_t b = 0; b < K / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        h[2 * b] = d[b] * (float)_mm512_reduce_add_epi32(q0);
        h[2 * b + 1] = d[b] * (float)_mm512_reduce_add_epi32(q1);
    }
}

A8 static void quantize_rows(const float *x, int64_t ldx, int64_t M, const Rows8 *r, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * r->K >= 65536)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, r->K, r->q + m * r->K, r->d + m * r->B, r->s + m * r->B,
                     r->h + 2 * m * r->B);
}

/* ---- the micro-kernel -------------------------------------------------------------------- */

A8_INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* acc += float(isum) * (d*dx) + m * sx for RM rows x RN groups, the scales at byte
 * offset `at` of each record; sx: the activations' dx * sum q of the values summed
 * (per row, `ls` floats apart), dx per row `ld` floats apart. Then isum = 0. */
A8_INLINE void epilogue(__m512 acc[4][2], __m512i is[4][2], const uint8_t *const r[2],
                        int64_t at, const float *dx, int64_t ld, const float *sx, int64_t ls,
                        const int RM, const int RN) {
    __m512 dv[2], mv[2];
    for (int j = 0; j < RN; j++) {
        dv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r[j] + at)));
        mv[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r[j] + at + 32)));
    }
    for (int i = 0; i < RM; i++) {
        const __m512 d = _mm512_set1_ps(dx[i * ld]), s = _mm512_set1_ps(sx[i * ls]);
        for (int j = 0; j < RN; j++) {
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][j]), _mm512_mul_ps(dv[j], d),
                                        acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(mv[j], s, acc[i][j]);
            is[i][j] = _mm512_setzero_si512();
        }
    }
}

/* RM rows x RN groups (RN * 16 columns), records of kind KIND. */
A8_INLINE void tile(const uint8_t *W, int64_t B, const Rows8 *a, int64_t m0, int64_t g0,
                    float *y, int64_t ldy, int64_t N, int accumulate, const int KIND,
                    const int RM, const int RN) {
    const int NIB = KIND == NIBBLES;
    const int64_t vbytes = NIB ? 256 : 512, rec = vbytes + (KIND == SUB16 ? 128 : 64);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[4][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *r[2];
        for (int j = 0; j < RN; j++) r[j] = W + ((g0 + j) * B + b) * rec;
        __m512i is[4][2];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < RN; j++) is[i][j] = _mm512_setzero_si512();
        if (NIB) {
            for (int jq = 0; jq < 4; jq++) {
                __m512i lo[2], hi[2];
                for (int j = 0; j < RN; j++) {
                    const __m512i v = _mm512_loadu_si512(r[j] + 64 * jq);
                    lo[j] = _mm512_and_si512(v, low);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                for (int i = 0; i < RM; i++) {
                    const int8_t *xq = a->q + (m0 + i) * a->K + b * QK + 4 * jq;
                    const __m512i xa = bcast4(xq), xb = bcast4(xq + 16);
                    for (int j = 0; j < RN; j++) {
                        is[i][j] = _mm512_dpbusd_epi32(is[i][j], lo[j], xa);
                        is[i][j] = _mm512_dpbusd_epi32(is[i][j], hi[j], xb);
                    }
                }
            }
        } else {
            for (int jq = 0; jq < 8; jq++) {
                __m512i v[2];
                for (int j = 0; j < RN; j++) v[j] = _mm512_loadu_si512(r[j] + 64 * jq);
                for (int i = 0; i < RM; i++) {
                    const __m512i xa = bcast4(a->q + (m0 + i) * a->K + b * QK + 4 * jq);
                    for (int j = 0; j < RN; j++) is[i][j] = _mm512_dpbusd_epi32(is[i][j], v[j], xa);
                }
                if (KIND == SUB16 && jq == 3) /* values 0-15 have their own scales */
                    epilogue(acc, is, r, vbytes, a->d + m0 * B + b, B,
                             a->h + 2 * (m0 * B + b), 2 * B, RM, RN);
            }
        }
        /* A streamed record's lines are read in order: without this compiler barrier gcc
         * hoisted the bytes kind's epilogue load of the minimums (line 8) above the
         * values' lines 1-7, and the stream read lines 0, 8, 1 ... 7 of each record. One
         * thread then streamed the LM head's Q8_0 records (49152 x 576) at 1.48x a plain
         * read of their bytes, and at 1.04-1.08x in order; b=1 layers 1.01-1.05x. The
         * nibble kind's loads were already in order, and a tile of two groups (RN 2,
         * many rows) computes from cache more than it streams, so only the bytes kind's
         * one-group tiles take it. It moves no arithmetic: the same bits. */
        if (KIND == BYTES && RN == 1) __asm__ volatile("" ::: "memory");
        if (KIND == SUB16)
            epilogue(acc, is, r, vbytes + 64, a->d + m0 * B + b, B,
                     a->h + 2 * (m0 * B + b) + 1, 2 * B, RM, RN);
        else
            epilogue(acc, is, r, vbytes, a->d + m0 * B + b, B, a->s + m0 * B + b, B, RM, RN);
    }
    for (int j = 0; j < RN; j++) {
        const int64_t n = (g0 + j) * GROUP, left = N - n;
        const __mmask16 mask = left >= GROUP ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        for (int i = 0; i < RM; i++) {
            float *out = y + (m0 + i) * ldy + n;
            __m512 v = acc[i][j];
            if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), v);
            _mm512_mask_storeu_ps(out, mask, v);
        }
    }
}

#define TILE_RM(KIND, RN)                                                                 \
    do {                                                                                  \
        int64_t m = m0;                                                                   \
        for (; m + 4 <= m1; m += 4) tile(W, B, a, m, g0, y, ldy, N, accumulate, KIND, 4, RN); \
        switch (m1 - m) {                                                                 \
            case 3: tile(W, B, a, m, g0, y, ldy, N, accumulate, KIND, 3, RN); break;      \
            case 2: tile(W, B, a, m, g0, y, ldy, N, accumulate, KIND, 2, RN); break;      \
            case 1: tile(W, B, a, m, g0, y, ldy, N, accumulate, KIND, 1, RN); break;      \
        }                                                                                 \
    } while (0)

#define TILE_RN(KIND)                                    \
    do {                                                 \
        if (rn == 2) TILE_RM(KIND, 2); else TILE_RM(KIND, 1); \
    } while (0)

/* Rows [m0, m1) against groups [g0, g0 + rn), rn <= 2. */
A8 static void rows_groups(const uint8_t *W, int kind, int64_t B, const Rows8 *a, int64_t m0,
                           int64_t m1, int64_t g0, int rn, float *y, int64_t ldy, int64_t N,
                           int accumulate) {
    switch (kind) {
        case NIBBLES: TILE_RN(NIBBLES); break;
        case SUB16: TILE_RN(SUB16); break;
        default: TILE_RN(BYTES); break;
    }
}

A8 void int8_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, Rows8 *r) {
    r->K = K, r->B = K / QK;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, K, r->q + m * K, r->d + m * r->B, r->s + m * r->B,
                     r->h + 2 * m * r->B);
}

A8 void int8_group(const uint8_t *W, int kind, const Rows8 *a, int64_t M, int64_t g, float *y,
                int64_t ldy, int64_t N, int accumulate) {
    rows_groups(W, kind, a->B, a, 0, M, g, 1, y, ldy, N, accumulate);
}

/* Rows up to this many are streaming-bound (a decode step's few rows): their columns go
 * one group (one sequential stream of records) at a time, each thread walking a
 * contiguous run of groups (`Runs`, _kernels.h). A tile of two groups reads two streams
 * 16 records apart and defeats the hardware prefetcher, and dynamic chunks make each
 * thread's stream jump: a decode step's cold GEMVs streamed at 0.45-0.73 of a plain
 * read so, 0.66-0.96 as runs of single groups (bench_quant_kernels.py --stream); at
 * M = 4 the same held; from M = 32 the two-group tiles and dynamic chunks are ahead. */
#define STREAM_ROWS 16

/* Rows [0, M) against every group, a group at a time (see STREAM_ROWS). */
A8 static void stream_groups(const uint8_t *W, int kind, int64_t B, const Rows8 *a, int64_t M,
                             int64_t groups, float *y, int64_t ldy, int64_t N, int accumulate,
                             int threads) {
    FOR_EACH_RUN_ITEM(threads, groups, g, rows_groups(W, kind, B, a, 0, M, g, 1, y, ldy, N, accumulate));
}

/* y (+)= x @ W^T for the packed weight W (see the header). Returns -1 when scratch
 * memory could not be allocated. Few rows: see STREAM_ROWS. More: tiles of 2 groups (32
 * columns) handed out in dynamic chunks (as in _kernels.c), rows in passes whose int8
 * activations stay in L2. Either way every output is the same operations (the tile and
 * thread split change which lanes share a load, not what a lane computes). */
int qlinear_int8(const uint8_t *W, int kind, int64_t N, int64_t K, const float *x,
                 int64_t ldx, int64_t M, float *y, int64_t ldy, int accumulate, int threads) {
    const int64_t B = K / QK, groups = (N + GROUP - 1) / GROUP, tiles = (groups + 1) / 2;
    Rows8 a = {malloc((size_t)(M * K)), malloc(sizeof(float) * (size_t)(M * B)),
               malloc(sizeof(float) * (size_t)(M * B)),
               malloc(sizeof(float) * (size_t)(2 * M * B)), K, B};
    if (a.q == NULL || a.d == NULL || a.s == NULL || a.h == NULL) {
        free(a.q), free(a.d), free(a.s), free(a.h);
        return -1;
    }
    quantize_rows(x, ldx, M, &a, threads);
    if (M <= STREAM_ROWS) {
        stream_groups(W, kind, B, &a, M, groups, y, ldy, N, accumulate, threads);
        free(a.q), free(a.d), free(a.s), free(a.h);
        return 0;
    }
    int64_t pass = (256 * 1024) / K;
    pass = pass < 16 ? 16 : pass > 1024 ? 1024 : pass;
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t m1 = m0 + pass < M ? m0 + pass : M;
#pragma omp for schedule(dynamic, chunk_of(tiles, threads, 4))
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t g0 = 2 * t;
            rows_groups(W, kind, B, &a, m0, m1, g0, g0 + 2 <= groups ? 2 : 1, y, ldy, N, accumulate);
        }
    }
    free(a.q), free(a.d), free(a.s), free(a.h);
    return 0;
}
