/* Attention over the paged KV cache, one query row at a time, and RoPE + KV write.
 *
 * Contract - row invariance: the output of a query row depends only on that row's
 * query, its key range and the cache; the float operations that produce it are the
 * same whether the row is a decode alone, one of 64 decodes, or one row of a 2,000-
 * token prefill chunk, and whichever thread runs it. So a token recomputed by a prefill
 * (a request resumed after a failure, a recompute migration) gets the bits its decode
 * got, so a resumed request's text is its undisturbed run's, token for token. torch's
 * SDPA does not promise this: its multi-query path sums in another order than its
 * single-query path (a ~1e-7 difference, which was enough to flip a near-tied greedy
 * token once quantized projections amplified it).
 *
 * Layout: a layer's cache is K, V: [num_blocks * bs slots][Hkv][D]; token j of a
 * sequence is in slot table[j / bs] * bs + j % bs. Query heads are kv-major (head h
 * reads KV head h / (H / Hkv)), as HF orders them. Row t attends keys
 * [rows[t][1], rows[t][2]) of sequence rows[t][0]; the caller writes this step's K/V
 * into the cache first. D is a multiple of 8.
 *
 * The method, per (row, KV head), for each of the G = H / Hkv query heads sharing it:
 * the scores q.k * scale over the keys in order (each dot product: 8 lanes, then one
 * fixed horizontal sum; computed 8 keys at a time), their max, p = exp(s - max) and its sum (8 lanes in key order, then
 * one horizontal sum), and out = (sum_j p_j v_j) / sum with the keys in order: exact
 * softmax in three passes, no online rescaling, so nothing depends on a block size.
 * Rows of one sequence are attended in blocks that share each key load (see ROWS); a
 * decode row takes all its KV heads at once, so each key is read in one piece (see
 * paged_attention), and asks for its values while it sums them (see VALUES_AHEAD); a
 * step of one decode row is shared between the threads in three phases (see LONE). */
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"

/* Keys [j0, j1) of KV head g in runs that are contiguous in the cache (one block, or
 * what of it the range covers): f(i, key) for key i (0-based from j0) at address key, in
 * order; heads g + 1 ... of the same key follow at key + D .... The block arithmetic is
 * done once per run, not once per key (an integer division per key cost more than the
 * key's dot product). RUN runs at the start of each run, `blk` its index in the table. */
#define FOR_EACH_KEY_RUN(a, cache, ES, table, g, j0, j1, i, key, blk, RUN, BODY)        \
    do {                                                                                  \
        const int64_t stride_ = (a)->Hkv * (a)->D * (ES);                                 \
        for (int64_t j_ = (j0); j_ < (j1);) {                                             \
            const int64_t blk = j_ / (a)->bs, off_ = j_ % (a)->bs;                        \
            const int64_t run_ = (a)->bs - off_ < (j1) - j_ ? (a)->bs - off_ : (j1) - j_; \
            const char *base_ = (const char *)(cache) + (((int64_t)(table)[blk] * (a)->bs + off_) * (a)->Hkv + (g)) * (a)->D * (ES); \
            RUN;                                                                          \
            for (int64_t r_ = 0; r_ < run_; r_++) {                                       \
                const int64_t i = j_ - (j0) + r_;                                         \
                const char *key = base_ + r_ * stride_;                                   \
                BODY;                                                                     \
            }                                                                             \
            j_ += run_;                                                                   \
        }                                                                                 \
    } while (0)
#define FOR_EACH_KEY(a, cache, ES, table, g, j0, j1, i, key, BODY) \
    FOR_EACH_KEY_RUN(a, cache, ES, table, g, j0, j1, i, key, blk_, (void)0, BODY)

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

/* Rows of one sequence attended together ("a row block", up to ROWS rows): each key and
 * value is then read from memory once per block instead of once per row - a 2,000-token
 * prefill read every row's K/V range from L3 and ran at half of torch's SDPA speed. Keys
 * go by in tiles of KEY_TILE that stay in L1 while every (row, head) of the block uses
 * them. Each (row, head) still sees its own keys in order with its own accumulators, so
 * the blocking changes no float operation (the contract above). */
#define ROWS 8
#define KEY_TILE 32

/* WIDE: the query heads that share a KV head computed together, up to GROUP_HEADS at a
 * time - one load of each key vector feeds their dot products, one load of each value
 * vector their sums - every (head, lane) chain the same operations as alone, so the
 * same bits. Their 24 accumulators need AVX-512VL's 32 vector registers (with AVX2's 16
 * they spill: 0.90-0.98x), so WIDE is a second build of the attention (attend_wide),
 * taken where the CPU has them, for row blocks of several rows (a 512-token prefill
 * chunk: 1.09x; decode rows gained nothing, 0.97-1.04x; bench/bench_kernel_ab.py
 * --attention). The calls below pass GH as a constant (3, 2 or 1) so each is unrolled. */
#define GROUP_HEADS 3

static int wide_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}

typedef struct {
    int64_t first, count; /* rows [first, first + count), all of one sequence */
} RowBlock;

