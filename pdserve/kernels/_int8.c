/* Integer products for `--activations int8` (llama.cpp's method): y[M,N] = x[M,K] @ W^T
 * with each row of x rounded to int8 per block of 32 values and the weights' integer
 * values multiplied by them - with AVX-512 VNNI (`vpdpbusd`: 64 byte products summed
 * into 16 int32 lanes per instruction, 4x the multiply-adds of an fp32 FMA), or on a CPU
 * with only AVX2 (AMD Zen 2/3, Intel before Ice Lake) with `vpmaddubsw` + `vpmaddwd`
 * (llama.cpp's AVX2 pair: 32 byte products into 8 int32 lanes in two instructions).
 * Both builds give the same bits (see "The AVX2 build" below).
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
#define A2 KERNEL
#define A2_INLINE INLINE

#define GROUP 16 /* output columns per group: one zmm lane each */

enum { BYTES = 0, NIBBLES = 1, SUB16 = 2 }; /* record kinds; linear.py's pack_int8 */

enum { NO_INT8 = 0, INT8_AVX2 = 1, INT8_VNNI = 2 }; /* the builds, by preference */

/* Which build this CPU runs: VNNI where it has AVX-512 F/BW/VL/DQ and VNNI, else AVX2 (with
 * FMA and F16C, as the rest of the kernels). INT8_ENV=avx2 takes the AVX2 build on a VNNI
 * CPU too (tests and benchmarks compare the two). Asked once; a race writes the same. */
static int int8_isa(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
        const int vnni = avx2 && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
        const char *want = getenv(INT8_ENV);
        const int forced = want != NULL && strcmp(want, "avx2") == 0;
        known = vnni && !forced ? INT8_VNNI : avx2 ? INT8_AVX2 : NO_INT8;
    }
    return known;
}

int int8_supported(void) { return int8_isa() != NO_INT8; }

const char *int8_build(void) {
    static const char *const names[] = {"", "avx2", "avx512-vnni"};
    return names[int8_isa()];
}

int rows8_init(Rows8 *r, int64_t rows, int64_t cap) {
    const size_t blocks = (size_t)(rows * (cap / QK));
    *r = (Rows8){malloc((size_t)(rows * cap)), malloc(sizeof(float) * blocks),
                 malloc(sizeof(float) * blocks), malloc(sizeof(float) * 2 * blocks),
                 malloc(sizeof(int32_t) * 2 * blocks), 0, 0};
    if (r->q != NULL && r->d != NULL && r->s != NULL && r->h != NULL && r->n != NULL) return 0;
    rows8_free(r);
    return -1;
}

void rows8_free(Rows8 *r) {
    free(r->q), free(r->d), free(r->s), free(r->h), free(r->n);
    *r = (Rows8){0};
}

/* ---- the activations -------------------------------------------------------------------- */

/* Rows8 (_kernels.h) holds, per row: q the values rounded; d [B] each block's scale dx =
 * max|x| / 127; s [B] dx * sum q; h [2B] dx * sum q of each half block (the SUB16 kind's);
 * n [2B] each half block's sum q (the AVX2 build's byte kinds). */

/* ---- the VNNI build ----------------------------------------------------------------------- */

