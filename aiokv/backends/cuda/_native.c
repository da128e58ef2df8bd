/* aiokv's native helper, its core: the driver table, the rows and their checks, the one
 * synchronous call per program (``Table.enqueue``), and the module. The waiter thread is in
 * _native_waiter.c, the issuer thread in _native_issuer.c, the planner in _native_plan.c;
 * what they share, and the helper's contract, in _native.h. */
#include "_native.h"

#include <stdlib.h>
#include <time.h>

atomic_int aiokv_caller_calls;
int aiokv_give_way_on = 1;

double
aiokv_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

CUresult
aiokv_thread_enter(const DriverTable *d)
{
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals stay with Python's threads */
    if (d->procs[P_CTX_SET] == NULL)
        return 0;
    return ((ctx_set_fn)d->procs[P_CTX_SET])(d->context);
}

int
aiokv_start_thread(pthread_t *thread, void *(*main_fn)(void *), void *arg, pthread_mutex_t *mu,
                   pthread_cond_t *cv, const int *ready)
{
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = pthread_create(thread, NULL, main_fn, arg);
    if (err == 0) { /* wait until the thread has its context (or failed to get it) */
        pthread_mutex_lock(mu);
        while (!*ready)
            pthread_cond_wait(cv, mu);
        pthread_mutex_unlock(mu);
    }
    Py_END_ALLOW_THREADS
    return err;
}

/* Stand-ins for the driver, to measure and test the host side of a submit without a
 * device (``FAKES``): an entry point that does nothing and succeeds (called with whatever
 * arguments: the caller cleans up), an event creation that hands out a non-null handle,
 * and a host-function launch that runs the function at once. */
static int
aiokv_noop(void)
{
    return 0;
}

static int
aiokv_fake_event_create(CUevent *out, unsigned int flags)
{
    static uintptr_t next = 0x10000;
    *out = (CUevent)__atomic_add_fetch(&next, 16, __ATOMIC_RELAXED);
    return 0;
}

static int
aiokv_fake_host_func_now(CUstream stream, void (*fn)(void *), void *data)
{
    fn(data);
    return 0;
}

PyObject *aiokv_invalid_error;
PyObject *aiokv_closed_error;

