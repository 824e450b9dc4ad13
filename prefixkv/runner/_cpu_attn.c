/* prefixkv.runner._cpu_attn: a step's causal attention over the paged KV pool, on CPU.
 *
 * One call computes, for every sequence of a step (a prefill chunk, or a decode with one
 * query), the attention of its n_q new queries (positions start .. start + n_q - 1) over every
 * key at positions [0, start + n_q), reading K and V in place through the sequence's block ids
 * (no gather, no padding, no mask tensor). GQA: query head h reads KV head h / (n_heads /
 * n_kv_heads). It is a flash-attention loop (online softmax, in base 2) written for AVX-512:
 * keys in tiles of 64, transposed into a small buffer (once per call when several position
 * blocks read a tile, per task otherwise), scores for four query rows at a time in 16 vector
 * accumulators, P x V the same way. Work is split into tasks (sequence x KV head x block of
 * positions x key split, heaviest first; split keys merged by log-sum-exp) that torch's OpenMP
 * team takes in turn, the GIL released.
 *
 * The arithmetic on one tile is in _cpu_attn_tile.h; this file plans the tasks and runs them.
 * Arithmetic is float32; bfloat16 tensors are widened on load (K into its transposed tiles, V
 * into a float32 copy) and the output rounded to nearest even.
 *
 * supported() -> bool
 *     whether this CPU and build run the kernel (x86-64 with AVX-512F/DQ, GCC or Clang).
 * attend(q, q_st, q_sh, o, o_st, o_sh, k, v, blk_st, tok_st, info, n_seqs, tables, n_heads,
 *        n_kv_heads, head_dim, block_size, scale, threads, bf16) -> None
 *     q, o, k, v: addresses (int) of the queries / outputs and the layer's K / V pool (all
 *     float32, or all bfloat16 when ``bf16``); *_st / *_sh: strides in elements (row, head;
 *     the head dimension is contiguous everywhere, KV heads adjacent within a token). info:
 *     int64 [n_seqs][4] (first row, queries, start position, offset of its ids in tables);
 *     tables: int64 block ids. The caller (prefixkv/runner/cpu_attention.py) checks every
 *     shape, stride, id and dtype: this module trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define HAVE_KERNEL 1
#include <immintrin.h>
#include <omp.h>
#else
#define HAVE_KERNEL 0
#endif

#define KT 64   /* keys per tile */
#define MR 4    /* query rows per micro-tile */
#define MAX_DIM 256

#if HAVE_KERNEL

#include "_avx512.h" /* prefixkv/models/: the AVX512 attribute, exp2_ps */

typedef struct { /* one sequence of the call: a prefill chunk, or a decode (n_q = 1) */
    long q0, n_q, start;    /* its queries: rows q0 .. q0 + n_q - 1, positions start .. */
    const int64_t *table;   /* its block ids */
    long pb, n_pblocks, n_split, n_tiles;
    long task0, pack0, item0;  /* its first task, K-tile task and merge item in the job */
    int shared;             /* K tiles transposed once into kt (several position blocks read
                               them); otherwise each task transposes the tiles it reads */
    float *kt, *v_all;      /* shared: K as [n_kv][n_tiles][dim][KT]; bf16: V as float32 */
    float *parts;           /* n_split > 1: per task, o [rows][dim], m [rows], l [rows] */
    long part_size;         /* floats per task in parts */
} seq_t;

typedef struct {
    const void *q, *k, *v; /* float32, or bfloat16 when bf16 (then o too) */
    void *o;
    int bf16;
    long q_st, q_sh, o_st, o_sh, blk_st, tok_st;
    long n_kv, dim, bs, rep;
    float scale2; /* softmax scale x log2(e): scores in base 2 */
    seq_t *seqs;
    long n_tasks, n_pack, n_items, max_rows;
    long *task_seq, *pack_seq, *item_seq; /* the sequence of each task / K tile / merge item */
    float *buf_kt, *buf_va, *buf_parts;   /* the sequences' kt / v_all / parts, one block each */
} job_t;

#include "_cpu_attn_tile.h"

/* Rows of positions pos0 .. pos0 + n - 1 (KV head g) of ``base``: one division, then blocks
 * stepped through (a division per key cost as much as the arithmetic on it for decodes). */
static void tile_rows(const job_t *J, const seq_t *sq, const void *base, long pos0, long n,
                      long g, const void **rows)
{
    long blk = pos0 / J->bs, off = pos0 % J->bs, es = J->bf16 ? 2 : 4;
    for (long j = 0; j < n; j++) {
        rows[j] = (const char *)base
                  + (sq->table[blk] * J->blk_st + off * J->tok_st + g * J->dim) * es;
        if (++off == J->bs) {
            off = 0;
            blk++;
        }
    }
}

