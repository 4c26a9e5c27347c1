/* The module's Python functions: each reads its arguments (integers - addresses from
 * torch's data_ptr(), sizes - and floats), refuses what it can check before anything
 * runs (sizes, layouts, ids out of range), and calls the kernel (_kernels.c,
 * _attention.c, _int8.c) with the GIL released. The callers (pdserve/quant/linear.py,
 * pdserve/model/attention.py and fused.py) check shapes, dtypes, contiguity and
 * lifetimes. The module loads only on a CPU with AVX2, FMA and F16C. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_kernels.h"

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

/* qlinear(layout, x, ldx, M, K, qs, d, m, N, y, ldy, threads, pre, pre_w, eps, accumulate):
 * y[M,N] = P(x)[M,K] @ W^T, or y += that with `accumulate`; P is the prologue `pre`
 * (PRE_NONE, PRE_RMSNORM with weight pre_w and eps, PRE_SWIGLU over rows of 2K).
 * Pointers are addresses (torch's data_ptr()); d and m are fp32; m is 0 except for the
 * layouts with minimums (Q4M, U8M). The caller checks
 * shapes, dtypes, contiguity and lifetimes (pdserve/quant/linear.py). K is a multiple
 * of 32. */
static PyObject *py_qlinear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[16];
    const int floats[] = {14};
    if (read_args(args, nargs, 16, v, floats, 1) < 0) return NULL;
    const int threads = v[11].i > 0 ? (int)v[11].i : 1;
    const int type = (int)v[0].i;
    const int64_t ldx = v[2].i, M = v[3].i, K = v[4].i, N = v[8].i, ldy = v[10].i;
    const Prologue pre = {(int)v[12].i, PTR(const float *, v[13]), (float)v[14].f};
    if (type < I8 || type > U8M || K % QK != 0 || M < 0 || N <= 0 || pre.kind < PRE_NONE ||
        pre.kind > PRE_SWIGLU || ((type == Q4M || type == U8M) && v[7].i == 0)) {
        PyErr_SetString(PyExc_ValueError, "qlinear: bad layout, shape, minimums or prologue");
        return NULL;
    }
    if (M == 0) Py_RETURN_NONE;
    const QWeight w = {type, PTR(const uint8_t *, v[5]), PTR(const float *, v[6]),
                       PTR(const float *, v[7]), N, K, K / QK};
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = qlinear(&w, &pre, PTR(const float *, v[1]), ldx, M, PTR(float *, v[9]), ldy,
                 v[15].i != 0, threads);
    Py_END_ALLOW_THREADS;
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* qlinear_int8(packed, kind, N, K, x, ldx, M, y, ldy, threads, pre, pre_w, eps,
 * accumulate): y[M,N] (+)= P(x)[M,K] @ W^T with P(x) rounded to int8 per 32 values
 * (_int8.c); `packed` is pack_int8's records of `kind` (0 bytes, 1 nibbles, 2 bytes with
 * a scale per 16; pdserve/quant/linear.py). The caller checks that int8_supported() and
 * the shapes, as for qlinear. */
static PyObject *py_qlinear_int8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[14];
    const int floats[] = {12};
    if (read_args(args, nargs, 14, v, floats, 1) < 0) return NULL;
    const int64_t N = v[2].i, K = v[3].i, ldx = v[5].i, M = v[6].i, ldy = v[8].i;
    const int threads = v[9].i > 0 ? (int)v[9].i : 1;
    const Prologue pre = {(int)v[10].i, PTR(const float *, v[11]), (float)v[12].f};
    if (!int8_supported() || K % QK != 0 || M < 0 || N <= 0 || pre.kind < PRE_NONE ||
        pre.kind > PRE_SWIGLU || v[1].i < 0 || v[1].i > 2) {
        PyErr_SetString(PyExc_ValueError, "qlinear_int8: no AVX2, or a bad shape or prologue");
        return NULL;
    }
    if (M == 0) Py_RETURN_NONE;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = qlinear_int8_pre(PTR(const uint8_t *, v[0]), (int)v[1].i, N, K, &pre,
                          PTR(const float *, v[4]), ldx, M, PTR(float *, v[7]), ldy,
                          v[13].i != 0, threads);
    Py_END_ALLOW_THREADS;
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* dense_linear(packed, N, K, x, ldx, M, y, ldy, threads, pre, pre_w, eps, accumulate):
 * y[M,N] (+)= P(x)[M,K] @ W^T for W packed into fp32 panels of 16 columns (_dense.c;
 * pdserve/quant/linear.py pack_dense). The caller checks the shapes, as for qlinear. */
