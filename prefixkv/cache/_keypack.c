/* prefixkv.cache._keypack: the cache core's optional C helpers (see radix_node.py, _checks.py).
 *
 * Four token ids below 2**18 pack into 9 bytes, little-endian: the 72-bit word
 * t0 | t1 << 18 | t2 << 36 | t3 << 54. Packing is a bijection on groups of four, so two runs
 * of whole groups are equal exactly when their packed bytes are, and a common prefix of whole
 * groups is a common byte prefix of a multiple of nine bytes. A 150k-token vocabulary (Qwen,
 * DeepSeek; Llama 3's 128k) then costs 2.25 bytes a token instead of 4.
 *
 * pack18(ids, start, stop) -> bytes
 *     ids: a buffer of uint32 ('I'), uint16 ('H') or 64-bit ('q', 'Q', 'l', 'L'; read as
 *     uint64, so a negative id stops the packing like a large one) items. Packs ids[start:start+m] where m is
 *     the largest multiple of 4 with start + m <= stop and every packed id below 2**18 (so a
 *     shorter result tells the caller where the first larger id is, to a group).
 * unpack18(data, start, stop) -> bytes
 *     the uint32 ids start..stop-1 (token positions) of packed ``data``, as native bytes.
 * common_bytes(a, a_off, b, b_off, limit) -> int
 *     the length of the common prefix of a[a_off:] and b[b_off:], at most ``limit``.
 * reversed_runs(runs, unit) -> array
 *     the uint32 runs (a list of buffers) concatenated in order, each reversed: an eviction's
 *     freed ids, each run deepest first (eviction.py), in one pass, written into ``unit *
 *     total`` (``unit``: a sequence of one 4-byte item, e.g. array('I', [0])), which is
 *     returned: the result array is filled in place, no bytes in between.
 * from_list(ids, narrow[, exact]) -> bytes | None
 *     a list or tuple of ints as uint32 bytes (uint16 when ``narrow`` and every id is below
 *     2**16); None at the first item that is not an int in [0, 2**32) (the caller's slower path
 *     then raises the precise error), or with ``exact`` not exactly an int (a bool or another
 *     int subclass: the engine's prompt check). Ints below 2**32 are read from their digits
 *     (CPython 3.11's layout, 3.12's compact-value API; others the general way): 1,024 ids
 *     0.66 us, 2,080 tokens 1.65 us, against 4 us for array('I', ids) of the 1,024.
 * narrow64(ints64, narrow) -> bytes | None
 *     a native 64-bit int buffer (array('q'), numpy int64) as uint32 bytes, or uint16 bytes when
 *     ``narrow`` and every value is below 2**16; None when a value is negative or >= 2**32.
 *     One pass in C where numpy takes about 2 us of per-call overhead for a 2,048-id query.
 * max_u32(ids) -> int
 *     the largest id of a uint32 buffer (0 when empty).
 * claim_free(tags, alive, ids, owner) -> int
 *     held_ids.py's bulk claim: stamp ``owner`` on each id of ``ids`` whose tag is not alive;
 *     -1, or the index of the first id that was held, came twice or lies past the tags, with
 *     nothing stamped.
 * fits32(ints64) -> bool
 *     whether every value of a native 64-bit int buffer is in [0, 2**32) (a query a packed
 *     tree walks as it is: radix.py's as_query).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LIMIT18 (1u << 18)

/* The id loops, compiled twice on x86-64 Linux (AVX2 and baseline), picked at load time. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

CLONES static uint64_t or_all64(const uint64_t *src, Py_ssize_t n)
{
    uint64_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        any |= src[i];
    return any;
}

CLONES static void narrow_to32(const uint64_t *src, uint32_t *dst, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = (uint32_t)src[i];
}

CLONES static void narrow_32_to16(const uint32_t *src, uint16_t *dst, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = (uint16_t)src[i];
}

CLONES static void narrow_to16(const uint64_t *src, uint16_t *dst, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        dst[i] = (uint16_t)src[i];
}

static int get_ids(PyObject *obj, Py_buffer *view, int *wide)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    if (view->ndim == 1 && view->itemsize == 4 && (f[0] == 'I' || f[0] == 'L') && !f[1]) {
        *wide = 1;
        return 0;
    }
    if (view->ndim == 1 && view->itemsize == 2 && f[0] == 'H' && !f[1]) {
        *wide = 0;
        return 0;
    }
    if (view->ndim == 1 && view->itemsize == 8 && strchr("qQlL", f[0]) && f[0] && !f[1]) {
        *wide = 2; /* 64-bit ints, read as uint64: a negative one stops the packing */
        return 0;
    }
    PyBuffer_Release(view);
    PyErr_SetString(PyExc_TypeError, "pack18: ids must be a 1-D uint16, uint32 or 64-bit int buffer");
    return -1;
}

