/*
 * aiokv's native helper: one call enqueues a whole job, and a waiter thread rings the
 * doorbell when a job ends, neither needing Python in between.
 *
 * No CUDA toolkit is needed to build it: the few driver types are declared here, and the
 * driver's entry points come in at run time as addresses (``Table``), which aiokv takes
 * from ``cuGetProcAddress`` of the libcuda that cuda-python loaded; tests hand it fakes.
 *
 * ``Table.enqueue`` runs a program: rows of 8 unsigned 64-bit words, one driver call each
 * (the opcodes below, mirrored in aiokv/backends/cuda/program.py). Every row is checked
 * before the first call is made, so bad input raises and enqueues nothing. A driver call
 * that fails stops the program; every stream the program touched is then joined into its
 * main stream (record ``rescue`` there, main waits on it), so an event recorded on main
 * afterwards covers everything enqueued, and the call returns (rows done, CUresult).
 *
 * ``Waiter`` is one thread per lane that waits on job end events in order (blocking-sync
 * events of its own, recorded on a side stream behind the job's) and writes one byte to a
 * doorbell pipe for each: the event loop wakes without any Python thread being involved.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUfunction;
typedef void *CUcontext;
typedef uint64_t CUdeviceptr;

#define CUDA_ERROR_NOT_SUPPORTED 801
#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2

typedef CUresult (*wait_fn)(CUstream, CUevent, unsigned int);
typedef CUresult (*record_fn)(CUevent, CUstream);
typedef CUresult (*copy_fn)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
typedef CUresult (*launch_fn)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                              unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
typedef CUresult (*batch13_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                               size_t, CUstream);
typedef CUresult (*batch12_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                               size_t, size_t *, CUstream);
typedef CUresult (*pitched13_fn)(size_t, void *, unsigned long long, CUstream);
typedef CUresult (*pitched12_fn)(size_t, void *, size_t *, unsigned long long, CUstream);
typedef CUresult (*sync_fn)(CUevent);
typedef CUresult (*event_create_fn)(CUevent *, unsigned int);
typedef CUresult (*event_destroy_fn)(CUevent);
typedef CUresult (*ctx_set_fn)(CUcontext);

/* The table's entry points, in the order ``Table(procs)`` takes them. */
enum { P_WAIT, P_RECORD, P_COPY, P_LAUNCH, P_BATCH, P_PITCHED, P_SYNC, P_EVENT_CREATE,
       P_EVENT_DESTROY, P_CTX_SET, N_PROCS };
static const char *PROC_NAMES[N_PROCS] = {
    "cuStreamWaitEvent", "cuEventRecord", "cuMemcpyAsync", "cuLaunchKernel",
    "cuMemcpyBatchAsync", "cuMemcpy3DBatchAsync", "cuEventSynchronize", "cuEventCreate",
    "cuEventDestroy", "cuCtxSetCurrent"};

/* Opcodes: one row of 8 words each.
 *   WAIT    stream, event                          cuStreamWaitEvent(stream, event, 0)
 *   RECORD  event, stream                          cuEventRecord(event, stream)
 *   BATCH   stream, dst, src, sizes, count, flags, first
 *           cuMemcpyBatchAsync of copies [first, first + count) of the tables dst, src and
 *           sizes (indices into ``buffers``, 8-byte ints each); flags picks the
 *           CUmemcpyAttributes (bit 0 stream-ordered, bit 1 to host). Without a batched
 *           call in the table: one cuMemcpyAsync per copy.
 *   COPY    stream, dst, src, nbytes               cuMemcpyAsync
 *   PITCHED stream, ops, count                     cuMemcpy3DBatchAsync: ops indexes a
 *           buffer of >= count rows of 14 u64 (CUDA_MEMCPY3D_BATCH_OP)
 *   LAUNCH  stream, function, grid, block, blob, offsets, nparams
 *           cuLaunchKernel(function, grid,1,1, block,1,1, 0, stream, params, NULL) with
 *           params[i] = &blob[offsets[i]] (blob and offsets index ``buffers``)
 */
enum { OP_WAIT = 1, OP_RECORD, OP_BATCH, OP_COPY, OP_PITCHED, OP_LAUNCH };
#define WORDS 8
#define MAX_PARAMS 64
#define MAX_RESCUE_STREAMS 256