static PyObject *py_dense_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[13];
    const int floats[] = {11};
    if (read_args(args, nargs, 13, v, floats, 1) < 0) return NULL;
    const int64_t N = v[1].i, K = v[2].i, ldx = v[4].i, M = v[5].i, ldy = v[7].i;
    const int threads = v[8].i > 0 ? (int)v[8].i : 1;
    const Prologue pre = {(int)v[9].i, PTR(const float *, v[10]), (float)v[11].f};
    if (K % QK != 0 || M < 0 || N <= 0 || pre.kind < PRE_NONE || pre.kind > PRE_SWIGLU) {
        PyErr_SetString(PyExc_ValueError, "dense_linear: a bad shape or prologue");
        return NULL;
    }
    if (M == 0) Py_RETURN_NONE;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = dense_linear_pre(PTR(const float *, v[0]), N, K, &pre, PTR(const float *, v[3]), ldx,
                          M, PTR(float *, v[6]), ldy, v[12].i != 0, threads);
    Py_END_ALLOW_THREADS;
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dense_build(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(dense_build());
}

/* 0 when every ids[i] (i < n) is in [0, bound); else -1 with an IndexError naming the
 * first one outside ("<fn>: <what> <id> is outside [0, <bound>)"). */
static int ids_within(const char *fn, const char *what, const int64_t *ids, int64_t n,
                      int64_t bound) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= bound) {
            PyErr_Format(PyExc_IndexError, "%s: %s %lld is outside [0, %lld)", fn, what,
                         (long long)ids[i], (long long)bound);
            return -1;
        }
    }
    return 0;
}

/* fused_layers(layers, n, h, T, positions, slots, cos, sin, kv, kv_layer, kv16, bs, rows,
 * tables, ldt, qkv, att, gate_up, threads, norm_w, eps, sample, n_sample, hidden, head,
 * logits, argmax):
 * DecoderLayer.forward_fused for n layers in one call (`layers`: n Layer records,
 * pdserve/model/fused.py; the rest up to `threads` as fused_layers' Step), then the tail:
 * hidden[i] = RMSNorm(h[sample[i]]) * norm_w for i < n_sample (sample int64, each in
 * [0, T), n_sample <= T), and with `head` (an Op record; 0 for none) logits = hidden @
 * head^T, and with `argmax` (int64 [n_sample]; 0 for none, and with no head) each logits
 * row's argmax (argmax_rows). A sample row outside [0, T) is refused before anything runs.
 * The caller checks every shape and keeps every tensor alive. */
static PyObject *py_fused_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[27];
    const int floats[] = {20};
    if (read_args(args, nargs, 27, v, floats, 1) < 0) return NULL;
    const Step s = {PTR(float *, v[2]), v[3].i, PTR(const int64_t *, v[4]),
                    PTR(const int64_t *, v[5]), PTR(const float *, v[6]),
                    PTR(const float *, v[7]), PTR(void *, v[8]), v[9].i, v[11].i,
                    PTR(const int32_t *, v[12]), PTR(const int32_t *, v[13]), v[14].i,
                    PTR(float *, v[15]), PTR(float *, v[16]), PTR(float *, v[17]),
                    v[10].i != 0};
    const int threads = v[18].i > 0 ? (int)v[18].i : 1;
    const Tail tail = {{PRE_RMSNORM, PTR(const float *, v[19]), (float)v[20].f},
                       PTR(const int64_t *, v[21]), v[22].i, PTR(float *, v[23]),
                       PTR(const Op *, v[24]), PTR(float *, v[25]), PTR(int64_t *, v[26])};
    if (tail.n < 0 || tail.n > s.T) {
        PyErr_Format(PyExc_ValueError, "fused_layers: %lld rows to sample, of %lld",
                     (long long)tail.n, (long long)s.T);
        return NULL;
    }
    if (ids_within("fused_layers", "row", tail.rows, tail.n, s.T) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = fused_layers(PTR(const Layer *, v[0]), v[1].i, &s, &tail, threads);
    Py_END_ALLOW_THREADS;
    if (rc == -1) return PyErr_NoMemory();
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, "fused_layers: a head size the attention cannot take");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* decode_burst(layers, n, h, T, positions, slots, cos, sin, kv, kv_layer, kv16, bs, rows,
 * tables, ldt, qkv, att, gate_up, threads, norm_w, eps, hidden, head, logits, embed_layout,
 * embed_qs, embed_d, embed_m, vocab, tokens, steps, stop, n_stop) -> the steps run:
 * `steps` greedy decode steps of T rows (one decode row per sequence) in one call
 * (decode_burst above). positions and slots are int64 [steps][T], rows int32
 * [steps][T][3] (each step's key ranges), tables its sequences' block tables covering
 * every step; tokens int64 [steps + 1][T], row 0 the first step's input ids (each in
 * [0, vocab), else IndexError before anything runs), rows 1 .. the steps' argmax; stop
 * int64 [n_stop]. The embedding: a quantized [vocab][K] weight (embed_layout, qs, d, m as
 * embed_rows takes them) or, with embed_layout -1, fp32 rows at embed_qs. head (an Op
 * record) is required; hidden [T][K] and logits [T][head N] are scratch. The caller
 * checks every shape and keeps every tensor alive. */
