/* Compiled twin of BlockPool's two hottest paths: allocate() of one base block and free() of a one-element list.
 *
 * The Python in kvlab/pool.py is the reference and stays the one to read: this file repeats only its
 * `hot path` branches, on the same lock, free stack, clock and metadata buffers, so both leave identical state
 * (tests/test_hotpath.py drives them side by side). Everything else -- batches, size classes, subscribers,
 * errors -- is handed to the Python method unchanged. Why it exists: in CPython a single-block allocate+free
 * spends ~1.5 us in bytecode (docs/benchmarks.md), three times a linked free queue; here it is a few C calls.
 *
 * BlockPool.__init__ builds one HotPath per pool and sets its methods as the instance's `allocate` and `free`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#ifndef KVLAB_SOURCE_SHA256
#define KVLAB_SOURCE_SHA256 "unknown"
#endif

enum field { STATUS, REFS, HITS, LAST, CREATED, OWNER, TOKENS, REUSABLE, NFIELDS };
static const Py_ssize_t ITEMSIZE[NFIELDS] = {1, 4, 8, 8, 8, 4, 4, 1};
static const char *FIELD[NFIELDS] = {"status", "refs", "hits", "last", "created", "owner", "tokens", "reusable"};

typedef struct {
    PyObject_HEAD
    PyObject *pool;                       /* the BlockPool (passed first to the Python methods) */
    PyObject *py_allocate, *py_free;      /* BlockPool.allocate / BlockPool.free, the reference paths */
    PyObject *acquire, *release;          /* pool.lock's bound methods */
    PyObject *pop, *push;                 /* pool._free[0]'s bound pop / append */
    PyObject *stack;                      /* pool._free[0] itself, an array('i'): its length says "empty" */
    PyObject *subs;                       /* pool._subs: any subscriber sends the call to Python */
    PyObject *clock, *tick;               /* pool.clock and its tick */
    Py_ssize_t step_offset;               /* where a LogicalClock keeps `step`, else 0: tick() is then called */
    Py_buffer buf[NFIELDS];               /* the pool's metadata arrays, indexed by enum field */
    int nbuf;                             /* how many of them are held (released in reverse) */
    Py_ssize_t num_blocks;
    int uniform;                          /* one size class: free() may take the fast path */
    uint8_t free_code, allocated_code;
    long long allocs, frees;              /* calls served here; BlockPool.lock_acquisitions adds them */
} HotPath;

static PyObject *one;

#define BUF(h, f, T) ((T *)(h)->buf[f].buf)

/* Hold a writable view of the next field's array (which also keeps it from being resized). */
static int hold(HotPath *h, PyObject *obj) {
    enum field f = h->nbuf;
    Py_buffer *view = &h->buf[f];
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    h->nbuf++;  /* held from here on, so dealloc releases it even if it is rejected below */
    if (view->itemsize != ITEMSIZE[f] || view->len < h->num_blocks * ITEMSIZE[f]) {
        PyErr_Format(PyExc_ValueError, "HotPath: %s must hold %zd items of %zd bytes", FIELD[f], h->num_blocks,
                     ITEMSIZE[f]);
        return -1;
    }
    return 0;
}

static void release_buffers(HotPath *h) {
    while (h->nbuf) PyBuffer_Release(&h->buf[--h->nbuf]);
}

static int traverse(HotPath *h, visitproc visit, void *arg) {
    Py_VISIT(h->pool); Py_VISIT(h->py_allocate); Py_VISIT(h->py_free); Py_VISIT(h->acquire);
    Py_VISIT(h->release); Py_VISIT(h->pop); Py_VISIT(h->push); Py_VISIT(h->stack); Py_VISIT(h->subs);
    Py_VISIT(h->clock); Py_VISIT(h->tick);
    for (int i = 0; i < h->nbuf; i++) Py_VISIT(h->buf[i].obj);
    return 0;
}

static int clear(HotPath *h) {
    Py_CLEAR(h->pool); Py_CLEAR(h->py_allocate); Py_CLEAR(h->py_free); Py_CLEAR(h->acquire);
    Py_CLEAR(h->release); Py_CLEAR(h->pop); Py_CLEAR(h->push); Py_CLEAR(h->stack); Py_CLEAR(h->subs);
    Py_CLEAR(h->clock); Py_CLEAR(h->tick);
    release_buffers(h);
    return 0;
}