static PyObject *invalid_error; /* aiokv.errors.InvalidSpec, set by set_error_class */

static PyObject *
bad_input(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg != NULL) {
        PyErr_SetObject(invalid_error != NULL ? invalid_error : PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

/* ------------------------------------------------------------------------- table */

typedef struct {
    PyObject_HEAD
    void *procs[N_PROCS];
    int version; /* 13000 or 12080: which signature the batched calls have */
    void *attrs[4];
    void *context;
} TableObject;

static int
read_addresses(PyObject *seq, void **out, Py_ssize_t n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        bad_input("%s must hold %zd addresses", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out[i] = (void *)(uintptr_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

static int
Table_init(TableObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"procs", "version", "attrs", "context", NULL};
    PyObject *procs, *attrs;
    int version;
    unsigned long long context;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiOK", kwlist, &procs, &version, &attrs, &context))
        return -1;
    if (read_addresses(procs, self->procs, N_PROCS, "procs") < 0 ||
        read_addresses(attrs, self->attrs, 4, "attrs") < 0)
        return -1;
    self->version = version;
    self->context = (void *)(uintptr_t)context;
    return 0;
}

/* A buffer of 8-byte integers (numpy int64/uint64, array('Q'), ...), C-contiguous. */
static int
is_words(const Py_buffer *b)
{
    if (b->itemsize != 8)
        return 0;
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<' || *f == '!' || *f == '>')
        f++;
    return f[0] != '\0' && f[1] == '\0' && strchr("qQlLnN", f[0]) != NULL;
}

static int
need_proc(TableObject *t, int p)
{
    if (t->procs[p] == NULL) {
        bad_input("the driver table has no %s", PROC_NAMES[p]);
        return -1;
    }
    return 0;
}

static int
need_words(Py_buffer *views, Py_ssize_t nbuf, uint64_t id, uint64_t count, Py_ssize_t row,
           const char *what)
{
    if (id >= (uint64_t)nbuf) {
        bad_input("op %zd: %s buffer %llu is not one of the %zd buffers", row, what,
                  (unsigned long long)id, nbuf);
        return -1;
    }
    if (!is_words(&views[id])) {
        bad_input("op %zd: %s buffer %llu must hold 8-byte integers (int64/uint64), not '%s' "
                  "of %zd bytes", row, what, (unsigned long long)id,
                  views[id].format ? views[id].format : "B", views[id].itemsize);
        return -1;
    }
    if (count > (uint64_t)(views[id].len / 8)) {
        bad_input("op %zd: %s buffer %llu holds %zd values, the op reads %llu", row, what,
                  (unsigned long long)id, views[id].len / 8, (unsigned long long)count);
        return -1;
    }
    return 0;
}

/* Every row is checked before any call is made: nothing is enqueued on bad input. */
static int
check_program(TableObject *t, const uint64_t *w, Py_ssize_t rows, Py_buffer *views, Py_ssize_t nbuf)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint64_t *o = w + r * WORDS;
        switch (o[0]) {
        case OP_WAIT:
            if (need_proc(t, P_WAIT) < 0)
                return -1;
            if (o[2] == 0)
                return bad_input("op %zd: cuStreamWaitEvent on a null event", r), -1;
            break;
        case OP_RECORD:
            if (need_proc(t, P_RECORD) < 0)
                return -1;
            if (o[1] == 0)
                return bad_input("op %zd: cuEventRecord of a null event", r), -1;
            break;
        case OP_BATCH:
            if (t->procs[P_BATCH] == NULL && need_proc(t, P_COPY) < 0)
                return -1;
            if (o[5] == 0)
                return bad_input("op %zd: a batched copy of no copies", r), -1;
            if (o[6] > 3)
                return bad_input("op %zd: batch flags %llu, not 0-3", r, (unsigned long long)o[6]), -1;
            if (t->procs[P_BATCH] != NULL && t->attrs[o[6]] == NULL)
                return bad_input("op %zd: the table has no copy attributes for flags %llu", r,
                                 (unsigned long long)o[6]), -1;
            if (o[7] > UINT64_MAX - o[5])
                return bad_input("op %zd: copies past the end of the tables", r), -1;
            if (need_words(views, nbuf, o[2], o[7] + o[5], r, "dst") < 0 ||
                need_words(views, nbuf, o[3], o[7] + o[5], r, "src") < 0 ||
                need_words(views, nbuf, o[4], o[7] + o[5], r, "sizes") < 0)
                return -1;
            break;
        case OP_COPY:
            if (need_proc(t, P_COPY) < 0)
                return -1;
            if (o[2] == 0 || o[3] == 0 || o[4] == 0)
                return bad_input("op %zd: a copy needs a destination, a source and a size", r), -1;
            break;
        case OP_PITCHED:
            if (o[3] == 0)
                return bad_input("op %zd: a pitched batch of no copies", r), -1;
            if (o[3] > (uint64_t)(PY_SSIZE_T_MAX / 14))
                return bad_input("op %zd: too many pitched copies", r), -1;
            if (need_words(views, nbuf, o[2], o[3] * 14, r, "pitched ops") < 0)
                return -1;
            break;
        case OP_LAUNCH:
            if (need_proc(t, P_LAUNCH) < 0)
                return -1;
            if (o[2] == 0)
                return bad_input("op %zd: cuLaunchKernel of a null function", r), -1;
            if (o[3] == 0 || o[3] > 0x7fffffffu || o[4] == 0 || o[4] > 1024)
                return bad_input("op %zd: grid %llu x block %llu is not a launch", r,
                                 (unsigned long long)o[3], (unsigned long long)o[4]), -1;
            if (o[7] == 0 || o[7] > MAX_PARAMS)
                return bad_input("op %zd: %llu parameters (1-%d)", r, (unsigned long long)o[7],
                                 MAX_PARAMS), -1;
            if (o[5] >= (uint64_t)nbuf)
                return bad_input("op %zd: parameter buffer %llu is not one of the %zd buffers", r,
                                 (unsigned long long)o[5], nbuf), -1;
            if (need_words(views, nbuf, o[6], o[7], r, "parameter offsets") < 0)
                return -1;
            {
                const uint64_t *offs = views[o[6]].buf;
                for (uint64_t i = 0; i < o[7]; i++)
                    if (offs[i] >= (uint64_t)views[o[5]].len)
                        return bad_input("op %zd: parameter %llu at byte %llu lies past the %zd-byte "
                                         "blob", r, (unsigned long long)i,
                                         (unsigned long long)offs[i], views[o[5]].len), -1;
            }
            break;
        default:
            return bad_input("op %zd: unknown opcode %llu", r, (unsigned long long)o[0]), -1;
        }
    }
    return 0;
}

static CUresult
run_op(TableObject *t, const uint64_t *o, Py_buffer *views)
{
    CUstream s;
    switch (o[0]) {
    case OP_WAIT:
        return ((wait_fn)t->procs[P_WAIT])((CUstream)(uintptr_t)o[1], (CUevent)(uintptr_t)o[2], 0);
    case OP_RECORD:
        return ((record_fn)t->procs[P_RECORD])((CUevent)(uintptr_t)o[1], (CUstream)(uintptr_t)o[2]);
    case OP_COPY:
        return ((copy_fn)t->procs[P_COPY])(o[2], o[3], (size_t)o[4], (CUstream)(uintptr_t)o[1]);
    case OP_BATCH: {
        s = (CUstream)(uintptr_t)o[1];
        CUdeviceptr *dst = (CUdeviceptr *)views[o[2]].buf + o[7], *src = (CUdeviceptr *)views[o[3]].buf + o[7];
        size_t *sizes = (size_t *)views[o[4]].buf + o[7], n = (size_t)o[5], first_attr = 0, failed = 0;
        if (t->procs[P_BATCH] == NULL) {
            for (size_t i = 0; i < n; i++) {
                CUresult r = ((copy_fn)t->procs[P_COPY])(dst[i], src[i], sizes[i], s);
                if (r != 0)
                    return r;
            }
            return 0;
        }
        void *attr = t->attrs[o[6]];
        if (t->version >= 13000)
            return ((batch13_fn)t->procs[P_BATCH])(dst, src, sizes, n, attr, &first_attr, 1, s);
        return ((batch12_fn)t->procs[P_BATCH])(dst, src, sizes, n, attr, &first_attr, 1, &failed, s);
    }
    case OP_PITCHED: {
        size_t failed = 0;
        s = (CUstream)(uintptr_t)o[1];
        if (t->procs[P_PITCHED] == NULL)
            return CUDA_ERROR_NOT_SUPPORTED;
        if (t->version >= 13000)
            return ((pitched13_fn)t->procs[P_PITCHED])((size_t)o[3], views[o[2]].buf, 0, s);
        return ((pitched12_fn)t->procs[P_PITCHED])((size_t)o[3], views[o[2]].buf, &failed, 0, s);
    }
    case OP_LAUNCH: {
        void *params[MAX_PARAMS];
        char *blob = views[o[5]].buf;
        const uint64_t *offs = views[o[6]].buf;
        for (uint64_t i = 0; i < o[7]; i++)
            params[i] = blob + offs[i];
        return ((launch_fn)t->procs[P_LAUNCH])((CUfunction)(uintptr_t)o[2], (unsigned int)o[3], 1, 1,
                                              (unsigned int)o[4], 1, 1, 0, (CUstream)(uintptr_t)o[1],
                                              params, NULL);
    }
    }
    return CUDA_ERROR_NOT_SUPPORTED; /* unreachable: checked */
}

static uint64_t
stream_of(const uint64_t *o)
{
    return o[0] == OP_RECORD ? o[2] : o[1];
}

/* After a failure at row ``failed``: join every stream rows 0..failed touched into main. */
static void
rescue_streams(TableObject *t, const uint64_t *w, Py_ssize_t failed, uint64_t main, uint64_t rescue)
{
    uint64_t seen[MAX_RESCUE_STREAMS];
    int nseen = 0;
    if (rescue == 0 || t->procs[P_RECORD] == NULL || t->procs[P_WAIT] == NULL)
        return;
    for (Py_ssize_t r = 0; r <= failed; r++) {
        uint64_t s = stream_of(w + r * WORDS);
        int known = s == main;
        for (int i = 0; i < nseen && !known; i++)
            known = seen[i] == s;
        if (known)
            continue;
        if (nseen < MAX_RESCUE_STREAMS)
            seen[nseen++] = s;
        if (((record_fn)t->procs[P_RECORD])((CUevent)(uintptr_t)rescue, (CUstream)(uintptr_t)s) == 0)
            ((wait_fn)t->procs[P_WAIT])((CUstream)(uintptr_t)main, (CUevent)(uintptr_t)rescue, 0);
    }
}

/* A C-contiguous view of ``obj``; anything else (a strided array, no buffer) is bad input. */
static int
get_view(PyObject *obj, Py_buffer *view, const char *what, Py_ssize_t index)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0)
        return 0;
    view->obj = NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (index < 0)
        bad_input("%s must be a C-contiguous buffer (%S)", what, value ? value : Py_None);
    else
        bad_input("%s %zd must be a C-contiguous buffer (%S)", what, index, value ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
}

static void
release_views(Py_buffer *views, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
    PyMem_Free(views);
}

PyDoc_STRVAR(enqueue_doc,
"enqueue(ops, buffers, main, rescue, hold_gil=True) -> (rows_done, cuda_result)\n\n"
"Run a program of driver calls: ``ops`` is a C-contiguous buffer of 8-byte integers, 8 per\n"
"row (opcode, then its words; see the opcodes in program.py), ``buffers`` a tuple of the\n"
"buffers rows name by index (kept exported for the call). Every row is checked first:\n"
"bad input raises InvalidSpec and enqueues nothing. Then the calls run in order, holding\n"
"the GIL (or, with hold_gil=False, after releasing it once). The first call that fails\n"
"stops the program; each stream the program used is joined into ``main`` by recording\n"
"``rescue`` on it and waiting on that from ``main``. Returns (rows done, 0) on success,\n"
"else (index of the failing row, its CUresult).");

static PyObject *
Table_enqueue(TableObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ops", "buffers", "main", "rescue", "hold_gil", NULL};
    PyObject *ops_obj, *buffers;
    unsigned long long main_stream, rescue;
    int hold_gil = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!KK|p", kwlist, &ops_obj, &PyTuple_Type, &buffers,
                                     &main_stream, &rescue, &hold_gil))
        return NULL;
    if (rescue == 0)
        return bad_input("the rescue event must not be null");
    Py_buffer ops;
    if (get_view(ops_obj, &ops, "ops", -1) < 0)
        return NULL;
    if (!is_words(&ops) || (ops.len / 8) % WORDS != 0) {
        PyBuffer_Release(&ops);
        return bad_input("ops must be rows of %d 8-byte integers", WORDS);
    }
    Py_ssize_t rows = ops.len / 8 / WORDS, nbuf = PyTuple_GET_SIZE(buffers);
    Py_buffer *views = PyMem_Calloc(nbuf ? nbuf : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyBuffer_Release(&ops);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        if (get_view(PyTuple_GET_ITEM(buffers, i), &views[i], "buffer", i) < 0) {
            release_views(views, i);
            PyBuffer_Release(&ops);
            return NULL;
        }
    }
    const uint64_t *w = ops.buf;
    if (check_program(self, w, rows, views, nbuf) < 0) {
        release_views(views, nbuf);
        PyBuffer_Release(&ops);
        return NULL;
    }
    Py_ssize_t done = 0;
    CUresult code = 0;
    PyThreadState *saved = hold_gil ? NULL : PyEval_SaveThread();
    for (; done < rows; done++) {
        code = run_op(self, w + done * WORDS, views);
        if (code != 0)
            break;
    }
    if (code != 0)
        rescue_streams(self, w, done, main_stream, rescue);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    release_views(views, nbuf);
    PyBuffer_Release(&ops);
    return Py_BuildValue("(ni)", done, code);
}

