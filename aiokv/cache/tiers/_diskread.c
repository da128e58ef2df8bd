/* The disk tier's optional native reader: one call reads and checksums many block files
 * without the GIL (aiokv/cache/tiers/disk_native.py is its Python side).
 *
 * A read thread that retakes the GIL after every open, preadv, close and per-page crc32
 * waits behind the event loop and the model's thread each time (up to the 5 ms switch
 * interval), so a restore's reads crawl whenever Python is busy. A ReadBatch holds one read
 * call's blocks; each of the call's threads runs ``ReadBatch.run()`` once, which takes the
 * next block until none is left (one shared cursor, so a slow file holds back only its own
 * thread), all of it with the GIL released:
 *
 *   open(path, flags)  ->  preadv into [head, *parts] (short reads continued, EINTR retried,
 *   at most IOVMAX buffers a call)  ->  close  ->  zlib crc32 of the parts, chained
 *
 * With direct I/O a block with a buffer off the page is read whole into an aligned buffer
 * of its own and copied into place (as the Python read's bounce buffer does).
 *
 * The file I/O of each block holds one of the tier's device slots (``Slots``), the checksum
 * runs after it, beside other threads' reads. A free slot goes to the waiting thread of the
 * lowest rank (``run(rank)``: the tier's read order), so the reads of an earlier request
 * take the device before a later one's. Verdicts (header, length, crc) stay in
 * Python: this returns what happened, per block. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zlib.h>

#define ABI 3
#define ALIGN 4096
#define IOVMAX 1024

#ifndef O_CLOEXEC
#define O_CLOEXEC 0
#endif
#ifndef O_DIRECT
#define O_DIRECT 0
#endif

/* Tests only: at most this many bytes a preadv asks for (0: no cap), to make short reads;
 * and how many preadv calls were made. */
static atomic_size_t read_cap;
static atomic_size_t read_calls;

/* What happened to one block (``ReadBatch.run`` returns it with the errno, bytes, crc). */
enum { ST_READ = 0, ST_OPEN_FAILED = 1, ST_READ_FAILED = 2 };

/* -- Slots: a counting semaphore taken without the GIL, lowest rank first ------------------ */

/* A thread waiting for a slot (on its own stack while it waits). */
typedef struct Waiter {
    long long rank;
    struct Waiter *next;
} Waiter;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long free;
    int ready;
    Waiter *waiting;
} SlotsObject;

/* Whether a waiter of a lower rank than ``me`` waits (it goes first). */
static int
slots_behind(const SlotsObject *s, const Waiter *me)
{
    for (const Waiter *w = s->waiting; w != NULL; w = w->next)
        if (w->rank < me->rank)
            return 1;
    return 0;
}

/* Take a slot; of the threads waiting, the one of the lowest rank gets the next (a read
 * of an earlier request before a later one's: aiokv/cache/tiers/disk_order.py). */
static void
slots_take(SlotsObject *s, long long rank)
{
    Waiter me = {rank, NULL};
    pthread_mutex_lock(&s->mu);
    me.next = s->waiting;
    s->waiting = &me;
    while (s->free <= 0 || slots_behind(s, &me))
        pthread_cond_wait(&s->cv, &s->mu);
    for (Waiter **w = &s->waiting; *w != NULL; w = &(*w)->next)
        if (*w == &me) {
            *w = me.next;
            break;
        }
    s->free--;
    if (s->free > 0 && s->waiting != NULL)
        pthread_cond_broadcast(&s->cv); /* the next in rank may take another */
    pthread_mutex_unlock(&s->mu);
}

static void
slots_give(SlotsObject *s)
{
    pthread_mutex_lock(&s->mu);
    s->free++;
    if (s->waiting != NULL)
        pthread_cond_broadcast(&s->cv); /* every waiter checks whether it is the lowest */
    pthread_mutex_unlock(&s->mu);
}

