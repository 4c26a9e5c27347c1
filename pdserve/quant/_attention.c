/* Attention over the paged KV cache, one query row at a time, and RoPE + KV write.
 *
 * Contract - row invariance: the output of a query row depends only on that row's
 * query, its key range and the cache; the float operations that produce it are the
 * same whether the row is a decode alone, one of 64 decodes, or one row of a 2,000-
 * token prefill chunk, and whichever thread runs it. So a token recomputed by a prefill
 * (a request resumed after a failure, a recompute migration) gets the bits its decode
 * got, and with quantized projections downstream (whose int16 rounding would amplify
 * a 1e-7 difference) the same greedy tokens. torch's SDPA does not promise this: its
 * multi-query path sums in another order than its single-query path.
 *
 * Layout: a layer's cache is K, V: [num_blocks * bs slots][Hkv][D]; token j of a
 * sequence is in slot table[j / bs] * bs + j % bs. Query heads are kv-major (head h
 * reads KV head h / (H / Hkv)), as HF orders them. Row t attends keys
 * [rows[t][1], rows[t][2]) of sequence rows[t][0]; the caller writes this step's K/V
 * into the cache first. D is a multiple of 8.
 *
 * The method, per (row, KV head), for each of the G = H / Hkv query heads sharing it:
 * the scores q.k * scale over the keys in order (each dot product: 8 lanes, then one
 * horizontal sum), their max, p = exp(s - max) and its sum (8 lanes in key order, then
 * one horizontal sum), and out = (sum_j p_j v_j) / sum with the keys in order: exact
 * softmax in three passes, no online rescaling, so nothing depends on a block size. */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_kernels.h"

INLINE float dot(const float *a, const float *b, const int64_t D) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (int64_t i = 8; i < D; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* Keys [j0, j1) of KV head g in runs that are contiguous in the cache (one block, or
 * what of it the range covers): f(i, key) for key i (0-based from j0) at address key, in
 * order. The block arithmetic is done once per run, not once per key (an integer
 * division per key cost more than the key's dot product). */
#define FOR_EACH_KEY(a, cache, table, g, j0, j1, i, key, BODY)                              \
    do {                                                                                  \
        const int64_t stride_ = (a)->Hkv * (a)->D;                                        \
        for (int64_t j_ = (j0); j_ < (j1);) {                                             \
            const int64_t blk_ = j_ / (a)->bs, off_ = j_ % (a)->bs;                       \
            const int64_t run_ = (a)->bs - off_ < (j1) - j_ ? (a)->bs - off_ : (j1) - j_; \
            const float *base_ = (cache) + (((int64_t)(table)[blk_] * (a)->bs + off_) * (a)->Hkv + (g)) * (a)->D; \
            for (int64_t r_ = 0; r_ < run_; r_++) {                                       \
                const int64_t i = j_ - (j0) + r_;                                         \
                const float *key = base_ + r_ * stride_;                                  \
                BODY;                                                                     \
            }                                                                             \
            j_ += run_;                                                                   \
        }                                                                                 \
    } while (0)

/* p = exp(s - max(s)) in place over n scores; returns sum(p). */
INLINE float softmax_numerator(float *s, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
    float m = hmax8(vmax);
    for (int64_t i = j; i < n; i++) m = s[i] > m ? s[i] : m;
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    if (j < n) {
        const __m256i mask = tail_mask(n - j);
        const __m256 p = exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), vm));
        _mm256_maskstore_ps(s + j, mask, p);
        sum = _mm256_add_ps(sum, _mm256_and_ps(p, _mm256_castsi256_ps(mask)));
    }
    return hsum8(sum);
}

/* out[0:D] = (sum_j p[j] * v_j) / total over the keys [j0, j0 + n) in order. DV is D
 * when it is a compile-time constant (the loops then live in registers), else 0. */
