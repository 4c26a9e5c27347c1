/* Quantized matrix products for pdserve: y[M,N] = x[M,K] @ W[N,K]^T with W in a GGUF
 * block format (Q8_0, Q4_0, Q4_1), read as it is, never expanded to fp32.
 *
 * The method: each 32-value block of an activation row is quantized on the fly to int16
 * with one fp32 scale (d = max|x| / 32767, q = round(x / d)), and a block of the product
 * is an exact int32 dot of the weights' small integers with those int16 values (AVX2
 * vpmaddwd), scaled by d_w * d_x. llama.cpp rounds activations to int8 instead (one
 * vpmaddubsw); on SmolLM2 that moved logits by ~0.2 and flipped near-tied greedy tokens
 * (the README's own question), while int16 stays within ~0.001 of fp32 activations for
 * one more integer op per block. See pdserve/quant/README.md for the layouts and the
 * error bound.
 *
 * Contract - batch invariance: every output element y[m, n] is computed by the same
 * sequence of float operations whatever M is, wherever m and n fall in a tile, and
 * however the work is split between threads. Integer parts are exact; the float
 * accumulation runs over the blocks in order, in fixed vector lanes, then one fixed
 * horizontal sum. So what a projection gives a row does not depend on what else shares
 * its step (decode alone, or beside other decodes and a prefill chunk); the prologues
 * (RMSNorm, SwiGLU) and the residual add work on one row at a time too, and so does the
 * attention (_attention.c): a whole quantized layer is row-invariant. The
 * file is built with -ffp-contract=off so the compiler cannot fuse differently in
 * different tiles; the FMAs are the explicit ones.
 *
 * Weight layout (made in Python, pdserve/quant/formats.py), row n of N:
 *   qs: Q8_0 int8 [N][K]; Q4_0/Q4_1 uint8 [N][K/2], GGUF's nibble order per block
 *       (byte j holds value j in its low nibble and value j+16 in its high nibble);
 *   d:  fp16 [N][K/32] block scales;
 *   off: fp16 [N][BP] the per-block scales of the offset term, zero-padded to BP = K/32
 *       rounded up to a multiple of 8 (Q4_0: d again; Q4_1: the block minimums m).
 * Values: Q8_0 w = d*q; Q4_0 w = d*(q-8); Q4_1 w = d*q + m.
 *
 * Threads: OpenMP over output columns. pdserve imports torch before this module, so
 * the libgomp.so.1 already loaded (torch's) is the one used: one thread pool, sized by
 * torch.set_num_threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_kernels.h"

#define QK 32
#define MC 64 /* activation rows per pass over the weights (fits in L2 with K <= 8192) */

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

/* Activations quantized per 32-value block. */
typedef struct {
    const int16_t *q; /* [M][K] */
    const float *d;  /* [M][B] scales */
    const float *s;  /* [M][BP] d * sum(q): what a constant per block (Q4_0's -8, Q4_1's m)
                        adds; zero past B */
    int64_t K, B;
} QRows;

typedef struct {
    int type;
    const uint8_t *qs;
    const uint16_t *d;
    const uint16_t *off; /* [N][BP] fp16 per-block offset scales, zero past B: Q4_0 d, Q4_1 m */
    int64_t N, K, B, BP; /* BP: B rounded up to a multiple of 8 */
} QWeight;

/* ---- activation quantization --------------------------------------------------------- */

INLINE int32_t hsum8i(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(x);
}

/* One block of 32 floats -> 32 int16, its scale and d * sum(q). Rounding to nearest,
 * ties to even (the same as numpy's rint on x * (32767/max)). */
INLINE void quantize_block(const float *x, int16_t *q, float *d_out, float *s_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float max = hmax8(amax);
    const float d = max / 32767.0f;
    const float id = max != 0.0f ? 32767.0f / max : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i32[4];
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], mul),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i32[i] = _mm256_cvtps_epi32(r);
    }
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                         _mm256_add_epi32(i32[2], i32[3]));
    /* pack 2x8 int32 -> 16 int16; the pack works per 128-bit lane, the permute restores order */
    for (int h = 0; h < 2; h++) {
        const __m256i p = _mm256_packs_epi32(i32[2 * h], i32[2 * h + 1]);
        _mm256_storeu_si256((__m256i *)(q + 16 * h), _mm256_permute4x64_epi64(p, 0xD8));
    }
    *d_out = d;
    *s_out = d * (float)hsum8i(sum);
}

