/* fp32 products for full-precision weights (`--quantization none`, HF-folder models):
 * y[M,N] (+)= x[M,K] @ W^T with W packed once at load into panels of 16 output columns,
 *     panel p = W[16p .. 16p+15][0 .. K) stored k-major: panel[p][k][c] = W[16p + c][k]
 * (the last panel padded with zero columns; pdserve/quant/linear.py `pack_dense`). A
 * panel's row k is one 64-byte line: the operand of one FMA against x[m][k] broadcast.
 *
 * Why not oneDNN (what `PackedLinear` calls): its products split the columns between
 * the threads statically, so a thread whose core another process takes holds the whole
 * product back - a b=1 decode step 2.3x slower beside one CPU-bound process. Here a
 * GEMV's panels are `Runs` (_kernels.h: a late thread holds back a few panels), a GEMM's
 * tiles dynamic chunks, and a decode step runs in the layer loop's one team
 * (fused_layers_team) as the quantized models' do.
 *
 * Contract - batch invariance, as the other kernels: every output y[m, n] is one FMA
 * chain over k = 0, 1, ..., K-1 in order (acc = x[m][k] * w + acc, from 0), then
 * y = acc or y = y + acc; a column is a vector lane, so there is no horizontal sum, and
 * the AVX-512 and AVX2 builds run the same chain per lane: the same bits whatever M, the
 * tile, the thread split or the build. */
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

#define PANEL 16
#define D512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
#define D512_INLINE static inline __attribute__((always_inline, target("avx512f,avx512vl,avx2,fma")))

/* Whether this CPU runs the AVX-512 build (DENSE_ENV=avx2 takes the AVX2 one: tests
 * compare the two). Asked once; a race writes the same. */
static int dense_wide(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        const char *env = getenv(DENSE_ENV);
        known = __builtin_cpu_supports("avx512f") && !(env && strcmp(env, "avx2") == 0);
    }
    return known;
}

const char *dense_build(void) { return dense_wide() ? "avx512" : "avx2"; }

/* ---- AVX-512: a panel is one zmm ------------------------------------------------------ */

/* Rows [m0, m0 + RM) against panels [p0, p0 + RP), RM <= 6, RP <= 4: up to 24
 * accumulators, RP weight registers and a broadcast of the 32. */
D512_INLINE void tile512(const float *W, int64_t K, const float *x, int64_t ldx, int64_t m0,
                         int64_t p0, float *y, int64_t ldy, int64_t N, int acc, const int RM,
                         const int RP) {
    __m512 a[6][4];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RP; j++) a[i][j] = _mm512_setzero_ps();
    const float *w = W + p0 * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m512 v[4];
        for (int j = 0; j < RP; j++) v[j] = _mm512_loadu_ps(w + (j * K + k) * PANEL);
        for (int i = 0; i < RM; i++) {
            const __m512 xb = _mm512_set1_ps(x[(m0 + i) * ldx + k]);
            for (int j = 0; j < RP; j++) a[i][j] = _mm512_fmadd_ps(xb, v[j], a[i][j]);
        }
    }
    for (int j = 0; j < RP; j++) {
        const int64_t n0 = (p0 + j) * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1);
        for (int i = 0; i < RM; i++) {
            float *out = y + (m0 + i) * ldy + n0;
            __m512 r = a[i][j];
            if (acc) r = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), r);
            _mm512_mask_storeu_ps(out, mask, r);
        }
    }
}

/* ---- AVX2: a panel is two ymm ---------------------------------------------------------- */

/* Rows [m0, m0 + RM) against panels [p0, p0 + RP), RM <= 3, RP <= 2. */
INLINE void tile256(const float *W, int64_t K, const float *x, int64_t ldx, int64_t m0,
                    int64_t p0, float *y, int64_t ldy, int64_t N, int acc, const int RM,
                    const int RP) {
    __m256 a[3][2][2];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RP; j++) a[i][j][0] = a[i][j][1] = _mm256_setzero_ps();
    const float *w = W + p0 * K * PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m256 v[2][2];
        for (int j = 0; j < RP; j++) {
            v[j][0] = _mm256_loadu_ps(w + (j * K + k) * PANEL);
            v[j][1] = _mm256_loadu_ps(w + (j * K + k) * PANEL + 8);
        }
        for (int i = 0; i < RM; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + (m0 + i) * ldx + k);
            for (int j = 0; j < RP; j++) {
                a[i][j][0] = _mm256_fmadd_ps(xb, v[j][0], a[i][j][0]);
                a[i][j][1] = _mm256_fmadd_ps(xb, v[j][1], a[i][j][1]);
            }
        }
    }
    for (int j = 0; j < RP; j++) {
        const int64_t n0 = (p0 + j) * PANEL;
        for (int h = 0; h < 2; h++) {
            const int64_t c0 = n0 + 8 * h, cols = N - c0 < 8 ? N - c0 : 8;
            if (cols <= 0) continue;
            const __m256i mask = tail_mask(cols);
            for (int i = 0; i < RM; i++) {
                float *out = y + (m0 + i) * ldy + c0;
                __m256 r = a[i][j][h];
                if (acc) r = _mm256_add_ps(_mm256_maskload_ps(out, mask), r);
                _mm256_maskstore_ps(out, mask, r);
            }
        }
    }
}

