/* prefixkv.models._cpu_gemv: y = x W^T (+ b) for a few rows of x, reading a oneDNN-packed
 * float32 (or bfloat16: see gemv) weight in place, on CPU, AVX-512.
 *
 * A decode step multiplies one row (or a few) by every weight of the model: the step is a
 * stream of the weights through memory, and its speed is the bandwidth the multiply reaches.
 * oneDNN's matmul for a packed weight reaches about 80% of what a plain AVX-512 loop does on
 * such rows (docs/benchmarks.md, issue 16), so this loop takes the decode rows while oneDNN
 * keeps prefill, where it is compute-bound and fast.
 *
 * The weight layout is oneDNN's for fp32 weights packed with a small batch hint:
 * [ceil(N / 64)][K][64] floats, output n = 64 b + j of block b at [b][k][j], zero padding past
 * N. The caller (cpu_gemv.py) checks the packed size and verifies the product against
 * F.linear once per weight before using this path, so a different layout is never read.
 * Per block: for each k, four 16-wide loads of W (64 outputs) times x[m, k] broadcast, into
 * 4 x (up to 4 rows) accumulators; no horizontal reduction; the weight rows prefetched a few
 * k ahead with the non-temporal hint. Rows beyond four run in groups of four over the same
 * block while it is still in L2.
 *
 * supported() -> bool
 *     whether this CPU and build run gemv (x86-64 with AVX-512F).
 * supported_bf16() -> bool
 *     whether they also run its bfloat16 form (AVX512_BF16: vdpbf16ps).
 * gemv(w, n, k, kb, x, x_st, y, y_st, b, rows, threads, bf16=False) -> None
 *     y[r, :n] = x[r, :k] W^T (+ b[:n] when b != 0); strides in floats; chunks of whole
 *     64-column blocks of the output shared out dynamically over torch's OpenMP team
 *     (libgomp, shared by soname; each output is one thread's, in the same order). The sum
 *     over k runs in blocks of kb inputs, each from zero, added to the output block by block:
 *     oneDNN's matmul sums in blocks too (512 or 1,024 inputs, by K), and the caller picks the
 *     kb that gives oneDNN's floats exactly, so a row's result does not depend on whether a
 *     step had few rows (this loop) or many (oneDNN): the prefix cache's outputs stay equal.
 *     bf16: w, x, y and b are bfloat16, w in oneDNN's [N/64][K/2][64][2] layout (k and kb
 *     even); sums in float32 by vdpbf16ps, + b, rounded to nearest even once.
 * Addresses are ints; the caller checks shapes, strides and sizes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define HAVE_GEMV 1
#include <immintrin.h>
#include <omp.h>
#include "_avx512.h"
#else
#define HAVE_GEMV 0
#endif

#define ROWS 4   /* rows of x a pass over a block computes */
#define BLOCK 64 /* outputs per packed block */
#define CHUNKS 4 /* work chunks per thread in a call (dynamically scheduled; see gemv) */
#define PREFETCH 8 /* k-rows of a block prefetched ahead, non-temporal: the weights stream
                      past the caches instead of evicting the activations, the KV and the
                      interpreter's own data (decode steps 5-6% faster than without) */

#if HAVE_GEMV
static int cpu_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

/* The next weight rows of a block (256 bytes: 64 float32 outputs, or 64 bfloat16 pairs),
 * PREFETCH rows ahead, non-temporal. */
static inline void prefetch_row(const void *row)
{
    const char *p = (const char *)row;
    _mm_prefetch(p, _MM_HINT_NTA);
    _mm_prefetch(p + 64, _MM_HINT_NTA);
    _mm_prefetch(p + 128, _MM_HINT_NTA);
    _mm_prefetch(p + 192, _MM_HINT_NTA);
}

/* Up to four 16-output strips (nsub) of one packed block against `m` rows of x over `k`
 * inputs; `out` rows are `ys` apart, strips 16 apart; add: out += the sums, else out = them. */
AVX512 static inline void strips(const float *w, long k, const float *x, long xs, int m,
                                 int nsub, float *out, long ys, int add)
{
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_ps();
    if (nsub == 4) {
        for (long i = 0; i < k; i++) {
            const float *wi = w + i * BLOCK;
            prefetch_row(wi + PREFETCH * BLOCK);
            __m512 w0 = _mm512_loadu_ps(wi), w1 = _mm512_loadu_ps(wi + 16);
            __m512 w2 = _mm512_loadu_ps(wi + 32), w3 = _mm512_loadu_ps(wi + 48);
            for (int r = 0; r < m; r++) {
                __m512 xv = _mm512_set1_ps(x[r * xs + i]);
                acc[r][0] = _mm512_fmadd_ps(w0, xv, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(w1, xv, acc[r][1]);
                acc[r][2] = _mm512_fmadd_ps(w2, xv, acc[r][2]);
                acc[r][3] = _mm512_fmadd_ps(w3, xv, acc[r][3]);
            }
        }
    } else {
        for (long i = 0; i < k; i++) {
            const float *wi = w + i * BLOCK;
            for (int j = 0; j < nsub; j++) {
                __m512 wv = _mm512_loadu_ps(wi + 16 * j);
                for (int r = 0; r < m; r++)
                    acc[r][j] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * xs + i]), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < nsub; j++) {
            float *o = out + r * ys + 16 * j;
            _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), acc[r][j]) : acc[r][j]);
        }
}