/* Tile ``t`` (keys t*KT ..) of KV head ``g`` of a sequence transposed into ``kt`` [dim][KT]
 * (zero past the last key); bf16: its V rows into ``v`` [KT][dim] as float32 too. */
AVX512 static void pack_tile(const job_t *J, const seq_t *sq, long g, long t, float *kt,
                             float *v)
{
    long D = J->dim, ctx = sq->start + sq->n_q, nk = ctx - t * KT < KT ? ctx - t * KT : KT;
    const void *rows[KT];
    tile_rows(J, sq, J->k, t * KT, nk, g, rows);
    for (long j = nk; j < KT; j++)
        rows[j] = zero_row;
    for (long j0 = 0; j0 < KT; j0 += 16)
        for (long d0 = 0; d0 < D; d0 += 16)
            transpose16(rows + j0, d0, kt + j0, J->bf16);
    if (J->bf16) {
        tile_rows(J, sq, J->v, t * KT, nk, g, rows);
        for (long j = 0; j < nk; j++)
            for (long d0 = 0; d0 < D; d0 += 16)
                _mm512_storeu_ps(v + j * D + d0, load16(rows[j], d0, 1));
    }
}

/* Phase 1: K tile ``task`` of the job (a shared sequence's (head, tile)). */
static void pack_shared(const job_t *J, long task)
{
    const seq_t *sq = J->seqs + J->pack_seq[task];
    long local = task - sq->pack0, g = local / sq->n_tiles, t = local % sq->n_tiles;
    pack_tile(J, sq, g, t, sq->kt + local * J->dim * KT,
              J->bf16 ? sq->v_all + (g * sq->n_tiles + t) * KT * J->dim : NULL);
}

/* One task: KV head g, positions [p0, p0 + np) of every query head reading it, over key split
 * ks of n_split (the tiles of keys [0, start + p0 + np) cut into n_split runs), for one
 * sequence. With one split the result goes to the output; otherwise the unnormalized o and
 * m / l go to the task's part (merged by merge_splits). */
