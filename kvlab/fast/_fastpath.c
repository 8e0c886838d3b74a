/* FastPath: the base type that makes kvlab.fast.pool.FastBlockPool's allocate() and free() run in C.
 *
 * kvlab/core/pool.py is the reference and the code to read; kvlab/fast/pool.py says in Python what this file does in C.
 * FastBlockPool inherits from this type, so `pool.allocate` / `pool.free` are methods of the class. Each serves
 * the common case of a one-size pool entirely here -- allocate(n[, owner=o]) of base blocks the free stack holds,
 * free(list) of distinct blocks that each hold their only reference and keep no reusable data -- on the pool's
 * own lock, free stack, clock, counters, metadata buffers and event bus, publishing the same events as the
 * reference. Any other call (other arguments, size classes, shared or cached blocks, errors) goes unchanged to
 * the Python method, which serves it or words the error. tests/test_perf.py holds all three pools equal.
 *
 * set_token_counts(ids, counts), incref(ids) and mark_reusable(ids) of a one-size pool run here too (the
 * engine calls them every step, a prefix-cache hit or store once per prompt). Four module functions serve the
 * layers above: token_bytes checks and converts a prompt's token ids for FastSequenceManager.create and
 * FastPrefixCache's lookups, walk_chain is FastPrefixCache's lookup loop, and plan_append and apply_append are
 * FastSequenceManager.append_tokens's loop over the batch: they read and write the sequences' fields exactly as
 * SequenceManager.append_tokens does for its common batch, while the pool calls in between stay the pool's.
 *
 * Why: in CPython a one-block allocate+free spends most of its time in bytecode dispatch and method calls
 * (docs/benchmarks.md); here it is a few C calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#ifndef KVLAB_SOURCE_SHA256
#define KVLAB_SOURCE_SHA256 "unknown"
#endif

enum field { STATUS, REFCOUNT, HITS, LAST_ACCESS, CREATED, OWNER, TOKENS, REUSABLE, NFIELDS };
static const char *FIELD[NFIELDS] = {"status", "refcount", "hits", "last_access", "created", "owner", "tokens",
                                     "reusable"};
static const Py_ssize_t ITEMSIZE[NFIELDS] = {1, 4, 8, 8, 8, 4, 4, 1};
enum { FREE = 0, PENDING = 1, ALLOCATED = 2 };
#define SMALL 64 /* ids kept on the C stack; longer calls use the heap */

/* PoolLock: a reentrant lock like threading.RLock, whose acquire and release the fast paths call directly (an
 * RLock's acquire parses its arguments on every call: a sixth of a compiled allocate+free pair). All its state
 * is read and written with the GIL held, so an uncontended acquire and release are a few loads and stores: no
 * OS lock, whose non-blocking acquire still reads the clock for a deadline (a tenth of the pair). Only a thread
 * that finds it held lets go of the GIL, to wait on `gate`, which the last release opens when someone waits. */
#ifdef Py_GIL_DISABLED
#error "PoolLock keeps its state under the GIL: build kvlab without the C on a free-threaded CPython"
#endif
typedef struct {
    PyObject_HEAD
    PyThread_type_lock gate; /* locked, except from a release that found waiters until a waiter takes it */
    unsigned long owner;     /* thread ident of the holder, while count > 0 */
    unsigned long count;     /* how many times the holder has acquired it */
    unsigned long waiters;   /* threads waiting at the gate */
    int opened;              /* the gate was opened and the waiter it let through has not run yet */
} PoolLock;

static PyTypeObject PoolLockType;

static PyObject *plock_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "PoolLock() takes no arguments");
        return NULL;
    }
    PoolLock *l = (PoolLock *)tp->tp_alloc(tp, 0);
    if (l && !(l->gate = PyThread_allocate_lock())) {
        Py_DECREF(l);
        return PyErr_NoMemory();
    }
    if (l) PyThread_acquire_lock(l->gate, WAIT_LOCK);  /* shut: a new lock is free, and the gate is for waiting */
    return (PyObject *)l;
}

static void plock_dealloc(PoolLock *l) {  /* nobody waits: a waiter's call holds a reference to the pool */
    if (l->gate) {
        if (!l->opened) PyThread_release_lock(l->gate);
        PyThread_free_lock(l->gate);
    }
    Py_TYPE(l)->tp_free((PyObject *)l);
}

/* Take the lock; -1 with the exception set when a signal handler raised while waiting (Ctrl-C interrupts a
 * wait, as it does threading.RLock's). A waiter that leaves so never took the gate: one the last release opened
 * stays open, and the next waiter through it finds the lock held or free as it really is. */
static int plock_take(PoolLock *l) {
    unsigned long me = PyThread_get_thread_ident();
    if (l->count && l->owner == me) {
        l->count++;
        return 0;
    }
    while (l->count) {  /* another thread holds it: wait at the gate without the GIL, then look again */
        PyLockStatus got;
        l->waiters++;
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(l->gate, -1, 1);  /* shut again behind us, unless interrupted */
        Py_END_ALLOW_THREADS
        l->waiters--;
        if (got == PY_LOCK_INTR) {
            if (Py_MakePendingCalls() < 0) return -1;  /* run the signal handlers; KeyboardInterrupt stops here */
            continue;
        }
        l->opened = 0;
    }
    l->owner = me;
    l->count = 1;
    return 0;
}

static int plock_give(PoolLock *l) {
    if (!l->count || l->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release a PoolLock this thread does not hold");
        return -1;
    }
    if (!--l->count && l->waiters && !l->opened) {  /* let one waiter through (once until it has run) */
        l->opened = 1;
        PyThread_release_lock(l->gate);
    }
    return 0;
}