typedef struct {
    int64_t block, g, ng; /* a row block's KV heads [g, g + ng) */
} Item;

typedef struct {
    const Attn *a;
    const int32_t *table;
    int64_t g, ng, G, D; /* KV heads [g, g + ng): query heads [g G, (g + ng) G) */
    int64_t nh;          /* ng * G */
    int64_t t0, R;       /* the block's rows */
    int64_t start[ROWS], n[ROWS];
    int64_t lo, hi;      /* the union of the rows' key ranges */
    int64_t stride;      /* floats between one (row, head)'s scores and the next */
    float *s;            /* scores, then probabilities: [R][nh][stride] */
    float *acc;          /* [R][nh][D] running sums of p * v */
} Block;

/* acc[m]: key m's 8 partial sums of a dot product. Returns lane m = key m's sum, each
 * reduced as hsum8 reduces (lo+hi, then lanes 0+2 and 1+3, then those two), for the 8
 * keys at once by shuffles, without a scalar sum per key. */
INLINE __m256 reduce8(const __m256 acc[8]) {
    __m256 x[4]; /* x[m]: key m's lo + hi in lanes 0-3, key m+4's in lanes 4-7 */
    for (int m = 0; m < 4; m++)
        x[m] = _mm256_add_ps(_mm256_permute2f128_ps(acc[m], acc[m + 4], 0x20),
                             _mm256_permute2f128_ps(acc[m], acc[m + 4], 0x31));
    /* y: (x0 + x2, x1 + x3) of keys (0, 1 | 4, 5) and (2, 3 | 6, 7) */
    const __m256 y01 = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 y23 = _mm256_add_ps(_mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
    /* y0 + y1 of keys 0, 1, 2, 3 | 4, 5, 6, 7 */
    return _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Elements i .. i + 7 of a key or value record at p, as fp32: F16 (an fp16 cache) widens
 * them exactly (F16C), so every float operation after the load is the one an fp32 cache
 * holding the same values gets. ES: the cache's bytes per element. */
#define ES_OF(F16) ((F16) ? 2 : 4)
INLINE __m256 load_kv(const char *p, int64_t i, const int F16) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i)));
    return _mm256_loadu_ps((const float *)(p + 4 * i));
}

/* q.k for 8 keys at once and GH query heads (q, q + D, ...): out[x] lane m is exactly
 * dot(q_x, k_m) - the same FMA chain (8 lanes over D) and reduce8, however many heads go
 * together; GH > 1 loads each key vector once for all of them (see WIDE). */
INLINE void dot8(const float *q, const char *const k[8], const int64_t D, const int GH,
                 const int F16, __m256 *out) {
    __m256 acc[GROUP_HEADS][8];
    for (int x = 0; x < GH; x++) {
        const __m256 qv = _mm256_loadu_ps(q + x * D);
        for (int m = 0; m < 8; m++) acc[x][m] = _mm256_mul_ps(qv, load_kv(k[m], 0, F16));
    }
    for (int64_t i = 8; i < D; i += 8) {
        __m256 qv[GROUP_HEADS];
        for (int x = 0; x < GH; x++) qv[x] = _mm256_loadu_ps(q + x * D + i);
        for (int m = 0; m < 8; m++) {
            const __m256 kv = load_kv(k[m], i, F16);
            for (int x = 0; x < GH; x++) acc[x][m] = _mm256_fmadd_ps(qv[x], kv, acc[x][m]);
        }
    }
    for (int x = 0; x < GH; x++) out[x] = reduce8(acc[x]);
}

/* Scores of keys j0 .. j0 + cnt - 1 (addresses k of KV head b->g; padded to 8 with valid
 * addresses) for every (row, head) of the block whose range holds them. */
INLINE void score_group(Block *b, const char *const k[8], int64_t j0, int64_t cnt,
                        const int64_t DV, const int WIDE, const int F16) {
    const Attn *a = b->a;
    const int64_t D = DV ? DV : b->D, G = b->G;
    const __m256 scale = _mm256_set1_ps(a->scale);
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32((int)j0),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i live = tail_mask(cnt);
    for (int64_t kv = 0; kv < b->ng; kv++) {
        const char *kh[8]; /* KV head g + kv of the 8 keys */
        for (int m = 0; m < 8; m++) kh[m] = k[m] + kv * D * ES_OF(F16);
        for (int64_t r = 0; r < b->R; r++) {
            const int64_t start = b->start[r], end = start + b->n[r];
            if (j0 >= end || j0 + cnt <= start) continue;
            /* lanes with start <= j < end */
            const __m256i in = _mm256_andnot_si256(
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)start), lane),
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)end), lane));
            const __m256i mask = _mm256_and_si256(in, live);
            const float *q = a->q + (b->t0 + r) * a->ldq + b->g * G * D;
            float *s = b->s + r * b->nh * b->stride + (j0 - start);
            for (int64_t h = kv * G; h < (kv + 1) * G;) {
                __m256 dots[GROUP_HEADS];
                const int64_t left = (kv + 1) * G - h;
                const int gh = !WIDE ? 1 : left >= 3 ? 3 : (int)left;
                if (gh == 3) dot8(q + h * D, kh, D, 3, F16, dots);
                else if (gh == 2) dot8(q + h * D, kh, D, 2, F16, dots);
                else dot8(q + h * D, kh, D, 1, F16, dots);
                for (int x = 0; x < gh; x++, h++)
                    _mm256_maskstore_ps(s + h * b->stride, mask, _mm256_mul_ps(dots[x], scale));
            }
        }
    }
}