static PyMethodDef Table_methods[] = {
    {"enqueue", (PyCFunction)(void (*)(void))Table_enqueue, METH_VARARGS | METH_KEYWORDS, enqueue_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Table_doc,
"Table(procs, version, attrs, context)\n\n"
"The driver entry points the helper calls, as addresses: ``procs`` in the order\n"
"cuStreamWaitEvent, cuEventRecord, cuMemcpyAsync, cuLaunchKernel, cuMemcpyBatchAsync,\n"
"cuMemcpy3DBatchAsync, cuEventSynchronize, cuEventCreate, cuEventDestroy, cuCtxSetCurrent\n"
"(0 where absent; a program that needs an absent one raises InvalidSpec). ``version``:\n"
"13000 or 12080, the batched calls' signature. ``attrs``: the CUmemcpyAttributes\n"
"addresses of batch flags 0-3. ``context``: the CUcontext a waiter thread makes current.");

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Table_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_methods = Table_methods,
};

/* ------------------------------------------------------------------------ waiter */

typedef struct {
    int slot;
    int fd;
} Entry;

/* Shared by the Python object and the thread; freed by whichever lets go last. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs, stop, abandoned, ready, running;
    pthread_t thread;
    void *procs[N_PROCS];
    void *context;
    CUstream stream;
    int nslots, created, nfree, head, count;
    CUevent *events;
    int *free_slots;
    Entry *queue;
    unsigned long long armed, rung, errors;
    CUresult last_error;
} WaiterState;

static void
state_free(WaiterState *st)
{
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->cv);
    PyMem_RawFree(st->events);
    PyMem_RawFree(st->free_slots);
    PyMem_RawFree(st->queue);
    PyMem_RawFree(st);
}

static void
state_release(WaiterState *st)
{
    pthread_mutex_lock(&st->mu);
    int last = --st->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last)
        state_free(st);
}

static void *
waiter_main(void *arg)
{
    WaiterState *st = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals stay with Python's threads */
    CUresult r = 0;
    if (st->procs[P_CTX_SET] != NULL)
        r = ((ctx_set_fn)st->procs[P_CTX_SET])(st->context);
    pthread_mutex_lock(&st->mu);
    if (r != 0) {
        st->errors++;
        st->last_error = r;
    }
    st->ready = 1;
    pthread_cond_broadcast(&st->cv);
    for (;;) {
        while (st->count == 0 && !st->stop)
            pthread_cond_wait(&st->cv, &st->mu);
        if (st->count == 0)
            break; /* stopped, and every armed ring is done */
        Entry e = st->queue[st->head];
        st->head = (st->head + 1) % st->nslots;
        st->count--;
        CUevent ev = st->events[e.slot];
        pthread_mutex_unlock(&st->mu);
        r = ((sync_fn)st->procs[P_SYNC])(ev); /* a blocking-sync event: the thread sleeps */
        pthread_mutex_lock(&st->mu);
        if (!st->abandoned) {
            ssize_t wrote = write(e.fd, "!", 1); /* a full pipe has a ring pending already */
            (void)wrote;
        }
        close(e.fd);
        if (r != 0) {
            st->errors++;
            st->last_error = r;
        }
        st->rung++;
        st->free_slots[st->nfree++] = e.slot;
        pthread_cond_broadcast(&st->cv);
    }
    st->running = 0;
    int last = --st->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last)
        state_free(st);
    return NULL;
}