/* What the product reads in place of the raw row x (fused, so the transformed row never
 * goes to memory): x itself; RMSNorm(x) * w; or SwiGLU, silu(gate) * up, of a row that
 * holds gate in x[0, K) and up in x[K, 2K) (the fused gate/up projection's output). */
enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2 };
typedef struct {
    int kind;
    const float *w; /* RMSNorm weight [K] */
    float eps;
} Prologue;

/* 1 / sqrt(mean(x^2) + eps) over a row of K (a multiple of 32) floats. */
INLINE float rms_scale(const float *x, int64_t K, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return 1.0f / sqrtf(hsum8(acc) / (float)K + eps);
}

/* Block b of the row the product reads: a pointer to x's own block, or buf filled. */
INLINE const float *prologue_block(const Prologue *pre, const float *x, int64_t K, int64_t b,
                                   float r, float *buf) {
    const float *p = x + b * QK;
    if (pre->kind == PRE_RMSNORM) {
        const __m256 vr = _mm256_set1_ps(r);
        for (int i = 0; i < QK; i += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p + i), vr);
            _mm256_storeu_ps(buf + i, _mm256_mul_ps(v, _mm256_loadu_ps(pre->w + b * QK + i)));
        }
        return buf;
    }
    if (pre->kind == PRE_SWIGLU) {
        const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < QK; i += 8) {
            const __m256 g = _mm256_loadu_ps(p + i);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, neg))));
            _mm256_storeu_ps(buf + i, _mm256_mul_ps(silu, _mm256_loadu_ps(p + K + i)));
        }
        return buf;
    }
    return p;
}

/* Rows of x (through the prologue) -> int16 blocks. s has row stride lds (>= B); its
 * entries past B are left as they are. */
KERNEL static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K,
                                 const Prologue *pre, int16_t *q, float *d, float *s,
                                 int64_t lds, int threads) {
    const int64_t B = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ldx;
        const float r = pre->kind == PRE_RMSNORM ? rms_scale(row, K, pre->eps) : 0.0f;
        float buf[QK] __attribute__((aligned(32)));
        for (int64_t b = 0; b < B; b++) {
            const float *src = prologue_block(pre, row, K, b, r, buf);
            quantize_block(src, q + m * K + b * QK, d + m * B + b, s + m * lds + b);
        }
    }
}

/* ---- the micro-kernel ---------------------------------------------------------------- */

/* Block b of a weight row as 32 int16 values: lo = values 0-15, hi = values 16-31. */
INLINE void weight_block(const uint8_t *row, int64_t b, const int T, __m256i *lo, __m256i *hi) {
    if (T == Q8_0) {
        const uint8_t *p = row + b * QK;
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    } else {
        /* each byte widened to 16 bits: its low nibble is value j, the rest value j+16 */
        const __m256i t = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + b * (QK / 2))));
        *lo = _mm256_and_si256(t, _mm256_set1_epi16(0x0F));
        *hi = _mm256_srli_epi16(t, 4);
    }
}

/* sum over the 32 values of w*a as 8 exact int32 lanes (|w| <= 128, |a| <= 32767: each
 * lane sums 4 products, below 2^24, so its conversion to fp32 is exact too). */
INLINE __m256 block_dot(__m256i wlo, __m256i whi, __m256i alo, __m256i ahi) {
    return _mm256_cvtepi32_ps(
        _mm256_add_epi32(_mm256_madd_epi16(wlo, alo), _mm256_madd_epi16(whi, ahi)));
}

INLINE float half(uint16_t h) { return _cvtsh_ss(h); }

/* sum_b off[b] * s[b] as 8 lanes over the blocks in order. Both rows are zero-padded to
 * a multiple of 8 blocks (BP), so there is no tail. The lanes are added to the main
 * accumulator: each output has one horizontal sum. */