/* Scores of every (row, head) of the block: s = q.k * scale, keys in order. */
INLINE void block_scores(Block *b, const int64_t DV, const int WIDE, const int ASK_VALUES,
                         const int F16) {
    const Attn *a = b->a;
    const int64_t ES = ES_OF(F16);
    const char *k8[8];
    int64_t cnt = 0, first = 0, ahead = 0; /* ahead: bytes to this slot of the next block */
    const int64_t block = a->bs * a->Hkv * a->D * ES, lines = (b->ng * a->D * ES + 63) / 64;
    /* With each key, the key in the same slot of the next cache block is asked for, into
     * L2, and with ASK_VALUES its value (read after every score) too. In a decode step
     * the KV comes from memory (the layers' weights streamed through L3 since; at batch
     * 8+ it outgrows L3 anyway), a demand miss per line otherwise. One prefetch per line
     * spread over the keys, to L2 rather than L1 (fewer outstanding misses): 1.2-1.3x at
     * batch 8-32 and 1.3-1.4x at batch 1 with weights read between (bench_kernel_ab.py
     * --attention; KV read at 17.5-22 GB/s instead of 14-16) over a whole block asked for
     * at once into L1 (itself 1.1-1.25x over no prefetch); two blocks ahead gained nothing
     * more. A decode row asks for its values later instead (see VALUES_AHEAD). */
    FOR_EACH_KEY_RUN(a, a->kc, ES, b->table, b->g, b->lo, b->hi, i, k, blk, {
        ahead = (blk + 1) * a->bs < b->hi ? ((int64_t)b->table[blk + 1] - b->table[blk]) * block : 0;
    }, {
        const char *v = (const char *)a->vc + (k - (const char *)a->kc);
        if (ASK_VALUES)
            for (int64_t l = 0; l < lines; l++) _mm_prefetch(v + 64 * l, _MM_HINT_T1);
        if (ahead != 0)
            for (int64_t l = 0; l < lines; l++) _mm_prefetch(k + ahead + 64 * l, _MM_HINT_T1);
        if (cnt == 0) first = b->lo + i;
        k8[cnt++] = k;
        if (cnt == 8) {
            score_group(b, k8, first, 8, DV, WIDE, F16);
            cnt = 0;
        }
    });
    if (cnt > 0) {
        for (int64_t m = cnt; m < 8; m++) k8[m] = k8[0];
        score_group(b, k8, first, cnt, DV, WIDE, F16);
    }
}

/* acc of GH query heads h0 .. h0 + GH - 1 (sharing KV head kv) of row r, value lanes
 * [d0, d0 + 64), += sum of p_j v_j over keys [lo, hi), in order: each (head, lane) chain
 * as alone, one load of each value vector feeding the GH heads (see WIDE). */
INLINE void value_heads(Block *b, int64_t r, int64_t kv, int64_t h0, int64_t d0, int64_t lo,
                        int64_t hi, const int GH, const int64_t D, const int F16) {
    const Attn *a = b->a;
    __m256 acc[GROUP_HEADS][8];
    const float *p[GROUP_HEADS];
    float *out[GROUP_HEADS];
    for (int x = 0; x < GH; x++) {
        const int64_t rh = r * b->nh + kv * b->G + h0 + x;
        p[x] = b->s + rh * b->stride + (lo - b->start[r]);
        out[x] = b->acc + rh * D + d0;
        for (int i = 0; i < 8; i++) acc[x][i] = _mm256_loadu_ps(out[x] + 8 * i);
    }
    FOR_EACH_KEY(a, a->vc, ES_OF(F16), b->table, b->g, lo, hi, j, v, {
        const char *vv = v + (kv * D + d0) * ES_OF(F16);
        __m256 pj[GROUP_HEADS];
        for (int x = 0; x < GH; x++) pj[x] = _mm256_broadcast_ss(p[x] + j);
        for (int i = 0; i < 8; i++) {
            const __m256 vi = load_kv(vv, 8 * i, F16);
            for (int x = 0; x < GH; x++) acc[x][i] = _mm256_fmadd_ps(pj[x], vi, acc[x][i]);
        }
    });
    for (int x = 0; x < GH; x++)
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(out[x] + 8 * i, acc[x][i]);
}

/* acc[r][h] += sum of p_j v_j over the keys of [j0, j1) in row r's range, in order. WIDE
 * (D a multiple of 64): the heads of a KV head three at a time (value_heads). */
