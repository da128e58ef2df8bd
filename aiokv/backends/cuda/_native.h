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
#ifndef AIOKV_NATIVE_H
#define AIOKV_NATIVE_H
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

typedef struct {
    PyObject_HEAD
    void *procs[N_PROCS];
    int version; /* 13000 or 12080: which signature the batched calls have */
    void *attrs[4];
    void *context;
} TableObject;

/* Shared by the two halves of the module (_native.c, _native_waiter.c). */
extern PyObject *aiokv_invalid_error; /* aiokv.errors.InvalidSpec, set by set_error_class */
extern PyTypeObject aiokv_TableType;
extern PyTypeObject aiokv_WaiterType;
PyObject *aiokv_bad_input(const char *fmt, ...);
int aiokv_need_proc(TableObject *t, int p);

#endif