/* Constant row counts, so the compiler unrolls the row loops. */
AVX512 static void strips_m(const float *w, long k, const float *x, long xs, int m, int nsub,
                            float *out, long ys, int add)
{
    switch (m) {
    case 1: strips(w, k, x, xs, 1, nsub, out, ys, add); break;
    case 2: strips(w, k, x, xs, 2, nsub, out, ys, add); break;
    case 3: strips(w, k, x, xs, 3, nsub, out, ys, add); break;
    default: strips(w, k, x, xs, 4, nsub, out, ys, add); break;
    }
}

/* The inputs in blocks of `kb`, each block's sums added to the output in turn: the order
 * oneDNN's matmul adds them in, so that both give the same floats (see gemv below). */
AVX512 static void blocked(const float *w, long k, long kb, const float *x, long xs, int m,
                           int nsub, float *out, long ys)
{
    for (long k0 = 0; k0 < k; k0 += kb)
        strips_m(w + k0 * BLOCK, k - k0 < kb ? k - k0 : kb, x + k0, xs, m, nsub, out, ys, k0 > 0);
}

/* Output strips [s0, s1) (16 outputs each) for all rows. */
AVX512 static void strip_range(const float *w, long n, long k, long kb, const float *x, long xs,
                               float *y, long ys, const float *bias, long rows, long s0, long s1)
{
    float tmp[ROWS * BLOCK];
    for (long s = s0; s < s1;) {
        long blk = s / 4, sub = s % 4;
        int nsub = (int)(4 - sub);
        if (s + nsub > s1)
            nsub = (int)(s1 - s);
        long n0 = blk * BLOCK + sub * 16;
        long width = n - n0 < 16L * nsub ? n - n0 : 16L * nsub;
        const float *wb = w + blk * k * BLOCK + sub * 16;
        for (long r0 = 0; r0 < rows; r0 += ROWS) {
            int m = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
            if (width == 16L * nsub) {
                blocked(wb, k, kb, x + r0 * xs, xs, m, nsub, y + r0 * ys + n0, ys);
            } else { /* the last block's padding: compute into tmp, copy what exists */
                blocked(wb, k, kb, x + r0 * xs, xs, m, nsub, tmp, BLOCK);
                for (int r = 0; r < m; r++)
                    for (long j = 0; j < width; j++)
                        y[(r0 + r) * ys + n0 + j] = tmp[r * BLOCK + j];
            }
            if (bias)
                for (int r = 0; r < m; r++)
                    for (long j = 0; j < width; j++)
                        y[(r0 + r) * ys + n0 + j] += bias[n0 + j];
        }
        s += nsub;
    }
}

#define AVX512BF16 __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16,fma")))

static int bf16_ok(void)
{
    return cpu_ok() && __builtin_cpu_supports("avx512bf16");
}

/* bfloat16 weights, packed [ceil(N / 64)][K / 2][64][2] (pairs of inputs side by side, as
 * vdpbf16ps reads them): the same strips as `strips`, each step two inputs, float32 sums. */
AVX512BF16 static inline void strips_bf16(const uint16_t *w, long k, const uint16_t *x, long xs,
                                          int m, int nsub, float *out, long ys, int add)
{
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (long i = 0; i < k; i += 2) {
        const uint16_t *wi = w + i * BLOCK; /* pair row i / 2: 64 outputs x 2 inputs */
        prefetch_row(wi + 2 * PREFETCH * BLOCK);
        for (int j = 0; j < nsub; j++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(wi + 32 * j));
            for (int r = 0; r < m; r++) {
                uint32_t pair;
                memcpy(&pair, x + r * xs + i, 4);
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < nsub; j++) {
            float *o = out + r * ys + 16 * j;
            _mm512_storeu_ps(o, add ? _mm512_add_ps(_mm512_loadu_ps(o), acc[r][j]) : acc[r][j]);
        }
}

AVX512BF16 static void strips_bf16_m(const uint16_t *w, long k, const uint16_t *x, long xs, int m,
                                     int nsub, float *out, long ys, int add)
{
    switch (m) {
    case 1: strips_bf16(w, k, x, xs, 1, nsub, out, ys, add); break;
    case 2: strips_bf16(w, k, x, xs, 2, nsub, out, ys, add); break;
    case 3: strips_bf16(w, k, x, xs, 3, nsub, out, ys, add); break;
    default: strips_bf16(w, k, x, xs, 4, nsub, out, ys, add); break;
    }
}

static inline float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to the nearest bfloat16, ties to even (NaN stays NaN), as torch does. */
static inline uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits | 0x00400000u) >> 16);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Output strips [s0, s1) for all rows, bfloat16 in and out: sums in float32 (in blocks of kb
 * inputs, as `blocked`), then + bias, rounded once. */