static PyObject *plock_acquire(PoolLock *l, PyObject *unused) {
    if (plock_take(l) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *plock_release(PoolLock *l, PyObject *unused) {
    if (plock_give(l) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *plock_exit(PoolLock *l, PyObject *const *args, Py_ssize_t nargs) {
    if (plock_give(l) < 0) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *plock_held(PoolLock *l, PyObject *unused) {
    return PyBool_FromLong(l->count && l->owner == PyThread_get_thread_ident());
}

static PyMethodDef plock_methods[] = {
    {"acquire", (PyCFunction)plock_acquire, METH_NOARGS, "Take the lock (again, if this thread holds it)."},
    {"release", (PyCFunction)plock_release, METH_NOARGS, "Give back one acquisition."},
    {"__enter__", (PyCFunction)plock_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))plock_exit, METH_FASTCALL, NULL},
    {"held", (PyCFunction)plock_held, METH_NOARGS, "Whether this thread holds the lock."},
    {NULL},
};

static PyTypeObject PoolLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab.fast._fastpath.PoolLock",
    .tp_doc = "A reentrant lock (as threading.RLock) that FastBlockPool's compiled paths take without a method call.",
    .tp_basicsize = sizeof(PoolLock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = plock_new,
    .tp_dealloc = (destructor)plock_dealloc,
    .tp_methods = plock_methods,
};

/* Where an event class (a slotted dataclass, kvlab.core.events) keeps its fields, in __init__'s order: an event is
 * then built by filling its slots in place rather than through the class's Python __init__, which costs more
 * than the allocation it reports whenever a live view listens. n == 0: build it by calling the class. */
#define NLAYOUT 4
#define MAXFIELDS 8
typedef struct {
    PyObject *cls;  /* borrowed: FastPath holds the class */
    Py_ssize_t n, offset[MAXFIELDS];
    int reusable;   /* no weak references to its instances: refcount 1 means nobody else can see one */
    int ids_field;  /* which field is block_ids (a tuple of ints), -1: none */
    PyObject *spare; /* owned: the last event of this class, which no subscriber kept, refilled for the next */
} Layout;

static int layout_of(PyObject *cls, Layout *l);

typedef struct {
    PyObject_HEAD
    long long lock_acquisitions;          /* the pool's counter (BlockPool.lock_acquisitions), shared with Python */
    long long allocs, frees;              /* blocks served here, not yet added to pool.counts (see _take_counts) */
    int bound;
    int uniform;                          /* one size class: free() of base blocks may run here */
    Py_ssize_t num_blocks;
    PyObject *py_allocate, *py_free;      /* the Python methods every other call goes to */
    PyObject *py_set_token_counts, *py_incref, *py_mark_reusable, *py_set_owner;
    PyObject *discard, *add;              /* the eviction policy's: a block stops / starts being a candidate */
    PyObject *refchanged_cls, *cached_cls; /* kvlab.core.events.RefChanged / Cached */
    long long capacity;                   /* tokens per base block (one-size pools only come here) */
    PyObject *acquire, *release;          /* the pool lock's bound methods */
    PoolLock *plock;                      /* the pool lock itself when it is a PoolLock: taken directly */
    PyObject *stack, *frombytes;          /* free stack 0 (array('i')) and its frombytes */
    PyObject *pop;                        /* and its pop: one block leaves with no slice object */
    PyObject *one_id;                     /* a private 4-byte bytearray: one block returns by frombytes, which
                                             is ~20 ns faster than append's PyArg_Parse of an int */
    PyObject *clock, *tick;               /* the pool clock and its tick (called unless step_offset) */
    Py_ssize_t step_offset;               /* where a LogicalClock keeps `step`: ticked in place */
    PyObject *events;                     /* the pool's EventBus: the list of its subscribers */
    PyObject *allocated_cls, *freed_cls;  /* kvlab.core.events.Allocated / Freed */
    Layout layout[NLAYOUT];               /* where the four event classes keep their fields */
    uint8_t *seen;                        /* num_blocks bytes, all 0 between calls: repeated ids in free() */
    Py_buffer buf[NFIELDS];
    int nbuf;
} FastPath;

static PyObject *s_owner, *s_ALLOCATED, *s_free, *s_subscribers_failed, *zero, *one;

#define F(h, f, T) ((T *)(h)->buf[f].buf)

static int traverse(FastPath *h, visitproc visit, void *arg) {
    Py_VISIT(h->py_allocate); Py_VISIT(h->py_free); Py_VISIT(h->py_set_token_counts); Py_VISIT(h->acquire);
    Py_VISIT(h->py_incref); Py_VISIT(h->py_mark_reusable); Py_VISIT(h->discard); Py_VISIT(h->refchanged_cls);
    Py_VISIT(h->py_set_owner); Py_VISIT(h->add); Py_VISIT(h->cached_cls);
    Py_VISIT(h->release); Py_VISIT(h->plock);
    Py_VISIT(h->stack); Py_VISIT(h->frombytes); Py_VISIT(h->pop); Py_VISIT(h->one_id); Py_VISIT(h->clock); Py_VISIT(h->tick); Py_VISIT(h->events);
    Py_VISIT(h->allocated_cls); Py_VISIT(h->freed_cls);
    for (int i = 0; i < NLAYOUT; i++) Py_VISIT(h->layout[i].spare);
    for (int i = 0; i < h->nbuf; i++) Py_VISIT(h->buf[i].obj);
    return 0;
}

static int clear(FastPath *h) {
    h->bound = 0;
    for (int i = 0; i < NLAYOUT; i++) Py_CLEAR(h->layout[i].spare);
    memset(h->layout, 0, sizeof h->layout);
    Py_CLEAR(h->py_allocate); Py_CLEAR(h->py_free); Py_CLEAR(h->py_set_token_counts); Py_CLEAR(h->acquire);
    Py_CLEAR(h->py_incref); Py_CLEAR(h->py_mark_reusable); Py_CLEAR(h->discard); Py_CLEAR(h->refchanged_cls);
    Py_CLEAR(h->py_set_owner); Py_CLEAR(h->add); Py_CLEAR(h->cached_cls);
    Py_CLEAR(h->release); Py_CLEAR(h->plock);
    Py_CLEAR(h->stack); Py_CLEAR(h->frombytes); Py_CLEAR(h->pop); Py_CLEAR(h->one_id); Py_CLEAR(h->clock); Py_CLEAR(h->tick); Py_CLEAR(h->events);
    Py_CLEAR(h->allocated_cls); Py_CLEAR(h->freed_cls);
    while (h->nbuf) PyBuffer_Release(&h->buf[--h->nbuf]);
    PyMem_Free(h->seen);
    h->seen = NULL;
    return 0;
}

/* Only ever the base of a Python class, whose deallocator drops the reference to the class itself. */
static void dealloc(FastPath *h) {
    PyObject_GC_UnTrack(h);
    clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

/* _bind_fastpath(...): called once by FastBlockPool.__init__ with the pool's own parts. */
static PyObject *bind(FastPath *h, PyObject *args, PyObject *kw) {
    static char *names[] = {"allocate", "free", "set_token_counts", "incref", "mark_reusable", "set_owner",
                            "discard", "add", "lock", "stack", "clock", "step_slot", "events", "allocated", "freed",
                            "refchanged", "cached", "status", "refcount", "hits", "last_access", "created", "owner",
                            "tokens", "reusable", "uniform", "capacity", NULL};
    PyObject *py_allocate, *py_free, *py_set_token_counts, *py_incref, *py_mark_reusable, *py_set_owner, *discard;
    PyObject *add, *lock, *stack, *clock, *step_slot, *events, *allocated, *freed, *refchanged, *cached;
    PyObject *fields[NFIELDS];
    int uniform;
    long long capacity;
    if (h->bound || h->nbuf) {
        PyErr_SetString(PyExc_RuntimeError, "the fast path is already bound");
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOOOO!OOOOOOOOOOOOpL:_bind_fastpath", names,
                                     &py_allocate, &py_free, &py_set_token_counts, &py_incref, &py_mark_reusable,
                                     &py_set_owner, &discard, &add, &lock, &stack, &clock, &step_slot, &PyList_Type,
                                     &events, &allocated, &freed, &refchanged, &cached, &fields[STATUS],
                                     &fields[REFCOUNT],
                                     &fields[HITS], &fields[LAST_ACCESS], &fields[CREATED], &fields[OWNER],
                                     &fields[TOKENS], &fields[REUSABLE], &uniform, &capacity))
        return NULL;
    if (step_slot != Py_None) {  /* LogicalClock.step, a __slots__ member: tick it in place, as `step += 1` */
        PyMemberDef *m = Py_IS_TYPE(step_slot, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)step_slot)->d_member
                                                                     : NULL;
        if (!m || m->type != T_OBJECT_EX ||
            !PyObject_TypeCheck(clock, ((PyMemberDescrObject *)step_slot)->d_common.d_type)) {
            PyErr_SetString(PyExc_TypeError, "step_slot must be the clock's `step` slot, or None");
            return NULL;
        }
        h->step_offset = m->offset;
    }
    if (Py_IS_TYPE(lock, &PoolLockType)) h->plock = (PoolLock *)Py_NewRef(lock);
    h->py_allocate = Py_NewRef(py_allocate);
    h->py_free = Py_NewRef(py_free);
    h->py_set_token_counts = Py_NewRef(py_set_token_counts);
    h->py_incref = Py_NewRef(py_incref);
    h->py_mark_reusable = Py_NewRef(py_mark_reusable);
    h->py_set_owner = Py_NewRef(py_set_owner);
    h->discard = Py_NewRef(discard);
    h->add = Py_NewRef(add);
    h->refchanged_cls = Py_NewRef(refchanged);
    h->cached_cls = Py_NewRef(cached);
    h->capacity = capacity;
    h->stack = Py_NewRef(stack);
    h->clock = Py_NewRef(clock);
    h->events = Py_NewRef(events);
    h->allocated_cls = Py_NewRef(allocated);
    h->freed_cls = Py_NewRef(freed);
    PyObject *kinds[NLAYOUT] = {allocated, freed, refchanged, cached};
    for (int i = 0; i < NLAYOUT; i++)
        if (layout_of(kinds[i], &h->layout[i]) < 0) return NULL;
    if (!(h->acquire = PyObject_GetAttrString(lock, "acquire")) ||
        !(h->release = PyObject_GetAttrString(lock, "release")) ||
        !(h->frombytes = PyObject_GetAttrString(stack, "frombytes")) ||
        !(h->pop = PyObject_GetAttrString(stack, "pop")) ||
        !(h->one_id = PyByteArray_FromStringAndSize(NULL, sizeof(int32_t))) ||
        !(h->tick = PyObject_GetAttrString(clock, "tick")))
        return NULL;
    for (int f = 0; f < NFIELDS; f++) {
        Py_buffer *view = &h->buf[f];
        if (PyObject_GetBuffer(fields[f], view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
        h->nbuf++;  /* held from here on (which also keeps the array from being resized) */
        if (view->itemsize != ITEMSIZE[f] || (f && view->len != h->buf[0].len * ITEMSIZE[f])) {
            PyErr_Format(PyExc_ValueError, "the %s field has items of %zd bytes, not %zd", FIELD[f],
                         view->itemsize, ITEMSIZE[f]);
            return NULL;
        }
    }
    h->num_blocks = h->buf[STATUS].len;
    h->uniform = uniform;
    if (!(h->seen = PyMem_Calloc(h->num_blocks ? h->num_blocks : 1, 1))) return PyErr_NoMemory();
    h->bound = 1;
    Py_RETURN_NONE;
}

static int lock(FastPath *h) {
    if (h->plock) return plock_take(h->plock);
    PyObject *r = PyObject_CallNoArgs(h->acquire);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* Release the lock, keeping an exception already raised (the `finally:` of a `with` block). */
static int unlock(FastPath *h) {
    if (h->plock) return plock_give(h->plock);  /* cannot fail: this call took it */
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

/* clock.tick(): a new reference to the new time (an int), or NULL with an exception set. */
static PyObject *tick(FastPath *h, long long *step) {
    PyObject *t;
    if (h->step_offset) {
        PyObject **slot = (PyObject **)((char *)h->clock + h->step_offset);
        if (!*slot) {
            PyErr_SetString(PyExc_AttributeError, "the pool's LogicalClock has no step");
            return NULL;
        }
        if (!(t = PyNumber_Add(*slot, one))) return NULL;
        Py_SETREF(*slot, Py_NewRef(t));
    } else if (!(t = PyObject_CallNoArgs(h->tick))) {
        return NULL;
    }
    *step = PyLong_AsLongLong(t);
    if (*step == -1 && PyErr_Occurred()) Py_CLEAR(t);
    return t;
}

/* _take_counts() -> (allocated, freed): the blocks served here since the last call, then zero. FastBlockPool
 * adds them to pool.counts whenever Python reads that dict (a dict update per call would cost a fifth of the
 * whole call). */
static PyObject *take_counts(FastPath *h, PyObject *unused) {
    PyObject *r = Py_BuildValue("(LL)", h->allocs, h->frees);
    if (r) h->allocs = h->frees = 0;
    return r;
}

/* The call as the Python method would get it: (self, *args, **kwargs). */
static PyObject *delegate(PyObject *self, PyObject *func, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8], **all = total < 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (!all) return PyErr_NoMemory();
    all[0] = self;
    for (Py_ssize_t i = 0; i < total; i++) all[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(func, all, nargs + 1, kwnames);
    if (all != small) PyMem_Free(all);
    return r;
}

/* An n-item tuple for the block_ids of an event of layout `l`: the spare event's own when nothing else holds it
 * (refcount 1: only the spare, which nobody can see), else a new one. Fill it with set_item, which drops what
 * a reused tuple held. Not from CPython 3.14 on, where a tuple caches its hash. */
static PyObject *ids_for(Layout *l, Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030E0000
    if (l && l->spare && l->ids_field >= 0) {
        PyObject *t = *(PyObject **)((char *)l->spare + l->offset[l->ids_field]);
        if (t && PyTuple_CheckExact(t) && Py_REFCNT(t) == 1 && PyTuple_GET_SIZE(t) == n) return Py_NewRef(t);
    }
#endif
    return PyTuple_New(n);
}

static void set_item(PyObject *t, Py_ssize_t i, PyObject *v) {  /* steals v */
    PyObject *old = PyTuple_GET_ITEM(t, i);
    PyTuple_SET_ITEM(t, i, v);
    Py_XDECREF(old);
}

static PyObject *ids_tuple(Layout *l, const int32_t *ids, Py_ssize_t n) {
    PyObject *t = ids_for(l, n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *b = PyLong_FromLong(ids[i]);
        if (!b) Py_CLEAR(t);
        else set_item(t, i, b);
    }
    return t;
}

/* The layout of event class `cls`, if it is a slotted dataclass whose __init__ only stores its fields (no
 * __post_init__, every field an object slot of a base of `cls`); otherwise n stays 0 and the class is called. */
static int layout_of(PyObject *cls, Layout *l) {
    Py_CLEAR(l->spare);
    l->cls = cls;
    l->n = 0;
    l->reusable = PyType_Check(cls) && !((PyTypeObject *)cls)->tp_weaklistoffset;
    PyObject *names = PyObject_GetAttrString(cls, "__match_args__");
    if (!names) return -1;
    int plain = PyType_Check(cls) && PyTuple_Check(names) && PyTuple_GET_SIZE(names) <= MAXFIELDS &&
                !PyObject_HasAttrString(cls, "__post_init__");
    for (Py_ssize_t i = 0; plain && i < PyTuple_GET_SIZE(names); i++) {
        PyObject *d = PyObject_GetAttr(cls, PyTuple_GET_ITEM(names, i));
        if (!d) {
            Py_DECREF(names);
            return -1;
        }
        PyMemberDef *m = Py_IS_TYPE(d, &PyMemberDescr_Type) ? ((PyMemberDescrObject *)d)->d_member : NULL;
        plain = m && m->type == T_OBJECT_EX && !(m->flags & READONLY) &&
                PyType_IsSubtype((PyTypeObject *)cls, ((PyMemberDescrObject *)d)->d_common.d_type);
        if (plain) l->offset[i] = m->offset;
        Py_DECREF(d);
    }
    if (plain) l->n = PyTuple_GET_SIZE(names);
    l->ids_field = -1;
    for (Py_ssize_t i = 0; plain && i < l->n; i++)
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(names, i), "block_ids") == 0) l->ids_field = (int)i;
    Py_DECREF(names);
    return 0;
}

/* The layout of `cls` built from `nargs` fields, or NULL: the class is then called. */
static Layout *layout_for(FastPath *h, PyObject *cls, Py_ssize_t nargs) {
    for (int i = 0; i < NLAYOUT; i++)
        if (h->layout[i].cls == cls && h->layout[i].n == nargs) return &h->layout[i];
    return NULL;
}

/* cls(*args), with its slots filled in place when its layout is known: into the spare event if there is one
 * (the old field values are ints, strings and tuples of ints, so dropping them runs no Python code). */
static PyObject *new_event(Layout *l, PyObject *cls, PyObject *const *args, Py_ssize_t nargs) {
    if (!l) return PyObject_Vectorcall(cls, args, nargs, NULL);
    PyObject *e = l->spare;
    l->spare = NULL;
    if (!e && !(e = ((PyTypeObject *)cls)->tp_alloc((PyTypeObject *)cls, 0))) return NULL;
    for (Py_ssize_t j = 0; j < nargs; j++) {
        PyObject **slot = (PyObject **)((char *)e + l->offset[j]);
        PyObject *old = *slot;
        *slot = Py_NewRef(args[j]);
        Py_XDECREF(old);
    }
    return e;
}

/* The exception being raised, normalized, with its traceback attached; the error indicator is cleared. */
static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Build cls(*args) and publish it on the bus (only called while someone listens) as EventBus.publish does: each
 * subscriber in turn (indexing the list afresh each time, as its iterator does, so a subscriber may leave); a
 * subscriber that raises an Exception is collected as (subscriber, error) and, once all have had the event,
 * handed to the bus's subscribers_failed, which unsubscribes and logs it. Anything else (Ctrl-C) stops here.
 * An event no subscriber kept (its only reference is ours, and it takes no weak references) is not freed but
 * kept as the class's spare: the allocation and deallocation it saves are most of what an event costs. Nobody
 * can tell, as nobody can see the object; CPython's own freelists and zip's result tuple do the same. */
static int publish(FastPath *h, PyObject *cls, PyObject *const *args, Py_ssize_t nargs) {
    Layout *l = layout_for(h, cls, nargs);
    PyObject *e = new_event(l, cls, args, nargs);
    if (!e) return -1;
    int ok = 0;
    PyObject *failed = NULL;
    for (Py_ssize_t i = 0; !ok && i < PyList_GET_SIZE(h->events); i++) {
        PyObject *fn = Py_NewRef(PyList_GET_ITEM(h->events, i));
        PyObject *r = PyObject_CallOneArg(fn, e);
        if (r) {
            Py_DECREF(r);
        } else if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyObject *error = take_exception();
            PyObject *pair = error ? PyTuple_Pack(2, fn, error) : NULL;
            Py_XDECREF(error);
            if (!pair || (!failed && !(failed = PyList_New(0))) || PyList_Append(failed, pair) < 0) ok = -1;
            Py_XDECREF(pair);
        } else {
            ok = -1;
        }
        Py_DECREF(fn);
    }
    if (failed) {
        if (!ok) {
            PyObject *r = PyObject_CallMethodObjArgs(h->events, s_subscribers_failed, e, failed, NULL);
            ok = r ? 0 : -1;
            Py_XDECREF(r);
        }
        Py_DECREF(failed);
    }
    if (l && l->reusable && !l->spare && Py_REFCNT(e) == 1)
        l->spare = e;
    else
        Py_DECREF(e);
    return ok;
}

/* Whether allocate's arguments are (n) or (n, owner=o) with exact ints, n >= 1, o in -1..2**31-1. */
static int plain_allocate(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t *n,
                          long long *owner) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int overflow = 0;
    *n = 1;
    *owner = -1;
    if (nargs > 1 || nkw > 1) return 0;
    if (nargs == 1) {
        if (!PyLong_CheckExact(args[0])) return 0;
        long long v = PyLong_AsLongLongAndOverflow(args[0], &overflow);
        if (overflow || v < 1 || v > PY_SSIZE_T_MAX) return 0;
        *n = (Py_ssize_t)v;
    }
    if (nkw) {
        PyObject *o = args[nargs];
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), s_owner) || !PyLong_CheckExact(o)) return 0;
        *owner = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow || *owner < -1 || *owner > INT32_MAX) return 0;
    }
    return 1;
}