INLINE void weighted_values(const Attn *a, const int32_t *table, int64_t g, int64_t j0,
                            int64_t n, const float *p, float total, float *out,
                            const int64_t DV) {
    const int64_t D = DV ? DV : a->D;
    __m256 acc[32];
    for (int64_t i = 0; i < D / 8; i++) acc[i] = _mm256_setzero_ps();
    FOR_EACH_KEY(a, a->vc, table, g, j0, j0 + n, j, v, {
        const __m256 pj = _mm256_broadcast_ss(p + j);
        for (int64_t i = 0; i < D / 8; i++)
            acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), acc[i]);
    });
    const __m256 t = _mm256_set1_ps(total);
    for (int64_t i = 0; i < D / 8; i++) _mm256_storeu_ps(out + 8 * i, _mm256_div_ps(acc[i], t));
}

/* Row t, KV head g: the G query heads that share it. s: scratch of G * n floats. */
INLINE void attend(const Attn *a, int64_t t, int64_t g, float *s, const int64_t DV) {
    const int64_t D = DV ? DV : a->D, G = a->H / a->Hkv;
    const int32_t *r = a->rows + 3 * t;
    const int32_t *table = a->tables + (int64_t)r[0] * a->ldt;
    const int64_t j0 = r[1], n = r[2] - r[1];
    if (n <= 0) {
        for (int64_t h = 0; h < G; h++) memset(a->out + t * a->ldo + (g * G + h) * D, 0, D * 4);
        return;
    }
    const float *q = a->q + t * a->ldq + g * G * D;
    FOR_EACH_KEY(a, a->kc, table, g, j0, j0 + n, j, k, {
        for (int64_t h = 0; h < G; h++) s[h * n + j] = dot(q + h * D, k, D) * a->scale;
    });
    for (int64_t h = 0; h < G; h++) {
        const float total = softmax_numerator(s + h * n, n);
        weighted_values(a, table, g, j0, n, s + h * n, total,
                        a->out + t * a->ldo + (g * G + h) * D, DV);
    }
}

KERNEL static void attend_any(const Attn *a, int64_t t, int64_t g, float *s) {
    switch (a->D) {
        case 64: attend(a, t, g, s, 64); break;
        case 128: attend(a, t, g, s, 128); break;
        default: attend(a, t, g, s, 0); break;
    }
}

/* Returns 0, or -1 when the scratch could not be allocated (nothing written then). */
KERNEL int paged_attention(const Attn *a, int64_t T, int threads) {
    if (a->D % 8 != 0 || a->D > 256 || a->H % a->Hkv != 0) return -2;
    const int64_t G = a->H / a->Hkv, items = T * a->Hkv;
    int64_t longest = 1, work = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = a->rows[3 * t + 2] - a->rows[3 * t + 1];
        longest = n > longest ? n : longest;
        work += n > 0 ? n : 0;
    }
    if (work * a->H * a->D < 65536) threads = 1; /* a fork costs more than the work */
    float *scratch = malloc(sizeof(float) * (size_t)(G * longest) * (size_t)threads);
    if (scratch == NULL) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
#ifdef _OPENMP
        float *s = scratch + (int64_t)omp_get_thread_num() * G * longest;
#else
        float *s = scratch;
#endif
        attend_any(a, i / a->Hkv, i % a->Hkv, s);
    }
    free(scratch);
    return 0;
}

/* qkv rows [T][ld]: H query heads, then Hkv key heads, then Hkv value heads, D each.
 * Rotates q and k in place (rotate-half RoPE: x * cos + rotate_half(x) * sin, as HF and
 * model/layers.py compute it: a product, a product, a sum) at positions[t], then copies
 * k and v into slot slots[t] of the cache. cos, sin: [max_positions][D]. */
KERNEL void rope_write_kv(float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv,
                          int64_t D, const int64_t *positions, const float *cos,
                          const float *sin, float *kc, float *vc, const int64_t *slots) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * ld;
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t h = 0; h < H + Hkv; h++) {
            float *x = row + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] + (-x2) * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        memcpy(kc + slots[t] * Hkv * D, row + H * D, sizeof(float) * Hkv * D);
        memcpy(vc + slots[t] * Hkv * D, row + (H + Hkv) * D, sizeof(float) * Hkv * D);
    }
}
