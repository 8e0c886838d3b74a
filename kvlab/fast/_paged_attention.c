/* Paged decode attention, compiled: one query token per sequence attends over K/V read in place from the pool.
 *
 * kvlab/core/attention.py is the reference and the code to read: it gathers each sequence's blocks into a workspace
 * and calls SDPA. This file computes the same thing without the gather, which costs a second pass over every
 * byte of K/V. For sequence i, logical position p lives in physical block tables[i][p / B] at offset p % B, and
 * a block holds [B, kv_heads, dim] floats (NHD), so one position's K for all kv heads is one contiguous row.
 *
 * Each piece of work ("span": a run of positions of one sequence, all heads) streams its rows in chunks of
 * CHUNK positions with an online softmax in base 2 (scores pre-multiplied by log2 e):
 *   scores s = q.k for the chunk; if the chunk's max beats the running max m, rescale the running sum l and the
 *   running output acc by 2^(m_old - m_new); then p = 2^(s - m), l += sum p, acc += p v.
 * A span ends as a partial (m, l, acc); a sequence split into several spans merges its partials at the end
 * (the split lets two threads share one long sequence). Positions >= the sequence's length are never read, so
 * stale data in a block's tail slots cannot leak in.
 *
 * Threads: the caller passes torch.get_num_threads(); spans go, longest first, to up to that many threads (the
 * calling thread included; at most one per thread_floats floats of K/V, as starting a thread costs ~20-50 us)
 * through one atomic counter. The GIL is released for the whole computation.
 *
 * Vectorisation: the build uses only portable flags (-O3); with GCC and glibc the per-span function is compiled
 * once per x86-64 level (AVX-512, AVX2+FMA, baseline SSE2) and the dynamic loader picks the best the CPU has
 * (target_clones, an ifunc); elsewhere it is compiled for the baseline.
 * Its inner loops are written so the compiler can vectorise them: 8 independent accumulators for dot products
 * (a float sum is not reassociated without -ffast-math), and a branch-free exp2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KVLAB_SOURCE_SHA256
#define KVLAB_SOURCE_SHA256 "unknown"
#endif

#define CHUNK 32      /* positions scored together: one max and one rescale per chunk, not per position */
#define MIN_SPAN 256  /* shortest split of a sequence: each split costs a partial and a merge */

#if defined(__x86_64__) && defined(__GLIBC__) && !defined(__clang__) && __GNUC__ >= 11
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

typedef struct {
    int64_t seq, begin, end; /* positions begin..end-1 of sequence seq */
    int64_t slot;            /* where its partial goes: spans of one sequence have consecutive slots */
} Span;

typedef struct {
    const float *q, *k, *v;   /* q [batch, heads, dim]; k, v: one layer [num_blocks, B, kv_heads, dim] */
    const int64_t *tables;    /* [batch, table_stride] physical block ids */
    int64_t table_stride, heads, kv_heads, dim, block_size;
    float scale2;             /* softmax scale * log2(e): scores in base 2 */
    Span *spans;              /* sorted longest first */
    int64_t num_spans;
    float *partials;          /* per slot: m[heads], l[heads], acc[heads * dim] */
    float *scratch;           /* per thread: scratch_floats floats */
    int64_t scratch_floats;
    atomic_llong next;        /* the next span to take */
} Job;

/* 2^x for x <= 0, branch-free so loops over it vectorise. x = n + f with n an integer, |f| <= 1/2; 2^f is
 * e^(f ln 2) by its Taylor series to degree 7 (relative error ~1e-7, float rounding), and 2^n goes straight into
 * the exponent bits. x is first clamped at -126 (2^-126 ~ 1e-38; -inf too): such terms lose to the running max.
 * The clamp compares bit patterns as integers (for x <= 0 they grow with |x|): a float compare may trap, which
 * keeps the compiler from vectorising it without -fno-trapping-math. */