AVX512 static void run_task(const job_t *J, scratch_t *S, long task)
{
    const seq_t *sq = J->seqs + J->task_seq[task];
    long local = task - sq->task0;
    long ks = local % sq->n_split, g = (local / sq->n_split) % J->n_kv;
    long pblock = sq->n_pblocks - 1 - local / (sq->n_split * J->n_kv);
    long p0 = pblock * sq->pb, np = sq->n_q - p0 < sq->pb ? sq->n_q - p0 : sq->pb;
    long rows = J->rep * np, D = J->dim, start = sq->start;
    for (long hh = 0; hh < J->rep; hh++)
        for (long i = 0; i < np; i++) {
            long at = (sq->q0 + p0 + i) * J->q_st + (g * J->rep + hh) * J->q_sh;
            float *dst = S->qs + (hh * np + i) * D;
            for (long d = 0; d < D; d += 16) /* D is a multiple of 16 */
                _mm512_store_ps(dst + d, _mm512_mul_ps(load16(J->q, at + d, J->bf16),
                                                       _mm512_set1_ps(J->scale2)));
        }
    memset(S->qs + rows * D, 0, MR * D * sizeof(float)); /* the padding rows of a micro-tile */
    memset(S->os, 0, (rows + MR) * D * sizeof(float));
    for (long r = 0; r < rows + MR; r++) {
        S->m[r] = -INFINITY;
        _mm512_store_ps(S->l + 16 * r, _mm512_setzero_ps());
    }
    long kend = start + p0 + np; /* keys [0, kend) */
    long n_t = (kend + KT - 1) / KT, t0 = ks * n_t / sq->n_split, t1 = (ks + 1) * n_t / sq->n_split;
    for (long j0 = t0 * KT; j0 < t1 * KT && j0 < kend; j0 += KT) {
        long nk = kend - j0 < KT ? kend - j0 : KT, t = j0 / KT;
        const float *vbase = NULL; /* bf16: the tile's V rows as float32 */
        if (sq->shared) {
            S->kt = sq->kt + (g * sq->n_tiles + t) * D * KT;
            vbase = J->bf16 ? sq->v_all + (g * sq->n_tiles + t) * KT * D : NULL;
        } else {
            pack_tile(J, sq, g, t, S->kt_own, S->v_own);
            S->kt = S->kt_own;
            vbase = S->v_own;
        }
        if (J->bf16)
            for (long j = 0; j < nk; j++)
                S->vrow[j] = vbase + j * D;
        else
            tile_rows(J, sq, J->v, j0, nk, g, (const void **)S->vrow);
        /* micro-tiles of MR rows in the order qs holds them (head-major: row hh * np + i is
         * query i of head hh), so the rep heads of a decode's one query fill one micro-tile */
        for (long r0 = 0; r0 < rows; r0 += MR) {
            float *qrow[MR], *orow[MR], *mr[MR], *lr[MR];
            int valid[MR], any = 0;
            for (int r = 0; r < MR; r++) {
                long row = r0 + r < rows ? r0 + r : rows + r; /* past the end: a padding row */
                long lim = r0 + r < rows ? start + p0 + row % np - j0 + 1 : 0; /* keys <= pos */
                valid[r] = (int)(lim < 0 ? 0 : lim > nk ? nk : lim);
                any |= valid[r] > 0;
                qrow[r] = S->qs + row * D;
                orow[r] = S->os + row * D;
                mr[r] = S->m + row;
                lr[r] = S->l + 16 * row;
            }
            if (!any)
                continue; /* every row of it is before this tile */
            scores_softmax(J->dim, S, qrow, orow, mr, lr, valid);
            accumulate_pv(J->dim, S, orow, nk);
        }
    }
    for (long r = 0; r < rows; r++) /* each row's 16 partial sums of l, added up */
        S->lsum[r] = _mm512_reduce_add_ps(_mm512_load_ps(S->l + 16 * r));
    if (sq->n_split > 1) {
        float *part = sq->parts + local * sq->part_size;
        memcpy(part, S->os, rows * D * sizeof(float));
        memcpy(part + rows * D, S->m, rows * sizeof(float));
        memcpy(part + rows * (D + 1), S->lsum, rows * sizeof(float));
        return;
    }
    for (long hh = 0; hh < J->rep; hh++)
        for (long i = 0; i < np; i++) {
            long row = hh * np + i;
            float inv = 1.0f / S->lsum[row];
            long at = (sq->q0 + p0 + i) * J->o_st + (g * J->rep + hh) * J->o_sh;
            if (!J->bf16) /* float32: 16 at a time (the same products) */
                for (long d = 0; d < D; d += 16)
                    _mm512_storeu_ps((float *)J->o + at + d,
                                     _mm512_mul_ps(_mm512_load_ps(S->os + row * D + d),
                                                   _mm512_set1_ps(inv)));
            else
                for (long d = 0; d < D; d++)
                    store1(J->o, at + d, S->os[row * D + d] * inv, 1);
        }
}

/* The n_split parts of merge item ``item`` (a sequence's (KV head, position block)) into the
 * output: each row's parts weighted by 2**(m_s - max m) (a split with no key for the row has
 * m = -inf, weight 0). */
static void merge_splits(const job_t *J, long item)
{
    const seq_t *sq = J->seqs + J->item_seq[item];
    long local = item - sq->item0, g = local % J->n_kv;
    long pblock = sq->n_pblocks - 1 - local / J->n_kv;
    long p0 = pblock * sq->pb, np = sq->n_q - p0 < sq->pb ? sq->n_q - p0 : sq->pb;
    long rows = J->rep * np, D = J->dim, ps_size = sq->part_size;
    const float *parts = sq->parts + local * sq->n_split * ps_size;
    for (long row = 0; row < rows; row++) {
        float top = -INFINITY, total = 0.0f, w[64];
        for (long s = 0; s < sq->n_split; s++) {
            float m = parts[s * ps_size + rows * D + row];
            top = m > top ? m : top;
        }
        for (long s = 0; s < sq->n_split; s++) {
            const float *ps = parts + s * ps_size;
            w[s] = exp2f(ps[rows * D + row] - top);
            total += w[s] * ps[rows * (D + 1) + row];
        }
        long hh = row / np, i = row % np;
        long at = (sq->q0 + p0 + i) * J->o_st + (g * J->rep + hh) * J->o_sh;
        for (long d = 0; d < D; d++) {
            float acc = 0.0f;
            for (long s = 0; s < sq->n_split; s++)
                acc += w[s] * parts[s * ps_size + row * D + d];
            store1(J->o, at + d, acc / total, J->bf16);
        }
    }
}

/* The phases on the caller's OpenMP team: the runtime torch already runs (its libgomp is
 * loaded first and shares the soname), so the threads are the ones torch's kernels just used. */
