/* aiokv's native helper: the issuer thread, which makes a lane's driver calls after the
 * submit that planned them has returned, and the tickets that say how far it got.
 *
 * ``Issuer.submit`` checks a program's rows (bad input raises InvalidSpec, nothing is
 * queued), copies them and every buffer they name into one C allocation, queues it and
 * returns a ``Ticket``: the caller's thread never waits for a driver call, and the thread
 * never reads a Python object or takes the GIL. Programs run in submission order; a
 * failing call stops its program, every stream it used is joined into its main stream
 * (``rescue``) and its end event is recorded there behind them, as ``Table.enqueue`` does.
 * A sticky CUresult (a dead context) fails every later program without a call. Doorbells
 * asked for before a program ran (``Ticket.ring_fd``) are armed by the thread through the
 * lane's waiter once it has run, so an await that began before the issue still wakes.
 * See _native.h. */
#include "_native.h"

#include <stdatomic.h>
#include <time.h>

#define SPARES 8        /* program allocations kept for reuse */
#define LAGS 4096       /* issue lags kept for statistics */
#define MAX_BELLS 4     /* doorbells one ticket arms once run */
#define MAX_STICKY 32

enum { T_QUEUED, T_ISSUING, T_DONE };

struct TicketState {
    atomic_int refs;
    atomic_llong rows_done;
    atomic_int state;
    IssuerState *issuer; /* retained: its lock and condition serve the waits */
    Py_ssize_t nrows;
    CUresult code;      /* of the row that failed (0: none), or AIOKV_CANCELLED */
    int failed_op;      /* that row's opcode */
    int end_failed;     /* the end was not recorded behind a failure (nothing covers it) */
    int inline_run;     /* run on the submitting thread (the issuer was idle) */
    uint64_t end;       /* the event the doorbells wait on */
    double queued_at, started_at, finished_at;
    double *stamps;     /* with ``stamps``: when each row's call returned (else NULL) */
    int bells[MAX_BELLS];
    int nbells;
};

struct IssuerState {
    pthread_mutex_t mu;
    pthread_cond_t work;     /* the thread waits here for programs */
    pthread_cond_t progress; /* tickets' waiters wait here */
    int refs, stop, cancel, paused, running, ready, sleeping, waiters, busy;
    atomic_int queued, row_waiters;
    atomic_int halt; /* stop or pause asked: a spin in progress ends now */
    pthread_t thread;
    DriverTable d;
    WaiterState *waiter;
    Program *head, *tail;
    Program *spares[SPARES];
    int nspares;
    int sticky[MAX_STICKY];
    int nsticky;
    CUresult broken; /* a sticky code seen: later programs fail with it, uncalled */
    CUresult ctx_error;
    long spin_ns;  /* the spin after each program */
    long nudge_ns; /* the spin a nudge (a job of the lane ended) starts */
    double spin_until; /* a nudge's spin window ends here (0: none pending) */
    unsigned long long issued, inlined, failed, cancelled, nlags;
    unsigned long long nudges, spin_picked, signalled;
    double busy_seconds, cpu_seconds, spin_seconds;
    double free_at; /* when the latest program ended: the thread could start the next then */
    double lags[LAGS];
    double pickups[LAGS]; /* lags from max(submit's return, the previous program's end) */
};

/* ---------------------------------------------------------------- program memory */

static size_t
align16(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

/* An allocation for ``rows`` rows, ``nbuf`` buffer slots and ``data`` bytes of buffers:
 * a spare one large enough, else a new one. NULL when out of memory. */
Program *
aiokv_program_new(IssuerState *st, Py_ssize_t rows, Py_ssize_t nbuf, size_t data)
{
    size_t need = align16((size_t)rows * WORDS * 8) + align16((size_t)(nbuf ? nbuf : 1) * sizeof(void *)) + data;
    Program *p = NULL;
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < st->nspares; i++) {
        if (st->spares[i]->cap >= need) {
            p = st->spares[i];
            st->spares[i] = st->spares[--st->nspares];
            break;
        }
    }
    pthread_mutex_unlock(&st->mu);
    if (p == NULL) {
        size_t cap = need < 4096 ? 4096 : need;
        p = malloc(sizeof(Program) + cap);
        if (p == NULL)
            return NULL;
        p->cap = cap;
    }
    p->next = NULL;
    p->ticket = NULL;
    p->main = p->rescue = p->end = 0;
    p->nrows = rows;
    p->nbuf = nbuf;
    p->rows = (uint64_t *)p->data;
    p->bufs = (void **)(p->data + align16((size_t)rows * WORDS * 8));
    p->used = align16((size_t)rows * WORDS * 8) + align16((size_t)(nbuf ? nbuf : 1) * sizeof(void *));
    for (Py_ssize_t i = 0; i < nbuf; i++)
        p->bufs[i] = NULL;
    return p;
}

/* ``nbytes`` of the program's memory for buffer ``buf`` (16-byte aligned). */
void *
aiokv_program_alloc(Program *p, Py_ssize_t buf, size_t nbytes)
{
    void *at = p->data + p->used;
    p->used += align16(nbytes ? nbytes : 1);
    p->bufs[buf] = at;
    return at;
}

/* Give a program's memory back: kept as a spare, or freed. Any thread. */
void
aiokv_program_drop(IssuerState *st, Program *p)
{
    pthread_mutex_lock(&st->mu);
    if (st->nspares < SPARES) {
        st->spares[st->nspares++] = p;
        p = NULL;
    } else { /* keep the larger ones: replace the smallest spare if this beats it */
        int small = 0;
        for (int i = 1; i < st->nspares; i++)
            if (st->spares[i]->cap < st->spares[small]->cap)
                small = i;
        if (st->spares[small]->cap < p->cap) {
            Program *q = st->spares[small];
            st->spares[small] = p;
            p = q;
        }
    }
    pthread_mutex_unlock(&st->mu);
    free(p);
}

/* ------------------------------------------------------------------ shared state */

static void
issuer_free(IssuerState *st)
{
    for (int i = 0; i < st->nspares; i++)
        free(st->spares[i]);
    if (st->waiter != NULL) {
        aiokv_waiter_set_nudge(st->waiter, NULL, st); /* the waiter may outlive this */
        aiokv_waiter_release(st->waiter);
    }
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->work);
    pthread_cond_destroy(&st->progress);
    free(st);
}