static inline void put_group(unsigned char *p, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3)
{
    uint64_t lo = (uint64_t)t0 | (uint64_t)t1 << 18 | (uint64_t)t2 << 36 | (uint64_t)t3 << 54;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &lo, 8);
#else
    for (int b = 0; b < 8; b++)
        p[b] = (unsigned char)(lo >> (8 * b));
#endif
    p[8] = (unsigned char)(t3 >> 10);
}

/* Groups of four uint32 ids packed into dst until one holds an id >= 2**18; returns how many. */
CLONES static Py_ssize_t pack_wide(const uint32_t *src, Py_ssize_t groups, unsigned char *dst)
{
    Py_ssize_t g = 0;
    for (; g < groups; g++, src += 4) {
        if ((src[0] | src[1] | src[2] | src[3]) >= LIMIT18)
            break;
        put_group(dst + 9 * g, src[0], src[1], src[2], src[3]);
    }
    return g;
}

/* The same from 64-bit ids (read as uint64). */
CLONES static Py_ssize_t pack_u64(const uint64_t *src, Py_ssize_t groups, unsigned char *dst)
{
    Py_ssize_t g = 0;
    for (; g < groups; g++, src += 4) {
        if ((src[0] | src[1] | src[2] | src[3]) >= LIMIT18)
            break;
        put_group(dst + 9 * g, (uint32_t)src[0], (uint32_t)src[1], (uint32_t)src[2], (uint32_t)src[3]);
    }
    return g;
}

CLONES static Py_ssize_t pack_narrow(const uint16_t *src, Py_ssize_t groups, unsigned char *dst)
{
    for (Py_ssize_t g = 0; g < groups; g++, src += 4)
        put_group(dst + 9 * g, src[0], src[1], src[2], src[3]);
    return groups;
}

static PyObject *pack18(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pack18(ids, start, stop) takes 3 arguments");
        return NULL;
    }
    PyObject *obj = args[0];
    Py_ssize_t start = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t stop = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (stop == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    int wide;
    if (get_ids(obj, &view, &wide) < 0)
        return NULL;
    Py_ssize_t len = view.len / view.itemsize;
    if (start < 0 || stop > len || start > stop) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_IndexError, "pack18: start/stop out of range");
        return NULL;
    }
    Py_ssize_t groups = (stop - start) / 4;
    PyObject *out = PyBytes_FromStringAndSize(NULL, groups * 9);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t g = wide == 2 ? pack_u64((const uint64_t *)view.buf + start, groups, dst)
                   : wide ? pack_wide((const uint32_t *)view.buf + start, groups, dst)
                          : pack_narrow((const uint16_t *)view.buf + start, groups, dst);
    PyBuffer_Release(&view);
    if (g < groups && _PyBytes_Resize(&out, g * 9) < 0)
        return NULL;
    return out;
}

static uint32_t token_at(const unsigned char *data, Py_ssize_t i)
{
    const unsigned char *p = data + 9 * (i / 4);
    int shift = 18 * (int)(i % 4);
    int byte = shift / 8, bit = shift % 8;
    /* bit is 0, 2, 4 or 6: the 18 bits lie within three bytes of the group */
    uint32_t v = (uint32_t)p[byte] | (uint32_t)p[byte + 1] << 8 | (uint32_t)p[byte + 2] << 16;
    return (v >> bit) & (LIMIT18 - 1);
}