/* One row: blocks of 32 rounded to int8 (nearest, ties to even) by 127 / max|x|. */
A8 static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s,
                            float *h, int32_t *n) {
    for (int64_t b = 0; b < K / QK; b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = amax / 127.0f;
        n[2 * b] = _mm512_reduce_add_epi32(q0), n[2 * b + 1] = _mm512_reduce_add_epi32(q1);
        s[b] = d[b] * (float)(n[2 * b] + n[2 * b + 1]);
        h[2 * b] = d[b] * (float)n[2 * b];
        h[2 * b + 1] = d[b] * (float)n[2 * b + 1];
    }
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
A8 static void rows_groups_vnni(const uint8_t *W, int kind, int64_t B, const Rows8 *a,
                                int64_t m0, int64_t m1, int64_t g0, int rn, float *y,
                                int64_t ldy, int64_t N, int accumulate) {
    switch (kind) {
        case NIBBLES: TILE_RN(NIBBLES); break;
        case SUB16: TILE_RN(SUB16); break;
        default: TILE_RN(BYTES); break;
    }
}

/* Rows up to this many are streaming-bound (a decode step's few rows): their columns go
 * one group (one sequential stream of records) at a time, each thread walking a
 * contiguous run of groups (`Runs`, _kernels.h). A tile of two groups reads two streams
 * 16 records apart and defeats the hardware prefetcher, and dynamic chunks make each
 * thread's stream jump: a decode step's cold GEMVs streamed at 0.45-0.73 of a plain
 * read so, 0.66-0.96 as runs of single groups (bench_quant_kernels.py --stream); at
 * M = 4 the same held; from M = 32 the two-group tiles and dynamic chunks are ahead. */
#define STREAM_ROWS 16

/* ---- the AVX2 build ----------------------------------------------------------------------- *
 * The same records, a 64-byte line as two 32-byte halves (columns 0-7 and 8-15 of the
 * group, one ymm lane each), and the same float operations per output lane - so the same
 * bits as the VNNI build. What differs is how the exact integer sum isum = sum u*q of a
 * block is reached:
 * - `vpmaddubsw` multiplies unsigned bytes by signed ones and adds pairs into int16 with
 *   saturation; `vpmaddwd` by ones then adds pairs of those into int32 - one column's 4
 *   products, as `vpdpbusd` gives.
 * - Nibbles (u <= 15, |q| <= 127): a pair is at most 3810, so a block's 8 `vpmaddubsw`
 *   results add up in int16 (at most 30480) and take one `vpmaddwd` per block.
 * - Bytes (u = w + 128 up to 255): a pair could reach 64770 and saturate. So the signed w
 *   (u with its top bit flipped) is multiplied as |w| (unsigned, up to 128) by q with w's
 *   sign (`vpsignb`): pairs of at most 32512, exact; and isum = sum w*q + 128 * sum q,
 *   the second term the sum's starting value (Rows8 n: each half block's sum q). */

/* Each block's record asks for the one AHEAD records on (the rest of this group's, then
 * the next group's: a thread's run of groups is one stream). The hardware prefetcher
 * alone left the AVX2 build's b=1 step compute and memory taking turns on an AMD EPYC
 * (Zen 3) here; asked 4 ahead, the layers of a b=1 step ran 1.08-1.13x faster (2 ahead:
 * 1.09x, 16: 1.08x; bench/bench_kernel_ab.py --step --activations int8, one CCD and
 * two). The VNNI build does not: it was not measured on a CPU that has VNNI. */
#ifndef AHEAD
#define AHEAD 4
#endif

/* The sum v stands in a register here. Integer adds reassociate, and gcc took that
 * freedom: it computed all 16 products of a block's lines first, parked them on the
 * stack (a store and a load each), and added them up after. Kept as a running sum, the
 * same exact integers and no spills (objdump -d of rows_groups_avx2). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

A2_INLINE __m256i bcast4_avx2(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One row, as quantize_row: the same maximum (exact), products, rounding (cvtps, nearest
 * even) and exact integer sums, so the same q, d, s, h and n. */
A2 static void quantize_row_avx2(const float *x, int64_t K, int8_t *q, float *d, float *s,
                                 float *h, int32_t *n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4], big = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + b * QK + 8 * j);
            big = _mm256_max_ps(big, _mm256_andnot_ps(sign, v[j]));
        }
        const float amax = hmax8(big);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
        /* |q| <= 127: the saturating packs only narrow; packs interleave 128-bit lanes,
         * which the permute puts back in order. */
        const __m256i w16 = _mm256_packs_epi32(qi[0], qi[1]), x16 = _mm256_packs_epi32(qi[2], qi[3]);
        const __m256i w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), w8);
        const __m256i lo = _mm256_add_epi32(qi[0], qi[1]), hi = _mm256_add_epi32(qi[2], qi[3]);
        int32_t part[2][8];
        _mm256_storeu_si256((__m256i *)part[0], lo), _mm256_storeu_si256((__m256i *)part[1], hi);
        n[2 * b] = n[2 * b + 1] = 0;
        for (int j = 0; j < 8; j++) n[2 * b] += part[0][j], n[2 * b + 1] += part[1][j];
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)(n[2 * b] + n[2 * b + 1]);
        h[2 * b] = d[b] * (float)n[2 * b];
        h[2 * b + 1] = d[b] * (float)n[2 * b + 1];
    }
}

/* epilogue's operations, per half group: acc += float(isum) * (d*dx) + m * sx. */
A2_INLINE void epilogue_avx2(__m256 acc[2][2], const __m256i is[2][2], const uint8_t *r,
                             int64_t at, const float *dx, int64_t ld, const float *sx,
                             int64_t ls, const int RM) {
    __m256 dv[2], mv[2];
    for (int h = 0; h < 2; h++) {
        dv[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + at + 16 * h)));
        mv[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + at + 32 + 16 * h)));
    }
    for (int i = 0; i < RM; i++) {
        const __m256 d = _mm256_set1_ps(dx[i * ld]), s = _mm256_set1_ps(sx[i * ls]);
        for (int h = 0; h < 2; h++) {
            acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i][h]), _mm256_mul_ps(dv[h], d),
                                        acc[i][h]);
            acc[i][h] = _mm256_fmadd_ps(mv[h], s, acc[i][h]);
        }
    }
}