INLINE void block_values(Block *b, int64_t j0, int64_t j1, const int64_t DV, const int WIDE,
                         const int F16) {
    const Attn *a = b->a;
    const int64_t D = DV ? DV : b->D, G = b->G;
    for (int64_t r = 0; r < b->R; r++) {
        const int64_t lo = j0 > b->start[r] ? j0 : b->start[r];
        const int64_t end = b->start[r] + b->n[r], hi = j1 < end ? j1 : end;
        if (lo >= hi) continue;
        if (WIDE) {
            for (int64_t kv = 0; kv < b->ng; kv++)
                for (int64_t d0 = 0; d0 < D; d0 += 64)
                    for (int64_t h0 = 0; h0 < G;) {
                        const int64_t gh = G - h0 >= 3 ? 3 : G - h0;
                        if (gh == 3) value_heads(b, r, kv, h0, d0, lo, hi, 3, D, F16);
                        else if (gh == 2) value_heads(b, r, kv, h0, d0, lo, hi, 2, D, F16);
                        else value_heads(b, r, kv, h0, d0, lo, hi, 1, D, F16);
                        h0 += gh;
                    }
            continue;
        }
        for (int64_t h = 0, off = 0; h < b->nh; h++, off += h % G == 0 ? D : 0) {
            const float *p = b->s + (r * b->nh + h) * b->stride + (lo - b->start[r]);
            float *out = b->acc + (r * b->nh + h) * D;
            __m256 acc[32];
            for (int64_t i = 0; i < D / 8; i++) acc[i] = _mm256_loadu_ps(out + 8 * i);
            FOR_EACH_KEY(a, a->vc, ES_OF(F16), b->table, b->g, lo, hi, j, v, {
                const __m256 pj = _mm256_broadcast_ss(p + j);
                for (int64_t i = 0; i < D / 8; i++)
                    acc[i] = _mm256_fmadd_ps(pj, load_kv(v, off + 8 * i, F16), acc[i]);
            });
            for (int64_t i = 0; i < D / 8; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);
        }
    }
}

/* A decode row (a block of one row) asks for its values while it sums them, this many
 * keys ahead, instead of with its scores: the scores then read only the keys and the
 * sums' arithmetic overlaps the values' reads, where both reads fell in the scores and
 * the sums waited on nothing. The first keys' values are asked for before the softmax,
 * whose arithmetic then overlaps their read. 1.20-1.22x at batch 8 and 32 and 1.19-1.23x
 * at 512-2,048 tokens of context (bench_kernel_ab.py --attention; 32, 64, 96 and 128
 * keys ahead: 1.16x, 1.16-1.19x, 1.16-1.18x, 1.14x before the first keys moved, which
 * added 1.02-1.05x). A row block of several rows keeps asking with its scores: each
 * value serves every row. */
#define VALUES_AHEAD 64

/* The values of keys [j0, j1) (KV heads [b->g, b->g + b->ng) of each), asked for into L2. */
INLINE void ask_values(const Block *b, int64_t j0, int64_t j1, const int F16) {
    const Attn *a = b->a;
    const int64_t lines = (b->ng * a->D * ES_OF(F16) + 63) / 64;
    FOR_EACH_KEY(a, a->vc, ES_OF(F16), b->table, b->g, j0, j1, i, v, {
        (void)i;
        for (int64_t l = 0; l < lines; l++) _mm_prefetch(v + 64 * l, _MM_HINT_T1);
    });
}

/* One row block, KV heads [g, g + ng). scratch: ROWS * H * (longest + D) floats. */
INLINE void attend(const Attn *a, RowBlock rb, int64_t g, int64_t ng, float *scratch,
                   int64_t longest, const int64_t DV, const int WIDE, const int F16) {
    Block b = {.a = a, .g = g, .ng = ng, .G = a->H / a->Hkv, .D = DV ? DV : a->D,
               .t0 = rb.first, .R = rb.count, .stride = longest};
    const int64_t D = b.D, NH = b.nh = ng * b.G;
    b.table = a->tables + (int64_t)a->rows[3 * rb.first] * a->ldt;
    b.s = scratch;
    b.acc = scratch + ROWS * a->H * longest;
    b.lo = INT64_MAX;
    b.hi = 0;
    for (int64_t r = 0; r < b.R; r++) {
        const int32_t *row = a->rows + 3 * (b.t0 + r);
        b.start[r] = row[1];
        b.n[r] = row[2] > row[1] ? row[2] - row[1] : 0;
        if (b.n[r] > 0) {
            b.lo = b.start[r] < b.lo ? b.start[r] : b.lo;
            b.hi = row[2] > b.hi ? row[2] : b.hi;
        }
    }
    memset(b.acc, 0, sizeof(float) * (size_t)(b.R * NH * D));
    if (b.lo < b.hi) {
        const int64_t ahead = b.R == 1 ? VALUES_AHEAD : 0; /* see VALUES_AHEAD */
        block_scores(&b, DV, WIDE, ahead == 0, F16);
        if (ahead > 0) ask_values(&b, b.lo, b.lo + ahead < b.hi ? b.lo + ahead : b.hi, F16);
        for (int64_t r = 0; r < b.R; r++)
            for (int64_t h = 0; h < NH; h++)
                if (b.n[r] > 0) b.s[(r * NH + h) * b.stride + longest - 1] =
                    softmax_numerator(b.s + (r * NH + h) * b.stride, b.n[r]);
        for (int64_t j = b.lo; j < b.hi; j += KEY_TILE) {
            const int64_t next = j + ahead + KEY_TILE;
            if (ahead > 0 && j + ahead < b.hi)
                ask_values(&b, j + ahead, next < b.hi ? next : b.hi, F16);
            block_values(&b, j, j + KEY_TILE < b.hi ? j + KEY_TILE : b.hi, DV, WIDE, F16);
        }
    }
    for (int64_t r = 0; r < b.R; r++) {
        for (int64_t h = 0; h < NH; h++) {
            float *out = a->out + (b.t0 + r) * a->ldo + (g * b.G + h) * D;
            const float *acc = b.acc + (r * NH + h) * D;
            if (b.n[r] == 0) {
                memset(out, 0, sizeof(float) * (size_t)D);
                continue;
            }
            const __m256 t = _mm256_set1_ps(b.s[(r * NH + h) * b.stride + longest - 1]);
            for (int64_t i = 0; i < D / 8; i++)
                _mm256_storeu_ps(out + 8 * i, _mm256_div_ps(_mm256_loadu_ps(acc + 8 * i), t));
        }
    }
}

