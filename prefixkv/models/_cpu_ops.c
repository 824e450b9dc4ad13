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
 * rope_cos_sin(pos, n, inv, half, cos, sin, threads) -> None
 *     the cos / sin rows rope() reads: row i (2 * half floats, halves equal) holds cos / sin of
 *     a = (float)pos[i] * inv[j] (the float32 product torch forms), j < half; ``pos`` int64,
 *     ``half`` a multiple of 16. Computed in double and rounded once (within an ulp of the
 *     exact value; torch's float32 SLEEF cos is within one too, so the two may differ by one).
 * gather_rows(src, src_rows, width, ids, n, dst) -> None
 *     row i of ``dst`` = row ids[i] of ``src`` (contiguous rows of ``width`` floats), i < n;
 *     ``ids`` int64; IndexError, nothing written, if an id is outside [0, src_rows). An
 *     embedding lookup without its dispatch.
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

/* fdlibm's pi/2 in three parts, its 2/pi and its kernel polynomials for sin and cos on
 * [-pi/4, pi/4] (double precision; a float result needs far less) */
#define PIO2_1 1.57079632673412561417e+00
#define PIO2_2 6.07710050630396597660e-11
#define PIO2_2T 2.02226624879595063154e-21
#define INVPIO2 6.36619772367581382433e-01
#define REDUCE_MAX 1.6e6 /* |angle| above which libm's sincos reduces it (never on RoPE's) */
static const double S_POLY[6] = {-1.66666666666666324348e-01, 8.33333333332248946124e-03,
    -1.98412698298579493134e-04, 2.75573137070700676789e-06, -2.50507602534068634195e-08,
    1.58969099521155010221e-10};
static const double C_POLY[6] = {4.16666666666666019037e-02, -1.38888888888741095749e-03,
    2.48015872894767294178e-05, -2.75573143513906633035e-07, 2.08757232129817482790e-09,
    -1.13596475577881948265e-11};

/* sin and cos of 8 angles: x = k pi/2 + r, |r| <= pi/4, then the quadrant k mod 4. */
AVX512 static void sincos_pd(__m512d x, __m512d *sn, __m512d *cs)
{
    __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(INVPIO2)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(k, _mm512_set1_pd(PIO2_1), x);
    r = _mm512_fnmadd_pd(k, _mm512_set1_pd(PIO2_2), r);
    r = _mm512_fnmadd_pd(k, _mm512_set1_pd(PIO2_2T), r);
    __m512d z = _mm512_mul_pd(r, r), ps = _mm512_set1_pd(S_POLY[5]), pc = _mm512_set1_pd(C_POLY[5]);
    for (int i = 4; i >= 0; i--) {
        ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(S_POLY[i]));
        pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(C_POLY[i]));
    }
    __m512d s = _mm512_fmadd_pd(_mm512_mul_pd(ps, z), r, r); /* r + r^3 P(z) */
    __m512d c = _mm512_fmadd_pd(_mm512_mul_pd(z, z), pc,
                                _mm512_fnmadd_pd(_mm512_set1_pd(0.5), z, _mm512_set1_pd(1.0)));
    __m512i q = _mm512_cvtpd_epi64(k);
    __mmask8 swap = _mm512_test_epi64_mask(q, _mm512_set1_epi64(1));
    __mmask8 neg_s = _mm512_test_epi64_mask(q, _mm512_set1_epi64(2));
    __mmask8 neg_c = _mm512_test_epi64_mask(_mm512_add_epi64(q, _mm512_set1_epi64(1)),
                                            _mm512_set1_epi64(2));
    __m512d s2 = _mm512_mask_blend_pd(swap, s, c), c2 = _mm512_mask_blend_pd(swap, c, s);
    *sn = _mm512_mask_sub_pd(s2, neg_s, _mm512_setzero_pd(), s2);
    *cs = _mm512_mask_sub_pd(c2, neg_c, _mm512_setzero_pd(), c2);
}