/* allocate(n=1, *, owner=-1): n base blocks off free stack 0, stamped, as BlockPool.allocate does. */
static PyObject *fast_allocate(FastPath *h, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), n;
    long long owner, step;
    if (!h->bound || !plain_allocate(args, nargs, kwnames, &n, &owner))
        return delegate((PyObject *)h, h->py_allocate, args, nargs, kwnames);
    if (lock(h) < 0) return NULL;
    Py_ssize_t have = Py_SIZE(h->stack);
    if (have < n) {  /* a split or an eviction is due: the Python path does it */
        if (unlock(h) < 0) return NULL;
        return delegate((PyObject *)h, h->py_allocate, args, nargs, kwnames);
    }
    int32_t small[SMALL], *ids = n <= SMALL ? small : PyMem_Malloc(n * sizeof(int32_t));
    PyObject *t = NULL, *out = NULL, *tuple = NULL, *one_id = NULL;
    Py_buffer sv;
    if (!ids) {
        PyErr_NoMemory();
        goto done;
    }
    if (n == 1) {  /* stack.pop(): its int is the one returned, and no slice object is built */
        if (!(one_id = PyObject_CallNoArgs(h->pop))) goto done;
        ids[0] = (int32_t)PyLong_AsLong(one_id);
    } else {
        if (PyObject_GetBuffer(h->stack, &sv, PyBUF_SIMPLE) < 0) goto done;
        const int32_t *top = (const int32_t *)sv.buf + have;
        for (Py_ssize_t i = 0; i < n; i++) ids[i] = top[-1 - i];  /* popped one by one: the top first */
        PyBuffer_Release(&sv);
        if (PySequence_DelSlice(h->stack, have - n, have) < 0) goto done;
    }
    h->lock_acquisitions++;
    if (!(t = tick(h, &step))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        F(h, STATUS, uint8_t)[b] = ALLOCATED;
        F(h, REFCOUNT, int32_t)[b] = 1;
        F(h, HITS, int64_t)[b] = 1;
        F(h, LAST_ACCESS, int64_t)[b] = F(h, CREATED, int64_t)[b] = step;
        F(h, OWNER, int32_t)[b] = (int32_t)owner;
    }
    h->allocs += n;
    if (!(out = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = one_id ? Py_NewRef(one_id) : PyLong_FromLong(ids[i]);
        if (!b) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, b);
    }
    if (PyList_GET_SIZE(h->events)) {
        PyObject *o = PyLong_FromLongLong(owner);
        if (o && (tuple = ids_for(layout_for(h, h->allocated_cls, 6), n))) {
            for (Py_ssize_t i = 0; i < n; i++) set_item(tuple, i, Py_NewRef(PyList_GET_ITEM(out, i)));
            PyObject *ev[6] = {t, tuple, zero, o, s_ALLOCATED, s_free};
            if (publish(h, h->allocated_cls, ev, 6) < 0) Py_CLEAR(out);
        } else {
            Py_CLEAR(out);
        }
        Py_XDECREF(o);
    }