static void
issuer_release(IssuerState *st)
{
    pthread_mutex_lock(&st->mu);
    int last = --st->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last)
        issuer_free(st);
}

static void
ticket_release(TicketState *t)
{
    if (atomic_fetch_sub(&t->refs, 1) != 1)
        return;
    for (int i = 0; i < t->nbells; i++)
        close(t->bells[i]);
    issuer_release(t->issuer);
    free(t->stamps);
    free(t);
}

static void
deadline_after(double seconds, struct timespec *ts)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    double whole = (double)(long)seconds;
    ts->tv_sec += (time_t)whole;
    ts->tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static int
is_sticky(const IssuerState *st, CUresult code)
{
    for (int i = 0; i < st->nsticky; i++)
        if (st->sticky[i] == code)
            return 1;
    return 0;
}

/* Ring a doorbell now: the poller wakes and looks for itself. */
static void
ring_now(int fd)
{
    ssize_t wrote = write(fd, "!", 1); /* a full pipe has a ring pending already */
    (void)wrote;
    close(fd);
}

/* ------------------------------------------------------------------ running one */

static double
thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Run ``p``'s rows (or none: ``refuse`` is the code it fails with), publishing progress.
 * Called without the lock, by the thread or by a submit that found the issuer idle
 * (``here``: no ticket of it can be waited on yet, so no broadcast is due). */
static void
run_program(IssuerState *st, Program *p, CUresult refuse, int here)
{
    TicketState *t = p->ticket;
    t->started_at = aiokv_now();
    atomic_store_explicit(&t->state, T_ISSUING, memory_order_release);
    Py_ssize_t done = 0;
    CUresult code = refuse;
    if (refuse == 0) {
        for (; done < p->nrows; done++) {
            if (!here)
                aiokv_give_way();
            code = aiokv_run_op(&st->d, p->rows + done * WORDS, p->bufs);
            if (code != 0)
                break;
            if (t->stamps != NULL)
                t->stamps[done] = aiokv_now();
            /* Both sequentially consistent, as the waiter's announce-then-look is
             * (``wait_progress``, ``ticket_ready``): with release / acquire the store may
             * sit in this core's buffer while the load reads no waiter, and the waiter
             * read the old count and sleep, missing this row until the program ends. */
            atomic_store(&t->rows_done, done + 1);
            if (!here && atomic_load(&st->row_waiters) > 0) {
                pthread_mutex_lock(&st->mu);
                pthread_cond_broadcast(&st->progress);
                pthread_mutex_unlock(&st->mu);
            }
        }
        if (code != 0) {
            t->failed_op = (int)p->rows[done * WORDS];
            aiokv_rescue(&st->d, p->rows, done, p->main, p->rescue);
            t->end_failed = 1;
            if (p->end != 0 && st->d.procs[P_RECORD] != NULL)
                t->end_failed = ((record_fn)st->d.procs[P_RECORD])((CUevent)(uintptr_t)p->end,
                                                                   (CUstream)(uintptr_t)p->main) != 0;
        }
    } else {
        t->end_failed = 1; /* nothing enqueued, nothing to wait for */
    }
    t->code = code;
    t->finished_at = aiokv_now();
}

/* Under the lock: the ticket is final; its bells are handed back for arming (outside). */
static int
finish_program(IssuerState *st, Program *p, int *bells)
{
    TicketState *t = p->ticket;
    if (t->code != 0 && t->code != AIOKV_CANCELLED && is_sticky(st, t->code) && st->broken == 0)
        st->broken = t->code;
    if (t->code == AIOKV_CANCELLED)
        st->cancelled++;
    else if (t->code != 0)
        st->failed++;
    st->issued++;
    if (!t->inline_run) /* a program run at submit cost the thread nothing, and waited for nothing */
        st->busy_seconds += t->finished_at - t->started_at;
    /* The pickup lag leaves out the wait behind the previous program's calls (a submit
     * right behind another): what is left is the thread's own wake-up or spin. */
    double ready = t->queued_at > st->free_at ? t->queued_at : st->free_at;
    st->pickups[st->nlags % LAGS] = t->inline_run ? 0.0 : t->started_at - ready;
    st->lags[st->nlags++ % LAGS] = t->inline_run ? 0.0 : t->started_at - t->queued_at;
    if (t->finished_at > st->free_at)
        st->free_at = t->finished_at;
    int n = t->nbells;
    memcpy(bells, t->bells, sizeof t->bells);
    t->nbells = 0;
    atomic_store_explicit(&t->state, T_DONE, memory_order_release);
    if (st->waiters > 0)
        pthread_cond_broadcast(&st->progress);
    return n;
}

/* Outside any lock: arm the bells asked for before the program ran behind its end event
 * (ringing at once where that cannot be done: the poller then polls). */
static void
arm_bells(IssuerState *st, const TicketState *t, const int *bells, int n)
{
    for (int i = 0; i < n; i++) {
        int fd = bells[i];
        if (st->waiter != NULL && t->end != 0 && !t->end_failed &&
            aiokv_waiter_arm(st->waiter, (CUevent)(uintptr_t)t->end, fd) == 0)
            continue;
        ring_now(fd);
    }
}