static PyObject *unpack18(PyObject *self, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "y*nn", &data, &start, &stop))
        return NULL;
    Py_ssize_t ntok = data.len / 9 * 4;
    if (data.len % 9 || start < 0 || stop > ntok || start > stop) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_IndexError, "unpack18: start/stop out of range");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (stop - start) * 4);
    if (out != NULL) {
        uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = start; i < stop; i++)
            dst[i - start] = token_at((const unsigned char *)data.buf, i);
    }
    PyBuffer_Release(&data);
    return out;
}

static PyObject *common_bytes(PyObject *self, PyObject *args)
{
    Py_buffer a, b;
    Py_ssize_t a_off, b_off, limit;
    if (!PyArg_ParseTuple(args, "y*ny*nn", &a, &a_off, &b, &b_off, &limit))
        return NULL;
    Py_ssize_t n = 0;
    if (a_off >= 0 && b_off >= 0 && a_off <= a.len && b_off <= b.len) {
        Py_ssize_t stop = a.len - a_off < b.len - b_off ? a.len - a_off : b.len - b_off;
        if (limit < stop)
            stop = limit;
        const unsigned char *x = (const unsigned char *)a.buf + a_off;
        const unsigned char *y = (const unsigned char *)b.buf + b_off;
        while (n + 8 <= stop && memcmp(x + n, y + n, 8) == 0)
            n += 8;
        while (n < stop && x[n] == y[n])
            n++;
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(n);
}

/* ``obj``'s buffer, C-contiguous items of ``itemsize`` bytes (``flags`` adds e.g. PyBUF_WRITABLE),
 * into ``view``: 0, or -1 with nothing held (``TypeError(msg)`` when the items are another size). */
static int items_view(PyObject *obj, Py_buffer *view, int flags, Py_ssize_t itemsize,
                      const char *msg)
{
    if (PyObject_GetBuffer(obj, view, flags | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->itemsize != itemsize || view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, msg);
        return -1;
    }
    return 0;
}

static PyObject *narrow64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "narrow64(ints64, narrow) takes 2 arguments");
        return NULL;
    }
    int narrow = PyObject_IsTrue(args[1]);
    if (narrow < 0)
        return NULL;
    Py_buffer view;
    if (items_view(args[0], &view, 0, 8, "narrow64: a buffer of 8-byte ints is required") < 0)
        return NULL;
    Py_ssize_t n = view.len / 8;
    const uint64_t *src = (const uint64_t *)view.buf;
    uint64_t any = or_all64(src, n);
    PyObject *out = NULL;
    if ((any >> 32) != 0) {  /* a negative value (read as >= 2**63) or one >= 2**32 */
        out = Py_None;
        Py_INCREF(out);
    } else if (narrow && (any >> 16) == 0) {
        out = PyBytes_FromStringAndSize(NULL, n * 2);
        if (out != NULL)
            narrow_to16(src, (uint16_t *)PyBytes_AS_STRING(out), n);
    } else {
        out = PyBytes_FromStringAndSize(NULL, n * 4);
        if (out != NULL)
            narrow_to32(src, (uint32_t *)PyBytes_AS_STRING(out), n);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *fits32(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (items_view(arg, &view, 0, 8, "fits32: a buffer of 8-byte ints is required") < 0)
        return NULL;
    uint64_t any = or_all64((const uint64_t *)view.buf, view.len / 8);
    PyBuffer_Release(&view);
    return PyBool_FromLong((any >> 32) == 0);
}

static PyObject *max_u32(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (items_view(arg, &view, 0, 4, "max_u32: a buffer of 4-byte ids is required") < 0)
        return NULL;
    const uint32_t *ids = (const uint32_t *)view.buf;
    uint32_t hi = 0;
    for (Py_ssize_t i = 0; i < view.len / 4; i++)
        hi = ids[i] > hi ? ids[i] : hi;
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(hi);
}

/* claim_free(tags, alive, ids, owner): stamp ``owner`` on every id of ``ids`` whose tag is not
 * alive (``alive[tags[id]] == 0``); -1 when all were, else the index of the first id that was
 * held or came twice (its second time it carries ``owner``, alive) or lies past the tags, with
 * every stamp of this call undone (back to 0, "not held"). held_ids.py's bulk claim. */
static PyObject *claim_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "claim_free(tags, alive, ids, owner) takes 4 arguments");
        return NULL;
    }
    unsigned long owner = PyLong_AsUnsignedLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    const char *need = "claim_free: uint32 tags, uint8 counts, uint32 ids and a tag within the "
                       "counts are required";
    Py_buffer tv, av, iv;
    if (items_view(args[0], &tv, PyBUF_WRITABLE, 4, need) < 0)
        return NULL;
    if (items_view(args[1], &av, 0, 1, need) < 0) {
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (items_view(args[2], &iv, 0, 4, need) < 0) {
        PyBuffer_Release(&tv);
        PyBuffer_Release(&av);
        return NULL;
    }
    Py_ssize_t bad = -1;
    if ((Py_ssize_t)owner >= av.len) {
        PyErr_SetString(PyExc_TypeError, need);
        bad = -2;
    } else {
        uint32_t *tags = (uint32_t *)tv.buf;
        const uint8_t *alive = (const uint8_t *)av.buf;
        const uint32_t *ids = (const uint32_t *)iv.buf;
        Py_ssize_t n = iv.len / 4, ntags = tv.len / 4, i = 0;
        for (; i < n; i++) {
            uint32_t b = ids[i];
            if ((Py_ssize_t)b >= ntags || alive[tags[b]])
                break;
            tags[b] = (uint32_t)owner;
        }
        if (i < n) {
            bad = i;
            for (Py_ssize_t j = 0; j < i; j++)
                tags[ids[j]] = 0;
        }
    }
    PyBuffer_Release(&tv);
    PyBuffer_Release(&av);
    PyBuffer_Release(&iv);
    return bad == -2 ? NULL : PyLong_FromSsize_t(bad);
}