KERNEL static void attend_any(const Attn *a, RowBlock rb, int64_t g, int64_t ng,
                              float *scratch, int64_t longest) {
    const int f16 = a->kv16;
    switch (a->D) {
        case 64:
            if (f16) attend(a, rb, g, ng, scratch, longest, 64, 0, 1);
            else attend(a, rb, g, ng, scratch, longest, 64, 0, 0);
            break;
        case 128:
            if (f16) attend(a, rb, g, ng, scratch, longest, 128, 0, 1);
            else attend(a, rb, g, ng, scratch, longest, 128, 0, 0);
            break;
        default:
            if (f16) attend(a, rb, g, ng, scratch, longest, 0, 0, 1);
            else attend(a, rb, g, ng, scratch, longest, 0, 0, 0);
            break;
    }
}

/* attend_any's WIDE build (see WIDE), for a head size of 64 or 128. */
KERNEL_WIDE static void attend_wide(const Attn *a, RowBlock rb, int64_t g, int64_t ng,
                                    float *scratch, int64_t longest) {
    if (a->D == 64 && a->kv16) attend(a, rb, g, ng, scratch, longest, 64, 1, 1);
    else if (a->D == 64) attend(a, rb, g, ng, scratch, longest, 64, 1, 0);
    else if (a->kv16) attend(a, rb, g, ng, scratch, longest, 128, 1, 1);
    else attend(a, rb, g, ng, scratch, longest, 128, 1, 0);
}

/* The block's attention, WIDE where the plan says so and the block has several rows. */
static void attend_item(const AttnPlan *p, const Attn *a, RowBlock rb, int64_t g, int64_t ng,
                        float *scratch) {
    if (p->wide && rb.count > 1) attend_wide(a, rb, g, ng, scratch, p->longest);
    else attend_any(a, rb, g, ng, scratch, p->longest);
}

/* LONE: a step of one decode row (batch 1) on a team of P threads, in three phases with
 * a barrier between, each split evenly: the scores of every head by key ranges (each
 * thread reads whole K records: all KV heads of its keys, contiguous), the softmax by
 * heads, the value sums by lanes (thread c owns a contiguous 1/P of each V record's
 * Hkv * D floats, all its keys). Split by KV head instead, one thread took two of
 * SmolLM2's three, and read a third of each record at a stride. Every score, softmax
 * and value lane is the same float operations as in `attend` (a score does not depend
 * on the keys beside it in its group of 8; a lane's sum is its own chain over the keys
 * in order), so the same bits. */
#define VALUE_VECS 4 /* lanes a pass: 4 vectors x up to 3 heads = 12 accumulators */

/* Lanes [d0, d0 + 8 nv) of KV head kv's query heads [h, h + GH), over the row's keys
 * [lo, hi): out = (sum of p_j v_j, keys in order) / sum. s: [H][stride] probabilities,
 * each head's sum in its slot stride - 1. */