PyObject *
aiokv_bad_input(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg != NULL) {
        PyErr_SetObject(aiokv_invalid_error != NULL ? aiokv_invalid_error : PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

/* ------------------------------------------------------------------------- table */



static int
read_addresses(PyObject *seq, void **out, Py_ssize_t n, const char *what)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        aiokv_bad_input("%s must hold %zd addresses", what, n);
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
    if (read_addresses(procs, self->d.procs, N_PROCS, "procs") < 0 ||
        read_addresses(attrs, self->d.attrs, 4, "attrs") < 0)
        return -1;
    self->d.version = version;
    self->d.context = (void *)(uintptr_t)context;
    return 0;
}

/* A buffer of 8-byte integers in this machine's byte order (numpy int64/uint64,
 * array('Q'), ...), C-contiguous. A byte-swapped one ('>Q' here) would be read as other
 * addresses and sizes, so it is refused like any other wrong format. */
int
aiokv_is_words(const Py_buffer *b)
{
#if PY_BIG_ENDIAN
    static const char swapped[] = "<";
#else
    static const char swapped[] = "!>";
#endif
    if (b->itemsize != 8)
        return 0;
    const char *f = b->format ? b->format : "B";
    if (*f != '\0' && strchr(swapped, *f) != NULL)
        return 0;
    if (*f == '@' || *f == '=' || *f == '<' || *f == '!' || *f == '>')
        f++;
    return f[0] != '\0' && f[1] == '\0' && strchr("qQlLnN", f[0]) != NULL;
}

int
aiokv_need_proc(const DriverTable *t, int p)
{
    if (t->procs[p] == NULL) {
        aiokv_bad_input("the driver table has no %s", PROC_NAMES[p]);
        return -1;
    }
    return 0;
}

static int
need_words(Py_buffer *views, Py_ssize_t nbuf, uint64_t id, uint64_t count, Py_ssize_t row,
           const char *what)
{
    if (id >= (uint64_t)nbuf) {
        aiokv_bad_input("op %zd: %s buffer %llu is not one of the %zd buffers", row, what,
                  (unsigned long long)id, nbuf);
        return -1;
    }
    if (!aiokv_is_words(&views[id])) {
        aiokv_bad_input("op %zd: %s buffer %llu must hold 8-byte integers (int64/uint64), not '%s' "
                  "of %zd bytes", row, what, (unsigned long long)id,
                  views[id].format ? views[id].format : "B", views[id].itemsize);
        return -1;
    }
    if (count > (uint64_t)(views[id].len / 8)) {
        aiokv_bad_input("op %zd: %s buffer %llu holds %zd values, the op reads %llu", row, what,
                  (unsigned long long)id, views[id].len / 8, (unsigned long long)count);
        return -1;
    }
    return 0;
}

/* Every row is checked before any call is made: nothing is enqueued on bad input. */
int
aiokv_check_program(const DriverTable *t, const uint64_t *w, Py_ssize_t rows, Py_buffer *views,
                    Py_ssize_t nbuf)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        const uint64_t *o = w + r * WORDS;
        switch (o[0]) {
        case OP_WAIT:
            if (aiokv_need_proc(t, P_WAIT) < 0)
                return -1;
            if (o[2] == 0)
                return aiokv_bad_input("op %zd: cuStreamWaitEvent on a null event", r), -1;
            break;
        case OP_RECORD:
            if (aiokv_need_proc(t, P_RECORD) < 0)
                return -1;
            if (o[1] == 0)
                return aiokv_bad_input("op %zd: cuEventRecord of a null event", r), -1;
            break;
        case OP_BATCH:
            if (t->procs[P_BATCH] == NULL && aiokv_need_proc(t, P_COPY) < 0)
                return -1;
            if (o[5] == 0)
                return aiokv_bad_input("op %zd: a batched copy of no copies", r), -1;
            if (o[6] > 3)
                return aiokv_bad_input("op %zd: batch flags %llu, not 0-3", r, (unsigned long long)o[6]), -1;
            if (t->procs[P_BATCH] != NULL && t->attrs[o[6]] == NULL)
                return aiokv_bad_input("op %zd: the table has no copy attributes for flags %llu", r,
                                 (unsigned long long)o[6]), -1;
            if (o[7] > UINT64_MAX - o[5])
                return aiokv_bad_input("op %zd: copies past the end of the tables", r), -1;
            if (need_words(views, nbuf, o[2], o[7] + o[5], r, "dst") < 0 ||
                need_words(views, nbuf, o[3], o[7] + o[5], r, "src") < 0 ||
                need_words(views, nbuf, o[4], o[7] + o[5], r, "sizes") < 0)
                return -1;
            break;
        case OP_COPY:
            if (aiokv_need_proc(t, P_COPY) < 0)
                return -1;
            if (o[2] == 0 || o[3] == 0 || o[4] == 0)
                return aiokv_bad_input("op %zd: a copy needs a destination, a source and a size", r), -1;
            break;
        case OP_PITCHED:
            if (o[3] == 0)
                return aiokv_bad_input("op %zd: a pitched batch of no copies", r), -1;
            if (o[3] > (uint64_t)(PY_SSIZE_T_MAX / 14) || o[4] > (uint64_t)(PY_SSIZE_T_MAX / 14) - o[3])
                return aiokv_bad_input("op %zd: too many pitched copies", r), -1;
            if (need_words(views, nbuf, o[2], (o[4] + o[3]) * 14, r, "pitched ops") < 0)
                return -1;
            break;
        case OP_LAUNCH:
            if (aiokv_need_proc(t, P_LAUNCH) < 0)
                return -1;
            if (o[2] == 0)
                return aiokv_bad_input("op %zd: cuLaunchKernel of a null function", r), -1;
            if (o[3] == 0 || o[3] > 0x7fffffffu || o[4] == 0 || o[4] > 1024)
                return aiokv_bad_input("op %zd: grid %llu x block %llu is not a launch", r,
                                 (unsigned long long)o[3], (unsigned long long)o[4]), -1;
            if (o[7] == 0 || o[7] > MAX_PARAMS)
                return aiokv_bad_input("op %zd: %llu parameters (1-%d)", r, (unsigned long long)o[7],
                                 MAX_PARAMS), -1;
            if (o[5] >= (uint64_t)nbuf)
                return aiokv_bad_input("op %zd: parameter buffer %llu is not one of the %zd buffers", r,
                                 (unsigned long long)o[5], nbuf), -1;
            if (need_words(views, nbuf, o[6], o[7], r, "parameter offsets") < 0)
                return -1;
            {
                const uint64_t *offs = views[o[6]].buf;
                for (uint64_t i = 0; i < o[7]; i++)
                    if (offs[i] >= (uint64_t)views[o[5]].len)
                        return aiokv_bad_input("op %zd: parameter %llu at byte %llu lies past the %zd-byte "
                                         "blob", r, (unsigned long long)i,
                                         (unsigned long long)offs[i], views[o[5]].len), -1;
            }
            break;
        default:
            return aiokv_bad_input("op %zd: unknown opcode %llu", r, (unsigned long long)o[0]), -1;
        }
    }
    return 0;
}