static int
Slots_init(SlotsObject *self, PyObject *args, PyObject *kwds)
{
    long n;
    static char *names[] = {"n", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "l", names, &n))
        return -1;
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "Slots needs at least one slot");
        return -1;
    }
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Slots is initialised once");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    self->waiting = NULL;
    self->free = n;
    self->ready = 1;
    return 0;
}

static void
Slots_dealloc(SlotsObject *self)
{
    if (self->ready) {
        pthread_cond_destroy(&self->cv);
        pthread_mutex_destroy(&self->mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Slots_enter(SlotsObject *self, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    slots_take(self, LLONG_MAX);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
Slots_exit(SlotsObject *self, PyObject *args)
{
    slots_give(self);
    Py_RETURN_FALSE;
}

static PyMethodDef Slots_methods[] = {
    {"__enter__", (PyCFunction)Slots_enter, METH_NOARGS,
     "Take a slot (waiting without the GIL), after every ranked waiter."},
    {"__exit__", (PyCFunction)Slots_exit, METH_VARARGS, "Give the slot back."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.cache.tiers._diskread.Slots",
    .tp_basicsize = sizeof(SlotsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Slots(n): block reads at the device at once, shared by every read thread of a "
              "tier (native reads and Python ones, as a context manager).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Slots_init,
    .tp_dealloc = (destructor)Slots_dealloc,
    .tp_methods = Slots_methods,
};

/* -- ReadBatch ------------------------------------------------------------------------------ */

typedef struct {
    char *path;
    Py_ssize_t first, count; /* its buffers in ReadBatch.bufs: the header's, then the parts */
    Py_ssize_t total;        /* bytes of all its buffers */
    int bounce;              /* direct I/O, a buffer off the page: read whole, then copied */
    int status, err;
    Py_ssize_t got;
    uLong crc;
} Job;

typedef struct {
    PyObject_HEAD
    SlotsObject *slots;
    int flags;
    Job *jobs;
    Py_ssize_t njobs;
    Py_buffer *bufs;
    Py_ssize_t nbufs;
    atomic_size_t next;
    PyObject *bounced; /* list of the job indices read through a bounce buffer */
} ReadBatchObject;

static int
is_aligned(const Py_buffer *b)
{
    return ((uintptr_t)b->buf % ALIGN) == 0 && (b->len % ALIGN) == 0;
}

/* Read the whole of ``job``'s buffers from ``fd``; the bytes read, or -1 with errno set. */
static Py_ssize_t
read_all(int fd, const Py_buffer *bufs, Py_ssize_t count)
{
    struct iovec iov[IOVMAX];
    Py_ssize_t at = 0;   /* the first buffer not yet full */
    Py_ssize_t into = 0; /* bytes of it already read */
    Py_ssize_t total = 0;
    size_t cap = atomic_load(&read_cap);
    while (at < count) {
        int n = 0;
        size_t asked = 0;
        for (Py_ssize_t i = at; i < count && n < IOVMAX; i++) {
            Py_ssize_t skip = i == at ? into : 0;
            if (bufs[i].len - skip == 0)
                continue;
            iov[n].iov_base = (char *)bufs[i].buf + skip;
            iov[n].iov_len = (size_t)(bufs[i].len - skip);
            if (cap && asked + iov[n].iov_len >= cap) {
                iov[n++].iov_len = cap - asked;
                break;
            }
            asked += iov[n].iov_len;
            n++;
        }
        if (n == 0)
            break;
        atomic_fetch_add(&read_calls, 1);
        ssize_t got = preadv(fd, iov, n, (off_t)total);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0)
            break; /* the end of the file: a short file */
        total += got;
        into += got;
        while (at < count && into >= bufs[at].len) {
            into -= bufs[at].len;
            at++;
        }
    }
    return total;
}

static uLong
crc_of(uLong crc, const char *p, Py_ssize_t len)
{
    while (len > 0) { /* zlib takes a uInt length */
        uInt step = len > (Py_ssize_t)(1u << 30) ? (1u << 30) : (uInt)len;
        crc = crc32(crc, (const Bytef *)p, step);
        p += step;
        len -= step;
    }
    return crc;
}

/* Copy ``src`` into ``job``'s buffers one after another, the header's first. */
static void
spread_copy(const Py_buffer *bufs, Py_ssize_t count, const char *src)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(bufs[i].buf, src, (size_t)bufs[i].len);
        src += bufs[i].len;
    }
}

static void
run_job(ReadBatchObject *b, Job *job, long long rank)
{
    const Py_buffer *bufs = b->bufs + job->first;
    Py_buffer whole; /* the bounce buffer: the whole file, pages read at page addresses */
    void *mem = NULL;
    if (job->bounce) {
        size_t size = ((size_t)job->total + ALIGN - 1) / ALIGN * ALIGN;
        if (posix_memalign(&mem, ALIGN, size) != 0) {
            job->status = ST_READ_FAILED;
            job->err = ENOMEM;
            return;
        }
        memset(&whole, 0, sizeof whole);
        whole.buf = mem;
        whole.len = (Py_ssize_t)size;
    }
    int fd;
    slots_take(b->slots, rank);
    do {
        fd = open(job->path, b->flags | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        job->status = ST_OPEN_FAILED;
        job->err = errno;
        slots_give(b->slots);
        free(mem);
        return;
    }
    Py_ssize_t got = mem ? read_all(fd, &whole, 1) : read_all(fd, bufs, job->count);
    int err = errno;
    close(fd);
    slots_give(b->slots);
    if (got < 0) {
        job->status = ST_READ_FAILED;
        job->err = err;
        free(mem);
        return;
    }
    job->status = ST_READ;
    job->got = got < job->total ? got : job->total; /* a longer file: its first bytes */
    if (got < job->total) { /* truncated: no checksum to take */
        free(mem);
        return;
    }
    if (mem) {
        spread_copy(bufs, job->count, mem);
        free(mem);
    }
    uLong crc = crc32(0L, Z_NULL, 0);
    for (Py_ssize_t i = 1; i < job->count; i++) /* the parts: the header is checked in Python */
        crc = crc_of(crc, bufs[i].buf, bufs[i].len);
    job->crc = crc;
}

static void
ReadBatch_clear(ReadBatchObject *self)
{
    if (self->bufs != NULL) {
        for (Py_ssize_t i = 0; i < self->nbufs; i++)
            PyBuffer_Release(&self->bufs[i]);
        PyMem_Free(self->bufs);
        self->bufs = NULL;
    }
    self->nbufs = 0;
    if (self->jobs != NULL) {
        for (Py_ssize_t i = 0; i < self->njobs; i++)
            PyMem_Free(self->jobs[i].path);
        PyMem_Free(self->jobs);
        self->jobs = NULL;
    }
    self->njobs = 0;
    Py_CLEAR(self->slots);
    Py_CLEAR(self->bounced);
}

static void
ReadBatch_dealloc(ReadBatchObject *self)
{
    ReadBatch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ReadBatch(slots, flags, jobs): jobs is a sequence of (path: bytes, head, parts), head and
 * each part a writable contiguous buffer; the file is read into head, then the parts. */
static int
ReadBatch_init(ReadBatchObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *slots, *jobs_arg;
    int flags;
    static char *names[] = {"slots", "flags", "jobs", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!iO", names, &SlotsType, &slots, &flags,
                                     &jobs_arg))
        return -1;
    if (self->jobs != NULL || self->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ReadBatch is initialised once");
        return -1;
    }
    PyObject *jobs = PySequence_Fast(jobs_arg, "jobs must be a sequence");
    if (jobs == NULL)
        return -1;
    Py_ssize_t njobs = PySequence_Fast_GET_SIZE(jobs);
    Py_INCREF(slots);
    self->slots = (SlotsObject *)slots;
    self->flags = flags;
    atomic_init(&self->next, 0);
    self->bounced = PyList_New(0);
    self->jobs = PyMem_Calloc(njobs ? (size_t)njobs : 1, sizeof(Job));
    if (self->bounced == NULL || self->jobs == NULL)
        goto fail_nomem;
    self->njobs = njobs;
    /* Count the buffers first, so they live in one array. */
    Py_ssize_t nbufs = 0;
    for (Py_ssize_t j = 0; j < njobs; j++) {
        PyObject *item = PySequence_Fast_GET_ITEM(jobs, j);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "each job is a (path, head, parts) tuple");
            goto fail;
        }
        Py_ssize_t n = PyObject_Length(PyTuple_GET_ITEM(item, 2));
        if (n < 0)
            goto fail;
        nbufs += 1 + n;
    }
    self->bufs = PyMem_Calloc(nbufs ? (size_t)nbufs : 1, sizeof(Py_buffer));
    if (self->bufs == NULL)
        goto fail_nomem;
    for (Py_ssize_t j = 0; j < njobs; j++) {
        PyObject *item = PySequence_Fast_GET_ITEM(jobs, j);
        Job *job = &self->jobs[j];
        char *path;
        Py_ssize_t plen;
        if (PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 0), &path, &plen) < 0)
            goto fail;
        if ((Py_ssize_t)strlen(path) != plen) {
            PyErr_SetString(PyExc_ValueError, "a path has a NUL byte");
            goto fail;
        }
        job->path = PyMem_Malloc((size_t)plen + 1);
        if (job->path == NULL)
            goto fail_nomem;
        memcpy(job->path, path, (size_t)plen + 1);
        job->first = self->nbufs;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &self->bufs[self->nbufs],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        self->nbufs++;
        PyObject *parts = PySequence_Fast(PyTuple_GET_ITEM(item, 2), "parts must be a sequence");
        if (parts == NULL)
            goto fail;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
        if (self->nbufs + n > nbufs) { /* the sequence grew since it was counted */
            Py_DECREF(parts);
            PyErr_SetString(PyExc_ValueError, "parts changed while the batch was built");
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, i), &self->bufs[self->nbufs],
                                   PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
                Py_DECREF(parts);
                goto fail;
            }
            self->nbufs++;
        }
        Py_DECREF(parts);
        job->count = self->nbufs - job->first;
        int all_aligned = 1;
        for (Py_ssize_t i = job->first; i < self->nbufs; i++) {
            job->total += self->bufs[i].len;
            all_aligned &= is_aligned(&self->bufs[i]);
        }
        if ((flags & O_DIRECT) && O_DIRECT && !all_aligned) {
            job->bounce = 1; /* direct I/O reads whole pages at page addresses only */
            PyObject *idx = PyLong_FromSsize_t(j);
            if (idx == NULL || PyList_Append(self->bounced, idx) < 0) {
                Py_XDECREF(idx);
                goto fail;
            }
            Py_DECREF(idx);
        }
    }
    Py_DECREF(jobs);
    return 0;