AVX512 static void cos_sin_row(int64_t p, const float *inv, long half, float *c, float *s)
{
    __m512 pv = _mm512_set1_ps((float)p);
    for (long j = 0; j < half; j += 8) {
        __m256 a = _mm256_mul_ps(_mm512_castps512_ps256(pv), _mm256_loadu_ps(inv + j));
        __m512d x = _mm512_cvtps_pd(a), sn, cs;
        sincos_pd(x, &sn, &cs);
        __m256 sf = _mm512_cvtpd_ps(sn), cf = _mm512_cvtpd_ps(cs);
        if (_mm512_cmp_pd_mask(_mm512_abs_pd(x), _mm512_set1_pd(REDUCE_MAX), _CMP_GT_OQ)) {
            float av[8], sv[8], cv[8];
            _mm256_storeu_ps(av, a);
            for (int i = 0; i < 8; i++) {
                double si, co;
                sincos((double)av[i], &si, &co);
                sv[i] = (float)si;
                cv[i] = (float)co;
            }
            sf = _mm256_loadu_ps(sv);
            cf = _mm256_loadu_ps(cv);
        }
        _mm256_storeu_ps(c + j, cf);
        _mm256_storeu_ps(c + half + j, cf);
        _mm256_storeu_ps(s + j, sf);
        _mm256_storeu_ps(s + half + j, sf);
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

/* Whether ``n`` row indices ``at`` (int64) all lie in [0, rows) and the sizes make sense; else
 * ValueError / IndexError (naming the function and the first bad index) and 0. */
static int rows_ok(const char *fn, const char *what, const int64_t *at, long n, long width,
                   long rows)
{
    if (n < 0 || width < 1 || rows < 0) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported arguments", fn);
        return 0;
    }
    for (long i = 0; i < n; i++)
        if (at[i] < 0 || at[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "%s: %s %lld out of [0, %ld)", fn, what,
                         (long long)at[i], rows);
            return 0;
        }
    return 1;
}

static PyObject *scatter_rows(PyObject *self, PyObject *args)
{
    unsigned long long src, dst, slots;
    long src_st, n, width, dst_rows;
    if (!PyArg_ParseTuple(args, "KlKKlll", &src, &src_st, &dst, &slots, &n, &width, &dst_rows))
        return NULL;
    const int64_t *at = (const int64_t *)slots;
    if (!rows_ok("scatter_rows", "slot", at, n, width, dst_rows))
        return NULL;
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

static PyObject *rope_cos_sin(PyObject *self, PyObject *args)
{
#if HAVE_OPS
    unsigned long long pos, inv, c, s;
    long n, half, threads;
    if (!PyArg_ParseTuple(args, "KlKlKKl", &pos, &n, &inv, &half, &c, &s, &threads))
        return NULL;
    if (!cpu_ok() || n < 0 || half < 16 || half % 16 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "rope_cos_sin: unsupported arguments");
        return NULL;
    }
    const int64_t *p = (const int64_t *)pos;
    int nt = n * half >= PARALLEL_MIN ? (int)threads : 1;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long i = 0; i < n; i++)
        cos_sin_row(p[i], (const float *)inv, half, (float *)c + i * 2 * half,
                    (float *)s + i * 2 * half);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this platform");
    return NULL;
#endif
}

static PyObject *gather_rows(PyObject *self, PyObject *args)
{
    unsigned long long src, ids, dst;
    long src_rows, width, n;
    if (!PyArg_ParseTuple(args, "KllKlK", &src, &src_rows, &width, &ids, &n, &dst))
        return NULL;
    const int64_t *at = (const int64_t *)ids;
    if (!rows_ok("gather_rows", "id", at, n, width, src_rows))
        return NULL;
    for (long i = 0; i < n; i++)
        memcpy((float *)dst + i * width, (const float *)src + at[i] * width,
               (size_t)width * sizeof(float));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU and build run the functions."},
    {"rms_norm", rms_norm, METH_VARARGS, "RMSNorm of rows (after adding a residual), float32."},
    {"scatter_rows", scatter_rows, METH_VARARGS, "Rows of floats to the given rows of a table (a step's K or V into the pool)."},
    {"silu_mul", silu_mul, METH_VARARGS, "silu(gate) * up of fused gate/up rows, float32."},
    {"rope", rope, METH_VARARGS, "HF RoPE in place on rows of heads, float32."},
    {"rope_cos_sin", rope_cos_sin, METH_VARARGS, "The cos / sin rows of RoPE for positions, float32."},
    {"gather_rows", gather_rows, METH_VARARGS, "Rows of a table by id (an embedding lookup), float32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_ops", "The decoder's elementwise steps fused (CPU, float32, AVX-512).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_ops(void)
{
    return PyModule_Create(&module);
}
