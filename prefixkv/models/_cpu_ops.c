/* prefixkv.models._cpu_ops: the decoder's elementwise steps fused, on CPU, float32, AVX-512.
 *
 * torch runs RMSNorm as six ops (pow, mean, add, rsqrt, mul, mul), SwiGLU's silu(gate) * up as
 * two and HF's RoPE as five, each a pass over memory plus ~1.5-3 us of dispatch: at decode
 * (one row) the dispatch is the cost, at prefill (thousands of rows) the passes are. Each
 * function here is one pass, rows split over torch's own OpenMP team when there are many
 * (the extension links libgomp by soname, so it shares the runtime torch loaded).
 *
 * supported() -> bool
 *     whether this CPU and build run the functions (x86-64 with AVX-512F/DQ).
 * rms_norm(x, x_st, res, res_st, out, out_st, w, rows, dim, eps, threads[, heads]) -> None
 *     per row r and head h < heads (default 1; heads of ``dim`` adjacent in a row, as Qwen3's
 *     q/k norms read the fused qkv output): res != 0: x[r, h] += res[r, h] first (in place: x
 *     becomes the residual stream). Then out[r, h] = x[r, h] / sqrt(mean(x[r, h]**2) + eps) * w.
 *     Without res, out may be x itself (each element is read before it is written); with res
 *     it must not overlap x.
 * scatter_rows(src, src_st, dst, slots, n, width, dst_rows) -> None
 *     row i of ``src`` (``width`` floats, rows ``src_st`` apart) to row slots[i] of ``dst``
 *     (contiguous rows of ``width``), i < n; ``slots`` int64. IndexError, nothing written, if a
 *     slot is outside [0, dst_rows). A step's new K or V into the pool (index_copy_'s work
 *     without its dispatch); any CPU, any float32 layout.
 * silu_mul(gu, gu_st, out, out_st, rows, inter, threads) -> None
 *     out[r, i] = silu(gu[r, i]) * gu[r, inter + i] (gate and up side by side, as the fused
 *     gate_up matmul writes them).
 * rope(x, x_st, cos, sin, cs_st, rows, heads, dim, threads) -> None
 *     in place, per row r and head h (heads of ``dim`` adjacent, a row ``x_st`` apart):
 *     a, b = halves; a' = a cos - b sin, b' = b cos + a sin, with cos / sin [rows][dim] whose
 *     halves are equal (cat(freqs, freqs)), as HF's rotate_half form computes.
 * Addresses are ints, strides in floats; the caller (cpu_ops.py) checks shapes and strides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define HAVE_OPS 1
#include <immintrin.h>
#include <omp.h>
#include "_avx512.h"
#else
#define HAVE_OPS 0
#endif

#define PARALLEL_MIN 32768 /* elements below which one thread does it (dispatch costs more) */

#if HAVE_OPS
static int cpu_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

/* e**x for float32: 2**(x log2 e) by exp2_ps (x above 88 clamped there, below about -87.3 to
 * 2**-126). */
AVX512 static inline __m512 exp_ps(__m512 x)
{
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    return exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

AVX512 static void rms_row(float *x, const float *res, float *out, const float *w, long dim,
                           float eps)
{
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < dim; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        if (res) {
            v = _mm512_add_ps(v, _mm512_loadu_ps(res + i));
            _mm512_storeu_ps(x + i, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps);
    __m512 s = _mm512_set1_ps(inv);
    for (long i = 0; i < dim; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), s),
                                                _mm512_loadu_ps(w + i)));
}

AVX512 static void silu_row(const float *gu, float *out, long inter)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    for (long i = 0; i < inter; i += 16) {
        __m512 g = _mm512_loadu_ps(gu + i);
        __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(gu + inter + i)));
    }
}

AVX512 static void rope_row(float *x, const float *c, const float *s, long heads, long dim)
{
    long half = dim / 2;
    for (long h = 0; h < heads; h++) {
        float *a = x + h * dim, *b = a + half;
        for (long i = 0; i < half; i += 16) {
            __m512 av = _mm512_loadu_ps(a + i), bv = _mm512_loadu_ps(b + i);
            __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
            _mm512_storeu_ps(a + i, _mm512_fnmadd_ps(bv, sv, _mm512_mul_ps(av, cv)));
            _mm512_storeu_ps(b + i, _mm512_fmadd_ps(av, sv, _mm512_mul_ps(bv, cv)));
        }
    }
}
#endif