fail_nomem:
    PyErr_NoMemory();
fail:
    Py_DECREF(jobs);
    ReadBatch_clear(self);
    return -1;
}

static PyObject *
ReadBatch_run(ReadBatchObject *self, PyObject *args, PyObject *kwds)
{
    long long rank = LLONG_MAX;
    static char *names[] = {"rank", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L", names, &rank))
        return NULL;
    if (self->jobs == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ReadBatch is not initialised");
        return NULL;
    }
    Py_ssize_t *mine = PyMem_Malloc((self->njobs ? (size_t)self->njobs : 1) * sizeof(Py_ssize_t));
    if (mine == NULL)
        return PyErr_NoMemory();
    Py_ssize_t done = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        size_t j = atomic_fetch_add(&self->next, 1);
        if (j >= (size_t)self->njobs)
            break;
        Job *job = &self->jobs[j];
        run_job(self, job, rank);
        mine[done++] = (Py_ssize_t)j;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(done);
    for (Py_ssize_t k = 0; out != NULL && k < done; k++) {
        Job *job = &self->jobs[mine[k]];
        PyObject *row = Py_BuildValue("(niink)", mine[k], job->status, job->err, job->got,
                                      (unsigned long)job->crc);
        if (row == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, k, row);
    }
    PyMem_Free(mine);
    return out;
}

static PyObject *
ReadBatch_get_bounced(ReadBatchObject *self, void *closure)
{
    if (self->bounced == NULL)
        return PyList_New(0);
    return PyList_GetSlice(self->bounced, 0, PyList_GET_SIZE(self->bounced));
}

static PyMethodDef ReadBatch_methods[] = {
    {"run", (PyCFunction)(void (*)(void))ReadBatch_run, METH_VARARGS | METH_KEYWORDS,
     "run(rank=LLONG_MAX): read and checksum the batch's next blocks, without the GIL, until "
     "none is left, each taking a device slot before any waiter of a higher rank; a list "
     "of (index, status, errno, bytes read, crc32 of the parts) for the blocks this call did."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ReadBatch_getset[] = {
    {"bounced", (getter)ReadBatch_get_bounced, NULL,
     "Indices of the jobs direct I/O cannot read in place: read whole into an aligned "
     "buffer of their own, then copied into place.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReadBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.cache.tiers._diskread.ReadBatch",
    .tp_basicsize = sizeof(ReadBatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ReadBatch(slots, flags, jobs): one read call's block files, shared by its threads.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ReadBatch_init,
    .tp_dealloc = (destructor)ReadBatch_dealloc,
    .tp_methods = ReadBatch_methods,
    .tp_getset = ReadBatch_getset,
};

/* -- module --------------------------------------------------------------------------------- */

static PyObject *
crc32_parts(PyObject *module, PyObject *args)
{
    PyObject *parts_arg;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "O|k", &parts_arg, &value))
        return NULL;
    PyObject *parts = PySequence_Fast(parts_arg, "parts must be a sequence");
    if (parts == NULL)
        return NULL;
    uLong crc = (uLong)(value & 0xFFFFFFFFUL);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(parts);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts, i), &b, PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(parts);
            return NULL;
        }
        Py_BEGIN_ALLOW_THREADS
        crc = crc_of(crc, b.buf, b.len);
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&b);
    }
    Py_DECREF(parts);
    return PyLong_FromUnsignedLong((unsigned long)(crc & 0xFFFFFFFFUL));
}