static void dealloc(HotPath *h) {
    PyObject_GC_UnTrack(h);
    clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *attr(PyObject *obj, const char *name) { return PyObject_GetAttrString(obj, name); }

static int init(HotPath *h, PyObject *args, PyObject *kw) {
    PyObject *pool, *py_allocate, *py_free, *lock, *stack, *subs, *clock, *step_slot;
    PyObject *fields[NFIELDS];
    Py_ssize_t num_blocks;
    int uniform, free_code, allocated_code;
    static char *names[] = {"pool", "allocate", "free", "lock", "stack", "subscribers", "clock", "step_slot",
                            "status", "refs", "hits", "last", "created", "owner", "tokens", "reusable",
                            "num_blocks", "uniform", "free_code", "allocated_code", NULL};
    if (h->pool) {
        PyErr_SetString(PyExc_RuntimeError, "HotPath is already bound to a pool");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOO!OOOOOOOOOOnpii:HotPath", names, &pool, &py_allocate,
                                     &py_free, &lock, &stack, &PyList_Type, &subs, &clock, &step_slot,
                                     &fields[STATUS], &fields[REFS], &fields[HITS], &fields[LAST], &fields[CREATED],
                                     &fields[OWNER], &fields[TOKENS], &fields[REUSABLE], &num_blocks, &uniform,
                                     &free_code, &allocated_code))
        return -1;
    h->num_blocks = num_blocks;
    h->uniform = uniform;
    h->free_code = (uint8_t)free_code;
    h->allocated_code = (uint8_t)allocated_code;
    h->pool = Py_NewRef(pool);
    h->py_allocate = Py_NewRef(py_allocate);
    h->py_free = Py_NewRef(py_free);
    h->stack = Py_NewRef(stack);
    h->subs = Py_NewRef(subs);
    h->clock = Py_NewRef(clock);
    if (step_slot != Py_None) {  /* LogicalClock.step, a __slots__ member: tick it in place, as `step += 1` does */
        PyMemberDef *m = Py_IS_TYPE(step_slot, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)step_slot)->d_member
                                                                     : NULL;
        if (!m || m->type != T_OBJECT_EX ||
            !PyObject_TypeCheck(clock, ((PyMemberDescrObject *)step_slot)->d_common.d_type)) {
            PyErr_SetString(PyExc_TypeError, "HotPath: step_slot must be the clock's `step` slot, or None");
            return -1;
        }
        h->step_offset = m->offset;
    }
    if (!(h->acquire = attr(lock, "acquire")) || !(h->release = attr(lock, "release")) ||
        !(h->pop = attr(stack, "pop")) || !(h->push = attr(stack, "append")) || !(h->tick = attr(clock, "tick")))
        return -1;
    for (int f = 0; f < NFIELDS; f++)
        if (hold(h, fields[f]) < 0) return -1;
    return 0;
}

static int lock(HotPath *h) {
    PyObject *r = PyObject_CallNoArgs(h->acquire);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* Release the pool's lock, keeping any exception already raised (the `finally:` of the Python paths). */
static int unlock(HotPath *h) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallNoArgs(h->release);
    if (!r) {
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return 0;
}

/* A call after the garbage collector broke this object's cycle with its pool (from a finaliser, say). */
static PyObject *gone(void) {
    PyErr_SetString(PyExc_ReferenceError, "this BlockPool is being destroyed");
    return NULL;
}

/* clock.tick(): a new reference to the new time, or NULL with an exception set. */
static PyObject *tick(HotPath *h) {
    if (!h->step_offset) return PyObject_CallNoArgs(h->tick);
    PyObject **step = (PyObject **)((char *)h->clock + h->step_offset);
    if (!*step) {
        PyErr_SetString(PyExc_AttributeError, "the pool's LogicalClock has no step");
        return NULL;
    }
    PyObject *next = PyNumber_Add(*step, one);
    if (next) Py_SETREF(*step, Py_NewRef(next));
    return next;
}

/* The call as the Python method would get it: (pool, *args, **kwargs). */
static PyObject *delegate(HotPath *h, PyObject *func, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **all = total < 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (!all) return PyErr_NoMemory();
    all[0] = h->pool;
    for (Py_ssize_t i = 0; i < total; i++) all[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(func, all, nargs + 1, kwnames);
    if (all != small) PyMem_Free(all);
    return r;
}

/* Stamp t into an int64 field; a clock whose tick is no int is refused (the int64 fields cannot hold it). */
static int as_step(PyObject *t, int64_t *out) {
    if (!PyLong_Check(t)) {
        PyErr_Format(PyExc_TypeError, "the pool's clock must tick in ints, got %R", t);
        return -1;
    }
    *out = PyLong_AsLongLong(t);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Whether allocate's arguments ask for the hot path: n omitted or exactly 1, and nothing else but an owner
 * that an int32 field holds (-1 = none). Anything else, bad values included, goes to Python to be served or
 * refused there. */
static int hot_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, long long *owner) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int overflow = 0;
    *owner = -1;
    if (nargs > 1 || nkw > 1) return 0;
    if (nargs == 1 && !(PyLong_CheckExact(args[0]) && PyLong_AsLongLongAndOverflow(args[0], &overflow) == 1))
        return 0;
    if (nkw) {
        PyObject *o = args[nargs];
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "owner") || !PyLong_CheckExact(o))
            return 0;
        *owner = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || *owner < -1 || *owner > INT32_MAX) return 0;
    }
    return 1;
}