static void *
issuer_main(void *arg)
{
    IssuerState *st = arg;
    CUresult r = aiokv_thread_enter(&st->d);
    pthread_mutex_lock(&st->mu);
    st->ctx_error = r;
    st->ready = 1;
    pthread_cond_broadcast(&st->progress);
    int bells[MAX_BELLS];
    for (;;) {
        int spun = 0, found = 0;
        while (!((st->head != NULL && !st->paused && !st->busy) || (st->stop && st->head == NULL && !st->busy))) {
            double now = aiokv_now();
            /* A short spin after a program (``spin_ns``: a submit right behind the last
             * one), or a nudge's window (a job of the lane just ended: the submit its
             * completion leads to). A submit meanwhile needs no futex wake-up, whose cost
             * on an idle CPU is tens of microseconds. The condition is looked at again
             * under the lock after it. */
            double until = !spun && st->spin_ns > 0 ? now + (double)st->spin_ns * 1e-9 : 0;
            if (st->spin_until > until)
                until = st->spin_until;
            st->spin_until = 0; /* a nudge is spent by the spin it starts */
            if (until > now && !st->paused && !st->stop) {
                spun = 1;
                pthread_mutex_unlock(&st->mu);
                double began = now;
                while (!(found = atomic_load_explicit(&st->queued, memory_order_acquire) > 0) &&
                       !atomic_load_explicit(&st->halt, memory_order_relaxed) && (now = aiokv_now()) < until)
                    ;
                now = aiokv_now();
                pthread_mutex_lock(&st->mu);
                st->spin_seconds += now - began;
                continue;
            }
            found = 0;
            st->sleeping = 1;
            pthread_cond_wait(&st->work, &st->mu);
            st->sleeping = 0;
        }
        if (st->head == NULL)
            break; /* stopped, and everything queued has run */
        if (found)
            st->spin_picked++; /* came while the thread spun: no wake-up needed */
        Program *p = st->head;
        st->head = p->next;
        if (st->head == NULL)
            st->tail = NULL;
        atomic_fetch_sub(&st->queued, 1);
        CUresult refuse = st->cancel ? AIOKV_CANCELLED : st->broken;
        st->busy = 1;
        pthread_mutex_unlock(&st->mu);
        double cpu = thread_cpu();
        run_program(st, p, refuse, 0);
        cpu = thread_cpu() - cpu;
        pthread_mutex_lock(&st->mu);
        st->cpu_seconds += cpu;
        st->busy = 0;
        int n = finish_program(st, p, bells);
        TicketState *t = p->ticket;
        pthread_mutex_unlock(&st->mu);
        arm_bells(st, t, bells, n);
        ticket_release(t);
        aiokv_program_drop(st, p);
        pthread_mutex_lock(&st->mu);
    }
    st->running = 0;
    pthread_cond_broadcast(&st->progress);
    int last = --st->refs == 0;
    pthread_mutex_unlock(&st->mu);
    if (last)
        issuer_free(st);
    return NULL;
}

/* ------------------------------------------------------------------------ ticket */

typedef struct {
    PyObject_HEAD
    TicketState *t;
} TicketObject;

/* Queue ``p`` (ticket made here): a new Ticket, or NULL with an error set (``p`` dropped).
 * With ``run_here`` and nothing queued or running, the program runs on this thread now,
 * holding the GIL (a tiny job: cheaper than handing it over). With ``stamps`` the ticket
 * keeps when each row's call returned (``Ticket.stamps``). */
static PyObject *
queue_program(IssuerState *st, Program *p, int run_here, int stamps)
{
    TicketState *t = calloc(1, sizeof(TicketState));
    double *times = t != NULL && stamps ? calloc((size_t)(p->nrows ? p->nrows : 1), sizeof(double)) : NULL;
    TicketObject *obj = t == NULL || (stamps && times == NULL) ? NULL
                                                               : PyObject_New(TicketObject, &aiokv_TicketType);
    if (obj == NULL) {
        free(times);
        free(t);
        aiokv_program_drop(st, p);
        return t == NULL || (stamps && times == NULL) ? PyErr_NoMemory() : NULL;
    }
    t->stamps = times;
    atomic_init(&t->refs, 2); /* the Python object and the program */
    atomic_init(&t->rows_done, 0);
    atomic_init(&t->state, T_QUEUED);
    t->nrows = p->nrows;
    t->end = p->end;
    t->issuer = st;
    obj->t = t;
    p->ticket = t;
    pthread_mutex_lock(&st->mu);
    st->refs++; /* the ticket's */
    if (st->stop) {
        pthread_mutex_unlock(&st->mu);
        Py_DECREF(obj); /* releases the ticket's ref of the issuer too */
        ticket_release(t);
        aiokv_program_drop(st, p);
        PyErr_SetString(aiokv_closed_error ? aiokv_closed_error : PyExc_ValueError,
                        "this lane is closed; create a new worker to transfer more");
        return NULL;
    }
    if (run_here && st->head == NULL && !st->busy && !st->paused) {
        /* ``busy`` keeps the thread from starting anything queued meanwhile; the lock is
         * not held across the driver calls. */
        CUresult refuse = st->cancel ? AIOKV_CANCELLED : st->broken;
        st->busy = 1;
        t->queued_at = aiokv_now();
        t->inline_run = 1;
        pthread_mutex_unlock(&st->mu);
        atomic_fetch_add_explicit(&aiokv_caller_calls, 1, memory_order_acq_rel); /* other lanes' issuers wait */
        run_program(st, p, refuse, 1);
        atomic_fetch_sub_explicit(&aiokv_caller_calls, 1, memory_order_acq_rel);
        pthread_mutex_lock(&st->mu);
        st->busy = 0;
        int bells[MAX_BELLS];
        int n = finish_program(st, p, bells); /* none: nobody held the ticket yet */
        st->inlined++;
        if ((st->head != NULL || st->stop) && st->sleeping) /* what waited for this run */
            pthread_cond_signal(&st->work);
        pthread_mutex_unlock(&st->mu);
        for (int i = 0; i < n; i++)
            ring_now(bells[i]);
        ticket_release(t);
        aiokv_program_drop(st, p);
        return (PyObject *)obj;
    }
    if (st->tail != NULL)
        st->tail->next = p;
    else
        st->head = p;
    st->tail = p;
    atomic_fetch_add(&st->queued, 1);
    t->queued_at = aiokv_now();
    if (st->sleeping) {
        st->signalled++;
        pthread_cond_signal(&st->work);
    }
    pthread_mutex_unlock(&st->mu);
    return (PyObject *)obj;
}

PyObject *
aiokv_issuer_queue(IssuerState *st, Program *p, int run_here)
{
    return queue_program(st, p, run_here, 0);
}

const DriverTable *
aiokv_issuer_table(IssuerState *st)
{
    return &st->d;
}