static PyObject *
set_read_cap(PyObject *module, PyObject *arg)
{
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "the cap is >= 0");
        return NULL;
    }
    atomic_store(&read_cap, (size_t)cap);
    return PyLong_FromSize_t(atomic_load(&read_calls));
}

static PyMethodDef module_methods[] = {
    {"set_read_cap", set_read_cap, METH_O,
     "set_read_cap(n): tests only: ask at most n bytes of each preadv (0: no cap), so reads "
     "come back short; returns how many preadv calls were made so far."},
    {"crc32_parts", crc32_parts, METH_VARARGS,
     "crc32_parts(parts, value=0): the crc32 the reader takes of parts one after another "
     "(zlib's), for tests to hold against zlib.crc32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_diskread",
    "The disk tier's native reader: block files read and checksummed without the GIL.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__diskread(void)
{
    if (PyType_Ready(&SlotsType) < 0 || PyType_Ready(&ReadBatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ABI) < 0
        || PyModule_AddIntConstant(m, "ST_READ", ST_READ) < 0
        || PyModule_AddIntConstant(m, "ST_OPEN_FAILED", ST_OPEN_FAILED) < 0
        || PyModule_AddIntConstant(m, "ST_READ_FAILED", ST_READ_FAILED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SlotsType);
    if (PyModule_AddObject(m, "Slots", (PyObject *)&SlotsType) < 0) {
        Py_DECREF(&SlotsType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ReadBatchType);
    if (PyModule_AddObject(m, "ReadBatch", (PyObject *)&ReadBatchType) < 0) {
        Py_DECREF(&ReadBatchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
