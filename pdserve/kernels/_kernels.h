/* Shared by the compiled kernels (_kernels.c: quantized products, the layer loop, decode
 * bursts; _attention.c: attention over the paged KV cache, RoPE and the KV write;
 * _int8.c: int8-activation products) and the module's Python bindings (_bindings.c).
 *
 * Everything here is deterministic: the same inputs give the same bits, whatever the
 * batch or the thread split (the files are built with -ffp-contract=off, so the only
 * fused multiply-adds are the explicit ones). */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define KERNEL __attribute__((target("avx2,fma,f16c")))
#define KERNEL_WIDE __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
#define INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

INLINE float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

INLINE float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* e^x, 8 lanes, within ~2 ulp of expf (Cephes' range reduction and polynomial); inputs
 * are clamped to [-87.3, 88.3], so the result is finite and > 0. */
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    /* 2^n: n is in [-126, 128) after the clamp; 2^128 is reached by two steps. */
    const __m256i e = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(e, 1);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* Lanes [0, n) set, n in [0, 8]: the mask of a tail's masked loads and stores. */
INLINE __m256i tail_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}

/* The team's step (fused_layers_team) runs from this many threads. A development
 * build with -DTEAM_MIN_THREADS=1 runs it, its LONE attention included, on one thread:
 * one core streaming the whole step with no other core to hand over to - what a core
 * of a two-CCD step would cost with nothing to wait for (bench_kernel_ab.py --step
 * --threads 1, with AB_CFLAGS_A and AB_CFLAGS_B=-DTEAM_MIN_THREADS=1). */
#ifndef TEAM_MIN_THREADS
#define TEAM_MIN_THREADS 2
#endif

/* Work items [0, n) in contiguous runs, one per thread, that a thread walks front to
 * back - so a thread reads its weights as one sequential stream, which the hardware
 * prefetcher follows (interleaved streams and dynamic chunks halved a cold GEMV's
 * bandwidth) - and that a thread done with its own run steals from, one item at a time
 * from the back of the run with the most left - so a thread that loses its core holds
 * back a few items, not its whole run (a static split once made a 0.1 ms product take 8
 * ms while another process ran). Each run is one 64-bit word, next item in the low half
 * and end in the high half, changed only by compare-and-swap: an item is taken once. The
 * words are a cache line apart (a run's owner updates it once per claim; sharing a line
 * with the other runs' words made the exact kernel's GEMV pass slower than dynamic
 * chunks).
 *
 * CLAIM: an owner takes its own items CLAIM at a time, one compare-and-swap per claim.
 * A locked instruction waits for the stores before it, and an item's last act is to
 * store its outputs, lines the other thread read in the op before: with a CAS an item,
 * each waited for those lines to be taken back from the other core. Across two CCDs
 * that was ~120 ns an item (a b=1 step's ~320 items a layer): with weights hot in
 * cache, a layer took 69-78 us on two CCDs against 41-44 on one, and 53 with claims of 8
 * (37-38 on one). A thread that loses its core then holds back up to CLAIM - 1 items it
 * has not begun, besides the one it is in. */
#define RUN_STRIDE 8 /* uint64_t words: 64 bytes */
#ifndef CLAIM
#define CLAIM 8
#endif
typedef struct {
    uint64_t *runs;
    int parts;
} Runs;

/* One thread's place in its claim: items [next, next + left) are its own to run. */
typedef struct {
    int64_t next, left;
} Claim;

/* runs: parts * RUN_STRIDE words (parts >= 1); n < 2^32. */
static inline Runs runs_init(uint64_t *runs, int parts, int64_t n) {
    for (int p = 0; p < parts; p++) {
        const uint64_t lo = (uint64_t)(n * p / parts), hi = (uint64_t)(n * (p + 1) / parts);
        runs[p * RUN_STRIDE] = hi << 32 | lo;
    }
    return (Runs){runs, parts};
}

