"""The driver facade: the only module of aiokv that imports cuda-python.

Every driver call the CUDA wing makes goes through ``Driver`` (streams, events, copies,
kernels, pinned memory), so every return code is checked in one place and translated into
``aiokv.errors`` (``_translate``). Hot calls are bound through ctypes, with or without
dropping the GIL as each call's cost asks (docs/performance.md, "GIL").

Threads: the driver is called from the submitting thread (an event loop or an engine
thread), from whoever polls, and from whoever waits. ``Driver.ensure_context`` makes the
device's primary context (the one torch uses) current in each such thread once.

Over 500 lines on purpose: it is the one home of cuda-python bindings, and splitting it
would put a second module in front of the driver.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from ...doorbell import Doorbell
from ...errors import CudaCallFailed, HostMemoryError, InvalidSpec, WorkerBroken

__all__ = ["GIL_HELD_DESCRIPTORS", "GIL_HELD_PITCHED_OPS", "Driver", "JobEvents"]

_OK = cu.CUresult.CUDA_SUCCESS
_NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
_OUT_OF_MEMORY = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

# Errors after which the context is unusable for the rest of the process.
_STICKY = frozenset(
    int(getattr(cu.CUresult, name))
    for name in (
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_EXTERNAL_DEVICE",
        # cuda.h says these too leave the process unusable (226: Hopper's error containment).
        "CUDA_ERROR_CONTAINED",
        "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    )
    if hasattr(cu.CUresult, name)
)
# Errors that mean the caller handed us something unusable.
_BAD_INPUT = frozenset(
    int(getattr(cu.CUresult, name))
    for name in (
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_INVALID_CONTEXT",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    )
    if hasattr(cu.CUresult, name)
)


# Batches this small return within ~15 us of host time (0.65-0.9 us per descriptor, 2-3 us
# per pitched op), so they keep the GIL as a record does. Larger ones drop it: held through
# the ~100 us calls of 2 MiB-page and pitched jobs, it slowed a GEMM loop in another Python
# thread (docs/performance.md, "GIL"). A caller may decide otherwise per call (``hold_gil``).
GIL_HELD_DESCRIPTORS = 16
GIL_HELD_PITCHED_OPS = 4


def _holding_gil(fn: Any) -> Any:
    """The same ctypes entry point, called without dropping the GIL (None stays None)."""
    if fn is None:
        return None
    proto = ctypes.PYFUNCTYPE(fn._restype_, *fn._argtypes_)
    return proto(int(ctypes.cast(fn, ctypes.c_void_p).value or 0))


class _DriverError(Exception):
    """The raw driver failure, kept as ``__cause__`` of the translated error."""

    def __init__(self, code: int, what: str) -> None:
        name = _error_name(code)
        super().__init__(f"{what} returned {name} ({code})")
        self.code = code
        self.name = name


def _error_name(code: int) -> str:
    try:
        return cu.CUresult(code).name
    except ValueError:
        return "CUDA_ERROR_UNKNOWN_CODE"


def _translate(code: int, what: str) -> Exception:
    """The one place a driver code becomes an aiokv error (raised ``from`` the raw one)."""
    raw = _DriverError(code, what)
    if code in _STICKY:
        err: Exception = WorkerBroken(
            f"the CUDA context is broken ({raw}); every pending transfer failed. Restart the "
            "process: a sticky CUDA error cannot be cleared"
        )
    elif code in _BAD_INPUT:
        err = InvalidSpec(f"CUDA rejected the request: {raw}")
    else:
        err = CudaCallFailed(f"CUDA call failed: {raw}", code)
    err.__cause__ = raw
    return err


@dataclass
class JobEvents:
    """A timing pair around one job's copies; ``stop`` (blocking-sync) also marks completion.

    One event for both saves a record per job: 8-17 us of host time on the H200's host.
    """

    start: Any
    stop: Any

    @property
    def done(self) -> Any:
        return self.stop


class Driver:
    """A thin, checked facade over the driver for one device (streams, events, copies).

    Also holds the backend-wide ``broken`` state: once a sticky error is seen, every
    pending completion reports it and every launch raises ``WorkerBroken``.
    """

    # Tell the driver where each side of a batched copy lives (measured: no gain on the H200).
    use_location_hints: bool = False

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._local = threading.local()
        self.broken: WorkerBroken | None = None
        self._check(cu.cuInit(0), "cuInit")
        self.device = self._check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = self._check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.ensure_context()
        self.driver_version = int(self._check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        least, greatest = self._check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.priority_low, self.priority_high = int(least), int(greatest)
        self._pool_lock = threading.Lock()
        self._event_pool: list[JobEvents] = []
        self._sync_pool: list[Any] = []
        self._all_events: list[Any] = []
        self._batch_fn, self.batch_kind = self._load_batch()
        self._batch3d_fn = self._load_batch3d()
        self._batch_fn_gil = _holding_gil(self._batch_fn)
        self._batch3d_fn_gil = _holding_gil(self._batch3d_fn)
        # Through ctypes CFUNCTYPE, which drops the GIL while the driver blocks: a thread
        # waiting for a copy must never stall the event loop.
        sync_proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
        self._event_sync = self._load_proc(b"cuEventSynchronize", sync_proto)
        vp = ctypes.c_void_p
        # A job makes ~16 records and waits, and every poll a query. They return at once, so
        # they keep the GIL (PYFUNCTYPE): a call that drops it may have to win it back from
        # another Python thread, which takes up to the switch interval (5 ms). Through
        # ctypes a record costs about a microsecond of host time (docs/performance.md, "GIL").
        self._host_func = self._load_proc(b"cuLaunchHostFunc", ctypes.PYFUNCTYPE(ctypes.c_int, vp, vp, vp))
        self._record_fn = self._load_proc(b"cuEventRecord", ctypes.PYFUNCTYPE(ctypes.c_int, vp, vp))
        self._wait_fn = self._load_proc(
            b"cuStreamWaitEvent", ctypes.PYFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_uint)
        )
        self._query_fn = self._load_proc(b"cuEventQuery", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
        ui = ctypes.c_uint
        self._launch_fn = self._load_proc(
            b"cuLaunchKernel", ctypes.PYFUNCTYPE(ctypes.c_int, vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp)
        )
        self._modules: list[Any] = []
        u64 = ctypes.c_uint64
        self._memcpy_fn = self._load_proc(
            b"cuMemcpyAsync", ctypes.PYFUNCTYPE(ctypes.c_int, u64, u64, ctypes.c_size_t, vp)
        )
        self.max_pitch = int(self._check(
            cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, self.device),
            "cuDeviceGetAttribute",
        ))
        self._attrs: dict[tuple[bool, bool | None], Any] = {}
        self._attr_ptrs: dict[tuple[bool, bool | None], int] = {}
        self._first_attr, self._fail_idx = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._first_attr_at = ctypes.addressof(self._first_attr)
        self._fail_idx_at = ctypes.addressof(self._fail_idx)

    # -- checking -------------------------------------------------------------------------

    def _check(self, ret: Any, what: str) -> Any:
        """Unpack a cuda-python return tuple, raising the translated error on failure."""
        code = ret[0] if isinstance(ret, tuple) else ret
        if code != _OK:
            raise self.fail(int(code), what)
        if isinstance(ret, tuple):
            return ret[1] if len(ret) == 2 else ret[1:]
        return None

    def fail(self, code: int, what: str) -> Exception:
        """Translate ``code``; a sticky one also marks the whole backend broken."""
        err = _translate(code, what)
        if isinstance(err, WorkerBroken) and self.broken is None:
            self.broken = err
        return err

    def ensure_context(self) -> None:
        """Make the primary context current in the calling thread (once per thread)."""
        if getattr(self._local, "ready", False):
            return
        ret = cu.cuCtxSetCurrent(self.context)
        if ret[0] != _OK:
            raise self.fail(int(ret[0]), "cuCtxSetCurrent")
        self._local.ready = True

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken

    # -- streams and events ---------------------------------------------------------------

    def create_stream(self, high_priority: bool = False) -> Any:
        """A non-blocking stream (never synchronises with the legacy default stream)."""
        prio = self.priority_high if high_priority else self.priority_low
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        return self._check(cu.cuStreamCreateWithPriority(flags, prio), "cuStreamCreateWithPriority")

    def destroy_stream(self, stream: Any) -> None:
        cu.cuStreamDestroy(stream)  # best effort at teardown

    def create_event(self, timing: bool = False, blocking: bool = False) -> Any:
        flags = 0
        if not timing:
            flags |= cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        if blocking:
            flags |= cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC
        ev = self._check(cu.cuEventCreate(flags), "cuEventCreate")
        with self._pool_lock:
            self._all_events.append(ev)
        return ev

    def take_job_events(self) -> JobEvents:
        """A timing pair whose stop event syncs by blocking, from the pool."""
        with self._pool_lock:
            if self._event_pool:
                return self._event_pool.pop()
        return JobEvents(self.create_event(timing=True), self.create_event(timing=True, blocking=True))

    def give_job_events(self, events: JobEvents) -> None:
        with self._pool_lock:
            self._event_pool.append(events)

    def take_sync_event(self) -> Any:
        """A plain (no timing) event for dependencies and fork/join edges."""
        with self._pool_lock:
            if self._sync_pool:
                return self._sync_pool.pop()
        return self.create_event()

    def give_sync_event(self, event: Any) -> None:
        with self._pool_lock:
            self._sync_pool.append(event)

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (a ``CUstream`` or a raw handle)."""
        if self._record_fn is not None:
            code = self._record_fn(int(event), int(stream))
        else:
            code = cu.cuEventRecord(event, cu.CUstream(int(stream)))[0]
        if code != _OK:
            raise self.fail(int(code), "cuEventRecord")

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Enqueue a wait on the event's latest record; the event may be re-recorded after."""
        if self._wait_fn is not None:
            code = self._wait_fn(int(stream), int(event), 0)
        else:
            code = cu.cuStreamWaitEvent(stream, event, 0)[0]
        if code != _OK:
            raise self.fail(int(code), "cuStreamWaitEvent")

    def query(self, event: Any) -> bool:
        """True when done, False when NOT_READY; anything else raises (translated).

        A dead context reports itself here, so no separate health check runs before a job
        is called done: after a device-side assert on another stream, the query of a copy's
        done event goes from NOT_READY to the sticky code in the same poll as a record on an
        idle stream would, and never to done, even for a copy whose bytes had all landed
        (docs/performance.md, "Completion"). Until the driver sees the error neither call
        can know of it.
        """
        if self._query_fn is not None:
            code = self._query_fn(int(event))
        else:
            code = cu.cuEventQuery(event)[0]
        if code == _OK:
            return True
        if code == _NOT_READY:
            return False
        raise self.fail(int(code), "cuEventQuery")

    def synchronize(self, event: Any) -> None:
        """Block (GIL released, no spin for blocking-sync events) until the event lands."""
        if self._event_sync is not None:
            code = self._event_sync(int(event))
        else:
            code = cu.cuEventSynchronize(event)[0]
        if code != _OK:
            raise self.fail(int(code), "cuEventSynchronize")

    def elapsed(self, start: Any, stop: Any) -> float | None:
        """Seconds between two completed timing events (None if the driver cannot say)."""
        ret = cu.cuEventElapsedTime(start, stop)
        return float(ret[1]) / 1e3 if ret[0] == _OK else None

    def can_ring(self) -> bool:
        """Whether ``ring_after`` has what it needs (host functions, a ring callback)."""
        return self._host_func is not None and bool(Doorbell.host_function())

    def ring_after(self, stream: Any, event: Any, bell: Doorbell) -> bool:
        """Ring ``bell`` from the driver's callback thread once ``event``'s latest record
        lands, via a host function enqueued on ``stream`` (a side stream, so the copies
        never wait for the callback). False where host functions cannot be used."""
        if not self.can_ring():
            return False
        fn = Doorbell.host_function()
        try:
            handle = bell.deferred_ring()
        except OSError:
            return False
        try:
            self.ensure_context()
            self.stream_wait(stream, event)
            code = self._host_func(int(stream), fn, handle)
            if code != _OK:
                raise self.fail(int(code), "cuLaunchHostFunc")
        except BaseException:
            Doorbell.cancel_deferred(handle)
            raise
        return True

    def stream_synchronize(self, stream: Any) -> None:
        code = cu.cuStreamSynchronize(stream)[0]
        if code != _OK:
            raise self.fail(int(code), "cuStreamSynchronize")

    # -- host memory ----------------------------------------------------------------------

    def host_register(self, address: int, nbytes: int) -> int:
        """Pin (page-lock) host memory; returns its device (UVA) address.

        Raises:
            HostMemoryError: the driver could not pin that much memory.
        """
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        code = int(cu.cuMemHostRegister(address, nbytes, flags)[0])
        if code == _OUT_OF_MEMORY:
            raise HostMemoryError(
                f"could not pin {nbytes} bytes of host memory ({_DriverError(code, 'cuMemHostRegister')}): "
                "ask for fewer chunks (num_cpu_chunks= or cpu_bytes=), or raise the locked-memory "
                "limit (ulimit -l)"
            ) from _DriverError(code, "cuMemHostRegister")
        if code != _OK:
            raise self.fail(code, "cuMemHostRegister")
        try:
            dptr = self._check(cu.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer")
        except BaseException:
            cu.cuMemHostUnregister(address)
            raise
        return int(dptr)

    def allocation_base(self, address: int) -> int:
        """Start of the device allocation holding ``address`` (copies may not span two)."""
        base, _size = self._check(cu.cuMemGetAddressRange(address), "cuMemGetAddressRange")
        return int(base)

    def host_unregister(self, address: int) -> None:
        self._check(cu.cuMemHostUnregister(address), "cuMemHostUnregister")

    # -- copies ---------------------------------------------------------------------------

    def _load_batch(self) -> tuple[Any, str]:
        """Bind cuMemcpyBatchAsync for raw pointer arrays (this binding drops the GIL).

        cuda-python's own wrapper converts Python lists entry by entry, which costs about
        half a microsecond per page and holds the GIL; numpy arrays go in as they are here.
        """
        if self.driver_version < 12080 or not hasattr(cu, "CUmemcpyAttributes"):
            return None, "loop"  # an old driver, or bindings older than 12.8 (no attribute type)
        version = 13000 if self.driver_version >= 13000 else 12080
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
        except Exception:
            return None, "loop"
        if ret[0] != _OK or not int(ret[1]):
            return None, "loop"
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        if version >= 13000:
            proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp)
            return proto(int(ret[1])), "batch13"
        proto = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, sz, vp, vp, sz, vp, vp)
        return proto(int(ret[1])), "batch12"

    def _load_proc(self, name: bytes, proto: Any) -> Any:
        """A driver entry point bound through ctypes, or None where it cannot be found."""
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(name, 12000, flags)
        except Exception:
            return None
        if ret[0] != _OK or not int(ret[1]):
            return None
        return proto(int(ret[1]))

    def _load_batch3d(self) -> Any:
        """Bind cuMemcpy3DBatchAsync (CUDA >= 12.8) for pitched copies, or None."""
        if self.batch_kind == "loop" or not hasattr(cu, "CUmemcpy3DOperandType"):
            return None
        version = 13000 if self.batch_kind == "batch13" else 12080
        flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        try:
            ret = cu.cuGetProcAddress(b"cuMemcpy3DBatchAsync", version, flags)
        except Exception:
            return None
        if ret[0] != _OK or not int(ret[1]):
            return None
        vp, sz, ull = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulonglong
        if version >= 13000:
            return ctypes.CFUNCTYPE(ctypes.c_int, sz, vp, ull, vp)(int(ret[1]))
        return ctypes.CFUNCTYPE(ctypes.c_int, sz, vp, vp, ull, vp)(int(ret[1]))

    @property
    def pitched_copies(self) -> bool:
        """Whether ``memcpy_pitched`` can issue a whole batch of 2D copies in one call."""
        return self._batch3d_fn is not None

    @staticmethod
    def pitched_ops(
        dst: np.ndarray, dst_pitch: np.ndarray, src: np.ndarray, src_pitch: np.ndarray,
        width: np.ndarray, height: np.ndarray, *, stream_ordered: bool = True,
    ) -> np.ndarray:
        """Pack 2D copies as ``CUDA_MEMCPY3D_BATCH_OP`` rows (14 x uint64 = 112 bytes each).

        Pointer operands with 1-byte elements: ``rowLength`` is the pitch in bytes and the
        extent is (width bytes, height rows, depth 1). Layout checked against
        cuda-bindings' own struct (13.x): words 0-4 src (type, ptr, rowLength, layerHeight,
        locHint), 5-9 dst, 10-12 extent, 13 srcAccessOrder | flags << 32.
        """
        ops = np.zeros((int(width.shape[0]), 14), dtype=np.uint64)
        pointer = int(cu.CUmemcpy3DOperandType.CU_MEMCPY_OPERAND_TYPE_POINTER)
        order = cu.CUmemcpySrcAccessOrder
        access = order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        if not stream_ordered:
            access = order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        ops[:, 0] = pointer
        ops[:, 1] = src
        ops[:, 2] = src_pitch
        ops[:, 3] = height
        ops[:, 5] = pointer
        ops[:, 6] = dst
        ops[:, 7] = dst_pitch
        ops[:, 8] = height
        ops[:, 10] = width
        ops[:, 11] = height
        ops[:, 12] = 1
        ops[:, 13] = int(access)
        return ops

    def memcpy_pitched(self, ops: np.ndarray, stream: Any, *, hold_gil: bool | None = None) -> None:
        """Enqueue packed 2D copies (``pitched_ops`` rows, C-contiguous) on ``stream``.

        ``hold_gil``: keep the GIL through the call (None: only for a few ops, see
        ``GIL_HELD_PITCHED_OPS``; a lane's issuer thread passes True)."""
        n = int(ops.shape[0])
        if n == 0:
            return
        if self._batch3d_fn is None:
            raise CudaCallFailed("this driver has no cuMemcpy3DBatchAsync (needs CUDA 12.8+)",
                                 int(cu.CUresult.CUDA_ERROR_NOT_SUPPORTED))
        if hold_gil is None:
            hold_gil = n <= GIL_HELD_PITCHED_OPS
        fn = self._batch3d_fn_gil if hold_gil else self._batch3d_fn
        if self.batch_kind == "batch13":
            code = fn(n, ops.ctypes.data, 0, int(stream))
        else:
            fail_idx = ctypes.c_size_t(0)
            code = fn(n, ops.ctypes.data, ctypes.addressof(fail_idx), 0, int(stream))
        if code != 0:
            raise self.fail(int(code), "cuMemcpy3DBatchAsync")

    def _attr(self, stream_ordered: bool, to_host: bool | None) -> Any:
        """The ``CUmemcpyAttributes`` for these settings, kept for the driver's lifetime.

        Threads may build one at the same time (lanes, and the DMA submit threads): the
        first stored wins and every caller gets that one, so no call passes the address of
        an object that a later store let go of while the driver still reads it."""
        hints = to_host if self.use_location_hints else None
        attr = self._attrs.get((stream_ordered, hints))
        if attr is None:
            attr = cu.CUmemcpyAttributes()
            order = cu.CUmemcpySrcAccessOrder
            attr.srcAccessOrder = (
                order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                if stream_ordered
                else order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            )
            if hints is not None:
                host, dev = cu.CUmemLocation(), cu.CUmemLocation()
                host.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
                dev.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                dev.id = self.device_index
                attr.srcLocHint, attr.dstLocHint = (dev, host) if hints else (host, dev)
            attr.flags = 0
            attr = self._attrs.setdefault((stream_ordered, hints), attr)
        return attr

    def memcpy_batch(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any, *,
        stream_ordered: bool = True, to_host: bool | None = None, hold_gil: bool | None = None,
    ) -> None:
        """Enqueue ``len(dst)`` copies on ``stream``; arrays are contiguous uint64 (or
        int64) of equal length. See ``memcpy_batch_at``."""
        n = int(dst.shape[0])
        if n:
            self.memcpy_batch_at(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n, stream,
                                 stream_ordered=stream_ordered, to_host=to_host, hold_gil=hold_gil)

    def memcpy_batch_at(
        self, dst: int, src: int, sizes: int, n: int, stream: Any, *,
        stream_ordered: bool = True, to_host: bool | None = None, hold_gil: bool | None = None,
    ) -> None:
        """Enqueue ``n`` copies on ``stream``, their destinations, sources and sizes read
        from the 8-byte arrays at host addresses ``dst``, ``src`` and ``sizes`` during the
        call (a caller's table needs no per-call conversion; ``.ctypes.data`` costs ~2 us).

        ``hold_gil``: keep the GIL through the call (None: for batches of at most
        ``GIL_HELD_DESCRIPTORS``; a lane's issuer thread passes True, threads issuing slices
        side by side pass False). Falls back
        to one cuMemcpyAsync per entry where the driver lacks batched copies.
        """
        if n <= 0:
            return
        if self._batch_fn is None:
            table = (ctypes.c_uint64 * n)
            for d, s, k in zip(table.from_address(dst), table.from_address(src), table.from_address(sizes)):
                ret = cu.cuMemcpyAsync(d, s, k, stream)
                if ret[0] != _OK:
                    raise self.fail(int(ret[0]), "cuMemcpyAsync")
            return
        attr = self._attr_at(stream_ordered, to_host)
        if hold_gil is None:
            hold_gil = n <= GIL_HELD_DESCRIPTORS
        fn = self._batch_fn_gil if hold_gil else self._batch_fn
        # Every copy takes attribute 0 (``_first_attr``, never written). CUDA 12.8's call
        # also reports the failing copy's index, which is never read: one shared output
        # serves every thread.
        if self.batch_kind == "batch12":
            code = fn(dst, src, sizes, n, attr, self._first_attr_at, 1, self._fail_idx_at, int(stream))
        else:
            code = fn(dst, src, sizes, n, attr, self._first_attr_at, 1, int(stream))
        if code != 0:
            raise self.fail(int(code), "cuMemcpyBatchAsync")

    def _attr_at(self, stream_ordered: bool, to_host: bool | None) -> int:
        """Address of the kept ``CUmemcpyAttributes`` for these settings (``_attr``)."""
        key = (stream_ordered, to_host if self.use_location_hints else None)
        at = self._attr_ptrs.get(key)
        if at is None:
            at = self._attr_ptrs[key] = int(self._attr(stream_ordered, to_host).getPtr())
        return at

    def memcpy_batch_lists(self, dst: list[int], src: list[int], sizes: list[int], stream: Any) -> None:
        """cuda-python's own batched call on Python lists: the baseline a user would write."""
        attr = self._attr(True, None)
        dsts = [cu.CUdeviceptr(x) for x in dst]
        srcs = [cu.CUdeviceptr(x) for x in src]
        ret = cu.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attr], [0], 1, stream)
        code = ret[0] if isinstance(ret, tuple) else ret
        if code != _OK:
            raise self.fail(int(code), "cuMemcpyBatchAsync")

    def load_function(self, image: bytes, name: bytes) -> Any:
        """Load a module image (PTX is compiled by the driver here) and return one kernel."""
        module = self._check(cu.cuModuleLoadData(image), "cuModuleLoadData")
        self._modules.append(module)
        return self._check(cu.cuModuleGetFunction(module, name), "cuModuleGetFunction")

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: Any,
               params: ctypes.Array[ctypes.c_void_p]) -> None:
        """Enqueue ``function`` on ``stream``. ``params`` points at the ctypes values of its
        parameters in order; the caller may rewrite them once this returns (the driver
        copies them at launch)."""
        gx, gy, gz = grid
        if self._launch_fn is not None:
            code = self._launch_fn(int(function), gx, gy, gz, block, 1, 1, 0, int(stream),
                                   ctypes.addressof(params), None)
        else:
            code = cu.cuLaunchKernel(function, gx, gy, gz, block, 1, 1, 0, stream,
                                     ctypes.addressof(params), 0)[0]
        if code != _OK:
            raise self.fail(int(code), "cuLaunchKernel")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """One async copy; keeps the GIL (it returns at once), like a record."""
        if self._memcpy_fn is not None:
            code = self._memcpy_fn(dst, src, nbytes, int(stream))
        else:
            code = cu.cuMemcpyAsync(dst, src, nbytes, stream)[0]
        if code != _OK:
            raise self.fail(int(code), "cuMemcpyAsync")

    def wrap_event(self, handle: int) -> Any:
        """A raw event handle (e.g. a ``torch.cuda.Event``'s) as the driver calls take it."""
        return cu.CUevent(handle)

    # -- device facts ---------------------------------------------------------------------

    def pci_bus_id(self) -> str | None:
        """The device's PCI bus id (e.g. "0000:1b:00.0"), or None where the driver cannot say."""
        code, bus = cu.cuDeviceGetPCIBusId(32, self.device)
        if code != _OK:
            return None
        raw = bus.decode(errors="replace") if isinstance(bus, bytes) else str(bus)
        return raw.split("\x00", 1)[0].strip().lower()

    def copy_engines(self) -> int | None:
        """How many copy engines the device has, or None where the driver cannot say."""
        code, engines = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, self.device
        )
        return int(engines) if code == _OK else None

    def close(self) -> None:
        """Destroy pooled events and release the primary context reference."""
        with self._pool_lock:
            events, self._all_events = self._all_events, []
            self._event_pool, self._sync_pool = [], []
        for ev in events:
            cu.cuEventDestroy(ev)
        modules, self._modules = self._modules, []
        for module in modules:
            cu.cuModuleUnload(module)
        cu.cuDevicePrimaryCtxRelease(self.device)