void
aiokv_issuer_nudge(IssuerState *st)
{
    pthread_mutex_lock(&st->mu);
    if (st->nudge_ns > 0 && !st->stop && !st->paused) {
        st->spin_until = aiokv_now() + (double)st->nudge_ns * 1e-9;
        st->nudges++;
        if (st->sleeping) { /* else it is running a program, or spinning: it sees it after */
            /* Woken now: it looks at the queue under the lock before it sleeps again, so a
             * submit made before it has the lock back must not signal it a second time. */
            st->sleeping = 0;
            pthread_cond_signal(&st->work);
        }
    }
    pthread_mutex_unlock(&st->mu);
}

/* A wait that has no deadline, or a long one, sleeps in slices of this many seconds; between
 * them the thread takes the GIL back and runs pending signal handlers, so Ctrl-C (or a
 * test's timeout) reaches a caller blocked on a program that never issues. */
#define WAIT_SLICE 0.05

/* Whether a wait is over; called under ``st->mu``. */
typedef int (*ready_fn)(IssuerState *st, void *arg);

/* Block, the GIL released, until ``ready`` holds or ``timeout`` seconds (< 0: none) passed:
 * 1 ready, 0 timed out, -1 a signal handler raised (its exception set). ``rows``: the wait
 * is for rows, so the thread announces each row it runs. */