/* isum's starting value for the byte kinds: 128 * sum q of rows m0.. over half blocks
 * [first, first + halves) of block b. */
A2_INLINE void start_sums(__m256i is[2][2], const Rows8 *a, int64_t m0, int64_t b, int first,
                          int halves, const int RM) {
    for (int i = 0; i < RM; i++) {
        const int32_t *n = a->n + 2 * ((m0 + i) * a->B + b) + first;
        const __m256i v = _mm256_set1_epi32(128 * (halves == 2 ? n[0] + n[1] : n[0]));
        is[i][0] = is[i][1] = v;
    }
}

/* RM (<= 2) rows x one group, records of kind KIND; `ahead`: ask for the records AHEAD
 * on. Two rows, not the VNNI build's four: AVX2 has 16 vector registers, and each row
 * holds 4 (two halves' sums and results). */
A2_INLINE void tile_avx2(const uint8_t *W, int64_t B, const Rows8 *a, int64_t m0, int64_t g,
                         float *y, int64_t ldy, int64_t N, int accumulate, const int KIND,
                         const int RM, const int ahead) {
    const int64_t vbytes = KIND == NIBBLES ? 256 : 512, rec = vbytes + (KIND == SUB16 ? 128 : 64);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2][2];
    __m256i is[2][2];
    for (int i = 0; i < RM; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *r = W + (g * B + b) * rec;
        const int8_t *xq = a->q + m0 * a->K + b * QK;
        for (int64_t l = 0; ahead && l < rec; l += 64) /* see AHEAD */
            _mm_prefetch((const char *)(r + AHEAD * rec + l), _MM_HINT_T0);
        if (KIND == NIBBLES) {
            __m256i p16[2][2];
            for (int i = 0; i < RM; i++) p16[i][0] = p16[i][1] = _mm256_setzero_si256();
            for (int jq = 0; jq < 4; jq++) {
                __m256i lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(r + 64 * jq + 32 * h));
                    lo[h] = _mm256_and_si256(v, low);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                for (int i = 0; i < RM; i++) {
                    const __m256i xa = bcast4_avx2(xq + i * a->K + 4 * jq);
                    const __m256i xb = bcast4_avx2(xq + i * a->K + 4 * jq + 16);
                    for (int h = 0; h < 2; h++) {
                        p16[i][h] = _mm256_add_epi16(
                            p16[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa),
                                                        _mm256_maddubs_epi16(hi[h], xb)));
                        IN_REGISTER(p16[i][h]);
                    }
                }
            }
            for (int i = 0; i < RM; i++)
                for (int h = 0; h < 2; h++) is[i][h] = _mm256_madd_epi16(p16[i][h], ones);
            epilogue_avx2(acc, is, r, vbytes, a->d + m0 * B + b, B, a->s + m0 * B + b, B, RM);
            continue;
        }
        start_sums(is, a, m0, b, 0, KIND == SUB16 ? 1 : 2, RM);
        for (int jq = 0; jq < 8; jq++) {
            __m256i w[2], mag[2];
            for (int h = 0; h < 2; h++) {
                w[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(r + 64 * jq + 32 * h)), flip);
                mag[h] = _mm256_abs_epi8(w[h]);
            }
            for (int i = 0; i < RM; i++) {
                const __m256i xa = bcast4_avx2(xq + i * a->K + 4 * jq);
                for (int h = 0; h < 2; h++) {
                    const __m256i p = _mm256_maddubs_epi16(mag[h], _mm256_sign_epi8(xa, w[h]));
                    is[i][h] = _mm256_add_epi32(is[i][h], _mm256_madd_epi16(p, ones));
                    IN_REGISTER(is[i][h]);
                }
            }
            if (KIND == SUB16 && jq == 3) { /* values 0-15 have their own scales */
                epilogue_avx2(acc, is, r, vbytes, a->d + m0 * B + b, B, a->h + 2 * (m0 * B + b),
                              2 * B, RM);
                start_sums(is, a, m0, b, 1, 1, RM);
            }
        }
        if (KIND == BYTES) __asm__ volatile("" ::: "memory"); /* lines in order: see tile */
        if (KIND == SUB16)
            epilogue_avx2(acc, is, r, vbytes + 64, a->d + m0 * B + b, B,
                          a->h + 2 * (m0 * B + b) + 1, 2 * B, RM);
        else
            epilogue_avx2(acc, is, r, vbytes, a->d + m0 * B + b, B, a->s + m0 * B + b, B, RM);
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 0; h < 2; h++) {
        const int64_t n = g * GROUP + 8 * h, left = N - n < 8 ? N - n : 8;
        if (left <= 0) break;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), lane);
        for (int i = 0; i < RM; i++) {
            float *out = y + (m0 + i) * ldy + n;
            __m256 v = acc[i][h];
            if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(out, mask), v);
            _mm256_maskstore_ps(out, mask, v);
        }
    }
}