INLINE __m256 offset_lanes(const uint16_t *off, const float *s, int64_t BP) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < BP; b += 8) {
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(off + b)));
        acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(s + b), acc);
    }
    return acc;
}

/* y[m0+i, n0+j] for i < RM, j < RN over all K: the same operations for every (i, j).
 * T, RM and RN are constants at every call, so the loops unroll into registers. */
INLINE void tile(const QWeight *w, const QRows *a, int64_t m0, int64_t n0, float *y,
                 int64_t ldy, int accumulate, const int T, const int RM, const int RN) {
    __m256 acc[4][4];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t K = w->K, B = w->B, BP = w->BP;
    const int64_t row_bytes = T == Q8_0 ? K : K / 2;
    const uint8_t *rows[4];
    for (int j = 0; j < RN; j++) rows[j] = w->qs + (n0 + j) * row_bytes;
    for (int64_t b = 0; b < B; b++) {
        __m256i wlo[4], whi[4];
        __m256 wd[4];
        for (int j = 0; j < RN; j++) {
            weight_block(rows[j], b, T, &wlo[j], &whi[j]);
            wd[j] = _mm256_set1_ps(half(w->d[(n0 + j) * B + b]));
        }
        for (int i = 0; i < RM; i++) {
            const int16_t *arow = a->q + (m0 + i) * K + b * QK;
            const __m256i alo = _mm256_loadu_si256((const __m256i *)arow);
            const __m256i ahi = _mm256_loadu_si256((const __m256i *)(arow + 16));
            const __m256 ad = _mm256_broadcast_ss(a->d + (m0 + i) * B + b);
            for (int j = 0; j < RN; j++) {
                const __m256 dot = block_dot(wlo[j], whi[j], alo, ahi);
                acc[i][j] = _mm256_fmadd_ps(dot, _mm256_mul_ps(wd[j], ad), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < RM; i++) {
        const float *s = a->s + (m0 + i) * BP;
        for (int j = 0; j < RN; j++) {
            const int64_t n = n0 + j;
            __m256 v = acc[i][j];
            if (T == Q4_0)
                v = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), offset_lanes(w->off + n * BP, s, BP), v);
            else if (T == Q4_1)
                v = _mm256_add_ps(v, offset_lanes(w->off + n * BP, s, BP));
            float *out = y + (m0 + i) * ldy + n;
            *out = accumulate ? *out + hsum8(v) : hsum8(v);
        }
    }
}

/* Tiles of up to 4 rows x RN columns over rows [m, m1). */
#define TILES(T, RN)                                                               \
    do {                                                                           \
        for (; m + 4 <= m1; m += 4) tile(w, a, m, n, y, ldy, accumulate, T, 4, RN);           \
        switch (m1 - m) {                                                          \
            case 3: tile(w, a, m, n, y, ldy, accumulate, T, 3, RN); break;                    \
            case 2: tile(w, a, m, n, y, ldy, accumulate, T, 2, RN); break;                    \
            case 1: tile(w, a, m, n, y, ldy, accumulate, T, 1, RN); break;                    \
        }                                                                          \
    } while (0)

#define WIDTHS(T)                                                                  \
    do {                                                                           \
        switch (rn) {                                                              \
            case 4: TILES(T, 4); break;                                            \
            case 3: TILES(T, 3); break;                                            \
            case 2: TILES(T, 2); break;                                            \
            default: TILES(T, 1); break;                                           \
        }                                                                          \
    } while (0)

/* Columns [n, n + rn) of rows [m0, m1). */
KERNEL static void column_block(const QWeight *w, const QRows *a, int64_t m0, int64_t m1,
                                int64_t n, int rn, float *y, int64_t ldy, int accumulate) {
    int64_t m = m0;
    switch (w->type) {
        case Q8_0: WIDTHS(Q8_0); break;
        case Q4_0: WIDTHS(Q4_0); break;
        default: WIDTHS(Q4_1); break;
    }
}

/* Tiles 4 x 2 for a GEMM (registers: 8 accumulators), 1 x 4 for a GEMV; rows in passes
 * of MC so a pass's activations stay in cache while every weight column goes by.
 * Column tiles are handed out in chunks of about 1/16 of a thread's share, not split
 * statically: on a shared machine a thread that loses its core for a while then holds
 * back one chunk, not half the product (a static split made a 0.1 ms product take 8 ms
 * while another process ran). Which thread computes a column never changes its value. */
KERNEL static void gemm(const QWeight *w, const QRows *a, int64_t M, float *y, int64_t ldy,
                        int accumulate, int threads) {
    const int rn = M == 1 ? 4 : 2;
    const int64_t tiles = (w->N + rn - 1) / rn;
    int64_t chunk = tiles / ((int64_t)threads * 16);
    if (chunk < 1) chunk = 1;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t m1 = m0 + MC < M ? m0 + MC : M;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(threads)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = t * rn;
            const int width = n + rn <= w->N ? rn : (int)(w->N - n);
            column_block(w, a, m0, m1, n, width, y, ldy, accumulate);
        }
    }
}