INLINE void lone_values(const Attn *a, const int32_t *table, const float *s, int64_t stride,
                        int64_t lo, int64_t hi, int64_t kv, int64_t h, int64_t d0, int nv,
                        const int GH, const int F16) {
    __m256 acc[3][VALUE_VECS];
    for (int x = 0; x < GH; x++)
        for (int i = 0; i < nv; i++) acc[x][i] = _mm256_setzero_ps();
    const int64_t ES = ES_OF(F16), block = a->bs * a->Hkv * a->D * ES;
    int64_t ahead = 0; /* bytes to this slot of the next block */
    FOR_EACH_KEY_RUN(a, a->vc, ES, table, kv, lo, hi, j, v, blk, {
        ahead = (blk + 1) * a->bs < hi ? ((int64_t)table[blk + 1] - table[blk]) * block : 0;
    }, {
        if (ahead != 0) /* these lanes of this slot of the next block (else they stall) */
            for (int i = 0; i < nv; i += 8 / ES) /* a line: 8 / ES vectors */
                _mm_prefetch(v + ahead + (d0 + 8 * i) * ES, _MM_HINT_T1);
        __m256 pj[3];
        for (int x = 0; x < GH; x++) pj[x] = _mm256_broadcast_ss(s + (h + x) * stride + j);
        for (int i = 0; i < nv; i++) {
            const __m256 vi = load_kv(v, d0 + 8 * i, F16);
            for (int x = 0; x < GH; x++) acc[x][i] = _mm256_fmadd_ps(pj[x], vi, acc[x][i]);
        }
    });
    for (int x = 0; x < GH; x++) {
        const __m256 t = _mm256_set1_ps(s[(h + x) * stride + stride - 1]);
        float *out = a->out + (h + x) * a->D + d0;
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_div_ps(acc[x][i], t));
    }
}

/* Thread c's lanes of the V records: [c L / P, (c + 1) L / P) of L = Hkv * D, at vector
 * bounds, a KV head's heads three at a time. */
INLINE void lone_value_lanes(const Attn *a, const int32_t *table, const float *s,
                             int64_t stride, int64_t lo, int64_t hi, int64_t c, int64_t P,
                             const int F16) {
    const int64_t vecs = a->Hkv * a->D / 8, G = a->H / a->Hkv;
    const int64_t first = c * vecs / P * 8, end = (c + 1) * vecs / P * 8;
    for (int64_t l = first; l < end;) {
        const int64_t kv = l / a->D, d0 = l % a->D;
        const int64_t room = (a->D - d0) / 8, left = (end - l) / 8; /* vectors */
        const int64_t fit = room < left ? room : left;
        const int nv = fit < VALUE_VECS ? (int)fit : VALUE_VECS;
        for (int64_t h = kv * G; h < (kv + 1) * G;) {
            const int64_t gh = (kv + 1) * G - h;
            if (gh >= 3 && nv == VALUE_VECS)
                lone_values(a, table, s, stride, lo, hi, kv, h, d0, VALUE_VECS, 3, F16), h += 3;
            else if (gh >= 3) lone_values(a, table, s, stride, lo, hi, kv, h, d0, nv, 3, F16), h += 3;
            else if (gh == 2) lone_values(a, table, s, stride, lo, hi, kv, h, d0, nv, 2, F16), h += 2;
            else lone_values(a, table, s, stride, lo, hi, kv, h, d0, nv, 1, F16), h += 1;
        }
        l += 8 * nv;
    }
}

KERNEL static void lone_value_part(const Attn *a, const int32_t *table, const float *s,
                                   int64_t stride, int64_t lo, int64_t hi, int64_t c, int64_t P) {
    if (a->kv16) lone_value_lanes(a, table, s, stride, lo, hi, c, P, 1);
    else lone_value_lanes(a, table, s, stride, lo, hi, c, P, 0);
}

/* Thread c's keys' scores, every head: keys [lo, hi) of the row cut in P ranges at
 * multiples of 8 from lo. */
KERNEL static void lone_score_part(const Attn *a, float *s, int64_t longest, int64_t c,
                                   int64_t P) {
    Block b = {.a = a, .g = 0, .ng = a->Hkv, .G = a->H / a->Hkv, .D = a->D, .nh = a->H,
               .t0 = 0, .R = 1, .stride = longest, .s = s};
    b.table = a->tables + (int64_t)a->rows[0] * a->ldt;
    b.start[0] = a->rows[1];
    b.n[0] = a->rows[2] - a->rows[1];
    const int64_t groups = (b.n[0] + 7) / 8;
    b.lo = b.start[0] + c * groups / P * 8;
    b.hi = b.start[0] + (c + 1) * groups / P * 8;
    b.hi = b.hi < a->rows[2] ? b.hi : a->rows[2];
    if (b.lo < b.hi && a->kv16) block_scores(&b, 0, 0, 0, 1);
    else if (b.lo < b.hi) block_scores(&b, 0, 0, 0, 0);
}

/* A head's probabilities, and their sum in its last slot. */
KERNEL static void lone_softmax(float *s, int64_t n, int64_t stride) {
    s[stride - 1] = softmax_numerator(s, n);
}

/* The LONE phases, on every thread of the team. */
static void lone_team(const AttnPlan *p, const Attn *a) {
    float *s = p->scratch; /* [H][longest]: shared by the team */
    const int64_t P = p->threads, n = a->rows[2] - a->rows[1], lo = a->rows[1];
#pragma omp for schedule(static)
    for (int64_t c = 0; c < P; c++) lone_score_part(a, s, p->longest, c, P);
    PHASE(2);
#pragma omp for schedule(static)
    for (int64_t h = 0; h < a->H; h++) lone_softmax(s + h * p->longest, n, p->longest);
    PHASE(3);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < P; c++)
        lone_value_part(a, a->tables + (int64_t)a->rows[0] * a->ldt, s, p->longest, lo,
                        lo + n, c, P);
    PHASE(4);
}