done:
    if (ids && ids != small) PyMem_Free(ids);
    Py_XDECREF(t);
    Py_XDECREF(tuple);
    Py_XDECREF(one_id);
    if (unlock(h) < 0) Py_CLEAR(out);
    return out;
}

/* A tuple (for an event of layout `l`) of the list's items whose kind[] is k. */
static PyObject *kind_tuple(Layout *l, PyObject *list, const uint8_t *kind, Py_ssize_t n, uint8_t k,
                            Py_ssize_t count) {
    PyObject *t = ids_for(l, count);
    for (Py_ssize_t i = 0, j = 0; t && i < n; i++)
        if (kind[i] == k) set_item(t, j++, Py_NewRef(PyList_GET_ITEM(list, i)));
    return t;
}

/* free() of distinct ALLOCATED blocks that each hold a reference, some shared or reusable (under the lock): one
 * reference dropped each; a block left referenced and a reusable one reaching 0 (now cached: the policy adds it)
 * get this step as last access; any other reaching 0 goes FREE, pushed so that the first id comes out first.
 * RefChanged, Cached and Freed are published for the three kinds when someone listens. */
enum { LEFT, KEPT, GONE };

/* RefChanged(t, the blocks still referenced, -1 each, their refcounts now). */
static int publish_left(FastPath *h, PyObject *t, PyObject *list, const uint8_t *kind, const int32_t *ids,
                        Py_ssize_t n, Py_ssize_t count) {
    PyObject *a = kind_tuple(layout_for(h, h->refchanged_cls, 4), list, kind, n, LEFT, count);
    PyObject *d = PyTuple_New(count), *rc = PyTuple_New(count);
    int ok = a && d && rc;
    for (Py_ssize_t i = 0, j = 0; ok && i < n; i++) {
        if (kind[i] != LEFT) continue;
        PyObject *v = PyLong_FromLong(F(h, REFCOUNT, int32_t)[ids[i]]);
        PyObject *m = PyLong_FromLong(-1);
        ok = v && m;
        if (!ok) {
            Py_XDECREF(v);
            Py_XDECREF(m);
            break;
        }
        PyTuple_SET_ITEM(d, j, m);
        PyTuple_SET_ITEM(rc, j++, v);
    }
    PyObject *args[4] = {t, a, d, rc};
    ok = ok && publish(h, h->refchanged_cls, args, 4) == 0;
    Py_XDECREF(a);
    Py_XDECREF(d);
    Py_XDECREF(rc);
    return ok ? 0 : -1;
}