static inline float exp2_nonpositive(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = u > 0xC2FC0000u ? 0xC2FC0000u : u; /* 0xC2FC0000 is -126.0f */
    memcpy(&x, &u, sizeof x);
    float n = (x + 12582912.0f) - 12582912.0f; /* round to nearest: adding 1.5 * 2^23 drops the fraction */
    float t = (x - n) * 0.693147180559945f;
    float p = 1.0f + t * (1.0f + t * (1.0f / 2 + t * (1.0f / 6 + t * (1.0f / 24 + t * (1.0f / 120 +
              t * (1.0f / 720 + t * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[d + u] * b[d + u];
    for (; d < n; d++) acc[0] += a[d] * b[d];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline float sum(const float *a, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[i + u];
    for (; i < n; i++) acc[0] += a[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* One span: its partial (m, l, acc) for every query head. scratch holds heads * (dim + CHUNK) floats. */
VECTOR_CLONES
static void attend_span(const Job *j, const Span *sp, float *scratch) {
    const int64_t H = j->heads, D = j->dim, B = j->block_size, KH = j->kv_heads, row = KH * D, G = H / KH;
    float *m = j->partials + sp->slot * H * (D + 2), *l = m + H, *acc = l + H;
    float *qs = scratch, *s = scratch + H * D; /* scaled queries; s[h * CHUNK + t]: scores, then weights */
    const float *krow[CHUNK], *vrow[CHUNK];
    const float *q = j->q + sp->seq * H * D;
    const int64_t *table = j->tables + sp->seq * j->table_stride;

    for (int64_t i = 0; i < H * D; i++) qs[i] = q[i] * j->scale2;
    for (int64_t h = 0; h < H; h++) m[h] = -INFINITY, l[h] = 0.0f;
    memset(acc, 0, (size_t)(H * D) * sizeof *acc);

    int64_t blk = sp->begin / B, off = sp->begin % B; /* walked forward: no division per position */
    for (int64_t t0 = sp->begin; t0 < sp->end; t0 += CHUNK) {
        const int64_t n = sp->end - t0 < CHUNK ? sp->end - t0 : CHUNK;
        for (int64_t t = 0; t < n; t++) {
            const int64_t at = (table[blk] * B + off) * row;
            krow[t] = j->k + at;
            vrow[t] = j->v + at;
            if (++off == B) off = 0, blk++;
        }
        for (int64_t t = 0; t < n; t++) /* query head h = kh * G + g reads kv head kh */
            for (int64_t kh = 0; kh < KH; kh++)
                for (int64_t h = kh * G; h < (kh + 1) * G; h++) s[h * CHUNK + t] = dot(qs + h * D, krow[t] + kh * D, D);
        for (int64_t h = 0; h < H; h++) {
            float *sh = s + h * CHUNK, top = sh[0];
            for (int64_t t = 1; t < n; t++) top = sh[t] > top ? sh[t] : top;
            if (top > m[h]) { /* a new max: what was summed so far shrinks by 2^(old - new) */
                const float shrink = exp2_nonpositive(m[h] - top);
                l[h] *= shrink;
                for (int64_t d = 0; d < D; d++) acc[h * D + d] *= shrink;
                m[h] = top;
            }
            const float mh = m[h]; /* a local: the compiler cannot tell that sh[] never overlaps m[] */
            for (int64_t t = 0; t < n; t++) sh[t] = exp2_nonpositive(sh[t] - mh);
            l[h] += sum(sh, n);
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t kh = 0; kh < KH; kh++)
                for (int64_t h = kh * G; h < (kh + 1) * G; h++) {
                    const float p = s[h * CHUNK + t], *vh = vrow[t] + kh * D;
                    float *ah = acc + h * D;
                    for (int64_t d = 0; d < D; d++) ah[d] += p * vh[d];
                }
    }
}

/* Softmax-merge the partials of each sequence's spans into out [batch, heads, dim]. */
static void merge(const Job *j, const int64_t *first, int64_t batch, float *out) {
    const int64_t H = j->heads, D = j->dim, stride = H * (D + 2);
    for (int64_t i = 0; i < batch; i++)
        for (int64_t h = 0; h < H; h++) {
            float top = -INFINITY, total = 0.0f, *o = out + (i * H + h) * D;
            for (int64_t u = first[i]; u < first[i + 1]; u++) {
                const float mu = j->partials[u * stride + h];
                top = mu > top ? mu : top;
            }
            memset(o, 0, (size_t)D * sizeof *o);
            for (int64_t u = first[i]; u < first[i + 1]; u++) {
                const float *m = j->partials + u * stride, *acc = m + 2 * H + h * D;
                const float w = exp2_nonpositive(m[h] - top); /* exactly 1 for a sequence in one span */
                total += w * m[H + h];
                for (int64_t d = 0; d < D; d++) o[d] += w * acc[d];
            }
            for (int64_t d = 0; d < D; d++) o[d] /= total;
        }
}

typedef struct {
    Job *job;
    float *scratch;
} Worker;

static void drain(Job *j, float *scratch) {
    for (long long i; (i = atomic_fetch_add(&j->next, 1)) < j->num_spans;) attend_span(j, &j->spans[i], scratch);
}

static void *worker_main(void *arg) {
    Worker *w = arg;
    drain(w->job, w->scratch);
    return NULL;
}

static int longest_first(const void *a, const void *b) {
    const Span *x = a, *y = b;
    const int64_t nx = x->end - x->begin, ny = y->end - y->begin;
    return (nx < ny) - (nx > ny);
}

/* Split each sequence into spans: whole sequences on one thread; else about 8 spans per thread over the batch
 * (longest first, they balance), each MIN_SPAN long or more but for a sequence's last. Returns the span count
 * and fills first (a sequence's first slot); fills spans too unless it is NULL. */
static int64_t plan(const int64_t *lens, int64_t batch, int64_t threads, Span *spans, int64_t *first) {
    int64_t total = 0, longest = 0, count = 0;
    for (int64_t i = 0; i < batch; i++) total += lens[i], longest = lens[i] > longest ? lens[i] : longest;
    int64_t span = threads == 1 ? longest : (total + 8 * threads - 1) / (8 * threads);
    span = span < MIN_SPAN ? MIN_SPAN : span;
    for (int64_t i = 0; i < batch; i++) {
        first[i] = count;
        for (int64_t b = 0; b < lens[i]; b += span, count++)
            if (spans) spans[count] = (Span){i, b, b + span < lens[i] ? b + span : lens[i], count};
    }
    first[batch] = count;
    return count;
}

PyDoc_STRVAR(decode_doc,
"decode(out, q, k, v, tables, table_stride, lens, batch, heads, kv_heads, dim, block_size, num_blocks, scale,\n"
"       threads, thread_floats)\n--\n\n"
"Decode attention of q [batch, heads, dim] over one layer's paged K/V into out [batch, heads, dim], all fp32.\n"
"out, q, k, v, tables (int64 [batch, table_stride]) and lens (int64 [batch], each >= 1) are addresses of\n"
"C-contiguous tensors; k and v are [num_blocks, block_size, kv_heads, dim]. kvlab.core.attention validates\n"
"the tensors and calls this; the block ids it reads are checked here too. It runs on at most `threads`\n"
"threads, and on one more only per `thread_floats` floats of K/V it reads.");

static PyObject *decode(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long out, q, k, v, tables, lens;
    Py_ssize_t stride, batch, heads, kv_heads, dim, block_size, num_blocks, threads, thread_floats;
    double scale;
    if (!PyArg_ParseTuple(args, "KKKKKnKnnnnnndnn", &out, &q, &k, &v, &tables, &stride, &lens, &batch, &heads,
                          &kv_heads, &dim, &block_size, &num_blocks, &scale, &threads, &thread_floats))
        return NULL;
    if (batch < 0 || kv_heads < 1 || heads < 1 || heads % kv_heads || dim < 1 || block_size < 1 || threads < 1 ||
        thread_floats < 1) {
        PyErr_Format(PyExc_ValueError, "decode: bad sizes batch=%zd heads=%zd kv_heads=%zd dim=%zd block_size=%zd "
                     "threads=%zd thread_floats=%zd", batch, heads, kv_heads, dim, block_size, threads, thread_floats);
        return NULL;
    }
    const int64_t *len = (const int64_t *)(uintptr_t)lens, *table = (const int64_t *)(uintptr_t)tables;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < batch; i++) {
        if (len[i] < 1 || len[i] > stride * block_size) {
            PyErr_Format(PyExc_ValueError, "decode: sequence %zd has length %lld; a table of %zd blocks of %zd "
                         "holds 1..%zd", i, (long long)len[i], stride, block_size, stride * block_size);
            return NULL;
        }
        for (int64_t b = 0; b < (len[i] + block_size - 1) / block_size; b++)
            if (table[i * stride + b] < 0 || table[i * stride + b] >= num_blocks) {
                PyErr_Format(PyExc_ValueError, "decode: sequence %zd names block %lld, outside 0..%zd", i,
                             (long long)table[i * stride + b], num_blocks - 1);
                return NULL;
            }
        total += len[i];
    }
    const int64_t worth = 2 * total * kv_heads * dim / thread_floats; /* threads the work pays for */
    threads = threads < worth ? threads : (worth > 1 ? worth : 1);
    int64_t *first = malloc((size_t)(batch + 1) * sizeof *first);
    const int64_t num_spans = first ? plan(len, batch, threads, NULL, first) : 0;
    const int64_t used = threads < num_spans ? threads : (num_spans ? num_spans : 1); /* threads with work */
    const int64_t scratch_floats = heads * (dim + CHUNK);
    Span *spans = malloc((size_t)(num_spans ? num_spans : 1) * sizeof *spans);
    float *floats = malloc((size_t)(num_spans * heads * (dim + 2) + used * scratch_floats) * sizeof *floats);
    Worker *workers = malloc((size_t)used * sizeof *workers);
    pthread_t *tids = malloc((size_t)used * sizeof *tids);
    if (!first || !spans || !floats || !workers || !tids) {
        free(first), free(spans), free(floats), free(workers), free(tids);
        return PyErr_NoMemory();
    }
    plan(len, batch, threads, spans, first);
    qsort(spans, (size_t)num_spans, sizeof *spans, longest_first);
    Job job = {(const float *)(uintptr_t)q, (const float *)(uintptr_t)k, (const float *)(uintptr_t)v, table,
               stride, heads, kv_heads, dim, block_size, (float)(scale * 1.4426950408889634), spans, num_spans,
               floats, floats + num_spans * heads * (dim + 2), scratch_floats, 0};
    Py_BEGIN_ALLOW_THREADS
    int64_t started = 0;
    for (; started < used - 1; started++) { /* if the OS refuses a thread, the others take its share */
        workers[started] = (Worker){&job, job.scratch + (started + 1) * scratch_floats};
        if (pthread_create(&tids[started], NULL, worker_main, &workers[started])) break;
    }
    drain(&job, job.scratch);
    for (int64_t t = 0; t < started; t++) pthread_join(tids[t], NULL);
    merge(&job, first, batch, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS
    free(first), free(spans), free(floats), free(workers), free(tids);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_attention",
                                    "Paged decode attention in C (see kvlab/fast/_paged_attention.c).", -1, methods};

PyMODINIT_FUNC PyInit__paged_attention(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddStringConstant(m, "SOURCE_SHA256", KVLAB_SOURCE_SHA256) < 0) Py_CLEAR(m);
    return m;
}