/* ---- rows against panels, by build ---------------------------------------------------- */

/* Rows [m0, m1) in tiles of STEP rows (the build's widest), then the rest. */
#define ROWS_BY(TILE, STEP, RP, REST)                                                    \
    do {                                                                                 \
        int64_t m = m0;                                                                  \
        for (; m + STEP <= m1; m += STEP) TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, STEP, RP); \
        REST(TILE, RP);                                                                  \
    } while (0)
#define REST512(TILE, RP)                                                                \
    switch (m1 - m) {                                                                    \
        case 5: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 5, RP); break;                 \
        case 4: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 4, RP); break;                 \
        case 3: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 3, RP); break;                 \
        case 2: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 2, RP); break;                 \
        case 1: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 1, RP); break;                 \
    }
#define REST256(TILE, RP)                                                                \
    switch (m1 - m) {                                                                    \
        case 2: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 2, RP); break;                 \
        case 1: TILE(W, K, x, ldx, m, p0, y, ldy, N, acc, 1, RP); break;                 \
    }

D512 static void rows512(const float *W, int64_t K, const float *x, int64_t ldx, int64_t m0,
                         int64_t m1, int64_t p0, int rp, float *y, int64_t ldy, int64_t N,
                         int acc) {
    switch (rp) {
        case 4: ROWS_BY(tile512, 6, 4, REST512); break;
        case 3: ROWS_BY(tile512, 6, 3, REST512); break;
        case 2: ROWS_BY(tile512, 6, 2, REST512); break;
        default: ROWS_BY(tile512, 6, 1, REST512); break;
    }
}

KERNEL static void rows256(const float *W, int64_t K, const float *x, int64_t ldx, int64_t m0,
                           int64_t m1, int64_t p0, int rp, float *y, int64_t ldy, int64_t N,
                           int acc) {
    const int64_t first = p0, end = p0 + rp;
    for (p0 = first; p0 < end; p0 += 2) { /* AVX2 has registers for 2 panels at a time */
        if (p0 + 2 <= end) ROWS_BY(tile256, 3, 2, REST256);
        else ROWS_BY(tile256, 3, 1, REST256);
    }
}

/* Rows [m0, m1) against panels [p0, p0 + rp), rp <= TILE_PANELS. */
static void rows_panels(const float *W, int64_t K, const float *x, int64_t ldx, int64_t m0,
                        int64_t m1, int64_t p0, int rp, float *y, int64_t ldy, int64_t N,
                        int acc) {
    if (dense_wide()) rows512(W, K, x, ldx, m0, m1, p0, rp, y, ldy, N, acc);
    else rows256(W, K, x, ldx, m0, m1, p0, rp, y, ldy, N, acc);
}

void dense_panel(const float *W, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                 int64_t p, float *y, int64_t ldy, int acc) {
    rows_panels(W, K, x, ldx, 0, M, p, 1, y, ldy, N, acc);
}

/* y (+)= x @ W^T. Few rows (a decode step's, < DENSE_STREAM_ROWS): a panel per item, on
 * `Runs` - each thread streams its own panels front to back and a thread done early
 * takes panels from the back of the other's. More rows: tiles of TILE_PANELS
 * panels in dynamic chunks, rows in passes whose activations stay in L2 while the panels
 * go by. */
#define DENSE_STREAM_ROWS 4
#define TILE_PANELS 4 /* a GEMM tile's panels: 64 columns */
void dense_linear(const float *W, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                  float *y, int64_t ldy, int acc, int threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL;
    if (M < DENSE_STREAM_ROWS) {
        FOR_EACH_RUN_ITEM(threads, panels, p, dense_panel(W, N, K, x, ldx, M, p, y, ldy, acc));
        return;
    }
    const int64_t tiles = (panels + TILE_PANELS - 1) / TILE_PANELS;
    int64_t pass = (256 * 1024 / 4) / K; /* rows whose activations fill ~256 KB */
    pass = pass < 16 ? 16 : pass > 256 ? 256 : pass;
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t m1 = m0 + pass < M ? m0 + pass : M;
#pragma omp for schedule(dynamic, chunk_of(tiles, threads, 4))
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t p0 = TILE_PANELS * t;
            const int64_t rp = panels - p0 < TILE_PANELS ? panels - p0 : TILE_PANELS;
            rows_panels(W, K, x, ldx, m0, m1, p0, (int)rp, y, ldy, N, acc);
        }
    }
}