/* allocate(n=1, *, owner=-1): the hot path of BlockPool.allocate. */
static PyObject *hot_allocate(HotPath *h, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    long long owner;
    int hot = hot_arguments(args, nargs, kwnames, &owner);
    if (!h->pool) return gone();
    if (!hot) return delegate(h, h->py_allocate, args, nargs, kwnames);  /* validates and words errors */
    if (lock(h) < 0) return NULL;
    if (PyList_GET_SIZE(h->subs) || Py_SIZE(h->stack) == 0) {  /* events to build, or a split/eviction due */
        if (unlock(h) < 0) return NULL;
        return delegate(h, h->py_allocate, args, nargs, kwnames);
    }
    PyObject *t = tick(h), *b = NULL, *out = NULL;
    int64_t step;
    if (!t || as_step(t, &step) < 0 || !(b = PyObject_CallNoArgs(h->pop))) goto done;
    Py_ssize_t i = PyLong_AsSsize_t(b);
    BUF(h, STATUS, uint8_t)[i] = h->allocated_code;
    BUF(h, REFS, int32_t)[i] = 1;
    BUF(h, HITS, int64_t)[i] = 1;
    BUF(h, LAST, int64_t)[i] = BUF(h, CREATED, int64_t)[i] = step;
    if (owner != -1) BUF(h, OWNER, int32_t)[i] = (int32_t)owner;
    if (!(out = PyList_New(1))) goto done;
    PyList_SET_ITEM(out, 0, b);
    b = NULL;
    h->allocs++;
done:
    Py_XDECREF(t);
    Py_XDECREF(b);
    if (unlock(h) < 0) Py_CLEAR(out);
    return out;
}

/* free(ids): the hot path of BlockPool.free, a list of one base block holding its only reference. */
static PyObject *hot_free(HotPath *h, PyObject *ids) {
    Py_ssize_t i = -1;
    PyObject *b = NULL;
    if (!h->pool) return gone();
    if (h->uniform && PyList_CheckExact(ids) && PyList_GET_SIZE(ids) == 1 &&
        PyLong_CheckExact(PyList_GET_ITEM(ids, 0))) {
        int overflow;
        b = PyList_GET_ITEM(ids, 0);
        long long v = PyLong_AsLongLongAndOverflow(b, &overflow);
        if (!overflow && v >= 0 && v < h->num_blocks) i = (Py_ssize_t)v;
    }
    if (i < 0) return PyObject_CallFunctionObjArgs(h->py_free, h->pool, ids, NULL);
    Py_INCREF(b);  /* the id stays ours even if another thread changes the caller's list */
    if (lock(h) < 0) {
        Py_DECREF(b);
        return NULL;
    }
    if (PyList_GET_SIZE(h->subs) || BUF(h, STATUS, uint8_t)[i] != h->allocated_code ||
        BUF(h, REFS, int32_t)[i] != 1 || BUF(h, REUSABLE, uint8_t)[i]) {  /* shared, cached, double free... */
        Py_DECREF(b);
        if (unlock(h) < 0) return NULL;
        return PyObject_CallFunctionObjArgs(h->py_free, h->pool, ids, NULL);
    }
    BUF(h, STATUS, uint8_t)[i] = h->free_code;
    BUF(h, REFS, int32_t)[i] = BUF(h, TOKENS, int32_t)[i] = 0;
    BUF(h, OWNER, int32_t)[i] = -1;
    PyObject *r = PyObject_CallOneArg(h->push, b), *t = NULL;
    Py_DECREF(b);
    if (r) {
        h->frees++;
        t = tick(h);
    }
    int ok = r && t;
    Py_XDECREF(r);
    Py_XDECREF(t);
    if (unlock(h) < 0 || !ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))hot_allocate, METH_FASTCALL | METH_KEYWORDS,
     "BlockPool.allocate, with one base block served in C (see kvlab/_hotpath.c)."},
    {"free", (PyCFunction)hot_free, METH_O,
     "BlockPool.free, with a one-block list served in C (see kvlab/_hotpath.c)."},
    {NULL},
};

static PyMemberDef members[] = {
    {"allocs", T_LONGLONG, offsetof(HotPath, allocs), READONLY, "single-block allocations served in C"},
    {"frees", T_LONGLONG, offsetof(HotPath, frees), READONLY, "single-block frees served in C"},
    {"stack", T_OBJECT, offsetof(HotPath, stack), READONLY, "the free stack it pops and pushes"},
    {"clock", T_OBJECT, offsetof(HotPath, clock), READONLY, "the clock it ticks"},
    {NULL},
};

static PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab._hotpath.HotPath",
    .tp_doc = "The single-block allocate/free paths of one BlockPool, in C.",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)init,
    .tp_dealloc = (destructor)dealloc,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_methods = methods,
    .tp_members = members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_hotpath",
                                    .m_doc = "Compiled hot paths of kvlab.BlockPool.", .m_size = -1};

PyMODINIT_FUNC PyInit__hotpath(void) {
    if (PyType_Ready(&HotPathType) < 0) return NULL;
    if (!one && !(one = PyLong_FromLong(1))) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", KVLAB_SOURCE_SHA256) < 0 ||
        PyModule_AddObjectRef(m, "HotPath", (PyObject *)&HotPathType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
