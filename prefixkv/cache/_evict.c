/* prefixkv.cache._evict: whole-leaf eviction steps of a radix index, in C (optional).
 *
 * The Python eviction loop (prefixkv/cache/eviction.py) spends about 2 us of interpreter work
 * per evicted leaf: a heap pop, a key probe, a detach, a release. This module runs the common
 * step of that loop, on the same Python objects, and hands the loop back to Python at the
 * first step that is not common:
 *
 *   the heap's top item is live and untouched (else Python settles it: re-key, drop stale);
 *   the next top (the smaller of the top's two children) is too;
 *   if more than one block is to go, the top's key's first component is strictly below the
 *     next top's (the policy declares that component independent of depth, so every key probe
 *     of the leaf at a smaller depth is below the next top too: the whole run goes at once);
 *   a leaf that goes whole is the one child its parent maps its first token to (no tuple).
 *
 * Such a step pops the item (heapq's algorithm; an item compares by its first component when
 * both are floats that differ, else as a tuple, which is the same order). A leaf whose blocks
 * fit in what is still wanted is detached as RadixForest.drop_tail does, its id array appended
 * to ``runs`` and released through its owner tag as HeldIds.release_owner does (a run whose
 * tag other entries still share goes to ``loose``, released id by id by the caller); when its
 * parent is left a childless non-root the runner stops and returns the node: Python's parent
 * rule follows. A leaf with more blocks gives up the tail still wanted (the call's last step):
 * the ids sliced off into ``runs`` and ``loose``, the key shortened, the leaf re-filed by the
 * heap's own push.
 *
 * Runner(heap, held, forest, node_type, detached, block_size)
 *     heap: the EvictableHeap (flat items only), held: the HeldIds, forest: the RadixForest
 *     (its _num_entries and _cached_tokens), node_type: RadixNode, detached: the shared empty
 *     id array of evicted nodes. Slot offsets are read once from the classes' descriptors.
 * Runner.run(want, got, runs, loose) -> (got, entries_freed, orphan or None)
 *     frees whole leaves while the steps stay common and got < want (blocks).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

typedef struct {
    PyObject_HEAD
    PyObject *heap, *held, *forest, *detached, *epoch_name, *entries_name, *tokens_name;
    PyObject *policy, *push; /* the heap's policy and its push (a trimmed leaf re-filed) */
    PyTypeObject *node_type;
    long bs;
    /* RadixNode / EntryState slots */
    Py_ssize_t blocks, children, key, owner, parent, heap_ver, in_heap, tick, num_children;
    Py_ssize_t h_heap, h_live, h_flat, h_epoch; /* EvictableHeap */
    Py_ssize_t i_alive, i_count;                 /* HeldIds */
} Runner;

/* The offset of slot ``name`` of ``type`` (a member descriptor holding an object), or -1. */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name)
{
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL)
        return -1;
    Py_ssize_t off = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX)
            off = m->offset;
    }
    Py_DECREF(d);
    if (off < 0)
        PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", type->tp_name, name);
    return off;
}

