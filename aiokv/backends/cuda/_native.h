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
 *
 * ``Issuer`` is one thread per lane that runs programs handed to it (``Issuer.submit``
 * copies a checked program into C memory and returns a ``Ticket`` at once), in order,
 * without the GIL, and then arms the doorbells asked for meanwhile through the lane's
 * waiter. ``Planner`` (_native_plan.c) builds a whole job's program from its block and
 * chunk ids, with no Python in between.
 */
#ifndef AIOKV_NATIVE_H
#define AIOKV_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
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
static const char *const PROC_NAMES[N_PROCS] = {
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
 *   PITCHED stream, ops, count, first              cuMemcpy3DBatchAsync of rows
 *           [first, first + count) of a buffer of rows of 14 u64 (CUDA_MEMCPY3D_BATCH_OP)
 *   LAUNCH  stream, function, grid, block, blob, offsets, nparams
 *           cuLaunchKernel(function, grid,1,1, block,1,1, 0, stream, params, NULL) with
 *           params[i] = &blob[offsets[i]] (blob and offsets index ``buffers``)
 */
enum { OP_WAIT = 1, OP_RECORD, OP_BATCH, OP_COPY, OP_PITCHED, OP_LAUNCH };
#define WORDS 8
#define MAX_PARAMS 64
#define MAX_RESCUE_STREAMS 256

/* The driver's entry points and what the batched calls take: plain C, so the issuer and
 * waiter threads keep a copy of their own and never read a Python object. */
typedef struct {
    void *procs[N_PROCS];
    int version; /* 13000 or 12080: which signature the batched calls have */
    void *attrs[4];
    void *context;
} DriverTable;

typedef struct {
    PyObject_HEAD
    DriverTable d;
} TableObject;

/* A CUresult no driver returns: the program was never run (its issuer closed first). */
#define AIOKV_CANCELLED (-1)

/* Shared by the parts of the module (_native.c, _native_waiter.c, _native_issuer.c,
 * _native_plan.c). */
extern PyObject *aiokv_invalid_error; /* aiokv.errors.InvalidSpec, set by set_error_class */
extern PyObject *aiokv_closed_error;  /* aiokv.errors.WorkerClosed, likewise */
extern PyTypeObject aiokv_TableType;
extern PyTypeObject aiokv_WaiterType;
extern PyTypeObject aiokv_IssuerType;
extern PyTypeObject aiokv_TicketType;
extern PyTypeObject aiokv_PlannerType;
PyObject *aiokv_bad_input(const char *fmt, ...);
int aiokv_need_proc(const DriverTable *t, int p);

/* One row's driver call; ``bufs`` are the addresses of the buffers rows name by index. */
CUresult aiokv_run_op(const DriverTable *t, const uint64_t *o, void *const *bufs);
/* After a failure at row ``failed``: join every stream rows 0..failed touched into main. */
void aiokv_rescue(const DriverTable *t, const uint64_t *w, Py_ssize_t failed, uint64_t main, uint64_t rescue);
/* Check rows against the buffers' views (see ``check_program`` in _native.c). */
int aiokv_check_program(const DriverTable *t, const uint64_t *w, Py_ssize_t rows, Py_buffer *views,
                        Py_ssize_t nbuf);
int aiokv_get_view(PyObject *obj, Py_buffer *view, const char *what, Py_ssize_t index);
int aiokv_is_words(const Py_buffer *b);
double aiokv_now(void); /* CLOCK_MONOTONIC seconds: time.perf_counter()'s clock on Linux */
/* The waiter's and the issuer's threads: the first call of each blocks every signal (they
 * stay with Python's threads) and binds the table's context: the CUresult of that (0 too
 * where the table sets none). */
CUresult aiokv_thread_enter(const DriverTable *d);

/* A driver call on a caller's thread (the planner's record of a job's dependency, a tiny
 * program run at submit) while an
 * issuer thread runs a program: the issuer holds back its next call until the caller's is
 * done. The driver lets one thread's calls through at a time and does not queue them in
 * order, so without this the caller can wait behind a run of the issuer's calls, not one.
 * ``AIOKV_ISSUER_GIVE_WAY=0`` turns it off (read once, at import). */
extern atomic_int aiokv_caller_calls;
extern int aiokv_give_way_on;
static inline void
aiokv_give_way(void)
{
    if (aiokv_give_way_on)
        while (atomic_load_explicit(&aiokv_caller_calls, memory_order_acquire) > 0) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause(); /* leave a hyperthread sibling (the caller?) its core */
#endif
        }
}

/* Start ``main_fn(arg)`` on a thread and wait, the GIL released, until it set ``*ready``
 * under ``mu`` and signalled ``cv``: 0, or pthread_create's error (no thread then). */
int aiokv_start_thread(pthread_t *thread, void *(*main_fn)(void *), void *arg, pthread_mutex_t *mu,
                       pthread_cond_t *cv, const int *ready);

/* The waiter's shared state, for the issuer thread to arm rings through (no Python). */
typedef struct WaiterState WaiterState;
void aiokv_waiter_retain(WaiterState *st);
void aiokv_waiter_release(WaiterState *st);
/* Arm a ring of ``fd`` (owned: kept and closed by the waiter once rung) behind ``event``:
 * 0 armed; -1 cannot (stopped, or every slot busy); else the CUresult of the call that
 * failed. On anything but 0 the caller still owns ``fd``. */
int aiokv_waiter_arm(WaiterState *st, CUevent event, int fd);
WaiterState *aiokv_waiter_state(PyObject *waiter); /* NULL (TypeError set) if not a Waiter */
/* Which issuer the waiter nudges as it rings (``aiokv_issuer_nudge``, called under the
 * waiter's lock: so waiter lock, then issuer lock, never the other way): set to ``issuer``
 * only if it is ``was`` now (NULL, or that issuer detaching itself before it is freed). */
typedef struct IssuerState IssuerState;
void aiokv_waiter_set_nudge(WaiterState *st, IssuerState *issuer, IssuerState *was);

/* A program in C memory: what the issuer thread runs. Rows and buffers live in the same
 * allocation (``data``), so nothing of it belongs to Python. */
typedef struct TicketState TicketState;
typedef struct Program {
    struct Program *next;
    TicketState *ticket;
    uint64_t main, rescue, end; /* end: recorded on main after a failure (0: none) */
    Py_ssize_t nrows, nbuf;
    uint64_t *rows;
    void **bufs;
    size_t cap, used; /* bytes of ``data``, and how many hold this program */
    int spare;        /* index in the issuer's spare list, or -1 */
    _Alignas(16) unsigned char data[];
} Program;

/* The planner hands finished programs to an issuer. */
IssuerState *aiokv_issuer_state(PyObject *issuer); /* NULL (TypeError set) if not an Issuer */
Program *aiokv_program_new(IssuerState *st, Py_ssize_t rows, Py_ssize_t nbuf, size_t data);
void *aiokv_program_alloc(Program *p, Py_ssize_t buf, size_t nbytes);
void aiokv_program_drop(IssuerState *st, Program *p);
/* Queue ``p``: a new Ticket, or NULL (``p`` dropped). ``run_here``: run it on this thread now,
 * holding the GIL, if the issuer is idle. */
PyObject *aiokv_issuer_queue(IssuerState *st, Program *p, int run_here);
const DriverTable *aiokv_issuer_table(IssuerState *st);
/* A job of the lane just ended: wake the issuer thread into a spin window (its ``nudge_us``;
 * none if 0 or stopping), so a submit made right after the completion finds it awake. */
void aiokv_issuer_nudge(IssuerState *st);

#endif