static PyObject *py_decode_burst(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[33];
    const int floats[] = {20};
    if (read_args(args, nargs, 33, v, floats, 1) < 0) return NULL;
    const int64_t T = v[3].i, vocab = v[28].i, steps = v[30].i, n_stop = v[32].i;
    const int64_t hidden = ((const Layer *)(intptr_t)v[0].i)->o.N;
    if (v[1].i <= 0 || T <= 0 || steps <= 0 || n_stop < 0 || vocab <= 0 || v[22].i == 0 ||
        v[24].i < -1 || v[24].i > U8M || (v[24].i >= 0 && hidden % QK != 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "decode_burst: layers, rows, steps and a head are required, and an "
                        "embedding layout -1 to 4");
        return NULL;
    }
    const Step s = {PTR(float *, v[2]), T, NULL, NULL, PTR(const float *, v[6]),
                    PTR(const float *, v[7]), PTR(void *, v[8]), v[9].i, v[11].i, NULL,
                    PTR(const int32_t *, v[13]), v[14].i, PTR(float *, v[15]),
                    PTR(float *, v[16]), PTR(float *, v[17]), v[10].i != 0};
    const Tail tail = {{PRE_RMSNORM, PTR(const float *, v[19]), (float)v[20].f}, NULL, T,
                       PTR(float *, v[21]), PTR(const Op *, v[22]), PTR(float *, v[23]), NULL};
    const Burst b = {PTR(const int64_t *, v[4]), PTR(const int64_t *, v[5]),
                     PTR(const int32_t *, v[12]), PTR(int64_t *, v[29]), steps,
                     PTR(const int64_t *, v[31]), n_stop,
                     {(int)v[24].i, PTR(const uint8_t *, v[25]), PTR(const float *, v[26]),
                      PTR(const float *, v[27]), vocab, hidden, hidden / QK}};
    if (ids_within("decode_burst", "token id", b.tokens, T, vocab) < 0) return NULL;
    const int threads = v[18].i > 0 ? (int)v[18].i : 1;
    int rc;
    int64_t done;
    Py_BEGIN_ALLOW_THREADS;
    done = decode_burst(PTR(const Layer *, v[0]), v[1].i, &s, &tail, &b, threads, &rc);
    Py_END_ALLOW_THREADS;
    if (rc == -1) return PyErr_NoMemory();
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, "decode_burst: a head size the attention cannot take");
        return NULL;
    }
    return PyLong_FromLongLong(done);
}

/* argmax_rows(x, ld, rows, n, out): out[i] (int64) = the index of the first largest of the
 * first n floats of row i of x [rows][ld] (a NaN counting as the largest), i < rows: numpy's
 * argmax, as fused_layers takes it for a greedy step; bound so tests hold it to numpy's. */