static PyObject *reversed_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "reversed_runs(runs, unit) takes 2 arguments");
        return NULL;
    }
    PyObject *runs = args[0], *unit = args[1];
    if (!PyList_Check(runs)) {
        PyErr_SetString(PyExc_TypeError, "reversed_runs: a list of uint32 buffers is required");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(runs), total = 0;
    Py_buffer *views = PyMem_Calloc(k ? k : 1, sizeof(Py_buffer));
    if (views == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    PyObject *out = NULL;
    for (; got < k; got++) {
        if (items_view(PyList_GET_ITEM(runs, got), &views[got], 0, 4,
                       "reversed_runs: every run must hold 4-byte ids") < 0)
            goto done;
        total += views[got].len / 4;
    }
    out = PySequence_Repeat(unit, total); /* e.g. array('I', [0]) * total: filled below */
    if (out == NULL)
        goto done;
    Py_buffer target;
    if (PyObject_GetBuffer(out, &target, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    if (target.itemsize != 4 || target.len != total * 4) {
        PyBuffer_Release(&target);
        Py_CLEAR(out);
        PyErr_SetString(PyExc_ValueError, "reversed_runs: unit must be one 4-byte item");
        goto done;
    }
    uint32_t *dst = (uint32_t *)target.buf;
    for (Py_ssize_t r = 0; r < k; r++) { /* run r, reversed, right after run r-1's */
        const uint32_t *src = (const uint32_t *)views[r].buf;
        Py_ssize_t n = views[r].len / 4;
        for (Py_ssize_t i = 0; i < n; i++)
            dst[i] = src[n - 1 - i];
        dst += n;
    }
    PyBuffer_Release(&target);
done:
    for (Py_ssize_t r = 0; r < got; r++)
        PyBuffer_Release(&views[r]);
    PyMem_Free(views);
    return out;
}

/* A non-negative int below 2**32 read from its digits (the common case: no call); 0 when it is
 * not one (another size or sign, or an interpreter whose layout this does not know): the caller
 * then converts it the general way. */
static inline int compact_u32(PyObject *item, long long *v)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item))
        return 0;
    Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)item);
    if (c < 0 || c > 0xFFFFFFFFLL)
        return 0;
    *v = (long long)c;
    return 1;
