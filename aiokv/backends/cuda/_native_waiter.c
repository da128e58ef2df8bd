/* aiokv's native helper, its second half: the waiter thread that rings doorbells as
 * jobs end, without Python. See _native.h. */
#include "_native.h"

/* ------------------------------------------------------------------------ waiter */

typedef struct {
    int slot;
    int fd;
} Entry;

/* Shared by the Python object, the thread and any issuer arming rings through it; freed
 * by whichever lets go last. */
struct WaiterState {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs, stop, abandoned, ready, running;
    pthread_t thread;
    DriverTable d;
    CUstream stream;
    int nslots, created, nfree, head, count;
    CUevent *events;
    int *free_slots;
    Entry *queue;
    unsigned long long armed, rung, errors, nudged;
    CUresult last_error;
    IssuerState *nudge; /* the lane's issuer, woken into a spin as a job ends (not owned) */
};

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

void
aiokv_waiter_retain(WaiterState *st)
{
    pthread_mutex_lock(&st->mu);
    st->refs++;
    pthread_mutex_unlock(&st->mu);
}

void
aiokv_waiter_release(WaiterState *st)
{
    state_release(st);
}

void
aiokv_waiter_set_nudge(WaiterState *st, IssuerState *issuer, IssuerState *was)
{
    pthread_mutex_lock(&st->mu);
    if (st->nudge == was)
        st->nudge = issuer;
    pthread_mutex_unlock(&st->mu);
}

static void *
waiter_main(void *arg)
{
    WaiterState *st = arg;
    CUresult r = aiokv_thread_enter(&st->d);
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
        r = ((sync_fn)st->d.procs[P_SYNC])(ev); /* a blocking-sync event: the thread sleeps */
        pthread_mutex_lock(&st->mu);
        if (!st->abandoned) {
            ssize_t wrote = write(e.fd, "!", 1); /* a full pipe has a ring pending already */
            (void)wrote;
        }
        close(e.fd);
        if (st->nudge != NULL && !st->abandoned) {
            /* The loop wakes to this ring and may submit the lane's next job at once: have
             * the issuer wake now, in parallel, and spin, so that submit finds it awake. */
            aiokv_issuer_nudge(st->nudge);
            st->nudged++;
        }
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
    if (self->st != NULL || self->closed) { /* closed: a new thread nothing would stop */
        PyErr_SetString(PyExc_RuntimeError, "a Waiter is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!K|i", kwlist, &aiokv_TableType, &table, &stream, &slots))
        return -1;
    if (slots < 1 || slots > 4096) {
        aiokv_bad_input("slots must be 1-4096, got %d", slots);
        return -1;
    }
    static const int needed[] = {P_WAIT, P_RECORD, P_SYNC, P_EVENT_CREATE, P_EVENT_DESTROY};
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
        if (aiokv_need_proc(&table->d, needed[i]) < 0)
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
    st->d = table->d;
    st->stream = (CUstream)(uintptr_t)stream;
    st->nslots = slots;
    st->refs = 2; /* this object and the thread */
    st->running = 1;
    int err = aiokv_start_thread(&st->thread, waiter_main, st, &st->mu, &st->cv, &st->ready);
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
        ((event_destroy_fn)st->d.procs[P_EVENT_DESTROY])(st->events[i]);
    st->created = 0;
}

PyDoc_STRVAR(watch_doc,
"watch(event, fd) -> int\n\n"
"Have the thread write one byte to ``fd`` (a dup of it, taken now) once ``event``'s latest\n"
"record has completed: a waiter event of its own is recorded on the waiter's stream behind\n"
"a wait on ``event``, so ``event`` may be recorded again at once. Rings come in the order\n"
"they were asked for. Returns 0 when armed, -1 when it cannot be (closed, or every slot\n"
"busy), or the CUresult of the driver call that failed (nothing armed then).");

int
aiokv_waiter_arm(WaiterState *st, CUevent event, int fd)
{
    pthread_mutex_lock(&st->mu);
    int slot = -1;
    CUresult r = 0;
    if (st->stop) {
        pthread_mutex_unlock(&st->mu);
        return -1;
    }
    if (st->nfree > 0) {
        slot = st->free_slots[--st->nfree];
    } else if (st->created < st->nslots) {
        CUevent ev = NULL;
        r = ((event_create_fn)st->d.procs[P_EVENT_CREATE])(&ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
        if (r == 0 && ev != NULL) {
            slot = st->created;
            st->events[st->created++] = ev;
        }
    }
    if (slot < 0) {
        pthread_mutex_unlock(&st->mu);
        return r != 0 ? r : -1;
    }
    r = ((wait_fn)st->d.procs[P_WAIT])(st->stream, event, 0);
    if (r == 0)
        r = ((record_fn)st->d.procs[P_RECORD])(st->events[slot], st->stream);
    if (r != 0) {
        st->free_slots[st->nfree++] = slot;
        pthread_mutex_unlock(&st->mu);
        return r;
    }
    st->queue[(st->head + st->count) % st->nslots] = (Entry){slot, fd};
    st->count++;
    st->armed++;
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
    return 0;
}

static PyObject *
Waiter_watch(WaiterObject *self, PyObject *args)
{
    unsigned long long event;
    int fd;
    if (!PyArg_ParseTuple(args, "Ki", &event, &fd))
        return NULL;
    if (event == 0)
        return aiokv_bad_input("watch: a null event");
    if (fd < 0)
        return aiokv_bad_input("watch: a negative file descriptor");
    WaiterState *st = self->st;
    if (st == NULL || self->closed)
        return PyLong_FromLong(-1);
    int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (dup < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int r = aiokv_waiter_arm(st, (CUevent)(uintptr_t)event, dup);
    if (r != 0)
        close(dup);
    return PyLong_FromLong(r);
}

WaiterState *
aiokv_waiter_state(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &aiokv_WaiterType)) {
        PyErr_SetString(PyExc_TypeError, "expected a _native.Waiter");
        return NULL;
    }
    WaiterObject *w = (WaiterObject *)obj;
    if (w->st == NULL || w->closed) {
        PyErr_SetString(PyExc_ValueError, "the waiter is closed");
        return NULL;
    }
    return w->st;
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
"and the last such CUresult, slots created, issuer nudges made as rings went out\n"
"(``nudged``), and whether the thread still runs.");

static PyObject *
Waiter_stats(WaiterObject *self, PyObject *unused)
{
    WaiterState *st = self->st;
    if (st == NULL)
        return Py_BuildValue("{s:O}", "running", Py_False);
    pthread_mutex_lock(&st->mu);
    unsigned long long armed = st->armed, rung = st->rung, errors = st->errors, nudged = st->nudged;
    int last = st->last_error, created = st->created, running = st->running, pending = st->count;
    pthread_mutex_unlock(&st->mu);
    return Py_BuildValue("{s:K,s:K,s:K,s:i,s:i,s:i,s:K,s:O}", "armed", armed, "rung", rung, "errors",
                         errors, "last_error", last, "slots", created, "pending", pending, "nudged",
                         nudged, "running", running ? Py_True : Py_False);
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

PyTypeObject aiokv_WaiterType = {
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