static PyObject *py_argmax_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[5];
    if (read_args(args, nargs, 5, v, NULL, 0) < 0) return NULL;
    const int64_t ld = v[1].i, rows = v[2].i, n = v[3].i;
    if (n <= 0 || rows < 0 || ld < n) {
        PyErr_SetString(PyExc_ValueError, "argmax_rows: need 0 < n <= ld and rows >= 0");
        return NULL;
    }
    const float *x = PTR(const float *, v[0]);
    int64_t *out = PTR(int64_t *, v[4]);
    Py_BEGIN_ALLOW_THREADS;
    argmax_rows(x, ld, rows, n, out);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* rms_norm_rows(x, ldx, T, rows, n, K, w, eps, out): out[i] = RMSNorm(x[rows[i]]) * w for
 * i < n (x [T][ldx], rows int64, out [n][K] contiguous): the gather of the rows that
 * sample and the model's final norm in one call, the same operations as a projection's
 * RMSNorm prologue. A row outside [0, T) is refused before anything is written. One
 * thread: a step samples a row per sequence (at most a few hundred). */
static PyObject *py_rms_norm_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[9];
    const int floats[] = {7};
    if (read_args(args, nargs, 9, v, floats, 1) < 0) return NULL;
    const int64_t ldx = v[1].i, T = v[2].i, n = v[4].i, K = v[5].i;
    if (K <= 0 || K % 8 != 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm_rows: K must be a positive multiple of 8");
        return NULL;
    }
    const int64_t *rows = PTR(const int64_t *, v[3]);
    if (ids_within("rms_norm_rows", "row", rows, n, T) < 0) return NULL;
    const Prologue pre = {PRE_RMSNORM, PTR(const float *, v[6]), (float)v[7].f};
    const float *x = PTR(const float *, v[0]);
    float *out = PTR(float *, v[8]);
    Py_BEGIN_ALLOW_THREADS;
    norm_rows_of(&pre, x, ldx, rows, n, K, out);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* embed_rows(layout, qs, d, m, N, K, ids, n, out): out[i] = row ids[i] of the [N][K]
 * weight, dequantized (d, m: fp32 as the kernels read them; ids int64; out [n][K]): the
 * values QuantWeight.dequantize gives, bit for bit (weight_block). An id outside [0, N)
 * is refused before anything is written. A decode step's token embedding: the torch
 * ops that gathered and dequantized one row took ~0.13 ms of a b=1 step (cold caches). */
static PyObject *py_embed_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[9];
    if (read_args(args, nargs, 9, v, NULL, 0) < 0) return NULL;
    const int64_t N = v[4].i, K = v[5].i, n = v[7].i;
    if (v[0].i < I8 || v[0].i > U8M || K <= 0 || K % QK != 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "embed_rows: a layout 0-4 and K a positive multiple of 32");
        return NULL;
    }
    const int64_t *ids = PTR(const int64_t *, v[6]);
    if (ids_within("embed_rows", "token id", ids, n, N) < 0) return NULL;
    const QWeight w = {(int)v[0].i, PTR(const uint8_t *, v[1]), PTR(const float *, v[2]),
                       PTR(const float *, v[3]), N, K, K / QK};
    float *out = PTR(float *, v[8]);
    Py_BEGIN_ALLOW_THREADS;
    embed_ids(&w, ids, n, out);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *py_int8_supported(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(int8_supported());
}

static PyObject *py_int8_build(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(int8_build());
}

/* paged_attention(q, ldq, T, H, Hkv, D, k_cache, v_cache, kv16, bs, rows, tables, ldt,
 * out, ldo, scale, threads): see _attention.c. rows and tables are int32; kv16: the caches
 * are fp16 (else fp32). */
static PyObject *py_paged_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[17];
    const int floats[] = {15};
    if (read_args(args, nargs, 17, v, floats, 1) < 0) return NULL;
    const Attn a = {PTR(const float *, v[0]), v[1].i, PTR(const void *, v[6]),
                    PTR(const void *, v[7]), v[3].i, v[4].i, v[5].i, v[9].i,
                    PTR(const int32_t *, v[10]), PTR(const int32_t *, v[11]), v[12].i,
                    PTR(float *, v[13]), v[14].i, (float)v[15].f, v[8].i != 0};
    const int threads = v[16].i > 0 ? (int)v[16].i : 1;
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

/* rope_write_kv(qkv, ld, T, H, Hkv, D, positions, cos, sin, k_cache, v_cache, kv16,
 * slots): see _attention.c. positions and slots are int64; kv16: the caches are fp16. */