static int
wait_progress(IssuerState *st, ready_fn ready, void *arg, double timeout, int rows)
{
    double until = timeout >= 0 ? aiokv_now() + timeout : 0;
    for (;;) {
        double slice = WAIT_SLICE;
        if (timeout >= 0) {
            double left = until - aiokv_now();
            slice = left < slice ? (left > 0 ? left : 0) : slice;
        }
        int ok;
        Py_BEGIN_ALLOW_THREADS
        struct timespec deadline;
        deadline_after(slice, &deadline);
        pthread_mutex_lock(&st->mu);
        st->waiters++;
        if (rows)
            atomic_fetch_add(&st->row_waiters, 1);
        while (!(ok = ready(st, arg)) && pthread_cond_timedwait(&st->progress, &st->mu, &deadline) != ETIMEDOUT)
            ;
        if (!ok)
            ok = ready(st, arg);
        if (rows)
            atomic_fetch_sub(&st->row_waiters, 1);
        st->waiters--;
        pthread_mutex_unlock(&st->mu);
        Py_END_ALLOW_THREADS
        if (ok)
            return 1;
        if (timeout >= 0 && aiokv_now() >= until)
            return 0;
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

typedef struct {
    TicketState *t;
    long long n;
} RowsWanted;

static int
ticket_ready(IssuerState *st, void *arg)
{
    const RowsWanted *w = arg;
    return atomic_load(&w->t->state) == T_DONE || (w->n >= 0 && atomic_load(&w->t->rows_done) >= w->n);
}

/* Block (GIL released) until ``n`` rows ran (n < 0: the program is over) or it is over,
 * or ``timeout`` seconds (< 0: none) passed. 1 once the condition holds, 0 if not, -1 if a
 * signal handler raised meanwhile. */
static int
ticket_wait(TicketState *t, long long n, double timeout)
{
    RowsWanted w = {t, n};
    int ok = wait_progress(t->issuer, ticket_ready, &w, timeout, n >= 0);
    if (ok > 0 && n >= 0)
        ok = atomic_load_explicit(&t->rows_done, memory_order_acquire) >= n;
    return ok;
}

static int
parse_timeout(PyObject *arg, double *timeout)
{
    *timeout = -1.0;
    if (arg == NULL || arg == Py_None)
        return 0;
    *timeout = PyFloat_AsDouble(arg);
    if (*timeout == -1.0 && PyErr_Occurred())
        return -1;
    if (*timeout < 0)
        *timeout = 0;
    return 0;
}

PyDoc_STRVAR(ticket_wait_doc,
"wait(timeout=None) -> bool\n\nBlock, the GIL released, until the program has been issued (every\n"
"row ran, or one failed, or it was refused); False if ``timeout`` seconds passed first. A\n"
"signal handler that raises (Ctrl-C) interrupts it with its exception.");

static PyObject *
Ticket_wait(TicketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double timeout;
    if (nargs > 1)
        return PyErr_Format(PyExc_TypeError, "wait takes at most one argument");
    if (parse_timeout(nargs ? args[0] : NULL, &timeout) < 0)
        return NULL;
    if (atomic_load_explicit(&self->t->state, memory_order_acquire) == T_DONE)
        Py_RETURN_TRUE;
    int ok = ticket_wait(self->t, -1, timeout);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

PyDoc_STRVAR(ticket_wait_rows_doc,
"wait_rows(n, timeout=None) -> bool\n\nBlock, the GIL released, until at least ``n`` rows have run;\n"
"False if ``timeout`` seconds passed first or the program ended short of them (a failure).\n"
"A signal handler that raises interrupts it, as it does ``wait``.");

static PyObject *
Ticket_wait_rows(TicketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double timeout;
    if (nargs < 1 || nargs > 2)
        return PyErr_Format(PyExc_TypeError, "wait_rows takes n and an optional timeout");
    long long n = PyLong_AsLongLong(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (parse_timeout(nargs > 1 ? args[1] : NULL, &timeout) < 0)
        return NULL;
    if (n <= 0 || atomic_load_explicit(&self->t->rows_done, memory_order_acquire) >= n)
        Py_RETURN_TRUE;
    int ok = ticket_wait(self->t, n, timeout);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

PyDoc_STRVAR(ticket_result_doc,
"result() -> (rows_done, cuda_result, failed_op, end_recorded) | None\n\nNone until the program\n"
"has been issued. ``cuda_result`` is 0, the CUresult of the row that failed (its opcode is\n"
"``failed_op``), or CANCELLED (the issuer closed before it ran). ``end_recorded``: after a\n"
"failure, whether the end event was recorded behind what was enqueued.");

static PyObject *
Ticket_result(TicketObject *self, PyObject *unused)
{
    TicketState *t = self->t;
    if (atomic_load_explicit(&t->state, memory_order_acquire) != T_DONE)
        Py_RETURN_NONE;
    return Py_BuildValue("(LiiO)", (long long)atomic_load(&t->rows_done), t->code, t->failed_op,
                         t->code != 0 && t->end_failed ? Py_False : Py_True);
}

PyDoc_STRVAR(ticket_ring_doc,
"ring_fd(fd) -> bool\n\nTrue: the program has not been issued yet, and the issuer thread will arm a\n"
"ring of ``fd`` (a dup of it, taken now) behind the ticket's end event once it has, or ring it\n"
"at once if it cannot. False: it has been issued already; the caller arms the ring itself.");

static PyObject *
Ticket_ring_fd(TicketObject *self, PyObject *arg)
{
    int fd = (int)PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0)
        return aiokv_bad_input("ring_fd: a negative file descriptor");
    TicketState *t = self->t;
    IssuerState *st = t->issuer;
    if (atomic_load_explicit(&t->state, memory_order_acquire) == T_DONE)
        Py_RETURN_FALSE;
    pthread_mutex_lock(&st->mu);
    int stashed = 0;
    if (atomic_load_explicit(&t->state, memory_order_acquire) != T_DONE && t->nbells < MAX_BELLS) {
        int dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (dup < 0) {
            pthread_mutex_unlock(&st->mu);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        t->bells[t->nbells++] = dup;
        stashed = 1;
    }
    int done = atomic_load_explicit(&t->state, memory_order_acquire) == T_DONE;
    pthread_mutex_unlock(&st->mu);
    if (!stashed && !done)
        return aiokv_bad_input("ring_fd: %d doorbells already wait on this ticket", MAX_BELLS);
    return PyBool_FromLong(stashed);
}

PyDoc_STRVAR(ticket_stamps_doc,
"stamps() -> tuple[float, ...] | None\n\nFor a program submitted with ``stamps``: CLOCK_MONOTONIC\n"
"seconds at which each row's driver call returned, for the rows run so far (else None).");

static PyObject *
Ticket_stamps(TicketObject *self, PyObject *unused)
{
    TicketState *t = self->t;
    if (t->stamps == NULL)
        Py_RETURN_NONE;
    long long n = atomic_load_explicit(&t->rows_done, memory_order_acquire);
    PyObject *out = PyTuple_New((Py_ssize_t)n);
    if (out == NULL)
        return NULL;
    for (long long i = 0; i < n; i++) {
        PyObject *v = PyFloat_FromDouble(t->stamps[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

static PyObject *
Ticket_get_rows_done(TicketObject *self, void *unused)
{
    return PyLong_FromLongLong(atomic_load_explicit(&self->t->rows_done, memory_order_acquire));
}

static PyObject *
Ticket_get_issued(TicketObject *self, void *unused)
{
    return PyBool_FromLong(atomic_load_explicit(&self->t->state, memory_order_acquire) == T_DONE);
}

static PyObject *
Ticket_get_rows(TicketObject *self, void *unused)
{
    return PyLong_FromSsize_t(self->t->nrows);
}

static PyObject *
Ticket_get_queued_at(TicketObject *self, void *unused)
{
    return PyFloat_FromDouble(self->t->queued_at);
}

static PyObject *
Ticket_get_started_at(TicketObject *self, void *unused)
{
    if (atomic_load_explicit(&self->t->state, memory_order_acquire) == T_QUEUED)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->t->started_at);
}

static PyObject *
Ticket_get_finished_at(TicketObject *self, void *unused)
{
    if (atomic_load_explicit(&self->t->state, memory_order_acquire) != T_DONE)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->t->finished_at);
}

static PyObject *
Ticket_get_inline(TicketObject *self, void *unused)
{
    return PyBool_FromLong(self->t->inline_run);
}

static void
Ticket_dealloc(TicketObject *self)
{
    if (self->t != NULL)
        ticket_release(self->t);
    PyObject_Free(self);
}

static PyMethodDef Ticket_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Ticket_wait, METH_FASTCALL, ticket_wait_doc},
    {"wait_rows", (PyCFunction)(void (*)(void))Ticket_wait_rows, METH_FASTCALL, ticket_wait_rows_doc},
    {"result", (PyCFunction)Ticket_result, METH_NOARGS, ticket_result_doc},
    {"ring_fd", (PyCFunction)Ticket_ring_fd, METH_O, ticket_ring_doc},
    {"stamps", (PyCFunction)Ticket_stamps, METH_NOARGS, ticket_stamps_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ticket_getset[] = {
    {"rows_done", (getter)Ticket_get_rows_done, NULL, "rows run so far (an atomic read: never blocks)", NULL},
    {"issued", (getter)Ticket_get_issued, NULL, "whether the program is over on the issuer", NULL},
    {"rows", (getter)Ticket_get_rows, NULL, "the program's rows", NULL},
    {"queued_at", (getter)Ticket_get_queued_at, NULL, "CLOCK_MONOTONIC seconds the submit returned at", NULL},
    {"started_at", (getter)Ticket_get_started_at, NULL,
     "CLOCK_MONOTONIC seconds just before its first driver call (None: not started)", NULL},
    {"finished_at", (getter)Ticket_get_finished_at, NULL, "CLOCK_MONOTONIC seconds it ended at", NULL},
    {"inline", (getter)Ticket_get_inline, NULL, "run on the submitting thread (the issuer was idle)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject aiokv_TicketType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Ticket",
    .tp_basicsize = sizeof(TicketObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One program handed to an issuer: how far it got, and its result once issued.",
    .tp_dealloc = (destructor)Ticket_dealloc,
    .tp_methods = Ticket_methods,
    .tp_getset = Ticket_getset,
};

/* ------------------------------------------------------------------------ issuer */

typedef struct {
    PyObject_HEAD
    IssuerState *st;
    int closed;
} IssuerObject;

IssuerState *
aiokv_issuer_state(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &aiokv_IssuerType)) {
        PyErr_SetString(PyExc_TypeError, "expected a _native.Issuer");
        return NULL;
    }
    IssuerObject *is = (IssuerObject *)obj;
    if (is->st == NULL || is->closed) {
        PyErr_SetString(aiokv_closed_error ? aiokv_closed_error : PyExc_ValueError,
                        "this lane is closed; create a new worker to transfer more");
        return NULL;
    }
    return is->st;
}

/* InvalidSpec for a spin window out of range, naming the value as given: a cast to int
 * would be undefined for NaN or a huge value, and would round -0.5 to 0. Returns -1. */
static int
bad_window(const char *name, double value)
{
    PyObject *v = PyFloat_FromDouble(value);
    if (v != NULL) {
        aiokv_bad_input("%s must be 0-10000, got %R", name, v);
        Py_DECREF(v);
    }
    return -1;
}

static int
Issuer_init(IssuerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"table", "waiter", "sticky", "spin_us", "nudge_us", NULL};
    TableObject *table;
    PyObject *waiter = Py_None, *sticky = NULL;
    double spin_us = 0, nudge_us = 0;
    if (self->st != NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "an Issuer is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|OOdd", kwlist, &aiokv_TableType, &table, &waiter, &sticky,
                                     &spin_us, &nudge_us))
        return -1;
    if (!(spin_us >= 0 && spin_us <= 10000))
        return bad_window("spin_us", spin_us);
    if (!(nudge_us >= 0 && nudge_us <= 10000))
        return bad_window("nudge_us", nudge_us);
    WaiterState *ws = NULL;
    if (waiter != Py_None && (ws = aiokv_waiter_state(waiter)) == NULL)
        return -1;
    IssuerState *st = calloc(1, sizeof(IssuerState));
    if (st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (sticky != NULL && sticky != Py_None) {
        PyObject *fast = PySequence_Fast(sticky, "sticky must be a sequence of CUresult codes");
        if (fast == NULL) {
            free(st);
            return -1;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
        for (Py_ssize_t i = 0; i < n && st->nsticky < MAX_STICKY; i++) {
            long c = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
            if (c == -1 && PyErr_Occurred()) {
                Py_DECREF(fast);
                free(st);
                return -1;
            }
            st->sticky[st->nsticky++] = (int)c;
        }
        Py_DECREF(fast);
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->work, NULL);
    pthread_cond_init(&st->progress, &ca);
    pthread_condattr_destroy(&ca);
    atomic_init(&st->queued, 0);
    atomic_init(&st->row_waiters, 0);
    atomic_init(&st->halt, 0);
    st->d = table->d;
    st->spin_ns = (long)(spin_us * 1000);
    st->nudge_ns = (long)(nudge_us * 1000);
    st->refs = 2; /* this object and the thread */
    st->running = 1;
    if (ws != NULL) {
        aiokv_waiter_retain(ws);
        st->waiter = ws;
    }
    int err = aiokv_start_thread(&st->thread, issuer_main, st, &st->mu, &st->progress, &st->ready);
    if (err != 0) {
        issuer_free(st);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (ws != NULL && st->nudge_ns > 0)
        aiokv_waiter_set_nudge(ws, st, NULL); /* undone by issuer_free */
    self->st = st;
    return 0;
}

/* The program's rows: a list of ints (Program.words) or a buffer of 8-byte ints. */
static Py_ssize_t
count_rows(PyObject *ops)
{
    if (PyList_Check(ops)) {
        Py_ssize_t n = PyList_GET_SIZE(ops);
        if (n % WORDS != 0) {
            aiokv_bad_input("ops must be rows of %d 8-byte integers", WORDS);
            return -1;
        }
        return n / WORDS;
    }
    Py_buffer v;
    if (aiokv_get_view(ops, &v, "ops", -1) < 0)
        return -1;
    Py_ssize_t n = -1;
    if (aiokv_is_words(&v) && (v.len / 8) % WORDS == 0)
        n = v.len / 8 / WORDS;
    else
        aiokv_bad_input("ops must be rows of %d 8-byte integers", WORDS);
    PyBuffer_Release(&v);
    return n;
}

static int
fill_rows(PyObject *ops, uint64_t *rows, Py_ssize_t n)
{
    if (PyList_Check(ops)) {
        for (Py_ssize_t i = 0; i < n * WORDS; i++) {
            PyObject *item = PyList_GET_ITEM(ops, i);
            unsigned long long v = PyLong_AsUnsignedLongLong(item);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError) && !PyErr_ExceptionMatches(PyExc_TypeError))
                    return -1;
                PyErr_Clear();
                aiokv_bad_input("ops word %zd is not an unsigned 64-bit integer", i);
                return -1;
            }
            rows[i] = v;
        }
        return 0;
    }
    Py_buffer v;
    if (aiokv_get_view(ops, &v, "ops", -1) < 0)
        return -1;
    memcpy(rows, v.buf, (size_t)n * WORDS * 8);
    PyBuffer_Release(&v);
    return 0;
}

PyDoc_STRVAR(submit_doc,
"submit(ops, buffers, main, rescue, end, run_here=False, stamps=False) -> Ticket\n\n"
"Check a program (as ``Table.enqueue`` does: bad input raises InvalidSpec and queues\n"
"nothing), copy its rows (a list of ints or a buffer of 8-byte ints, 8 per row) and every\n"
"buffer of the tuple ``buffers`` into C memory, and queue it; returns at once, never\n"
"waiting for a driver call. After a failing row the thread joins the program's streams into\n"
"``main`` through ``rescue`` and records ``end`` (non-zero) on ``main``. ``run_here``: run it\n"
"on this thread now, holding the GIL, if nothing is queued or running (a tiny job).\n"
"``stamps``: the ticket keeps when each row's call returned (``Ticket.stamps()``).");

static PyObject *
Issuer_submit(IssuerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ops", "buffers", "main", "rescue", "end", "run_here", "stamps", NULL};
    PyObject *ops, *buffers;
    unsigned long long main_stream, rescue, end;
    int run_here = 0, stamps = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!KKK|pp", kwlist, &ops, &PyTuple_Type, &buffers,
                                     &main_stream, &rescue, &end, &run_here, &stamps))
        return NULL;
    IssuerState *st = aiokv_issuer_state((PyObject *)self);
    if (st == NULL)
        return NULL;
    if (rescue == 0)
        return aiokv_bad_input("the rescue event must not be null");
    Py_ssize_t rows = count_rows(ops);
    if (rows < 0)
        return NULL;
    Py_ssize_t nbuf = PyTuple_GET_SIZE(buffers);
    Py_buffer small[8];
    Py_buffer *views = nbuf <= 8 ? small : PyMem_Calloc(nbuf, sizeof(Py_buffer));
    if (views == NULL)
        return PyErr_NoMemory();
    Py_ssize_t got = 0;
    size_t data = 0;
    Program *p = NULL;
    PyObject *ticket = NULL;
    for (; got < nbuf; got++) {
        if (aiokv_get_view(PyTuple_GET_ITEM(buffers, got), &views[got], "buffer", got) < 0)
            goto done;
        data += align16(views[got].len ? (size_t)views[got].len : 1);
    }
    p = aiokv_program_new(st, rows, nbuf, data);
    if (p == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (fill_rows(ops, p->rows, rows) < 0 || aiokv_check_program(&st->d, p->rows, rows, views, nbuf) < 0) {
        aiokv_program_drop(st, p);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nbuf; i++)
        memcpy(aiokv_program_alloc(p, i, (size_t)views[i].len), views[i].buf, (size_t)views[i].len);
    p->main = main_stream;
    p->rescue = rescue;
    p->end = end;
    ticket = queue_program(st, p, run_here, stamps);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    if (views != small)
        PyMem_Free(views);
    return ticket;
}

PyDoc_STRVAR(pause_doc,
"pause()\n\nStop picking up programs (one already running ends first); submits still queue. For\n"
"tests that need a program to stay queued.");

static PyObject *
Issuer_pause(IssuerObject *self, PyObject *unused)
{
    IssuerState *st = aiokv_issuer_state((PyObject *)self);
    if (st == NULL)
        return NULL;
    pthread_mutex_lock(&st->mu);
    st->paused = 1;
    atomic_store(&st->halt, 1);
    pthread_mutex_unlock(&st->mu);
    Py_RETURN_NONE;
}

static PyObject *
Issuer_resume(IssuerObject *self, PyObject *unused)
{
    IssuerState *st = aiokv_issuer_state((PyObject *)self);
    if (st == NULL)
        return NULL;
    pthread_mutex_lock(&st->mu);
    st->paused = 0;
    atomic_store(&st->halt, st->stop);
    pthread_cond_signal(&st->work);
    pthread_mutex_unlock(&st->mu);
    Py_RETURN_NONE;
}

/* Nothing queued or running (or no thread left to run it). */
static int
issuer_idle(IssuerState *st, void *unused)
{
    return (st->head == NULL && !st->busy) || !st->running;
}

PyDoc_STRVAR(drain_doc,
"drain(timeout=None) -> bool\n\nBlock, the GIL released, until nothing is queued or running;\n"
"False if ``timeout`` seconds passed first. A signal handler that raises interrupts it.");

static PyObject *
Issuer_drain(IssuerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double timeout;
    if (nargs > 1)
        return PyErr_Format(PyExc_TypeError, "drain takes at most one argument");
    if (parse_timeout(nargs ? args[0] : NULL, &timeout) < 0)
        return NULL;
    IssuerState *st = aiokv_issuer_state((PyObject *)self);
    if (st == NULL)
        return NULL;
    int ok = wait_progress(st, issuer_idle, NULL, timeout, 0);
    return ok < 0 ? NULL : PyBool_FromLong(ok);
}

PyDoc_STRVAR(close_doc,
"close(timeout=10.0) -> bool\n\nLet the thread issue what is queued (for at most ``timeout``\n"
"seconds; what is still queued then fails with CANCELLED, uncalled) and join it. False if\n"
"the thread did not end within a second after that (it is left to end by itself).\n"
"Idempotent.");

static PyObject *
Issuer_close(IssuerObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double timeout = 10.0;
    if (nargs > 1)
        return PyErr_Format(PyExc_TypeError, "close takes at most one argument");
    if (nargs && parse_timeout(args[0], &timeout) < 0)
        return NULL;
    if (timeout < 0)
        timeout = 10.0;
    IssuerState *st = self->st;
    if (st == NULL || self->closed)
        Py_RETURN_TRUE;
    self->closed = 1;
    int ended = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    st->paused = 0;
    atomic_store(&st->halt, 1);
    pthread_cond_signal(&st->work);
    struct timespec deadline;
    deadline_after(timeout, &deadline);
    st->waiters++;
    while (st->running && pthread_cond_timedwait(&st->progress, &st->mu, &deadline) != ETIMEDOUT)
        ;
    if (st->running) { /* past the bound: what is still queued fails, uncalled */
        st->cancel = 1;
        pthread_cond_signal(&st->work);
        deadline_after(1.0, &deadline);
        while (st->running && pthread_cond_timedwait(&st->progress, &st->mu, &deadline) != ETIMEDOUT)
            ;
    }
    st->waiters--;
    ended = !st->running;
    pthread_mutex_unlock(&st->mu);
    if (ended)
        pthread_join(st->thread, NULL);
    else
        pthread_detach(st->thread); /* stuck in a driver call: it lets go of its share itself */
    Py_END_ALLOW_THREADS
    self->st = NULL;
    issuer_release(st);
    return PyBool_FromLong(ended);
}

static void
issuer_abandon(IssuerObject *self)
{
    IssuerState *st = self->st;
    if (st == NULL || self->closed)
        return;
    self->closed = 1;
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    st->cancel = 1; /* nobody waits for them: queued programs are not run */
    st->paused = 0;
    atomic_store(&st->halt, 1);
    pthread_cond_signal(&st->work);
    pthread_mutex_unlock(&st->mu);
    pthread_detach(st->thread);
    self->st = NULL;
    issuer_release(st);
}

PyDoc_STRVAR(abandon_doc,
"abandon()\n\nStop without waiting (a worker dropped unclosed): a program running ends, what is\n"
"queued fails with CANCELLED, uncalled, and the thread ends by itself.");

static PyObject *
Issuer_abandon(IssuerObject *self, PyObject *unused)
{
    issuer_abandon(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_broken_doc,
"set_broken(code)\n\nA sticky CUresult seen elsewhere: every program not yet run fails with it,\n"
"uncalled.");

static PyObject *
Issuer_set_broken(IssuerObject *self, PyObject *arg)
{
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    IssuerState *st = self->st;
    if (st != NULL && code != 0) {
        pthread_mutex_lock(&st->mu);
        if (st->broken == 0)
            st->broken = (CUresult)code;
        pthread_mutex_unlock(&st->mu);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(nudge_doc,
"nudge()\n\nWake the thread into a spin of ``nudge_us`` (none if 0): what the lane's waiter does as\n"
"it rings a job's end, so a submit right after the completion finds the thread awake.");

static PyObject *
Issuer_nudge(IssuerObject *self, PyObject *unused)
{
    IssuerState *st = aiokv_issuer_state((PyObject *)self);
    if (st == NULL)
        return NULL;
    aiokv_issuer_nudge(st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict\n\nPrograms issued (by the thread, or run at submit: ``inline``), failed and\n"
"cancelled, queued now, seconds spent issuing and the thread's CPU seconds, the sticky\n"
"code seen (``broken``), the context error at start, and whether the thread runs. Its\n"
"wake-ups: ``nudges`` taken (see ``nudge``), programs the thread found while it spun\n"
"(``spin_picked``: no wake-up needed), submits that had to wake it from its sleep\n"
"(``signalled``), and the seconds it spent spinning (``spin_seconds``).");

static PyObject *
Issuer_stats(IssuerObject *self, PyObject *unused)
{
    IssuerState *st = self->st;
    if (st == NULL)
        return Py_BuildValue("{s:O}", "running", Py_False);
    pthread_mutex_lock(&st->mu);
    unsigned long long issued = st->issued, inlined = st->inlined, failed = st->failed,
                       cancelled = st->cancelled, nudges = st->nudges, spin_picked = st->spin_picked,
                       signalled = st->signalled;
    double busy = st->busy_seconds, cpu = st->cpu_seconds, spin = st->spin_seconds;
    int queued = atomic_load(&st->queued), running = st->running, broken = st->broken, ctx = st->ctx_error;
    pthread_mutex_unlock(&st->mu);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:i,s:d,s:d,s:i,s:i,s:K,s:K,s:K,s:d,s:O}", "issued", issued, "inline",
                         inlined, "failed", failed, "cancelled", cancelled, "queued", queued, "busy_seconds",
                         busy, "cpu_seconds", cpu, "broken", broken, "context_error", ctx, "nudges", nudges,
                         "spin_picked", spin_picked, "signalled", signalled, "spin_seconds", spin, "running",
                         running ? Py_True : Py_False);
}

PyDoc_STRVAR(lags_doc,
"lags(pickup=False) -> list[float]\n\nFor the latest programs (up to 4096, oldest first): seconds from\n"
"the submit's return to the thread's first driver call for it, by the thread's monotonic\n"
"clock (0 for a program run at submit). ``pickup``: from the submit's return or the end of\n"
"the program before it, whichever came later, so a wait behind that program's calls is left\n"
"out: the thread's own wake-up (or spin) alone.");

static PyObject *
Issuer_lags(IssuerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"pickup", NULL};
    int pickup = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p", kwlist, &pickup))
        return NULL;
    IssuerState *st = self->st;
    if (st == NULL)
        return PyList_New(0);
    pthread_mutex_lock(&st->mu);
    unsigned long long n = st->nlags < LAGS ? st->nlags : LAGS, first = st->nlags - n;
    const double *from = pickup ? st->pickups : st->lags;
    double *copy = malloc((n ? n : 1) * sizeof(double));
    if (copy != NULL)
        for (unsigned long long i = 0; i < n; i++)
            copy[i] = from[(first + i) % LAGS];
    pthread_mutex_unlock(&st->mu);
    if (copy == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (unsigned long long i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyFloat_FromDouble(copy[i] < 0 ? 0 : copy[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    free(copy);
    return out;
}

static PyObject *
Issuer_get_idle(IssuerObject *self, void *unused)
{
    IssuerState *st = self->st;
    if (st == NULL)
        Py_RETURN_TRUE;
    pthread_mutex_lock(&st->mu);
    int idle = st->head == NULL && !st->busy && !st->paused;
    pthread_mutex_unlock(&st->mu);
    return PyBool_FromLong(idle);
}

static PyGetSetDef Issuer_getset[] = {
    {"idle", (getter)Issuer_get_idle, NULL,
     "nothing queued or running, nor paused: a program handed over now starts at once (a short "
     "lock, never a wait)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static void
Issuer_dealloc(IssuerObject *self)
{
    issuer_abandon(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Issuer_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Issuer_submit, METH_VARARGS | METH_KEYWORDS, submit_doc},
    {"pause", (PyCFunction)Issuer_pause, METH_NOARGS, pause_doc},
    {"resume", (PyCFunction)Issuer_resume, METH_NOARGS, "resume()\n\nUndo ``pause``."},
    {"drain", (PyCFunction)(void (*)(void))Issuer_drain, METH_FASTCALL, drain_doc},
    {"close", (PyCFunction)(void (*)(void))Issuer_close, METH_FASTCALL, close_doc},
    {"abandon", (PyCFunction)Issuer_abandon, METH_NOARGS, abandon_doc},
    {"set_broken", (PyCFunction)Issuer_set_broken, METH_O, set_broken_doc},
    {"nudge", (PyCFunction)Issuer_nudge, METH_NOARGS, nudge_doc},
    {"stats", (PyCFunction)Issuer_stats, METH_NOARGS, stats_doc},
    {"lags", (PyCFunction)(void (*)(void))Issuer_lags, METH_VARARGS | METH_KEYWORDS, lags_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Issuer_doc,
"Issuer(table, waiter=None, sticky=(), spin_us=0, nudge_us=0)\n\n"
"A thread that runs submitted programs in order without the GIL (see ``submit``). It makes\n"
"the table's context current first. ``waiter``: the lane's ``Waiter``, through which it arms\n"
"the doorbells asked for before a program ran. ``sticky``: CUresults after which every\n"
"later program fails uncalled. ``spin_us``: how long the idle thread looks for a next\n"
"program before it sleeps. ``nudge_us``: how long it spins once nudged, which the waiter\n"
"does as it rings a job's end (0: never; both at most 10000).");

PyTypeObject aiokv_IssuerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "aiokv.backends.cuda._native.Issuer",
    .tp_basicsize = sizeof(IssuerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Issuer_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Issuer_init,
    .tp_dealloc = (destructor)Issuer_dealloc,
    .tp_methods = Issuer_methods,
    .tp_getset = Issuer_getset,
};