static PyObject *supported(PyObject *self, PyObject *noargs)
{
#if HAVE_OPS
    if (cpu_ok())
        Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

static PyObject *rms_norm(PyObject *self, PyObject *args)
{
#if HAVE_OPS
    unsigned long long x, res, out, w;
    long x_st, res_st, out_st, rows, dim, threads, heads = 1;
    double eps;
    if (!PyArg_ParseTuple(args, "KlKlKlKlldl|l", &x, &x_st, &res, &res_st, &out, &out_st, &w,
                          &rows, &dim, &eps, &threads, &heads))
        return NULL;
    if (!cpu_ok() || rows < 1 || heads < 1 || dim < 16 || dim % 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: unsupported arguments");
        return NULL;
    }
    long n = rows * heads; /* a norm per head of dim, heads adjacent in a row */
    int nt = n * dim >= PARALLEL_MIN ? (int)threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long i = 0; i < n; i++) {
        long r = i / heads, h = (i % heads) * dim;
        rms_row((float *)x + r * x_st + h, res ? (const float *)res + r * res_st + h : NULL,
                (float *)out + r * out_st + h, (const float *)w, dim, (float)eps);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this platform");
    return NULL;
#endif
}

static PyObject *scatter_rows(PyObject *self, PyObject *args)
{
    unsigned long long src, dst, slots;
    long src_st, n, width, dst_rows;
    if (!PyArg_ParseTuple(args, "KlKKlll", &src, &src_st, &dst, &slots, &n, &width, &dst_rows))
        return NULL;
    const int64_t *at = (const int64_t *)slots;
    if (n < 0 || width < 1 || dst_rows < 0) {
        PyErr_SetString(PyExc_ValueError, "scatter_rows: unsupported arguments");
        return NULL;
    }
    for (long i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= dst_rows) {
            PyErr_Format(PyExc_IndexError, "scatter_rows: slot %lld out of [0, %ld)",
                         (long long)at[i], dst_rows);
            return NULL;
        }
    for (long i = 0; i < n; i++)
        memcpy((float *)dst + at[i] * width, (const float *)src + i * src_st,
               (size_t)width * sizeof(float));
    Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *args)
{
#if HAVE_OPS
    unsigned long long gu, out;
    long gu_st, out_st, rows, inter, threads;
    if (!PyArg_ParseTuple(args, "KlKllll", &gu, &gu_st, &out, &out_st, &rows, &inter, &threads))
        return NULL;
    if (!cpu_ok() || rows < 1 || inter < 16 || inter % 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: unsupported arguments");
        return NULL;
    }
    int nt = rows * inter >= PARALLEL_MIN ? (int)threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long r = 0; r < rows; r++)
        silu_row((const float *)gu + r * gu_st, (float *)out + r * out_st, inter);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this platform");
    return NULL;
#endif
}

static PyObject *rope(PyObject *self, PyObject *args)
{
#if HAVE_OPS
    unsigned long long x, c, s;
    long x_st, cs_st, rows, heads, dim, threads;
    if (!PyArg_ParseTuple(args, "KlKKlllll", &x, &x_st, &c, &s, &cs_st, &rows, &heads, &dim,
                          &threads))
        return NULL;
    if (!cpu_ok() || rows < 1 || heads < 1 || dim < 32 || dim % 32 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rope: unsupported arguments");
        return NULL;
    }
    int nt = rows * heads * dim >= PARALLEL_MIN ? (int)threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long r = 0; r < rows; r++)
        rope_row((float *)x + r * x_st, (const float *)c + r * cs_st,
                 (const float *)s + r * cs_st, heads, dim);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this platform");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU and build run the functions."},
    {"rms_norm", rms_norm, METH_VARARGS, "RMSNorm of rows (after adding a residual), float32."},
    {"scatter_rows", scatter_rows, METH_VARARGS, "Rows of floats to the given rows of a table (a step's K or V into the pool)."},
    {"silu_mul", silu_mul, METH_VARARGS, "silu(gate) * up of fused gate/up rows, float32."},
    {"rope", rope, METH_VARARGS, "HF RoPE in place on rows of heads, float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_ops", "The decoder's elementwise steps fused (CPU, float32, AVX-512).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_ops(void)
{
    return PyModule_Create(&module);
}