/* A LONE step's next layer, read ahead (see WARM in _kernels.c): thread c loads its part
 * of that layer's KV - the K records of the keys lone_score_part gives it, its lanes of
 * every V record as lone_value_lanes cuts them - a float per line, summed and returned
 * so the loads stay. */
float attention_warm(const AttnPlan *p, const Attn *a, int64_t c) {
    float sum = 0.0f;
    if (!p->lone) return sum;
    const int64_t P = p->threads, ES = a->kv16 ? 2 : 4, record = a->Hkv * a->D * ES;
    const int32_t *table = a->tables + (int64_t)a->rows[0] * a->ldt;
    const int64_t start = a->rows[1], end = a->rows[2], groups = (end - start + 7) / 8;
    const int64_t lo = start + c * groups / P * 8, hi = start + (c + 1) * groups / P * 8;
    const int64_t vecs = a->Hkv * a->D / 8;
    const int64_t first = c * vecs / P * 8 * ES, last = (c + 1) * vecs / P * 8 * ES;
    for (int64_t j = start; j < end; j++) {
        const int64_t slot = (int64_t)table[j / a->bs] * a->bs + j % a->bs;
        const char *k = (const char *)a->kc + slot * record;
        const char *v = (const char *)a->vc + slot * record;
        if (j >= lo && j < hi)
            for (int64_t b = 0; b < record; b += 64) sum += *(const float *)(const void *)(k + b);
        for (int64_t b = first & ~(int64_t)63; b < last; b += 64)
            sum += *(const float *)(const void *)(v + b);
    }
    return sum;
}

/* Consecutive rows of one sequence, up to ROWS at a time. Returns the count. */
static int64_t row_blocks(const Attn *a, int64_t T, RowBlock *out) {
    int64_t count = 0;
    for (int64_t t = 0; t < T;) {
        int64_t n = 1;
        while (t + n < T && n < ROWS && a->rows[3 * (t + n)] == a->rows[3 * t]) n++;
        out[count++] = (RowBlock){t, n};
        t += n;
    }
    return count;
}

int attention_plan(AttnPlan *p, const Attn *a, int64_t T, int threads) {
    *p = (AttnPlan){0};
    if (a->D % 8 != 0 || a->D > 256 || a->H % a->Hkv != 0) return -2;
    int64_t longest = 1, work = 0;
    for (int64_t t = 0; t < T; t++) {
        const int64_t n = a->rows[3 * t + 2] - a->rows[3 * t + 1];
        longest = n > longest ? n : longest;
        work += n > 0 ? n : 0;
    }
    longest += 1; /* the last slot of each (row, head) holds its softmax sum */
    if (work * a->H * a->D < 65536) threads = 1; /* a fork costs more than the work */
    const int64_t per_thread = ROWS * a->H * (longest + a->D);
    float *scratch = malloc(sizeof(float) * (size_t)per_thread * (size_t)threads);
    RowBlock *blocks = malloc(sizeof(RowBlock) * (size_t)(T > 0 ? T : 1));
    Item *items = malloc(sizeof(Item) * (size_t)(T > 0 ? T : 1) * (size_t)a->Hkv);
    if (scratch == NULL || blocks == NULL || items == NULL) {
        free(scratch);
        free(blocks);
        free(items);
        return -1;
    }
    /* Work items: a row block and a range of its KV heads. A one-row block (a decode)
     * takes all its heads, so each key's K and V (Hkv * D floats) are read in one
     * contiguous piece instead of D of every Hkv * D floats per head (1.1-1.2x on decode
     * steps of 8-32 sequences, bench/bench_kernel_ab.py --attention); unless there are
     * fewer such blocks than two per thread, when the heads are split to give every
     * thread work (a step of one decode row goes by phases instead, see LONE). A block
     * of several rows (a prefill chunk) is split by head: its rows share each key load
     * already, and its scores for all heads would not stay in L2.
     * Which item computes a (row, head) changes none of its float operations. */
    const int64_t nb = row_blocks(a, T, blocks);
    const int whole = threads == 1 || nb >= 2 * threads;
    int64_t n_items = 0;
    for (int64_t i = 0; i < nb; i++) {
        const int64_t split = whole && blocks[i].count == 1 ? 1 : a->Hkv;
        for (int64_t k = 0; k < split; k++)
            items[n_items++] = (Item){i, k * (a->Hkv / split), a->Hkv / split};
    }
    const int wide = (a->D == 64 || a->D == 128) && wide_supported();
    const int lone = T == 1 && threads >= TEAM_MIN_THREADS && a->rows[2] > a->rows[1];
    *p = (AttnPlan){longest, per_thread, n_items, blocks, items, scratch, threads, wide, lone};
    return 0;
}