CUresult
aiokv_run_op(const DriverTable *t, const uint64_t *o, void *const *bufs)
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
        CUdeviceptr *dst = (CUdeviceptr *)bufs[o[2]] + o[7], *src = (CUdeviceptr *)bufs[o[3]] + o[7];
        size_t *sizes = (size_t *)bufs[o[4]] + o[7], n = (size_t)o[5], first_attr = 0, failed = 0;
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
            return ((pitched13_fn)t->procs[P_PITCHED])((size_t)o[3], (uint64_t *)bufs[o[2]] + o[4] * 14, 0, s);
        return ((pitched12_fn)t->procs[P_PITCHED])((size_t)o[3], (uint64_t *)bufs[o[2]] + o[4] * 14, &failed, 0,
                                                   s);
    }
    case OP_LAUNCH: {
        void *params[MAX_PARAMS];
        char *blob = bufs[o[5]];
        const uint64_t *offs = bufs[o[6]];
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

void
aiokv_rescue(const DriverTable *t, const uint64_t *w, Py_ssize_t failed, uint64_t main, uint64_t rescue)
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
int
aiokv_get_view(PyObject *obj, Py_buffer *view, const char *what, Py_ssize_t index)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0)
        return 0;
    view->obj = NULL;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (index < 0)
        aiokv_bad_input("%s must be a C-contiguous buffer (%S)", what, value ? value : Py_None);
    else
        aiokv_bad_input("%s %zd must be a C-contiguous buffer (%S)", what, index, value ? value : Py_None);
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
        return aiokv_bad_input("the rescue event must not be null");
    Py_buffer ops;
    if (aiokv_get_view(ops_obj, &ops, "ops", -1) < 0)
        return NULL;
    if (!aiokv_is_words(&ops) || (ops.len / 8) % WORDS != 0) {
        PyBuffer_Release(&ops);
        return aiokv_bad_input("ops must be rows of %d 8-byte integers", WORDS);
    }
    Py_ssize_t rows = ops.len / 8 / WORDS, nbuf = PyTuple_GET_SIZE(buffers);
    Py_buffer *views = PyMem_Calloc(nbuf ? nbuf : 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyBuffer_Release(&ops);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nbuf; i++) {
        if (aiokv_get_view(PyTuple_GET_ITEM(buffers, i), &views[i], "buffer", i) < 0) {
            release_views(views, i);
            PyBuffer_Release(&ops);
            return NULL;
        }
    }
    const uint64_t *w = ops.buf;
    void **bufs = PyMem_Calloc(nbuf ? nbuf : 1, sizeof(void *));
    if (bufs == NULL) {
        release_views(views, nbuf);
        PyBuffer_Release(&ops);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nbuf; i++)
        bufs[i] = views[i].buf;
    if (aiokv_check_program(&self->d, w, rows, views, nbuf) < 0) {
        PyMem_Free(bufs);
        release_views(views, nbuf);
        PyBuffer_Release(&ops);
        return NULL;
    }
    Py_ssize_t done = 0;
    CUresult code = 0;
    PyThreadState *saved = hold_gil ? NULL : PyEval_SaveThread();
    for (; done < rows; done++) {
        code = aiokv_run_op(&self->d, w + done * WORDS, bufs);
        if (code != 0)
            break;
    }
    if (code != 0)
        aiokv_rescue(&self->d, w, done, main_stream, rescue);
    if (saved != NULL)
        PyEval_RestoreThread(saved);
    PyMem_Free(bufs);
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

PyTypeObject aiokv_TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Table",
    .tp_basicsize = sizeof(TableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Table_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_methods = Table_methods,
};

/* ------------------------------------------------------------------------ module */

static int
is_exception_class(PyObject *cls)
{
    return PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception);
}

static PyObject *
set_error_class(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2 || !is_exception_class(args[0]) || (nargs == 2 && !is_exception_class(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "set_error_class takes one or two exception classes");
        return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(aiokv_invalid_error, args[0]);
    if (nargs == 2) {
        Py_INCREF(args[1]);
        Py_XSETREF(aiokv_closed_error, args[1]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_error_class", (PyCFunction)(void (*)(void))set_error_class, METH_FASTCALL,
     "set_error_class(invalid, closed=None)\n\nThe exceptions raised for bad input\n"
     "(aiokv.errors.InvalidSpec) and for a closed issuer (aiokv.errors.WorkerClosed)."},
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
    PyTypeObject *types[] = {&aiokv_TableType, &aiokv_WaiterType, &aiokv_IssuerType, &aiokv_TicketType,
                             &aiokv_PlannerType};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    const char *give_way = getenv("AIOKV_ISSUER_GIVE_WAY");
    aiokv_give_way_on = give_way == NULL || strcmp(give_way, "0") != 0;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    static const char *names[] = {"Table", "Waiter", "Issuer", "Ticket", "Planner"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "WORDS", WORDS) < 0 ||
        PyModule_AddIntConstant(m, "CANCELLED", AIOKV_CANCELLED) < 0 ||
        PyModule_AddObject(m, "FAKES", Py_BuildValue(
            "{s:N,s:N,s:N}", "noop", PyLong_FromVoidPtr((void *)(uintptr_t)&aiokv_noop), "event_create",
            PyLong_FromVoidPtr((void *)(uintptr_t)&aiokv_fake_event_create), "host_func_now",
            PyLong_FromVoidPtr((void *)(uintptr_t)&aiokv_fake_host_func_now))) < 0 ||
        PyModule_AddIntConstant(m, "ABI", 4) < 0) { /* native.py's _ABI: raise both together */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