/* ---- Python bindings ----------------------------------------------------------------- */

static int cpu_ok(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* Integer arguments (addresses, sizes), except those listed in `floats`: read as doubles
 * into out[i] reinterpreted through the union. */
typedef union {
    long long i;
    double f;
} Arg;

static int read_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Arg *out,
                     const int *floats, int n_floats) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        int is_float = 0;
        for (int k = 0; k < n_floats; k++) is_float |= floats[k] == i;
        if (is_float) {
            out[i].f = PyFloat_AsDouble(args[i]);
            if (out[i].f == -1.0 && PyErr_Occurred()) return -1;
        } else {
            out[i].i = PyLong_AsLongLong(args[i]);
            if (out[i].i == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

#define PTR(T, a) ((T)(intptr_t)(a).i)

/* qlinear(type, x, ldx, M, K, qs, d, off, N, y, ldy, threads, pre, pre_w, eps, accumulate):
 * y[M,N] = P(x)[M,K] @ W^T, or y += that with `accumulate`; P is the prologue `pre`
 * (PRE_NONE, PRE_RMSNORM with weight pre_w and eps, PRE_SWIGLU over rows of 2K).
 * Pointers are addresses (torch's data_ptr()); the caller checks shapes, dtypes,
 * contiguity and lifetimes (pdserve/quant/linear.py). K is a multiple of 32. */
static PyObject *py_qlinear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[16];
    const int floats[] = {14};
    if (read_args(args, nargs, 16, v, floats, 1) < 0) return NULL;
    const int threads = v[11].i > 0 ? (int)v[11].i : 1;
    const int type = (int)v[0].i;
    const float *x = PTR(const float *, v[1]);
    const int64_t ldx = v[2].i, M = v[3].i, K = v[4].i, N = v[8].i, ldy = v[10].i;
    float *y = PTR(float *, v[9]);
    const Prologue pre = {(int)v[12].i, PTR(const float *, v[13]), (float)v[14].f};
    const int accumulate = v[15].i != 0;
    if (type < Q8_0 || type > Q4_1 || K % QK != 0 || M < 0 || N <= 0 || pre.kind < PRE_NONE ||
        pre.kind > PRE_SWIGLU) {
        PyErr_SetString(PyExc_ValueError, "qlinear: bad type, shape or prologue");
        return NULL;
    }
    if (M == 0) Py_RETURN_NONE;
    const int64_t B = K / QK, BP = (B + 7) / 8 * 8;
    QWeight w = {type, PTR(const uint8_t *, v[5]), PTR(const uint16_t *, v[6]),
                 PTR(const uint16_t *, v[7]), N, K, B, BP};
    int16_t *q = NULL;
    float *d = NULL;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS;
    q = aligned_alloc(64, (size_t)((M * K * 2 + 63) / 64 * 64));
    d = calloc((size_t)(M * (B + BP)), sizeof(float)); /* scales [M][B], then s [M][BP] */
    if (q != NULL && d != NULL) {
        quantize_rows(x, ldx, M, K, &pre, q, d, d + M * B, BP, threads);
        QRows a = {q, d, d + M * B, K, B};
        gemm(&w, &a, M, y, ldy, accumulate, threads);
        ok = 1;
    }
    free(q);
    free(d);
    Py_END_ALLOW_THREADS;
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* quantize_rows(x, ldx, M, K, q, d, s): the activation quantization alone (for tests). */
static PyObject *py_quantize_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[7];
    if (read_args(args, nargs, 7, v, NULL, 0) < 0) return NULL;
    if (v[3].i % QK != 0) {
        PyErr_SetString(PyExc_ValueError, "quantize_rows: K must be a multiple of 32");
        return NULL;
    }
    const Prologue none = {PRE_NONE, NULL, 0.0f};
    Py_BEGIN_ALLOW_THREADS;
    quantize_rows(PTR(const float *, v[0]), v[1].i, v[2].i, v[3].i, &none,
                  PTR(int16_t *, v[4]), PTR(float *, v[5]), PTR(float *, v[6]), v[3].i / QK, 1);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* paged_attention(q, ldq, T, H, Hkv, D, k_cache, v_cache, bs, rows, tables, ldt, out, ldo,
 * scale, threads): see _attention.c. rows and tables are int32. */
static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[16];
    const int floats[] = {14};
    if (read_args(args, nargs, 16, v, floats, 1) < 0) return NULL;
    const Attn a = {PTR(const float *, v[0]), v[1].i, PTR(const float *, v[6]),
                    PTR(const float *, v[7]), v[3].i, v[4].i, v[5].i, v[8].i,
                    PTR(const int32_t *, v[9]), PTR(const int32_t *, v[10]), v[11].i,
                    PTR(float *, v[12]), v[13].i, (float)v[14].f};
    const int threads = v[15].i > 0 ? (int)v[15].i : 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = paged_attention(&a, v[2].i, threads);
    Py_END_ALLOW_THREADS;
    if (rc == -1) return PyErr_NoMemory();
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "paged_attention: head_dim must be a multiple of 8 up to 256, and the "
                        "query heads a multiple of the KV heads");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* rope_write_kv(qkv, ld, T, H, Hkv, D, positions, cos, sin, k_cache, v_cache, slots):
 * see _attention.c. positions and slots are int64. */
static PyObject *py_rope_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[12];
    if (read_args(args, nargs, 12, v, NULL, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rope_write_kv(PTR(float *, v[0]), v[1].i, v[2].i, v[3].i, v[4].i, v[5].i,
                  PTR(const int64_t *, v[6]), PTR(const float *, v[7]), PTR(const float *, v[8]),
                  PTR(float *, v[9]), PTR(float *, v[10]), PTR(const int64_t *, v[11]));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"qlinear", (PyCFunction)(void (*)(void))py_qlinear, METH_FASTCALL,
     "qlinear(type, x, ldx, M, K, qs, d, off, N, y, ldy, threads, pre, pre_w, eps, accumulate):"
     " y (+)= P(x) @ W^T, W in GGUF blocks"},
    {"quantize_rows", (PyCFunction)(void (*)(void))py_quantize_rows, METH_FASTCALL,
     "quantize_rows(x, ldx, M, K, q, d, s): int16 blocks of 32 with scales d and d*sum(q)"},
    {"paged_attention", (PyCFunction)(void (*)(void))py_paged_attention, METH_FASTCALL,
     "paged_attention(q, ldq, T, H, Hkv, D, k_cache, v_cache, bs, rows, tables, ldt, out, ldo,"
     " scale, threads): each query row over its keys in the paged cache"},
    {"rope_write_kv", (PyCFunction)(void (*)(void))py_rope_write_kv, METH_FASTCALL,
     "rope_write_kv(qkv, ld, T, H, Hkv, D, positions, cos, sin, k_cache, v_cache, slots):"
     " RoPE on q and k in place, k and v into their cache slots"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    if (!cpu_ok()) {
        PyErr_SetString(PyExc_ImportError, "this CPU lacks AVX2, FMA or F16C");
        return NULL;
    }
    return PyModule_Create(&module);
}