static PyObject *release_held(FastPath *h, PyObject *list, const int32_t *ids, Py_ssize_t n) {
    uint8_t small[SMALL], *kind = n <= SMALL ? small : PyMem_Malloc(n);
    PyObject *out = NULL, *t = NULL, *bytes = NULL;
    Py_ssize_t count[3] = {0, 0, 0};
    long long step;
    if (!kind) return PyErr_NoMemory();
    h->lock_acquisitions++;
    if (!(t = tick(h, &step))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        int32_t r = --F(h, REFCOUNT, int32_t)[b];
        kind[i] = r ? LEFT : F(h, REUSABLE, uint8_t)[b] ? KEPT : GONE;
        count[kind[i]]++;
        if (kind[i] == GONE) continue;
        F(h, LAST_ACCESS, int64_t)[b] = step;
        if (kind[i] == KEPT) {
            PyObject *res = PyObject_CallOneArg(h->add, PyList_GET_ITEM(list, i));
            if (!res) goto done;
            Py_DECREF(res);
        }
    }
    if (count[GONE]) {
        if (!(bytes = PyBytes_FromStringAndSize(NULL, count[GONE] * (Py_ssize_t)sizeof(int32_t)))) goto done;
        int32_t *rev = (int32_t *)PyBytes_AS_STRING(bytes) + count[GONE];
        for (Py_ssize_t i = 0; i < n; i++) {
            if (kind[i] != GONE) continue;
            int32_t b = ids[i];
            *--rev = b;  /* the first id ends on top */
            F(h, STATUS, uint8_t)[b] = FREE;
            F(h, TOKENS, int32_t)[b] = 0;
            F(h, REUSABLE, uint8_t)[b] = 0;
            F(h, OWNER, int32_t)[b] = -1;
        }
        PyObject *r = PyObject_CallOneArg(h->frombytes, bytes);
        if (!r) goto done;
        Py_DECREF(r);
    }
    h->frees += n;
    if (PyList_GET_SIZE(h->events)) {
        if (count[LEFT] && publish_left(h, t, list, kind, ids, n, count[LEFT]) < 0) goto done;
        for (int k = KEPT; k <= GONE; k++) {
            if (!count[k]) continue;
            PyObject *cls = k == KEPT ? h->cached_cls : h->freed_cls;
            PyObject *a = kind_tuple(layout_for(h, cls, 2), list, kind, n, (uint8_t)k, count[k]);
            PyObject *args[2] = {t, a};
            int bad = !a || publish(h, cls, args, 2) < 0;
            Py_XDECREF(a);
            if (bad) goto done;
        }
    }
    out = Py_NewRef(Py_None);
done:
    if (kind != small) PyMem_Free(kind);
    Py_XDECREF(t);
    Py_XDECREF(bytes);
    return out;
}

/* free(ids): distinct base blocks, each ALLOCATED with refcount 1 and no reusable data, back to FREE; distinct
 * ALLOCATED blocks that each hold a reference but are shared or reusable go through release_held. */
static PyObject *fast_free(FastPath *h, PyObject *list) {
    Py_ssize_t n = PyList_CheckExact(list) ? PyList_GET_SIZE(list) : 0;
    if (!h->bound || !h->uniform || !n) return PyObject_CallFunctionObjArgs(h->py_free, (PyObject *)h, list, NULL);
    int32_t small[SMALL], *ids = n <= SMALL ? small : PyMem_Malloc(n * sizeof(int32_t));
    if (!ids) return PyErr_NoMemory();
    /* Copy the ids out first: taking a contended lock lets other threads run, and they may change the list. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;
        if (overflow || v < 0 || v >= h->num_blocks) {
            if (ids != small) PyMem_Free(ids);
            return PyObject_CallFunctionObjArgs(h->py_free, (PyObject *)h, list, NULL);
        }
        ids[i] = (int32_t)v;
    }
    PyObject *first = Py_NewRef(PyList_GET_ITEM(list, 0));  /* a one-block free's id, for its event */
    PyObject *out = NULL, *t = NULL, *pushed = NULL, *tuple = NULL;  /* pushed: the ids as bytes */
    long long step;
    if (lock(h) < 0) goto done;
    int plain = 1, held = 1;
    Py_ssize_t i = 0;
    for (; i < n && held; i++) {
        int32_t b = ids[i];
        held = F(h, STATUS, uint8_t)[b] == ALLOCATED && F(h, REFCOUNT, int32_t)[b] >= 1 && !h->seen[b];
        plain = plain && held && F(h, REFCOUNT, int32_t)[b] == 1 && !F(h, REUSABLE, uint8_t)[b];
        h->seen[b] = 1;
    }
    while (i) h->seen[ids[--i]] = 0;
    if (!held) {  /* cached, repeated, a double free...: the Python path serves or refuses it */
        if (unlock(h) < 0) goto done;
        out = PyObject_CallFunctionObjArgs(h->py_free, (PyObject *)h, list, NULL);
        goto done;
    }
    if (!plain) {  /* shared or reusable blocks among them */
        out = release_held(h, list, ids, n);
        goto unlock;
    }
    if (n == 1) {  /* the id into the private bytearray: no new object */
        pushed = Py_NewRef(h->one_id);
        memcpy(PyByteArray_AS_STRING(pushed), ids, sizeof(int32_t));
    } else {
        if (!(pushed = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t)))) goto unlock;
        int32_t *rev = (int32_t *)PyBytes_AS_STRING(pushed);
        for (Py_ssize_t j = 0; j < n; j++) rev[j] = ids[n - 1 - j];  /* the first id ends on top */
    }
    h->lock_acquisitions++;
    if (!(t = tick(h, &step))) goto unlock;
    PyObject *r = PyObject_CallOneArg(h->frombytes, pushed);
    if (!r) goto unlock;
    Py_DECREF(r);
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t b = ids[j];
        F(h, STATUS, uint8_t)[b] = FREE;
        F(h, REFCOUNT, int32_t)[b] = F(h, TOKENS, int32_t)[b] = 0;
        F(h, REUSABLE, uint8_t)[b] = 0;
        F(h, OWNER, int32_t)[b] = -1;
    }
    h->frees += n;
    if (PyList_GET_SIZE(h->events)) {
        Layout *l = layout_for(h, h->freed_cls, 2);
        if (n == 1) {  /* the caller's int, read before the lock: no new one */
            if ((tuple = ids_for(l, 1))) set_item(tuple, 0, Py_NewRef(first));
        } else {
            tuple = ids_tuple(l, ids, n);
        }
        if (!tuple) goto unlock;
        PyObject *ev[2] = {t, tuple};
        if (publish(h, h->freed_cls, ev, 2) < 0) goto unlock;
    }
    out = Py_NewRef(Py_None);
unlock:
    if (unlock(h) < 0) Py_CLEAR(out);
done:
    if (ids != small) PyMem_Free(ids);
    Py_DECREF(first);
    Py_XDECREF(t);
    Py_XDECREF(pushed);
    Py_XDECREF(tuple);
    return out;
}

/* An exact int in 0..hi-1 as a long long, else -1 (a bool, a numpy int, a negative or too large one). */
static long long exact_index(PyObject *o, long long hi) {
    int overflow = 0;
    long long v = PyLong_CheckExact(o) ? PyLong_AsLongLongAndOverflow(o, &overflow) : -1;
    return overflow || v < 0 || v >= hi ? -1 : v;
}

/* set_token_counts(ids, counts): lists of exact ints, each id a block that is not FREE, each count in
 * 0..capacity, written under the lock. Anything else goes to the Python method. */
static PyObject *fast_set_token_counts(FastPath *h, PyObject *const *args, Py_ssize_t nargs) {
    if (!h->bound || !h->uniform || nargs != 2 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) ||
        PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]))
        return delegate((PyObject *)h, h->py_set_token_counts, args, nargs, NULL);
    PyObject *ids = args[0], *counts = args[1];
    if (lock(h) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids), i = 0;
    for (; i < n; i++) {
        long long b = exact_index(PyList_GET_ITEM(ids, i), h->num_blocks);
        long long c = exact_index(PyList_GET_ITEM(counts, i), h->capacity + 1);
        if (b < 0 || c < 0 || F(h, STATUS, uint8_t)[b] == FREE) break;
    }
    if (i == n) {
        for (i = 0; i < n; i++)
            F(h, TOKENS, int32_t)[PyLong_AsLongLong(PyList_GET_ITEM(ids, i))] =
                (int32_t)PyLong_AsLongLong(PyList_GET_ITEM(counts, i));
    }
    if (unlock(h) < 0) return NULL;
    if (i == n) Py_RETURN_NONE;
    return delegate((PyObject *)h, h->py_set_token_counts, args, nargs, NULL);  /* it words the error */
}

/* Whether `list` holds distinct exact ints naming blocks of one of the two statuses `a`, `b` (h->seen marks
 * them and is cleared again); ids[i] gets the i-th. */