AVX512BF16 static void strip_range_bf16(const uint16_t *w, long n, long k, long kb,
                                        const uint16_t *x, long xs, uint16_t *y, long ys,
                                        const uint16_t *bias, long rows, long s0, long s1)
{
    float tmp[ROWS * BLOCK];
    for (long s = s0; s < s1;) {
        long blk = s / 4, sub = s % 4;
        int nsub = (int)(4 - sub);
        if (s + nsub > s1)
            nsub = (int)(s1 - s);
        long n0 = blk * BLOCK + sub * 16;
        long width = n - n0 < 16L * nsub ? n - n0 : 16L * nsub;
        const uint16_t *wb = w + blk * k * BLOCK + sub * 32;
        for (long r0 = 0; r0 < rows; r0 += ROWS) {
            int m = rows - r0 < ROWS ? (int)(rows - r0) : ROWS;
            for (long k0 = 0; k0 < k; k0 += kb)
                strips_bf16_m(wb + k0 * BLOCK, k - k0 < kb ? k - k0 : kb, x + r0 * xs + k0, xs,
                              m, nsub, tmp, BLOCK, k0 > 0);
            for (int r = 0; r < m; r++)
                for (long j = 0; j < width; j++) {
                    float f = tmp[r * BLOCK + j] + (bias ? bf16_to_f32(bias[n0 + j]) : 0.0f);
                    y[(r0 + r) * ys + n0 + j] = f32_to_bf16(f);
                }
        }
        s += nsub;
    }
}
#endif

static PyObject *supported(PyObject *self, PyObject *unused)
{
#if HAVE_GEMV
    return PyBool_FromLong(cpu_ok());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *supported_bf16(PyObject *self, PyObject *unused)
{
#if HAVE_GEMV
    return PyBool_FromLong(bf16_ok());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *gemv(PyObject *self, PyObject *args)
{
#if HAVE_GEMV
    unsigned long long w, x, y, b;
    long n, k, kb, x_st, y_st, rows, threads;
    int bf16 = 0;
    if (!PyArg_ParseTuple(args, "KlllKlKlKll|p", &w, &n, &k, &kb, &x, &x_st, &y, &y_st, &b, &rows,
                          &threads, &bf16))
        return NULL;
    if (!(bf16 ? bf16_ok() : cpu_ok()) || !w || !x || !y || n < 1 || k < 1 || kb < 1 || rows < 1
        || threads < 1 || x_st < k || y_st < n || (bf16 && (k % 2 || kb % 2))) {
        PyErr_SetString(PyExc_ValueError, "gemv: unsupported arguments");
        return NULL;
    }
    long nstrips = (n + 15) / 16;
    int nt = nstrips >= 8 * threads ? (int)threads : 1;
    /* Chunks of whole blocks (4 strips), about CHUNKS per thread, taken in turn by whichever
     * thread is free: the threads stream from memory at rates that differ from call to call,
     * and an even static split left the faster one waiting at the barrier. */
    long ch = nstrips / (CHUNKS * nt);
    ch = ch < 4 ? 4 : ch - ch % 4;
    long nchunks = (nstrips + ch - 1) / ch;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (long c = 0; c < nchunks; c++) {
        long s0 = c * ch, s1 = s0 + ch < nstrips ? s0 + ch : nstrips;
        if (bf16)
            strip_range_bf16((const uint16_t *)w, n, k, kb, (const uint16_t *)x, x_st,
                             (uint16_t *)y, y_st, (const uint16_t *)b, rows, s0, s1);
        else
            strip_range((const float *)w, n, k, kb, (const float *)x, x_st, (float *)y, y_st,
                        (const float *)b, rows, s0, s1);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "not built for this platform");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU and build run gemv."},
    {"supported_bf16", supported_bf16, METH_NOARGS, "Whether they run its bfloat16 form."},
    {"gemv", gemv, METH_VARARGS, "x W^T (+ b) for a few rows, W oneDNN-packed (float32 or bf16)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_gemv", "Few-row matmul on oneDNN-packed weights (CPU, AVX-512).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_gemv(void)
{
    return PyModule_Create(&module);
}