static int run_job(job_t *J, int threads)
{
    long rows = J->max_rows + MR, D = J->dim;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < J->n_pack; t++)
            pack_shared(J, t);
        scratch_t S;
        S.qs = aligned_alloc(64, rows * D * sizeof(float));
        S.os = aligned_alloc(64, rows * D * sizeof(float));
        S.p = aligned_alloc(64, MR * KT * sizeof(float));
        S.kt_own = aligned_alloc(64, D * KT * sizeof(float));
        S.v_own = aligned_alloc(64, D * KT * sizeof(float));
        S.m = malloc(rows * sizeof(float));
        S.l = aligned_alloc(64, rows * 16 * sizeof(float));
        S.lsum = malloc(rows * sizeof(float));
        int ok = S.qs && S.os && S.p && S.kt_own && S.v_own && S.m && S.l && S.lsum;
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < J->n_tasks; t++)
            if (ok)
                run_task(J, &S, t);
        free(S.qs); free(S.os); free(S.p); free(S.kt_own); free(S.v_own); free(S.m); free(S.l);
        free(S.lsum);
#pragma omp for schedule(dynamic, 4)
        for (long item = 0; item < J->n_items; item++)
            merge_splits(J, item);
    }
    return failed;
}

static int cpu_ok(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("fma");
}

#endif /* HAVE_KERNEL */

static PyObject *supported(PyObject *self, PyObject *noargs)
{
#if HAVE_KERNEL
    if (cpu_ok())
        Py_RETURN_TRUE;
#endif
    Py_RETURN_FALSE;
}

#if HAVE_KERNEL
/* Plan the sequences' tasks: blocks of 32 positions; with fewer than 2 tasks a thread in all,
 * split keys (each split 2+ tiles: short chunks on long prefixes, decodes; a chunk of 16+
 * queries only as far as the threads' balance needs), then shrink the
 * blocks (2 a thread measured 3-10% faster than 6 on warm chunks, level on prefill and
 * decodes: fewer parts to merge). Then the buffers: shared K tiles for sequences with several position blocks, parts
 * for split ones. Returns 0, or -1 when out of memory (everything freed). */
static int plan(job_t *J, const int64_t *info, long n_seqs, const int64_t *tables, long threads)
{
    long want = 2 * threads, base = 0, D = J->dim, chunk = 0;
    for (long s = 0; s < n_seqs; s++) {
        base += J->n_kv * ((info[4 * s + 1] + 31) / 32);
        chunk |= info[4 * s + 1] >= 16;
    }
    long f = base >= want ? 1 : (want + base - 1) / base;
    if (chunk && f > 1) { /* a chunk's split costs its rows' merge: the fewest splits that keep
                           * the threads evenly loaded (a 32-token chunk over 2,080 keys, 2 KV
                           * heads, 2 threads: 8% faster unsplit; decodes keep 2 tasks a thread) */
        long most = f;
        for (long g = f = 1; g <= most; g++)
            if ((base * g + threads - 1) / threads * f < (base * f + threads - 1) / threads * g)
                f = g;
    }
    long kt_floats = 0, part_floats = 0;
    J->n_tasks = J->n_pack = J->n_items = J->max_rows = 0;
    for (long s = 0; s < n_seqs; s++) {
        seq_t *sq = J->seqs + s;
        const int64_t *x = info + 4 * s;
        sq->q0 = x[0], sq->n_q = x[1], sq->start = x[2], sq->table = tables + x[3];
        long first_tiles = (sq->start + (sq->n_q < 32 ? sq->n_q : 32) + KT - 1) / KT;
        sq->n_split = f < first_tiles / 2 ? f : first_tiles / 2 > 1 ? first_tiles / 2 : 1;
        if (sq->n_split > 64)
            sq->n_split = 64;
        sq->pb = 32;
        while (sq->pb > MR && sq->n_split * ((sq->n_q + sq->pb - 1) / sq->pb) < f)
            sq->pb /= 2;
        sq->n_pblocks = (sq->n_q + sq->pb - 1) / sq->pb;
        sq->n_tiles = (sq->start + sq->n_q + KT - 1) / KT;
        sq->shared = sq->n_pblocks > 1;
        sq->part_size = J->rep * sq->pb * (D + 2);
        sq->task0 = J->n_tasks;
        sq->pack0 = J->n_pack;
        sq->item0 = J->n_items;
        J->n_tasks += sq->n_pblocks * J->n_kv * sq->n_split;
        J->n_pack += sq->shared ? J->n_kv * sq->n_tiles : 0;
        J->n_items += sq->n_split > 1 ? sq->n_pblocks * J->n_kv : 0;
        kt_floats += sq->shared ? J->n_kv * sq->n_tiles * KT * D : 0;
        part_floats += sq->n_split > 1 ? sq->n_pblocks * J->n_kv * sq->n_split * sq->part_size : 0;
        if (J->rep * sq->pb > J->max_rows)
            J->max_rows = J->rep * sq->pb;
    }
    float *kt = kt_floats ? aligned_alloc(64, kt_floats * sizeof(float)) : NULL;
    float *va = kt_floats && J->bf16 ? aligned_alloc(64, kt_floats * sizeof(float)) : NULL;
    float *parts = part_floats ? malloc(part_floats * sizeof(float)) : NULL;
    long *index = malloc((J->n_tasks + J->n_pack + J->n_items + 1) * sizeof(long));
    if ((kt_floats && !kt) || (kt_floats && J->bf16 && !va) || (part_floats && !parts) || !index) {
        free(kt); free(va); free(parts); free(index);
        return -1;
    }
    J->buf_kt = kt, J->buf_va = va, J->buf_parts = parts;
    J->task_seq = index;
    J->pack_seq = index + J->n_tasks;
    J->item_seq = J->pack_seq + J->n_pack;
    for (long s = 0; s < n_seqs; s++) {
        seq_t *sq = J->seqs + s;
        sq->kt = sq->shared ? kt : NULL;
        sq->v_all = sq->shared && J->bf16 ? va : NULL;
        sq->parts = sq->n_split > 1 ? parts : NULL;
        long n_t = sq->n_pblocks * J->n_kv * sq->n_split;
        for (long t = 0; t < n_t; t++)
            J->task_seq[sq->task0 + t] = s;
        for (long t = 0; sq->shared && t < J->n_kv * sq->n_tiles; t++)
            J->pack_seq[sq->pack0 + t] = s;
        for (long t = 0; sq->n_split > 1 && t < sq->n_pblocks * J->n_kv; t++)
            J->item_seq[sq->item0 + t] = s;
        if (sq->shared) {
            kt += J->n_kv * sq->n_tiles * KT * D;
            va = va ? va + J->n_kv * sq->n_tiles * KT * D : NULL;
        }
        if (sq->n_split > 1)
            parts += n_t * sq->part_size;
    }
    return 0;
}