static int distinct_blocks(FastPath *h, PyObject *list, int32_t *ids, uint8_t a, uint8_t b) {
    Py_ssize_t n = PyList_GET_SIZE(list), i = 0;
    int ok = 1;
    for (; i < n && ok; i++) {
        long long v = exact_index(PyList_GET_ITEM(list, i), h->num_blocks);
        ok = v >= 0 && !h->seen[v] && (F(h, STATUS, uint8_t)[v] == a || F(h, STATUS, uint8_t)[v] == b);
        if (ok) {
            ids[i] = (int32_t)v;
            h->seen[v] = 1;
        }
    }
    for (Py_ssize_t j = 0; j < i - !ok; j++) h->seen[ids[j]] = 0;
    return ok;
}

/* incref(ids): distinct ALLOCATED base blocks, one reference each (a cached one leaves the policy's set), hits
 * and last access stamped, RefChanged published when someone listens. Anything else goes to Python. */
static PyObject *fast_incref(FastPath *h, PyObject *list) {
    Py_ssize_t n = PyList_CheckExact(list) ? PyList_GET_SIZE(list) : 0;
    if (!h->bound || !h->uniform || !n) return PyObject_CallFunctionObjArgs(h->py_incref, (PyObject *)h, list, NULL);
    int32_t small[SMALL], *ids = n <= SMALL ? small : PyMem_Malloc(n * sizeof(int32_t));
    if (!ids) return PyErr_NoMemory();
    PyObject *out = NULL, *t = NULL, *a = NULL, *c = NULL, *r = NULL;
    long long step;
    if (lock(h) < 0) goto done;
    if (!distinct_blocks(h, list, ids, ALLOCATED, ALLOCATED)) {
        if (unlock(h) < 0) goto done;
        out = PyObject_CallFunctionObjArgs(h->py_incref, (PyObject *)h, list, NULL);
        goto done;
    }
    h->lock_acquisitions++;
    if (!(t = tick(h, &step))) goto unlock;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (!F(h, REFCOUNT, int32_t)[b]) {  /* cached: no longer a candidate */
            PyObject *bo = PyLong_FromLong(b), *res = bo ? PyObject_CallOneArg(h->discard, bo) : NULL;
            Py_XDECREF(bo);
            if (!res) goto unlock;
            Py_DECREF(res);
        }
        F(h, REFCOUNT, int32_t)[b] += 1;
        F(h, HITS, int64_t)[b] += 1;
        F(h, LAST_ACCESS, int64_t)[b] = step;
    }
    if (PyList_GET_SIZE(h->events)) {
        if (!(a = PyList_AsTuple(list)) || !(c = PyTuple_New(n)) || !(r = PyTuple_New(n))) goto unlock;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *rc = PyLong_FromLong(F(h, REFCOUNT, int32_t)[ids[i]]);
            if (!rc) goto unlock;
            PyTuple_SET_ITEM(c, i, Py_NewRef(one));
            PyTuple_SET_ITEM(r, i, rc);
        }
        PyObject *ev[4] = {t, a, c, r};
        if (publish(h, h->refchanged_cls, ev, 4) < 0) goto unlock;
    }
    out = Py_NewRef(Py_None);
unlock:
    if (unlock(h) < 0) Py_CLEAR(out);
done:
    if (ids != small) PyMem_Free(ids);
    Py_XDECREF(t); Py_XDECREF(a); Py_XDECREF(c); Py_XDECREF(r);
    return out;
}

/* mark_reusable(ids): base blocks that hold data (ALLOCATED or PENDING; repeats harmless) marked reusable, one
 * clock tick, no event (marking frees nothing). Unmarking, or anything else, goes to Python. */
static PyObject *fast_mark_reusable(FastPath *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t n = nargs == 1 && !kwnames && PyList_CheckExact(args[0]) ? PyList_GET_SIZE(args[0]) : 0, i = 0;
    if (!h->bound || !h->uniform || !n) return delegate((PyObject *)h, h->py_mark_reusable, args, nargs, kwnames);
    PyObject *list = args[0], *t = NULL;
    long long step;
    if (lock(h) < 0) return NULL;
    for (; i < n; i++) {
        long long b = exact_index(PyList_GET_ITEM(list, i), h->num_blocks);
        if (b < 0 || (F(h, STATUS, uint8_t)[b] != ALLOCATED && F(h, STATUS, uint8_t)[b] != PENDING)) break;
    }
    if (i == n) {
        h->lock_acquisitions++;
        if ((t = tick(h, &step)))
            for (i = 0; i < n; i++) F(h, REUSABLE, uint8_t)[PyLong_AsLongLong(PyList_GET_ITEM(list, i))] = 1;
    }
    if (unlock(h) < 0) Py_CLEAR(t);
    if (i != n) return delegate((PyObject *)h, h->py_mark_reusable, args, nargs, kwnames);
    if (!t) return NULL;
    Py_DECREF(t);
    Py_RETURN_NONE;
}

/* set_owner(ids, owner): a list of exact ints naming blocks that are not FREE, an exact int owner in
 * -1..2**31-1, written under the lock. Anything else goes to Python. */
static PyObject *fast_set_owner(FastPath *h, PyObject *const *args, Py_ssize_t nargs) {
    int overflow = 0;
    long long owner = nargs == 2 && PyLong_CheckExact(args[1]) ? PyLong_AsLongLongAndOverflow(args[1], &overflow) : -2;
    if (!h->bound || !h->uniform || nargs != 2 || !PyList_CheckExact(args[0]) || overflow || owner < -1 ||
        owner > INT32_MAX)
        return delegate((PyObject *)h, h->py_set_owner, args, nargs, NULL);
    PyObject *ids = args[0];
    Py_ssize_t n = PyList_GET_SIZE(ids), i = 0;
    if (lock(h) < 0) return NULL;
    for (; i < n; i++) {
        long long b = exact_index(PyList_GET_ITEM(ids, i), h->num_blocks);
        if (b < 0 || F(h, STATUS, uint8_t)[b] == FREE) break;
    }
    if (i == n)
        for (i = 0; i < n; i++) F(h, OWNER, int32_t)[PyLong_AsLongLong(PyList_GET_ITEM(ids, i))] = (int32_t)owner;
    if (unlock(h) < 0) return NULL;
    if (i == n) Py_RETURN_NONE;
    return delegate((PyObject *)h, h->py_set_owner, args, nargs, NULL);  /* it words the error */
}

/* ---------------------------------------------------------------- FastSequenceManager.append_tokens's loop */
static PyObject *s_seq_id, *s_swapped, *s_num_tokens, *s_token_ids, *s_block_table;

/* A sequence's fields as append_tokens reads them (new references), or -1 with an exception set. */
typedef struct {
    PyObject *seq_id, *swapped, *num_tokens, *token_ids, *table;
} SeqFields;

static void release_fields(SeqFields *f) {
    Py_CLEAR(f->seq_id); Py_CLEAR(f->swapped); Py_CLEAR(f->num_tokens); Py_CLEAR(f->token_ids); Py_CLEAR(f->table);
}

static int read_fields(PyObject *seq, SeqFields *f) {
    memset(f, 0, sizeof(*f));
    if (!(f->seq_id = PyObject_GetAttr(seq, s_seq_id)) || !(f->swapped = PyObject_GetAttr(seq, s_swapped)) ||
        !(f->num_tokens = PyObject_GetAttr(seq, s_num_tokens)) ||
        !(f->token_ids = PyObject_GetAttr(seq, s_token_ids)) || !(f->table = PyObject_GetAttr(seq, s_block_table))) {
        release_fields(f);
        return -1;
    }
    return 0;
}

/* How many tokens `x` brings to a sequence (token ids, a list of exact ints in 0..2**63-1, for one that tracks
 * them; a count for one that does not), or -1 when it is anything else. */