void attention_team(const AttnPlan *p, const Attn *a) {
    const RowBlock *blocks = p->blocks;
    const Item *items = p->items;
    if (p->lone) {
        lone_team(p, a);
        return;
    }
    if (p->threads == 1) {
#pragma omp single
        for (int64_t i = 0; i < p->n_items; i++)
            attend_item(p, a, blocks[items[i].block], items[i].g, items[i].ng, p->scratch);
        return;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < p->n_items; i++)
        attend_item(p, a, blocks[items[i].block], items[i].g, items[i].ng,
                    p->scratch + (int64_t)THREAD_ME * p->per_thread);
}

void attention_plan_free(AttnPlan *p) {
    free(p->items);
    free(p->blocks);
    free(p->scratch);
    *p = (AttnPlan){0};
}

/* Returns 0; -1 when the scratch could not be allocated (nothing written then); -2 for a
 * head size the kernel cannot take. */
int paged_attention(const Attn *a, int64_t T, int threads) {
    AttnPlan p;
    const int rc = attention_plan(&p, a, T, threads);
    if (rc != 0) return rc;
#pragma omp parallel num_threads(p.threads)
    {
        PHASE_START(1);
        attention_team(&p, a);
    }
    attention_plan_free(&p);
    return 0;
}

/* n floats (a multiple of 8) into fp16, rounded to nearest even as torch's .to(float16)
 * rounds (an fp32 beyond fp16's range becomes an infinity in both). */
INLINE void store_f16(uint16_t *out, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

/* n consecutive heads of x rotated into out (which may be x): rotate-half RoPE, x * cos
 * + rotate_half(x) * sin, as HF and model/layers.py compute it (a product, a product, a
 * sum), with c, s the position's [D] cos and sin. */
INLINE void rope_heads(const float *x, float *out, int64_t n, int64_t D, const float *c,
                       const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < n; h++, x += D, out += D) {
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            out[i] = x1 * c[i] + (-x2) * s[i];
            out[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
}

/* n values of x (a multiple of 8 when kv16) into a cache at element `at`. */
INLINE void write_kv(void *cache, int64_t at, const float *x, int64_t n, int kv16) {
    if (kv16) store_f16((uint16_t *)cache + at, x, n);
    else memcpy((float *)cache + at, x, sizeof(float) * (size_t)n);
}

/* qkv rows [T][ld]: H query heads, then Hkv key heads, then Hkv value heads, D each.
 * Rotates q and k in place (rope_heads) at positions[t], then copies k and v into slot
 * slots[t] of the cache (kv16: rounded to fp16). cos, sin: [max_positions][D]. */
KERNEL void rope_write_kv(float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv,
                          int64_t D, const int64_t *positions, const float *cos,
                          const float *sin, void *kc, void *vc, int kv16,
                          const int64_t *slots) {
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * ld;
        rope_heads(row, row, H + Hkv, D, cos + positions[t] * D, sin + positions[t] * D);
        const int64_t at = slots[t] * Hkv * D;
        write_kv(kc, at, row + H * D, Hkv * D, kv16);
        write_kv(vc, at, row + (H + Hkv) * D, Hkv * D, kv16);
    }
}

/* LONE_ROPE: a LONE step's RoPE and KV write with no thread doing them for the team and
 * no barrier after them. Thread c rotates every query head of the row into q (its own
 * [H][D]: the scores of its keys need them all), and writes only what of the new token's
 * K and V its own phases of this layer's attention read: the K record when the new key
 * (the row's last) is in its score range (lone_score_part's split; rotated into q after
 * the query heads: q has room for H + Hkv heads), and its lanes of the V record
 * (lone_value_lanes' split). Before, one thread did all of it (`omp single`)
 * and the team waited at a barrier, then read the rotated q and the new K across cores.
 * Every value written is rope_write_kv's (the same rope_heads, the same rounding). */
KERNEL void lone_rope_write_kv(const AttnPlan *p, const Attn *a, const float *qkv,
                               int64_t position, const float *cos, const float *sin,
                               int64_t slot, float *q, int64_t c) {
    const int64_t P = p->threads, H = a->H, Hkv = a->Hkv, D = a->D;
    const float *cs = cos + position * D, *sn = sin + position * D;
    const int64_t start = a->rows[1], last = a->rows[2] - 1, groups = (last - start + 8) / 8;
    const int64_t lo = start + c * groups / P * 8, hi = start + (c + 1) * groups / P * 8;
    const int64_t at = slot * Hkv * D;
    const int key = last >= lo && last < hi; /* the new key is among this thread's */
    rope_heads(qkv, q, key ? H + Hkv : H, D, cs, sn);
    if (key) write_kv((void *)a->kc, at, q + H * D, Hkv * D, a->kv16);
    const int64_t vecs = Hkv * D / 8, first = c * vecs / P * 8, end = (c + 1) * vecs / P * 8;
    write_kv((void *)a->vc, at + first, qkv + (H + Hkv) * D + first, end - first, a->kv16);
}