typedef struct {
    PyObject_HEAD
    WaiterState *st;
    int closed;
} WaiterObject;

static int
Waiter_init(WaiterObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"table", "stream", "slots", NULL};
    TableObject *table;
    unsigned long long stream;
    int slots = 64;
    if (self->st != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Waiter is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!K|i", kwlist, &TableType, &table, &stream, &slots))
        return -1;
    if (slots < 1 || slots > 4096) {
        bad_input("slots must be 1-4096, got %d", slots);
        return -1;
    }
    static const int needed[] = {P_WAIT, P_RECORD, P_SYNC, P_EVENT_CREATE, P_EVENT_DESTROY};
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
        if (need_proc(table, needed[i]) < 0)
            return -1;
    WaiterState *st = PyMem_RawCalloc(1, sizeof(WaiterState));
    if (st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    st->events = PyMem_RawCalloc(slots, sizeof(CUevent));
    st->free_slots = PyMem_RawCalloc(slots, sizeof(int));
    st->queue = PyMem_RawCalloc(slots, sizeof(Entry));
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
    if (st->events == NULL || st->free_slots == NULL || st->queue == NULL) {
        state_free(st);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(st->procs, table->procs, sizeof st->procs);
    st->context = table->context;
    st->stream = (CUstream)(uintptr_t)stream;
    st->nslots = slots;
    st->refs = 2; /* this object and the thread */
    st->running = 1;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = pthread_create(&st->thread, NULL, waiter_main, st);
    if (err == 0) { /* wait until the thread has its context (or failed to get it) */
        pthread_mutex_lock(&st->mu);
        while (!st->ready)
            pthread_cond_wait(&st->cv, &st->mu);
        pthread_mutex_unlock(&st->mu);
    }
    Py_END_ALLOW_THREADS
    if (err != 0) {
        state_free(st);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->st = st;
    return 0;
}

static void
destroy_events(WaiterState *st)
{
    for (int i = 0; i < st->created; i++)
        ((event_destroy_fn)st->procs[P_EVENT_DESTROY])(st->events[i]);
    st->created = 0;
}

PyDoc_STRVAR(watch_doc,
"watch(event, fd) -> int\n\n"
"Have the thread write one byte to ``fd`` (a dup of it, taken now) once ``event``'s latest\n"
"record has completed: a waiter event of its own is recorded on the waiter's stream behind\n"
"a wait on ``event``, so ``event`` may be recorded again at once. Rings come in the order\n"
"they were asked for. Returns 0 when armed, -1 when it cannot be (closed, or every slot\n"
"busy), or the CUresult of the driver call that failed (nothing armed then).");

static PyObject *
Waiter_watch(WaiterObject *self, PyObject *args)
{
    unsigned long long event;
    int fd;
    if (!PyArg_ParseTuple(args, "Ki", &event, &fd))
        return NULL;
    if (event == 0)
        return bad_input("watch: a null event");
    if (fd < 0)
        return bad_input("watch: a negative file descriptor");
    WaiterState *st = self->st;
    if (st == NULL || self->closed)
        return PyLong_FromLong(-1);
    pthread_mutex_lock(&st->mu);
    int slot = -1;
    CUresult r = 0;
    if (st->stop) {
        pthread_mutex_unlock(&st->mu);
        return PyLong_FromLong(-1);
    }
    if (st->nfree > 0) {
        slot = st->free_slots[--st->nfree];
    } else if (st->created < st->nslots) {
        CUevent ev = NULL;
        r = ((event_create_fn)st->procs[P_EVENT_CREATE])(&ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
        if (r == 0 && ev != NULL) {
            slot = st->created;
            st->events[st->created++] = ev;
        }
    }
    if (slot < 0) {
        pthread_mutex_unlock(&st->mu);
        return PyLong_FromLong(r != 0 ? r : -1);
    }
    int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
        int saved = errno;
        st->free_slots[st->nfree++] = slot;
        pthread_mutex_unlock(&st->mu);
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    r = ((wait_fn)st->procs[P_WAIT])(st->stream, (CUevent)(uintptr_t)event, 0);
    if (r == 0)
        r = ((record_fn)st->procs[P_RECORD])(st->events[slot], st->stream);
    if (r != 0) {
        close(dup);
        st->free_slots[st->nfree++] = slot;
        pthread_mutex_unlock(&st->mu);
        return PyLong_FromLong(r);
    }
    st->queue[(st->head + st->count) % st->nslots] = (Entry){slot, dup};
    st->count++;
    st->armed++;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return PyLong_FromLong(0);
}

PyDoc_STRVAR(close_doc,
"close()\n\nLet the thread finish the rings armed (their events must complete), join it and\n"
"destroy the waiter's events (the context must be current). Idempotent.");

static PyObject *
Waiter_close(WaiterObject *self, PyObject *unused)
{
    WaiterState *st = self->st;
    if (st == NULL || self->closed)
        Py_RETURN_NONE;
    self->closed = 1;
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(st->thread, NULL);
    Py_END_ALLOW_THREADS
    destroy_events(st);
    self->st = NULL;
    state_release(st);
    Py_RETURN_NONE;
}

static void
waiter_abandon(WaiterObject *self)
{
    WaiterState *st = self->st;
    if (st == NULL || self->closed)
        return;
    self->closed = 1;
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    st->abandoned = 1; /* nobody listens: rings are dropped, events are leaked */
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    pthread_detach(st->thread);
    self->st = NULL;
    state_release(st);
}

PyDoc_STRVAR(abandon_doc,
"abandon()\n\nStop without waiting (a worker dropped unclosed): the thread ends once the rings\n"
"armed are over, writing none of them; the waiter's events are never destroyed.");

static PyObject *
Waiter_abandon(WaiterObject *self, PyObject *unused)
{
    waiter_abandon(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict\n\nRings armed and rung, waits that returned an error (they ring all the same)\n"
"and the last such CUresult, slots created, and whether the thread still runs.");

static PyObject *
Waiter_stats(WaiterObject *self, PyObject *unused)
{
    WaiterState *st = self->st;
    if (st == NULL)
        return Py_BuildValue("{s:O}", "running", Py_False);
    pthread_mutex_lock(&st->mu);
    unsigned long long armed = st->armed, rung = st->rung, errors = st->errors;
    int last = st->last_error, created = st->created, running = st->running, pending = st->count;
    pthread_mutex_unlock(&st->mu);
    return Py_BuildValue("{s:K,s:K,s:K,s:i,s:i,s:i,s:O}", "armed", armed, "rung", rung, "errors",
                         errors, "last_error", last, "slots", created, "pending", pending,
                         "running", running ? Py_True : Py_False);
}

static void
Waiter_dealloc(WaiterObject *self)
{
    waiter_abandon(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Waiter_methods[] = {
    {"watch", (PyCFunction)Waiter_watch, METH_VARARGS, watch_doc},
    {"close", (PyCFunction)Waiter_close, METH_NOARGS, close_doc},
    {"abandon", (PyCFunction)Waiter_abandon, METH_NOARGS, abandon_doc},
    {"stats", (PyCFunction)Waiter_stats, METH_NOARGS, stats_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Waiter_doc,
"Waiter(table, stream, slots=64)\n\n"
"A thread that rings doorbells as jobs end (see ``watch``), with up to ``slots`` rings armed\n"
"at once. ``stream`` is where its events are recorded (a side stream: copies never wait for\n"
"it). The thread makes the table's context current first and never takes the GIL.");

static PyTypeObject WaiterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Waiter",
    .tp_basicsize = sizeof(WaiterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Waiter_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Waiter_init,
    .tp_dealloc = (destructor)Waiter_dealloc,
    .tp_methods = Waiter_methods,
};

/* ------------------------------------------------------------------------ module */

static PyObject *
set_error_class(PyObject *module, PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "set_error_class takes an exception class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(invalid_error, cls);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_error_class", set_error_class, METH_O,
     "set_error_class(cls)\n\nThe exception raised for bad input (aiokv.errors.InvalidSpec)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_native",
    "aiokv's native helper: one call per job's enqueue, and a waiter that rings doorbells.",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&WaiterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TableType);
    Py_INCREF(&WaiterType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObject(m, "Waiter", (PyObject *)&WaiterType) < 0 ||
        PyModule_AddIntConstant(m, "WORDS", WORDS) < 0 ||
        PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