static long long tokens_brought(PyObject *x, int tracks, long long num) {
    int overflow = 0;
    if (PyList_CheckExact(x) && tracks) {
        Py_ssize_t n = PyList_GET_SIZE(x);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = PyList_GET_ITEM(x, i);
            if (!PyLong_CheckExact(t) || PyLong_AsLongLongAndOverflow(t, &overflow) < 0 || overflow) return -1;
        }
        return n <= LLONG_MAX - num ? n : -1;
    }
    if (PyLong_CheckExact(x) && !tracks) {
        long long n = PyLong_AsLongLongAndOverflow(x, &overflow);
        return overflow || n < 0 || n > LLONG_MAX - num ? -1 : n;
    }
    return -1;
}

static long long blocks_for(long long tokens, long long B) { return tokens / B + (tokens % B != 0); }

/* plan_append(seqs, new, live, seq_type, block_size, refcount) -> the new blocks the batch needs, or None when
 * it is not the common batch: lists of equal length; every sequence of type seq_type, live (live[seq_id] is it)
 * and resident, named once; each new entry as tokens_brought accepts; no append into a shared, partly filled
 * last block (refcount, the pool's field, > 1: copy-on-write). Reads only. */
static PyObject *plan_append(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyDict_CheckExact(args[2]) || !PyType_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "plan_append(seqs, new, live, seq_type, block_size, refcount)");
        return NULL;
    }
    PyObject *seqs = args[0], *new = args[1], *live = args[2];
    long long B = PyLong_AsLongLong(args[4]);
    if (B < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        return NULL;
    }
    if (!PyList_CheckExact(seqs) || !PyList_CheckExact(new) || PyList_GET_SIZE(seqs) != PyList_GET_SIZE(new))
        Py_RETURN_NONE;
    Py_buffer rb;
    if (PyObject_GetBuffer(args[5], &rb, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *named = PySet_New(NULL), *out = NULL;
    if (!named || rb.itemsize != 4) {
        if (named) PyErr_SetString(PyExc_ValueError, "refcount must have 4-byte items");
        goto done;
    }
    const int32_t *refs = rb.buf;
    long long nref = rb.len / 4, need = 0;
    Py_ssize_t n = PyList_GET_SIZE(seqs);
    int common = 1;
    for (Py_ssize_t i = 0; i < n && common; i++) {
        PyObject *seq = PyList_GET_ITEM(seqs, i);
        SeqFields f;
        if ((PyObject *)Py_TYPE(seq) != args[3]) {
            common = 0;
            break;
        }
        if (read_fields(seq, &f) < 0) goto done;
        PyObject *alive = PyDict_GetItemWithError(live, f.seq_id);  /* borrowed */
        long long num = PyLong_CheckExact(f.num_tokens) ? PyLong_AsLongLong(f.num_tokens) : -1;
        long long k = tokens_brought(PyList_GET_ITEM(new, i), f.token_ids != Py_None, num);
        Py_ssize_t len = PyList_CheckExact(f.table) ? PyList_GET_SIZE(f.table) : -1;
        common = alive == seq && f.swapped == Py_None && num >= 0 && k >= 0 && len >= 0 &&
                 PySet_Add(named, f.seq_id) == 0;
        if (common && k && num % B) {  /* appending into the last block: it must not be shared */
            long long last = len ? exact_index(PyList_GET_ITEM(f.table, len - 1), nref) : -1;
            common = last >= 0 && refs[last] <= 1;
        }
        if (common) need += blocks_for(num + k, B) - len;
        release_fields(&f);
        if (PyErr_Occurred()) goto done;
    }
    out = common && PySet_GET_SIZE(named) == n ? PyLong_FromLongLong(need) : Py_NewRef(Py_None);
done:
    Py_XDECREF(named);
    PyBuffer_Release(&rb);
    return out;
}

static int append_long(PyObject *list, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    int r = o ? PyList_Append(list, o) : -1;
    Py_XDECREF(o);
    return r;
}

/* apply_append(seqs, new, fresh, block_size) -> (starts, filled, counts, owned): after plan_append said yes and
 * the pool gave the `fresh` blocks it asked for, each sequence in turn takes its new blocks off the front of
 * `fresh` (extending its table; owned gets (blocks, seq_id) for the pool's set_owner), records where it started,
 * counts its tokens, extends its token ids; filled/counts name every block it wrote and the tokens it now holds
 * (for the pool's set_token_counts). */
static PyObject *apply_append(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "apply_append(seqs: list, new: list, fresh: list, block_size)");
        return NULL;
    }
    PyObject *seqs = args[0], *new = args[1], *fresh = args[2];
    long long B = PyLong_AsLongLong(args[3]);
    if (B < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        return NULL;
    }
    PyObject *starts = PyList_New(0), *filled = PyList_New(0), *counts = PyList_New(0), *owned = PyList_New(0);
    PyObject *out = NULL;
    Py_ssize_t at = 0, n = PyList_GET_SIZE(seqs);
    if (!starts || !filled || !counts || !owned) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *seq = PyList_GET_ITEM(seqs, i), *x = PyList_GET_ITEM(new, i), *end_o = NULL;
        SeqFields f;
        if (read_fields(seq, &f) < 0) goto done;
        long long num = PyLong_AsLongLong(f.num_tokens);
        long long k = PyList_CheckExact(x) ? PyList_GET_SIZE(x) : PyLong_AsLongLong(x), end = num + k;
        Py_ssize_t len = PyList_GET_SIZE(f.table), more = (Py_ssize_t)(blocks_for(end, B) - len);
        int ok = more <= PyList_GET_SIZE(fresh) - at;
        if (ok && more) {
            PyObject *got = PyList_GetSlice(fresh, at, at + more), *pair = NULL;
            ok = got && PyList_SetSlice(f.table, len, len, got) == 0 && (pair = PyTuple_Pack(2, got, f.seq_id)) &&
                 PyList_Append(owned, pair) == 0;
            Py_XDECREF(got);
            Py_XDECREF(pair);
            at += more;
        } else if (!ok) {
            PyErr_SetString(PyExc_ValueError, "apply_append: fewer fresh blocks than the plan needs");
        }
        ok = ok && append_long(starts, num) == 0 && (end_o = PyLong_FromLongLong(end)) &&
             PyObject_SetAttr(seq, s_num_tokens, end_o) == 0;
        Py_XDECREF(end_o);
        for (long long b = num / B; ok && b < blocks_for(end, B); b++)
            ok = PyList_Append(filled, PyList_GET_ITEM(f.table, b)) == 0 &&
                 append_long(counts, end - b * B < B ? end - b * B : B) == 0;
        if (ok && k && PyList_CheckExact(x)) {
            Py_ssize_t have = PyList_GET_SIZE(f.token_ids);
            ok = PyList_SetSlice(f.token_ids, have, have, x) == 0;
        }
        release_fields(&f);
        if (!ok) goto done;
    }
    out = PyTuple_Pack(4, starts, filled, counts, owned);
done:
    Py_XDECREF(starts); Py_XDECREF(filled); Py_XDECREF(counts); Py_XDECREF(owned);
    return out;
}

/* token_bytes(ids) -> the int64 bytes of a list of exact ints in 0..2**63-1 (8 per id, native order), or None
 * for any other list: checks.token_bytes then names what is wrong. One pass, no Python object per id. */
static PyObject *token_bytes(PyObject *mod, PyObject *list) {
    if (!PyList_CheckExact(list)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out) return NULL;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(list, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(t) ? PyLong_AsLongLongAndOverflow(t, &overflow) : -1;
        if (v < 0 || overflow) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        dst[i] = v;
    }
    return out;
}

/* walk_chain(tokens, n, width, salted, block_of, stored, status, reusable, stamp, created) -> (ids, last, stale):
 * PrefixCache._walk's loop. Block i's hash is a copy of `salted` (the tenant's hasher) fed the previous hit's
 * digest and tokens[i*width:(i+1)*width]; the walk follows block_of[digest] while the block is still the
 * registered allocation (status ALLOCATED, reusable, stamp == created[block]) and holds exactly those tokens
 * (stored[block]). ids are the hits, last the last hit's digest (None if none), stale a block found stale
 * (the caller drops it) or -1. */
static PyObject *s_copy, *s_update, *s_digest;