static void set_slot(PyObject *o, Py_ssize_t off, PyObject *v) /* steals v */
{
    PyObject *old = SLOT(o, off);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* slot += delta for an int slot; -1 on error. */
static int add_slot(PyObject *o, Py_ssize_t off, long delta)
{
    PyObject *v = SLOT(o, off);
    if (v == NULL || !PyLong_CheckExact(v)) {
        PyErr_SetString(PyExc_TypeError, "an int slot holds something else");
        return -1;
    }
    PyObject *d = PyLong_FromLong(delta), *s = d ? PyNumber_Add(v, d) : NULL;
    Py_XDECREF(d);
    if (s == NULL)
        return -1;
    set_slot(o, off, s);
    return 0;
}

/* forest.name -= delta (a plain attribute). */
static int sub_attr(PyObject *o, PyObject *name, long long delta)
{
    if (delta == 0)
        return 0;
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    PyObject *d = PyLong_FromLongLong(delta), *s = d ? PyNumber_Subtract(v, d) : NULL;
    Py_DECREF(v);
    Py_XDECREF(d);
    int rc = s ? PyObject_SetAttr(o, name, s) : -1;
    Py_XDECREF(s);
    return rc;
}

/* a < b for two heap items: their first components when both are floats that differ (the
 * tuples' own order then), else the tuples compared; -1 on error. */
static int lt(PyObject *a, PyObject *b)
{
    PyObject *a0 = PyTuple_GET_ITEM(a, 0), *b0 = PyTuple_GET_ITEM(b, 0);
    if (PyFloat_CheckExact(a0) && PyFloat_CheckExact(b0)) {
        double x = PyFloat_AS_DOUBLE(a0), y = PyFloat_AS_DOUBLE(b0);
        if (x < y)
            return 1;
        if (x > y)
            return 0;
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* heapq's _siftdown and _siftup (the same moves), on a list of tuples. */
static int siftdown(PyObject *heap, Py_ssize_t start, Py_ssize_t pos)
{
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > start) {
        Py_ssize_t parent = (pos - 1) >> 1;
        PyObject **arr = ((PyListObject *)heap)->ob_item;
        int c = lt(arr[pos], arr[parent]);
        if (c < 0)
            return -1;
        if (size != PyList_GET_SIZE(heap)) {
            PyErr_SetString(PyExc_RuntimeError, "the heap changed size during a comparison");
            return -1;
        }
        if (!c)
            break;
        arr = ((PyListObject *)heap)->ob_item;
        PyObject *t = arr[parent];
        arr[parent] = arr[pos];
        arr[pos] = t;
        pos = parent;
    }
    return 0;
}

static int siftup(PyObject *heap, Py_ssize_t pos)
{
    Py_ssize_t end = PyList_GET_SIZE(heap), start = pos, limit = end >> 1;
    while (pos < limit) {
        Py_ssize_t child = 2 * pos + 1;
        PyObject **arr = ((PyListObject *)heap)->ob_item;
        if (child + 1 < end) {
            int c = lt(arr[child], arr[child + 1]);
            if (c < 0)
                return -1;
            if (end != PyList_GET_SIZE(heap)) {
                PyErr_SetString(PyExc_RuntimeError, "the heap changed size during a comparison");
                return -1;
            }
            child += c ^ 1;
        }
        arr = ((PyListObject *)heap)->ob_item;
        PyObject *t = arr[child];
        arr[child] = arr[pos];
        arr[pos] = t;
        pos = child;
    }
    return siftdown(heap, start, pos);
}

/* heapq.heappop: a new reference to the smallest item. */
static PyObject *heap_pop(PyObject *heap)
{
    Py_ssize_t n = PyList_GET_SIZE(heap);
    PyObject *last = PyList_GET_ITEM(heap, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    if (n == 1)
        return last;
    PyObject *ret = PyList_GET_ITEM(heap, 0); /* its reference passes to the caller */
    PyList_SET_ITEM(heap, 0, last);
    if (siftup(heap, 0) < 0) {
        Py_DECREF(ret);
        return NULL;
    }
    return ret;
}

/* Whether ``item`` is live and untouched (EvictableHeap._settle_top would keep it): its entry
 * is a node in the heap at the item's version and tick. 1 / 0, -1 on error. */
static int settled(Runner *R, PyObject *item)
{
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) < 5)
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(item);
    PyObject *e = PyTuple_GET_ITEM(item, n - 1);
    if (!PyObject_TypeCheck(e, R->node_type) || SLOT(e, R->in_heap) != Py_True)
        return 0;
    PyObject *ver = SLOT(e, R->heap_ver), *tick = SLOT(e, R->tick);
    if (ver == NULL || tick == NULL)
        return 0;
    int c = PyObject_RichCompareBool(PyTuple_GET_ITEM(item, n - 3), ver, Py_EQ);
    if (c <= 0)
        return c;
    return PyObject_RichCompareBool(PyTuple_GET_ITEM(item, n - 2), tick, Py_EQ);
}

/* A node key's first token (its place in the parent's children): packed bytes or an array. */
static PyObject *first_token(PyObject *key)
{
    if (PyBytes_CheckExact(key)) {
        if (PyBytes_GET_SIZE(key) < 3)
            return NULL;
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(key);
        return PyLong_FromUnsignedLong(b[0] | (unsigned long)b[1] << 8 | (unsigned long)(b[2] & 3) << 16);
    }
    Py_buffer v;
    if (PyObject_GetBuffer(key, &v, PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *out = NULL;
    if (v.len > 0 && v.itemsize == 2 && v.format && v.format[0] == 'H' && !v.format[1])
        out = PyLong_FromUnsignedLong(*(const uint16_t *)v.buf);
    else if (v.len > 0 && v.itemsize == 4 && v.format && v.format[0] == 'I' && !v.format[1])
        out = PyLong_FromUnsignedLong(*(const uint32_t *)v.buf);
    PyBuffer_Release(&v);
    return out;
}

/* Start fetching the memory a freed run will be read and released from: the ids (the join reads
 * them once, after the runner, when they are cold by then) and the line past them (free() reads
 * the next chunk's header). The memory system fetches them while the runner works on. */
static void prefetch_run(PyObject *ids)
{
#if defined(__GNUC__)
    Py_buffer v;
    if (PyObject_GetBuffer(ids, &v, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return;
    }
    const char *p = (const char *)v.buf, *end = p + v.len + 64;
    for (; p < end; p += 64)
        __builtin_prefetch(p, 0, 3);
    PyBuffer_Release(&v);
#else
    (void)ids;
#endif
}

/* Detach leaf ``e`` (whole) as RadixForest.drop_tail does; its ids go to runs (and loose when
 * its tag is shared); returns the ids' count, -1 on error. ``first`` is its key's first token,
 * ``children`` its parent's dict (checked to map first to e). */
static Py_ssize_t detach(Runner *R, PyObject *e, PyObject *parent, PyObject *children,
                         PyObject *first, PyObject *runs, PyObject *loose, long long *released)
{
    PyObject *blocks = SLOT(e, R->blocks);
    Py_ssize_t nb = PyObject_Length(blocks);
    Py_INCREF(blocks);
    Py_INCREF(R->detached);
    set_slot(e, R->blocks, R->detached);
    int rc = PyDict_DelItem(children, first);
    rc = rc < 0 ? rc : add_slot(parent, R->num_children, -1);
    rc = rc < 0 ? rc : PyList_Append(runs, blocks);
    if (rc == 0) {
        prefetch_run(blocks);
        PyObject *owner = SLOT(e, R->owner), *alive = SLOT(R->held, R->i_alive);
        Py_ssize_t o = owner ? PyLong_AsSsize_t(owner) : 0;
        if (o == -1 && PyErr_Occurred())
            rc = -1;
        else if (o > 0 && PyByteArray_CheckExact(alive) && o < PyByteArray_GET_SIZE(alive)) {
            unsigned char *a = (unsigned char *)PyByteArray_AS_STRING(alive) + o;
            if (*a == 0) { /* HeldIds.release_owner would fail the same way (a byte below 0) */
                PyErr_SetString(PyExc_ValueError, "evict: an owner tag with no holder left");
                Py_DECREF(blocks);
                return -1;
            }
            *a -= 1;
            if (*a)
                rc = PyList_Append(loose, blocks);
            else
                *released += nb;
        } else
            rc = PyList_Append(loose, blocks);
    }
    Py_DECREF(blocks);
    return rc < 0 ? -1 : nb;
}

/* Pop the top item (its entry ``e``) as EvictableHeap.pop does. */
static int pop_top(Runner *R, PyObject *heap, PyObject *e)
{
    PyObject *item = heap_pop(heap);
    int rc = item == NULL || add_slot(e, R->heap_ver, 1) < 0 || add_slot(R->heap, R->h_live, -1) < 0;
    Py_XDECREF(item);
    if (rc)
        return -1;
    Py_INCREF(Py_False);
    set_slot(e, R->in_heap, Py_False);
    return 0;
}

/* The top leaf ``e`` (``nb`` blocks) gives up its last ``k`` < nb: popped, cut as
 * RadixForest.drop_tail does (ids sliced off, key shortened), the ids to runs and loose (a
 * trimmed tail is released id by id), then re-filed by the heap's own push. */
static int drop_part(Runner *R, PyObject *e, PyObject *blocks, PyObject *key, Py_ssize_t nb,
                     Py_ssize_t k, PyObject *runs, PyObject *loose)
{
    PyObject *heap = SLOT(R->heap, R->h_heap);
    Py_ssize_t keep = nb - k;
    Py_INCREF(e);
    int rc = pop_top(R, heap, e);
    PyObject *ids = rc < 0 ? NULL : PySequence_GetSlice(blocks, keep, nb);
    rc = ids == NULL ? -1 : PySequence_DelSlice(blocks, keep, nb);
    if (rc == 0 && PyBytes_CheckExact(key)) { /* packed: 9 bytes per 4 tokens */
        PyObject *cut = PyBytes_FromStringAndSize(PyBytes_AS_STRING(key), keep * R->bs * 9 / 4);
        if (cut == NULL)
            rc = -1;
        else
            set_slot(e, R->key, cut);
    } else if (rc == 0)
        rc = PySequence_DelSlice(key, keep * R->bs, PY_SSIZE_T_MAX);
    rc = rc < 0 ? rc : PyList_Append(runs, ids);
    rc = rc < 0 ? rc : PyList_Append(loose, ids);
    if (rc == 0) {
        PyObject *r = PyObject_CallOneArg(R->push, e);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_XDECREF(ids);
    Py_DECREF(e);
    return rc;
}

static PyObject *Runner_run(Runner *R, PyObject *args)
{
    Py_ssize_t want, got;
    PyObject *runs, *loose;
    if (!PyArg_ParseTuple(args, "nnO!O!", &want, &got, &PyList_Type, &runs, &PyList_Type, &loose))
        return NULL;
    long long freed = 0, blocks_freed = 0, released = 0;
    PyObject *orphan = NULL;
    int err = 0;
    PyObject *epoch = PyObject_GetAttr(R->policy, R->epoch_name);
    PyObject *mine = SLOT(R->heap, R->h_epoch), *flat = SLOT(R->heap, R->h_flat);
    PyObject *heap = SLOT(R->heap, R->h_heap);
    int ok = epoch && mine && flat && heap && PyList_CheckExact(heap) && PyLong_CheckExact(flat)
             && PyLong_AsLong(flat) > 0;
    if (ok) {
        int same = PyObject_RichCompareBool(epoch, mine, Py_EQ);
        err = same < 0;
        ok = same > 0;
    }
    Py_XDECREF(epoch);
    if (epoch == NULL)
        return NULL;
    while (ok && !err && got < want) {
        Py_ssize_t n = PyList_GET_SIZE(heap);
        if (n == 0)
            break;
        PyObject *top = PyList_GET_ITEM(heap, 0);
        int s = settled(R, top);
        if (s <= 0) {
            err = s < 0;
            break;
        }
        PyObject *e = PyTuple_GET_ITEM(top, PyTuple_GET_SIZE(top) - 1);
        PyObject *blocks = SLOT(e, R->blocks), *parent = SLOT(e, R->parent);
        PyObject *key = SLOT(e, R->key);
        if (blocks == NULL || parent == NULL || parent == Py_None || key == NULL
            || !PyObject_TypeCheck(parent, R->node_type))
            break;
        Py_ssize_t nb = PyObject_Length(blocks);
        if (nb <= 0)
            break;
        int part = got + nb > want; /* a tail only: the last step of the call */
        if (n >= 2) { /* the next top: the smaller child, live and untouched */
            PyObject *next = PyList_GET_ITEM(heap, 1);
            if (n >= 3) {
                int c = lt(PyList_GET_ITEM(heap, 2), next);
                if (c < 0) {
                    err = 1;
                    break;
                }
                if (c)
                    next = PyList_GET_ITEM(heap, 2);
            }
            s = settled(R, next);
            if (s <= 0) {
                err = s < 0;
                break;
            }
            if ((part ? want - got : nb) > 1) { /* the run only when the heads say so */
                PyObject *a = PyTuple_GET_ITEM(top, 0), *b = PyTuple_GET_ITEM(next, 0);
                int c = PyObject_RichCompareBool(a, b, Py_LT);
                if (c <= 0) {
                    err = c < 0;
                    break;
                }
            }
        }
        if (part) {
            err = drop_part(R, e, blocks, key, nb, want - got, runs, loose) < 0;
            if (!err) {
                blocks_freed += want - got;
                got = want;
            }
            break;
        }
        PyObject *children = SLOT(parent, R->children);
        if (children == NULL || !PyDict_CheckExact(children))
            break;
        PyObject *first = first_token(key);
        if (first == NULL) {
            err = PyErr_Occurred() != NULL;
            break;
        }
        PyObject *found = PyDict_GetItemWithError(children, first);
        if (found != e) {
            Py_DECREF(first);
            err = PyErr_Occurred() != NULL;
            break;
        }
        /* commit: pop the item (as EvictableHeap.pop), then drop the node */
        Py_INCREF(e);
        Py_INCREF(parent);
        err = pop_top(R, heap, e) < 0;
        if (!err) {
            Py_ssize_t k = detach(R, e, parent, children, first, runs, loose, &released);
            if (k < 0)
                err = 1;
            else {
                got += k;
                freed += 1;
                blocks_freed += k;
            }
        }
        Py_DECREF(first);
        if (!err) {
            PyObject *grand = SLOT(parent, R->parent), *kids = SLOT(parent, R->num_children);
            if (grand != NULL && grand != Py_None && kids != NULL && PyLong_CheckExact(kids)
                && PyLong_AsLong(kids) == 0) {
                orphan = e; /* the parent rule is Python's */
                Py_INCREF(orphan);
            }
        }
        Py_DECREF(parent);
        Py_DECREF(e);
        if (orphan != NULL)
            break;
    }
    /* the counters, also after an error: what was detached is accounted for */
    PyObject *exc = NULL, *val = NULL, *tb = NULL;
    if (err)
        PyErr_Fetch(&exc, &val, &tb);
    int bad = sub_attr(R->forest, R->entries_name, freed) < 0
              || sub_attr(R->forest, R->tokens_name, blocks_freed * R->bs) < 0
              || (released && add_slot(R->held, R->i_count, -(long)released) < 0);
    if (err) {
        if (bad)
            PyErr_Clear();
        PyErr_Restore(exc, val, tb);
    }
    if (err || bad) {
        Py_XDECREF(orphan);
        return NULL;
    }
    return Py_BuildValue("nLN", got, freed, orphan ? orphan : Py_NewRef(Py_None));
}

static int Runner_init(Runner *R, PyObject *args, PyObject *kw)
{
    PyObject *heap, *held, *forest, *detached;
    PyTypeObject *node_type;
    long bs;
    if (!PyArg_ParseTuple(args, "OOOO!Ol", &heap, &held, &forest, &PyType_Type, &node_type,
                          &detached, &bs))
        return -1;
    PyTypeObject *ht = Py_TYPE(heap), *it = Py_TYPE(held);
#define OFF(field, type, name) \
    if ((R->field = slot_offset(type, name)) < 0) \
        return -1;
    OFF(blocks, node_type, "blocks") OFF(children, node_type, "children")
    OFF(key, node_type, "key") OFF(owner, node_type, "owner") OFF(parent, node_type, "parent")
    OFF(heap_ver, node_type, "heap_ver") OFF(in_heap, node_type, "in_heap")
    OFF(tick, node_type, "tick") OFF(num_children, node_type, "num_children")
    OFF(h_heap, ht, "_heap") OFF(h_live, ht, "_live") OFF(h_flat, ht, "_flat")
    OFF(h_epoch, ht, "_epoch") OFF(i_alive, it, "_alive") OFF(i_count, it, "count")
#undef OFF
    PyObject *policy = PyObject_GetAttrString(heap, "policy");
    if (policy == NULL)
        return -1;
    Py_XSETREF(R->policy, policy);
    PyObject *push = PyObject_GetAttrString(heap, "push");
    if (push == NULL)
        return -1;
    Py_XSETREF(R->push, push);
    Py_XSETREF(R->heap, Py_NewRef(heap));
    Py_XSETREF(R->held, Py_NewRef(held));
    Py_XSETREF(R->forest, Py_NewRef(forest));
    Py_XSETREF(R->detached, Py_NewRef(detached));
    Py_XSETREF(R->node_type, (PyTypeObject *)Py_NewRef(node_type));
    Py_XSETREF(R->epoch_name, PyUnicode_InternFromString("key_epoch"));
    Py_XSETREF(R->entries_name, PyUnicode_InternFromString("_num_entries"));
    Py_XSETREF(R->tokens_name, PyUnicode_InternFromString("_cached_tokens"));
    R->bs = bs;
    return R->epoch_name && R->entries_name && R->tokens_name ? 0 : -1;
}

static int Runner_traverse(Runner *R, visitproc visit, void *arg)
{
    Py_VISIT(R->heap);
    Py_VISIT(R->held);
    Py_VISIT(R->forest);
    Py_VISIT(R->detached);
    Py_VISIT(R->policy);
    Py_VISIT(R->push);
    Py_VISIT(R->node_type);
    return 0;
}

static int Runner_clear(Runner *R)
{
    Py_CLEAR(R->heap);
    Py_CLEAR(R->held);
    Py_CLEAR(R->forest);
    Py_CLEAR(R->detached);
    Py_CLEAR(R->policy);
    Py_CLEAR(R->push);
    Py_CLEAR(R->node_type);
    Py_CLEAR(R->epoch_name);
    Py_CLEAR(R->entries_name);
    Py_CLEAR(R->tokens_name);
    return 0;
}

static void Runner_dealloc(Runner *R)
{
    PyObject_GC_UnTrack(R);
    Runner_clear(R);
    Py_TYPE(R)->tp_free((PyObject *)R);
}

static PyMethodDef Runner_methods[] = {
    {"run", (PyCFunction)Runner_run, METH_VARARGS,
     "run(want, got, runs, loose) -> (got, entries_freed, orphan): free whole leaves while "
     "the steps stay common (module doc)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RunnerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixkv.cache._evict.Runner",
    .tp_basicsize = sizeof(Runner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Whole-leaf eviction steps of one radix index (module doc).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Runner_init,
    .tp_dealloc = (destructor)Runner_dealloc,
    .tp_traverse = (traverseproc)Runner_traverse,
    .tp_clear = (inquiry)Runner_clear,
    .tp_methods = Runner_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "prefixkv.cache._evict",
    "Whole-leaf eviction steps of a radix index in C (see the source's head comment).", -1, NULL,
};

PyMODINIT_FUNC PyInit__evict(void)
{
    if (PyType_Ready(&RunnerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RunnerType);
    if (PyModule_AddObject(m, "Runner", (PyObject *)&RunnerType) < 0) {
        Py_DECREF(&RunnerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