#endif

static PyObject *attend(PyObject *self, PyObject *args)
{
#if HAVE_KERNEL
    unsigned long long q, o, k, v, info, tables;
    long q_st, q_sh, o_st, o_sh, blk_st, tok_st, n_seqs, n_heads, n_kv, dim, bs, threads;
    double scale;
    int bf16;
    if (!PyArg_ParseTuple(args, "KllKllKKllKlKlllldlp", &q, &q_st, &q_sh, &o, &o_st, &o_sh, &k,
                          &v, &blk_st, &tok_st, &info, &n_seqs, &tables, &n_heads, &n_kv, &dim,
                          &bs, &scale, &threads, &bf16))
        return NULL;
    const int64_t *x = (const int64_t *)info;
    int bad = !cpu_ok() || n_seqs < 1 || n_kv < 1 || n_heads % n_kv || dim % 16 || dim > MAX_DIM
              || bs < 1 || threads < 1;
    for (long s = 0; !bad && s < n_seqs; s++)
        bad = x[4 * s] < 0 || x[4 * s + 1] < 1 || x[4 * s + 2] < 0 || x[4 * s + 3] < 0;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "attend: unsupported arguments");
        return NULL;
    }
    job_t J = {.q = (const void *)q, .k = (const void *)k, .v = (const void *)v,
               .o = (void *)o, .bf16 = bf16, .q_st = q_st, .q_sh = q_sh, .o_st = o_st, .o_sh = o_sh,
               .blk_st = blk_st, .tok_st = tok_st, .n_kv = n_kv, .dim = dim,
               .bs = bs, .rep = n_heads / n_kv, .scale2 = (float)(scale * 1.4426950408889634)};
    J.seqs = malloc(n_seqs * sizeof(seq_t));
    if (!J.seqs || plan(&J, x, n_seqs, (const int64_t *)tables, threads)) {
        free(J.seqs);
        return PyErr_NoMemory();
    }
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = run_job(&J, (int)(threads < J.n_tasks ? threads : J.n_tasks));
    Py_END_ALLOW_THREADS
    free(J.task_seq);
    free(J.buf_kt);
    free(J.buf_va);
    free(J.buf_parts);
    free(J.seqs);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_RuntimeError, "attend: not built for this platform");
    return NULL;
#endif
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "Whether this CPU and build run the kernel."},
    {"attend", attend, METH_VARARGS, "Causal attention of a step's sequences over the paged pool."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_attn", "Causal attention over the paged KV pool (CPU, float32 / bf16, AVX-512).", -1, methods,
};

PyMODINIT_FUNC PyInit__cpu_attn(void)
{
    return PyModule_Create(&module);
}