#define TILE_AVX2(KIND)                                                                    \
    do {                                                                                   \
        int64_t m = m0;                                                                    \
        if (stream && m1 - m >= 2)                                                         \
            tile_avx2(W, B, a, m, g, y, ldy, N, accumulate, KIND, 2, 1), m += 2;           \
        else if (stream)                                                                   \
            tile_avx2(W, B, a, m, g, y, ldy, N, accumulate, KIND, 1, 1), m += 1;           \
        for (; m + 2 <= m1; m += 2) tile_avx2(W, B, a, m, g, y, ldy, N, accumulate, KIND, 2, 0); \
        if (m < m1) tile_avx2(W, B, a, m, g, y, ldy, N, accumulate, KIND, 1, 0);           \
    } while (0)

/* Rows [m0, m1) against groups [g0, g0 + rn), a group at a time. A few rows (a decode
 * step's: STREAM_ROWS) stream the records, and their first tile asks for them ahead;
 * more rows compute from cache, where the asks only cost (0.94-0.98x at M >= 64). */
A2 static void rows_groups_avx2(const uint8_t *W, int kind, int64_t B, const Rows8 *a,
                                int64_t m0, int64_t m1, int64_t g0, int rn, float *y,
                                int64_t ldy, int64_t N, int accumulate) {
    const int stream = m1 - m0 <= STREAM_ROWS;
    for (int64_t g = g0; g < g0 + rn; g++) switch (kind) {
            case NIBBLES: TILE_AVX2(NIBBLES); break;
            case SUB16: TILE_AVX2(SUB16); break;
            default: TILE_AVX2(BYTES); break;
        }
}

/* ---- the drivers: the build this CPU runs ------------------------------------------------- */

static void round_row(const float *x, const Rows8 *r, int64_t m) {
    const int64_t K = r->K, B = r->B;
    if (int8_isa() == INT8_VNNI)
        quantize_row(x, K, r->q + m * K, r->d + m * B, r->s + m * B, r->h + 2 * m * B, r->n + 2 * m * B);
    else
        quantize_row_avx2(x, K, r->q + m * K, r->d + m * B, r->s + m * B, r->h + 2 * m * B,
                          r->n + 2 * m * B);
}

static void rows_groups(const uint8_t *W, int kind, int64_t B, const Rows8 *a, int64_t m0,
                        int64_t m1, int64_t g0, int rn, float *y, int64_t ldy, int64_t N,
                        int accumulate) {
    if (int8_isa() == INT8_VNNI)
        rows_groups_vnni(W, kind, B, a, m0, m1, g0, rn, y, ldy, N, accumulate);
    else
        rows_groups_avx2(W, kind, B, a, m0, m1, g0, rn, y, ldy, N, accumulate);
}

static void quantize_rows(const float *x, int64_t ldx, int64_t M, const Rows8 *r, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M * r->K >= 65536)
    for (int64_t m = 0; m < M; m++) round_row(x + m * ldx, r, m);
}

void int8_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, Rows8 *r) {
    r->K = K, r->B = K / QK;
    for (int64_t m = 0; m < M; m++) round_row(x + m * ldx, r, m);
}

void int8_group(const uint8_t *W, int kind, const Rows8 *a, int64_t M, int64_t g, float *y,
                int64_t ldy, int64_t N, int accumulate) {
    rows_groups(W, kind, a->B, a, 0, M, g, 1, y, ldy, N, accumulate);
}


/* Rows [0, M) against every group, a group at a time (see STREAM_ROWS). */
static void stream_groups(const uint8_t *W, int kind, int64_t B, const Rows8 *a, int64_t M,
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
    Rows8 a;
    if (rows8_init(&a, M, K) != 0) return -1;
    a.K = K, a.B = B;
    quantize_rows(x, ldx, M, &a, threads);
    if (M <= STREAM_ROWS) {
        stream_groups(W, kind, B, &a, M, groups, y, ldy, N, accumulate, threads);
        rows8_free(&a);
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
    rows8_free(&a);
    return 0;
}