static PyObject *py_rope_write_kv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arg v[13];
    if (read_args(args, nargs, 13, v, NULL, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS;
    rope_write_kv(PTR(float *, v[0]), v[1].i, v[2].i, v[3].i, v[4].i, v[5].i,
                  PTR(const int64_t *, v[6]), PTR(const float *, v[7]), PTR(const float *, v[8]),
                  PTR(void *, v[9]), PTR(void *, v[10]), v[11].i != 0,
                  PTR(const int64_t *, v[12]));
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"qlinear", (PyCFunction)(void (*)(void))py_qlinear, METH_FASTCALL,
     "qlinear(layout, x, ldx, M, K, qs, d, m, N, y, ldy, threads, pre, pre_w, eps, accumulate):"
     " y (+)= P(x) @ W^T, W in GGUF blocks"},
    {"qlinear_int8", (PyCFunction)(void (*)(void))py_qlinear_int8, METH_FASTCALL,
     "qlinear_int8(packed, kind, N, K, x, ldx, M, y, ldy, threads, pre, pre_w, eps,"
     " accumulate): y (+)= int8(P(x)) @ W^T, W packed by pack_int8"},
    {"dense_linear", (PyCFunction)(void (*)(void))py_dense_linear, METH_FASTCALL,
     "dense_linear(packed, N, K, x, ldx, M, y, ldy, threads, pre, pre_w, eps, accumulate):"
     " y (+)= P(x) @ W^T, W fp32 in panels of 16 columns (pack_dense)"},
    {"dense_build", py_dense_build, METH_NOARGS,
     "the build of dense_linear this CPU runs: 'avx512', or 'avx2' (also where"
     " PDSERVE_DENSE_KERNEL=avx2)"},
    {"fused_layers", (PyCFunction)(void (*)(void))py_fused_layers, METH_FASTCALL,
     "fused_layers(layers, n, h, T, positions, slots, cos, sin, kv, kv_layer, kv16, bs, rows,"
     " tables, ldt, qkv, att, gate_up, threads, norm_w, eps, sample, n_sample, hidden, head, logits,"
     " argmax): n fused decoder layers, then the final norm and LM head of the rows that"
     " sample (and their argmax), in one call"},
    {"decode_burst", (PyCFunction)(void (*)(void))py_decode_burst, METH_FASTCALL,
     "decode_burst(layers, n, h, T, positions, slots, cos, sin, kv, kv_layer, kv16, bs, rows,"
     " tables, ldt, qkv, att, gate_up, threads, norm_w, eps, hidden, head, logits, embed_layout,"
     " embed_qs, embed_d, embed_m, vocab, tokens, steps, stop, n_stop): up to `steps` greedy"
     " decode steps in one call; returns the steps run"},
    {"argmax_rows", (PyCFunction)(void (*)(void))py_argmax_rows, METH_FASTCALL,
     "argmax_rows(x, ld, rows, n, out): each row's first largest (numpy's argmax)"},
    {"rms_norm_rows", (PyCFunction)(void (*)(void))py_rms_norm_rows, METH_FASTCALL,
     "rms_norm_rows(x, ldx, T, rows, n, K, w, eps, out): RMSNorm of the rows `rows` of x"},
    {"embed_rows", (PyCFunction)(void (*)(void))py_embed_rows, METH_FASTCALL,
     "embed_rows(layout, qs, d, m, N, K, ids, n, out): rows ids of a quantized weight,"
     " dequantized"},
    {"int8_supported", py_int8_supported, METH_NOARGS,
     "whether this CPU runs qlinear_int8 (AVX2, FMA and F16C)"},
    {"int8_build", py_int8_build, METH_NOARGS,
     "the build of qlinear_int8 this CPU runs: 'avx512-vnni', 'avx2' (also where"
     " PDSERVE_INT8_KERNEL=avx2), '' for none"},
    {"paged_attention", (PyCFunction)(void (*)(void))py_paged_attention, METH_FASTCALL,
     "paged_attention(q, ldq, T, H, Hkv, D, k_cache, v_cache, kv16, bs, rows, tables, ldt, out,"
     " ldo,"
     " scale, threads): each query row over its keys in the paged cache"},
    {"rope_write_kv", (PyCFunction)(void (*)(void))py_rope_write_kv, METH_FASTCALL,
     "rope_write_kv(qkv, ld, T, H, Hkv, D, positions, cos, sin, k_cache, v_cache, kv16, slots):"
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