static PyObject *walk_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10 || !PyBytes_Check(args[0]) || !PyDict_CheckExact(args[4]) || !PyList_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "walk_chain(tokens: bytes, n, width, salted, block_of: dict, stored: list, "
                                         "status, reusable, stamp, created)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]), width = PyLong_AsSsize_t(args[2]);
    if ((n < 0 || width < 1) && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "n >= 0, width >= 1");
    if (PyErr_Occurred()) return NULL;
    if (n * width > PyBytes_GET_SIZE(args[0])) {
        PyErr_SetString(PyExc_ValueError, "walk_chain: fewer tokens than n blocks");
        return NULL;
    }
    PyObject *salted = args[3], *block_of = args[4], *stored = args[5];
    Py_buffer v[4];  /* status (u8), reusable (u8), stamp (i64), created (i64), each one per block */
    static const Py_ssize_t size[4] = {1, 1, 8, 8};
    int nv = 0;
    PyObject *ids = PyList_New(0), *parent = Py_NewRef(Py_None), *out = NULL;
    long long stale = -1;
    if (!ids) goto done;
    for (; nv < 4; nv++) {
        if (PyObject_GetBuffer(args[6 + nv], &v[nv], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (v[nv].itemsize != size[nv] || v[nv].len / size[nv] != PyList_GET_SIZE(stored)) {
            nv++;
            PyErr_SetString(PyExc_ValueError, "walk_chain: a field does not hold one item per block");
            goto done;
        }
    }
    const char *data = PyBytes_AS_STRING(args[0]);
    Py_ssize_t nblocks = PyList_GET_SIZE(stored);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyObject_VectorcallMethod(s_copy, &salted, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        PyObject *chunk = h ? PyBytes_FromStringAndSize(data + i * width, width) : NULL, *digest = NULL, *r;
        int ok = chunk != NULL;
        if (ok && parent != Py_None) {
            PyObject *a[2] = {h, parent};
            ok = (r = PyObject_VectorcallMethod(s_update, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)) != NULL;
            Py_XDECREF(r);
        }
        if (ok) {
            PyObject *a[2] = {h, chunk};
            ok = (r = PyObject_VectorcallMethod(s_update, a, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)) != NULL;
            Py_XDECREF(r);
        }
        if (ok) digest = PyObject_VectorcallMethod(s_digest, &h, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        ok = ok && digest != NULL;
        Py_XDECREF(h);
        PyObject *bo = ok ? PyDict_GetItemWithError(block_of, digest) : NULL;  /* borrowed */
        long long b = bo && PyLong_CheckExact(bo) ? PyLong_AsLongLong(bo) : -1;
        int hit = 0;
        if (ok && bo && b >= 0 && b < nblocks) {
            int valid = ((uint8_t *)v[0].buf)[b] == ALLOCATED && ((uint8_t *)v[1].buf)[b] == 1 &&
                        ((int64_t *)v[2].buf)[b] == ((int64_t *)v[3].buf)[b];
            PyObject *mine = PyList_GET_ITEM(stored, b);
            if (!valid) {
                stale = b;
            } else {
                hit = PyBytes_Check(mine) && PyBytes_GET_SIZE(mine) == width &&
                      !memcmp(PyBytes_AS_STRING(mine), data + i * width, width);  /* a collision otherwise */
            }
        }
        Py_XDECREF(chunk);
        if (hit) hit = PyList_Append(ids, bo) == 0 ? 1 : -1;
        if (hit == 1) Py_SETREF(parent, digest);
        else Py_XDECREF(digest);
        if (!ok || hit < 0 || PyErr_Occurred()) goto done;
        if (!hit) break;
    }
    out = Py_BuildValue("(OOL)", ids, parent, stale);
done:
    while (nv) PyBuffer_Release(&v[--nv]);
    Py_XDECREF(ids);
    Py_XDECREF(parent);
    return out;
}

static PyMethodDef module_functions[] = {
    {"walk_chain", (PyCFunction)(void (*)(void))walk_chain, METH_FASTCALL,
     "walk_chain(tokens, n, width, salted, block_of, stored, status, reusable, stamp, created) -> (ids, last, "
     "stale): PrefixCache._walk's loop."},
    {"token_bytes", (PyCFunction)token_bytes, METH_O,
     "token_bytes(ids) -> int64 bytes of a list of exact ints in 0..2**63-1, or None."},
    {"plan_append", (PyCFunction)(void (*)(void))plan_append, METH_FASTCALL,
     "plan_append(seqs, new, live, seq_type, block_size, refcount) -> blocks needed, or None (not the common "
     "batch)."},
    {"apply_append", (PyCFunction)(void (*)(void))apply_append, METH_FASTCALL,
     "apply_append(seqs, new, fresh, block_size) -> (starts, filled, counts, owned)."},
    {NULL},
};

static PyMethodDef methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))fast_allocate, METH_FASTCALL | METH_KEYWORDS,
     "BlockPool.allocate; allocate(n[, owner=o]) of base blocks the free stack holds runs in C."},
    {"free", (PyCFunction)fast_free, METH_O,
     "BlockPool.free; a list of distinct blocks that each hold their only reference runs in C."},
    {"set_token_counts", (PyCFunction)(void (*)(void))fast_set_token_counts, METH_FASTCALL,
     "BlockPool.set_token_counts; lists of exact ints run in C."},
    {"incref", (PyCFunction)fast_incref, METH_O, "BlockPool.incref; a list of distinct ALLOCATED blocks runs in C."},
    {"set_owner", (PyCFunction)(void (*)(void))fast_set_owner, METH_FASTCALL,
     "BlockPool.set_owner; a list of exact ints runs in C."},
    {"mark_reusable", (PyCFunction)(void (*)(void))fast_mark_reusable, METH_FASTCALL | METH_KEYWORDS,
     "BlockPool.mark_reusable; marking a list of blocks that hold data runs in C."},
    {"_take_counts", (PyCFunction)take_counts, METH_NOARGS,
     "(blocks allocated, blocks freed) here since the last call, which FastBlockPool adds to pool.counts."},
    {"_bind_fastpath", (PyCFunction)(void (*)(void))bind, METH_VARARGS | METH_KEYWORDS,
     "Bind the C paths to this pool's parts (FastBlockPool.__init__ calls it once)."},
    {NULL},
};

static PyMemberDef members[] = {
    {"lock_acquisitions", T_LONGLONG, offsetof(FastPath, lock_acquisitions), 0,
     "public mutations that took the pool lock (one per call)"},
    {NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab.fast._fastpath.FastPath",
    .tp_doc = "Base type of kvlab.fast.pool.FastBlockPool: its allocate() and free() in C.",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)dealloc,
    .tp_traverse = (traverseproc)traverse,
    .tp_clear = (inquiry)clear,
    .tp_methods = methods,
    .tp_members = members,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_fastpath",
                                    .m_doc = "The compiled paths of kvlab.fast.pool: FastBlockPool's allocate, free and "
                                             "set_token_counts, FastSequenceManager's append loop.",
                                    .m_size = -1, .m_methods = module_functions};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&FastPathType) < 0 || PyType_Ready(&PoolLockType) < 0) return NULL;
    if (!(s_owner = PyUnicode_InternFromString("owner")) ||
        !(s_ALLOCATED = PyUnicode_InternFromString("ALLOCATED")) || !(s_free = PyUnicode_InternFromString("free")) ||
        !(s_subscribers_failed = PyUnicode_InternFromString("subscribers_failed")) ||
        !(zero = PyLong_FromLong(0)) || !(one = PyLong_FromLong(1)) ||
        !(s_seq_id = PyUnicode_InternFromString("seq_id")) || !(s_swapped = PyUnicode_InternFromString("swapped")) ||
        !(s_num_tokens = PyUnicode_InternFromString("num_tokens")) ||
        !(s_token_ids = PyUnicode_InternFromString("token_ids")) ||
        !(s_block_table = PyUnicode_InternFromString("block_table")) ||
        !(s_copy = PyUnicode_InternFromString("copy")) || !(s_update = PyUnicode_InternFromString("update")) ||
        !(s_digest = PyUnicode_InternFromString("digest")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", KVLAB_SOURCE_SHA256) < 0 ||
        PyModule_AddObjectRef(m, "FastPath", (PyObject *)&FastPathType) < 0 ||
        PyModule_AddObjectRef(m, "PoolLock", (PyObject *)&PoolLockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