#elif PY_VERSION_HEX >= 0x030B0000 && PyLong_SHIFT == 30
    const PyLongObject *o = (const PyLongObject *)item;
    Py_ssize_t size = Py_SIZE(item);
    if (size == 0)
        *v = 0;
    else if (size == 1)
        *v = (long long)o->ob_digit[0];
    else if (size == 2 && (o->ob_digit[1] >> 2) == 0) /* below 2**32 */
        *v = (long long)o->ob_digit[0] | ((long long)o->ob_digit[1] << 30);
    else
        return 0;
    return 1;
#else
    (void)item;
    (void)v;
    return 0;
#endif
}

static PyObject *from_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "from_list(ids, narrow[, exact]) takes 2 or 3 arguments");
        return NULL;
    }
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_SetString(PyExc_TypeError, "from_list: a list or tuple is required");
        return NULL;
    }
    int narrow = PyObject_IsTrue(args[1]), exact = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (narrow < 0 || exact < 0)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL)
        return NULL;
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        int overflow;
        long long v;
        if (exact ? !PyLong_CheckExact(item) : !PyLong_Check(item))
            goto other;  /* not an int: the caller's path reports it */
        if (!compact_u32(item, &v)) {
            v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow || v < 0 || v > 0xFFFFFFFFLL)
                goto other;  /* out of range: likewise */
        }
        dst[i] = (uint32_t)v;
        any |= (uint32_t)v;
    }
    if (narrow && n && any <= 0xFFFF) {
        PyObject *small = PyBytes_FromStringAndSize(NULL, n * 2);
        if (small != NULL)
            narrow_32_to16(dst, (uint16_t *)PyBytes_AS_STRING(small), n);
        Py_DECREF(out);
        return small;
    }
    return out;
other:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack18", (PyCFunction)(void (*)(void))pack18, METH_FASTCALL, "Pack ids[start:stop] (whole groups of 4 below 2**18) into 9 bytes a group."},
    {"unpack18", unpack18, METH_VARARGS, "Token ids start..stop-1 of packed data, as uint32 bytes."},
    {"from_list", (PyCFunction)(void (*)(void))from_list, METH_FASTCALL,
     "A list or tuple of ints as uint32 (or uint16: narrow, all < 2**16) bytes; None for a non-int or out-of-range item."},
    {"narrow64", (PyCFunction)(void (*)(void))narrow64, METH_FASTCALL,
     "Native 64-bit ints as uint16 (narrow, all < 2**16) or uint32 bytes; None if any is outside [0, 2**32)."},
    {"fits32", fits32, METH_O, "Whether every native 64-bit int of the buffer is in [0, 2**32)."},
    {"max_u32", max_u32, METH_O, "The largest id of a uint32 buffer (0 when empty)."},
    {"claim_free", (PyCFunction)(void (*)(void))claim_free, METH_FASTCALL,
     "Stamp owner on ids whose tag is not alive; -1, or the first bad index (nothing stamped)."},
    {"reversed_runs", (PyCFunction)(void (*)(void))reversed_runs, METH_FASTCALL,
     "The uint32 runs (a list of buffers) concatenated in order, each reversed, into ``unit`` "
     "(one 4-byte item, e.g. array('I', [0])) repeated to their length."},
    {"common_bytes", common_bytes, METH_VARARGS, "Common prefix length of a[a_off:] and b[b_off:], at most limit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keypack", "The cache core's optional C helpers: 18-bit packed radix keys, int64 id narrowing.", -1, methods,
};

PyMODINIT_FUNC PyInit__keypack(void)
{
    return PyModule_Create(&module);
}