/* Up to CLAIM items from the front of thread me's own run into c; 0 when it is empty. */
static inline int64_t runs_claim(Runs r, int me, Claim *c) {
    uint64_t *word = &r.runs[me % r.parts * RUN_STRIDE];
    uint64_t v = __atomic_load_n(word, __ATOMIC_RELAXED);
    while ((uint32_t)v < (v >> 32)) {
        const uint64_t left = (v >> 32) - (uint32_t)v, n = left < CLAIM ? left : CLAIM;
        if (__atomic_compare_exchange_n(word, &v, v + n, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *c = (Claim){(int64_t)(uint32_t)v, (int64_t)n};
            return (int64_t)n;
        }
    }
    return 0;
}

/* One item from the back of the run with the most left, or -1 when none is left. */
static inline int64_t runs_steal(Runs r) {
    for (;;) {
        int victim = -1;
        uint64_t most = 0;
        for (int p = 0; p < r.parts; p++) {
            const uint64_t w = __atomic_load_n(&r.runs[p * RUN_STRIDE], __ATOMIC_RELAXED);
            const uint64_t left = (w >> 32) > (uint32_t)w ? (w >> 32) - (uint32_t)w : 0;
            if (left > most) most = left, victim = p;
        }
        if (victim < 0) return -1;
        uint64_t w = __atomic_load_n(&r.runs[victim * RUN_STRIDE], __ATOMIC_RELAXED);
        while ((uint32_t)w < (w >> 32))
            if (__atomic_compare_exchange_n(&r.runs[victim * RUN_STRIDE], &w, w - ((uint64_t)1 << 32), 1,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                return (int64_t)(w >> 32) - 1;
    }
}

/* The next item for thread `me` (its claim, then its own run, then a steal), or -1 when
 * none is left. c: the thread's claim in these runs, {0, 0} before its first call. */
static inline int64_t runs_take(Runs r, int me, Claim *c) {
    if (c->left == 0 && runs_claim(r, me, c) == 0) return runs_steal(r);
    c->left--;
    return c->next++;
}

/* The calling thread's number in its OpenMP team (0 in a build without OpenMP). */
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ME omp_get_thread_num()
#else
#define THREAD_ME 0
#endif

/* BODY for every item of [0, n) on `threads` OpenMP threads, each walking its run (Runs
 * above); `item` names the item (int64_t) in BODY. */
#define FOR_EACH_RUN_ITEM(threads, n, item, BODY)                                      \
    do {                                                                               \
        const int threads_ = (threads);                                                \
        uint64_t words_[threads_ * RUN_STRIDE] __attribute__((aligned(64)));           \
        const Runs runs_ = runs_init(words_, threads_, (n));                           \
        _Pragma("omp parallel num_threads(threads_)") {                                \
            Claim claim_ = {0, 0};                                                     \
            for (int64_t item; (item = runs_take(runs_, THREAD_ME, &claim_)) >= 0;) BODY; \
        }                                                                              \
    } while (0)

/* Dynamic-schedule chunk: `tiles` in about threads * per_thread chunks. */
static inline int64_t chunk_of(int64_t tiles, int threads, int per_thread) {
    const int64_t chunk = tiles / ((int64_t)threads * per_thread);
    return chunk < 1 ? 1 : chunk;
}

/* Attention over the paged cache (_attention.c); see there for the layout. */
typedef struct {
    const float *q;       /* query of row t, head h: q + t * ldq + h * D */
    int64_t ldq;
    const void *kc, *vc; /* [slots][Hkv][D], fp32 or (kv16) fp16 */
    int64_t H, Hkv, D, bs;
    const int32_t *rows;   /* [T][3]: sequence, first key, end key (exclusive) */
    const int32_t *tables; /* [S][ldt]: each sequence's block ids */
    int64_t ldt;
    float *out; /* row t, head h: out + t * ldo + h * D */
    int64_t ldo;
    float scale;
    int kv16; /* the cache holds fp16 (read widened to fp32) */
} Attn;

int paged_attention(const Attn *a, int64_t T, int threads);

/* How paged_attention splits a step's rows into work items, planned once per step: the
 * rows and tables are every layer's, so a step's layers share one plan (fused_layers).
 * `threads`: the team that will run it (1 when the work is too small to share). */
typedef struct {
    int64_t longest;     /* the longest key range + 1 (a softmax sum's slot) */
    int64_t per_thread;  /* scratch floats per thread */
    int64_t n_items;
    void *blocks, *items; /* the row blocks and items (_attention.c) */
    float *scratch;      /* threads x per_thread */
    int threads;
    int wide;            /* prefill row blocks take attend_wide (_attention.c, WIDE) */
    int lone;            /* one decode row on several threads, in phases (_attention.c, LONE) */
} AttnPlan;
/* Returns 0; -1 when memory could not be allocated (nothing to free then); -2 for a head
 * size the kernel cannot take. Only a's shape, rows and tables are read. */
int attention_plan(AttnPlan *p, const Attn *a, int64_t T, int threads);
/* The plan's items for a (a layer's q, caches and output) - called by every thread of a
 * running team of p->threads threads or fewer (an orphaned `omp for`; ends in a barrier). */
void attention_team(const AttnPlan *p, const Attn *a);
void attention_plan_free(AttnPlan *p);
/* A LONE plan's thread c reads its part of the KV `a` will attend (nothing for another
 * plan); returns a sum of what it read, for the caller to keep. */
float attention_warm(const AttnPlan *p, const Attn *a, int64_t c);
void rope_write_kv(float *qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                   const int64_t *positions, const float *cos, const float *sin, void *kc,
                   void *vc, int kv16, const int64_t *slots);
/* A LONE plan's RoPE and KV write, thread c's share (_attention.c, LONE_ROPE): every query
 * head of the row's qkv rotated into q ([H + Hkv][D] room), what of the new token's K and
 * V thread c's attention phases read written into a's caches at `slot`. */
void lone_rope_write_kv(const AttnPlan *p, const Attn *a, const float *qkv, int64_t position,
                        const float *cos, const float *sin, int64_t slot, float *q, int64_t c);

/* The int8-activation products (_int8.c): whether this CPU has what they need (AVX2, FMA
 * and F16C; AVX-512 F/BW/VL/DQ and VNNI for the faster build), which build it runs
 * ("avx512-vnni", "avx2", "" for none; INT8_ENV=avx2 takes the AVX2 one on any CPU that
 * has it), and y (+)= x @ W^T for a weight packed by linear.py's pack_int8. */
#define INT8_ENV "PDSERVE_INT8_KERNEL"
int int8_supported(void);
const char *int8_build(void);
int qlinear_int8(const uint8_t *W, int kind, int64_t N, int64_t K, const float *x,
                 int64_t ldx, int64_t M, float *y, int64_t ldy, int accumulate, int threads);

/* The fp32 products for full-precision weights (_dense.c): y (+)= x @ W^T for W packed
 * into panels of 16 columns (linear.py's pack_dense); one panel p against M rows (a
 * caller that runs its own thread team: fused_layers); which build runs ("avx512",
 * "avx2"; DENSE_ENV=avx2 takes the AVX2 one on any CPU). */
#define DENSE_ENV "PDSERVE_DENSE_KERNEL"
void dense_linear(const float *W, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                  float *y, int64_t ldy, int acc, int threads);
void dense_panel(const float *W, int64_t N, int64_t K, const float *x, int64_t ldx, int64_t M,
                 int64_t p, float *y, int64_t ldy, int acc);
const char *dense_build(void);

/* Rows of activations rounded to int8 (see _int8.c) and their scales; room for M rows of
 * up to `cap` values: q [M][cap] bytes, d and s [M][cap / 32] floats, h [M][cap / 16],
 * n [M][cap / 16] int32. rows8_init allocates that (0, or -1 with nothing held). */
typedef struct {
    int8_t *q;
    float *d, *s, *h;
    int32_t *n;
    int64_t K, B; /* the values per row now held, K / 32 */
} Rows8;
int rows8_init(Rows8 *r, int64_t rows, int64_t cap);
void rows8_free(Rows8 *r);
/* The pieces of qlinear_int8 a caller that runs its own thread team uses (fused_layers):
 * rows [0, M) of x rounded into r (one thread), and y (+)= those rows times the 16
 * output columns of group g (one thread; N: W's columns). */
void int8_round_rows(const float *x, int64_t ldx, int64_t M, int64_t K, Rows8 *r);
void int8_group(const uint8_t *W, int kind, const Rows8 *a, int64_t M, int64_t g, float *y,
                int64_t ldy, int64_t N, int accumulate);

/* ---- the products and the layer loop (_kernels.c), as the bindings call them --------- */

#define QK 32 /* values per block */

enum { I8 = 0, Q4 = 1, Q4M = 2, I8_16 = 3, U8M = 4 }; /* the layouts; formats.Layout */

typedef struct {
    int type; /* the layout */
    const uint8_t *qs;
    const float *d; /* block scales (I8_16: two per block of 32) */
    const float *m; /* block minimums (Q4M, U8M); else NULL */
    int64_t N, K, B;   /* B = K / 32 blocks per row */
} QWeight;

/* x itself; RMSNorm(x) * w; or SwiGLU, silu(gate) * up, of a row that holds gate in
 * x[0, K) and up in x[K, 2K) (the fused gate/up projection's output). Fused so the
 * caller makes no separate pass (and no Python op) for them. */
enum { PRE_NONE = 0, PRE_RMSNORM = 1, PRE_SWIGLU = 2 };
typedef struct {
    int kind;
    const float *w; /* RMSNorm weight [K] */
    float eps;
} Prologue;

/* The layer loop's view of a model, written by pdserve/model/fused.py (every field 8
 * bytes, in this order). A part is one kernel call of a projection, as QuantLinear's
 * `_calls` hold them: layout >= 0 the exact kernel (qs, fp32 scales d and minimums m),
 * layout -1 the int8 kernel (qs the records, d their kind), layout -2 (PART_DENSE) the fp32
 * panels (qs, _dense.c); its output columns start at
 * byte `offset` of a row. */
typedef struct {
    int64_t layout, qs, d, m, rows, offset;
} Part;
#define PART_INT8 (-1)
#define PART_DENSE (-2)

#define MAX_PARTS 3 /* a part per run of one format: q, k, v at most */
typedef struct {
    int64_t parts, N, K, bias; /* bias: fp32 [N] or 0 */
    Part part[MAX_PARTS];
} Op;

typedef struct {
    Op qkv, o, gate_up, down;
    int64_t norm1, norm2; /* RMSNorm weights, fp32 [hidden] */
    double eps1, eps2;
    int64_t H, Hkv, D;
    double scale;
} Layer;

/* The step's inputs to every layer (see py_fused_layers, _bindings.c). */
typedef struct {
    float *h; /* [T][hidden], updated in place */
    int64_t T;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    void *kv;          /* [layers][2][slots][Hkv][D], fp32 or (kv16) fp16 */
    int64_t kv_layer;  /* elements from one layer's K to its V (and V to the next K) */
    int64_t bs;
    const int32_t *rows, *tables;
    int64_t ldt;
    float *qkv, *att, *gate_up; /* scratch: [T][qkv N], [T][H D], [T][gate_up N] */
    int kv16;
} Step;

/* What follows the layers in the same call: the final RMSNorm of the rows that sample and
 * the LM head over them (see py_fused_layers, _bindings.c). */
typedef struct {
    Prologue norm;       /* PRE_RMSNORM with the final norm's weight and eps */
    const int64_t *rows; /* [n] rows of h, each in [0, T) */
    int64_t n;
    float *hidden;       /* [n][hidden]: RMSNorm(h[rows[i]]) * w */
    const Op *head;      /* NULL: no LM head here */
    float *logits;       /* [n][head N] */
    int64_t *argmax;     /* [n]: each row's argmax_row of its logits; NULL: not asked */
} Tail;

/* What a burst reads besides one step's inputs. Step k (k < steps) of T rows, one decode
 * row per sequence: its tokens are tokens[k] ([steps + 1][T]), its positions, slots and
 * key ranges the k-th [T] (or [T][3]) of each array, and its argmax goes to
 * tokens[k + 1]: the next step's input. */
typedef struct {
    const int64_t *positions, *slots; /* [steps][T] */
    const int32_t *rows;              /* [steps][T][3] */
    int64_t *tokens;                  /* [steps + 1][T] */
    int64_t steps;
    const int64_t *stop; /* [n_stop]: a step that samples one of these ends the burst */
    int64_t n_stop;
    QWeight embed;       /* the token embedding; type -1: fp32 rows at embed.qs */
} Burst;

/* y (+)= P(x) @ W^T (the exact kernel) and, for W packed by pack_int8, with P(x) rounded
 * to int8 (qlinear_int8). Return -1 when scratch memory could not be allocated. */
int qlinear(const QWeight *w, const Prologue *pre, const float *x, int64_t ldx, int64_t M,
            float *y, int64_t ldy, int acc, int threads);
int qlinear_int8_pre(const uint8_t *W, int kind, int64_t N, int64_t K, const Prologue *pre,
                     const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int acc,
                     int threads);
int dense_linear_pre(const float *W, int64_t N, int64_t K, const Prologue *pre, const float *x,
                     int64_t ldx, int64_t M, float *y, int64_t ldy, int acc, int threads);
/* DecoderLayer.forward_fused for layers [0, n), then the tail; 0, -1 (no memory) or
 * another code (a head size the attention cannot take). */
int fused_layers(const Layer *layers, int64_t n, const Step *s, const Tail *tail, int threads);
/* Up to b->steps greedy decode steps; returns the steps run, *rc as fused_layers'. */
int64_t decode_burst(const Layer *layers, int64_t n, const Step *s0, const Tail *t0,
                     const Burst *b, int threads, int *rc);
/* out[i] = the prologue of row rows[i] of x; each row's argmax; token embeddings. */
void norm_rows_of(const Prologue *pre, const float *x, int64_t ldx, const int64_t *rows,
                  int64_t n, int64_t K, float *out);
void argmax_rows(const float *x, int64_t ld, int64_t rows, int64_t n, int64_t *out);
void embed_ids(const QWeight *w, const int64_t *ids, int64_t n, float *out);

/* PHASES (a development build: -DPHASES, e.g. AB_CFLAGS_B=-DPHASES with
 * bench/bench_kernel_ab.py --step): thread 0 of fused_layers_team adds the time since its
 * last mark to phase k at PHASE(k) - each mark stands after a barrier, so a phase is the
 * team's - and the module prints each phase's time per call when the process exits.
 * Phases: 0 q/k/v, 1 RoPE + KV write (in a LONE step thread 0's own share, with no
 * barrier after it: LONE_ROPE), 2-4 the LONE attention's scores, softmax and
 * values (a step of 2-3 rows marks none of them: its attention counts in o), 5 o, 6
 * gate/up, 7 down, 8 the final norm and LM head. Per call: per
 * fused_layers_team call, or where there was none (a harness of paged_attention alone)
 * per paged_attention call. */
#ifdef PHASES
#include <time.h>
extern double phase_ns[9], phase_t0;
extern long phase_calls[2]; /* fused_layers_team's, paged_attention's */
static inline double phase_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
#define PHASE(k)                                                   \
    do {                                                           \
        if (THREAD_ME == 0) {                                      \
            const double t_ = phase_now();                         \
            phase_ns[k] += t_ - phase_t0;                          \
            phase_t0 = t_;                                         \
        }                                                          \
    } while (0)
#define PHASE_START(which) \
    (THREAD_ME == 0 ? (void)(phase_t0 = phase_now(), phase_calls[which]++) : (void)0)
#else
#define PHASE(k) ((void)0)
#define PHASE_START(which) ((void)0)
#endif

#endif
