"""CUDA backend: dedicated streams per direction, pooled events, errors translated once.

The only module that calls cuda-python (``cuda_usable`` only checks that it imports).
Everything else (copy strategies, host pool)
talks to the device through the small ``Driver`` facade defined here, so that every
return code is checked in one place and translated into ``aiokv.specs`` errors.

Threads: the driver is called from the submitting thread (an event loop or an engine
thread), from whoever polls, and from whoever waits. ``Driver.ensure_context`` makes the
device's primary context (the one torch uses) current in each such thread once.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from cuda.bindings import driver as cu

from ..doorbell import Doorbell
from ..errors import AiokvError, CudaCallFailed, InvalidSpec, WorkerBroken
from ..issuer import Issuer
from ..layout import CanonicalKVCaches
from ..plan import CopyPlan, HostLayout
from ..specs import Direction
from .base import Backend, Completion, HostPool, Lane

__all__ = ["CudaBackend", "CudaCallFailed", "Driver"]

_OK = cu.CUresult.CUDA_SUCCESS
_NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY

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
# per pitched op; docs/performance-history.md), so they keep the GIL like a record does. Larger ones
# drop it: held through the ~100 us calls of 2 MiB-page and pitched jobs, it slowed a GEMM
# loop in another Python thread by 0.6-5.7% instead of -0.7-1.7% (runs 36-37).
GIL_HELD_DESCRIPTORS = 16
# With ``WorkerOptions.issue_thread``, jobs of at least this many bytes (~0.15 ms on PCIe 5)
# are enqueued by the lane's issuer thread, so ``submit`` returns after planning; smaller
# ones, whose issue is short and whose latency a thread hand-off would add to, are enqueued
# by the caller when the lane is idle.
ISSUE_THREAD_BYTES = 8 << 20
# An issuer thread keeps the GIL through its batched copies, so it takes the GIL once per
# job, not once per call: each retake waits for the loop thread or the other lanes' issuers
# to let go (beside a pure-Python thread, for a switch interval). probes/probe_issue.py, run
# 78, per-layer 32 KiB-page job, against issuing on the caller: both directions at once
# 0.89-0.91 (dropping it: 0.85-0.88; the caller: 0.91-0.92); round trip beside a busy
# Python thread 19-25 ms (dropping it: 49-51 ms; the caller: 22-27 ms); medium GEMMs from
# a Python thread slowed +2.8 to +4.7% (dropping it +3.5%, the caller +2.4 to +4.3%). One
# issuer thread shared by the lanes did no better (both 0.88-0.89, busy 53-62 ms). Runs
# 79-80: both directions 0.86-0.96 (the caller 0.92-0.97), medium GEMMs +4.7 to +7.0%
# (the caller +3.0 to +4.6%): why ``issue_thread`` is off by default.
ISSUE_THREAD_KEEPS_GIL = True
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
class _Events:
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
        self._event_pool: list[_Events] = []
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
        # another Python thread, which takes up to the switch interval (5 ms;
        # probes/probe_completion.py, run 36). Through ctypes a record cost 8-12 us of host
        # time on the H200's host in runs 27-32, 0.6-1.5 us in runs 35-36.
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

    def take_job_events(self) -> _Events:
        """A timing pair whose stop event syncs by blocking, from the pool."""
        with self._pool_lock:
            if self._event_pool:
                return self._event_pool.pop()
        return _Events(self.create_event(timing=True), self.create_event(timing=True, blocking=True))

    def give_job_events(self, events: _Events) -> None:
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
        is called done. In probes/probe_health.py (run 65: a device-side assert on another
        stream) the query of a copy's done event went from NOT_READY to the sticky code in
        the same poll as a record on an idle stream (the old check), and never to done,
        also for a 1 GiB copy running when the context died, whose bytes had all landed.
        Until the driver sees the error (~14 ms there) neither call can know of it.
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
        """Pin (page-lock) host memory; returns its device (UVA) address."""
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        self._check(cu.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")
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

    def memcpy_pitched(self, ops: np.ndarray, stream: Any) -> None:
        """Enqueue packed 2D copies (``pitched_ops`` rows, C-contiguous) on ``stream``."""
        n = int(ops.shape[0])
        if n == 0:
            return
        if self._batch3d_fn is None:
            raise CudaCallFailed("this driver has no cuMemcpy3DBatchAsync (needs CUDA 12.8+)",
                                 int(cu.CUresult.CUDA_ERROR_NOT_SUPPORTED))
        keep = n <= GIL_HELD_PITCHED_OPS or getattr(self._local, "keep_gil", False)
        fn = self._batch3d_fn_gil if keep else self._batch3d_fn
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

        ``hold_gil``: keep the GIL through the call (default: for small batches, and on a
        lane's issuer thread; threads issuing slices side by side pass False). Falls back
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
            hold_gil = n <= GIL_HELD_DESCRIPTORS or getattr(self._local, "keep_gil", False)
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


class CudaCompletion(Completion):
    """The completion event of one job; its events go back to the pool once observed."""

    __slots__ = (
        "_bell_stream", "_bells", "_done", "_driver", "_elapsed", "_error", "_events", "_issued",
        "_lock", "_orphan", "_started", "_unsettled", "_waiting",
    )

    def __init__(
        self, driver: Driver, events: _Events, error: BaseException | None = None,
        bell_stream: Any = None, started: float | None = None,
    ) -> None:
        self._driver = driver
        self._started = started
        self._bell_stream = bell_stream
        self._events: _Events | None = events
        self._done = False
        self._error = error
        self._elapsed: float | None = None
        # A finished job's timing pair, until ``settle`` reads it and pools it (off the
        # wake-up path: the read and the return cost 7-10 us per job, probes/probe_turns.py).
        self._unsettled: _Events | None = None
        self._lock = threading.Lock()
        # Threads inside cuEventSynchronize on our events: those go back to the pool only
        # once the last one is out, or a new job could re-record an event being waited on.
        self._waiting = 0
        self._orphan: _Events | None = None
        # Unset while the lane's issuer has yet to enqueue the job (None: enqueued at launch);
        # doorbells asked for meanwhile are armed once it has.
        self._issued: threading.Event | None = None
        self._bells: list[Doorbell] = []

    def _mark_issued(self, started: float, error: BaseException | None) -> None:
        """Called by the issuer once every copy is enqueued (or the enqueue failed)."""
        with self._lock:
            self._started = started
            if error is not None and self._error is None:
                self._error = error  # reported once the enqueued part is over
            bells, self._bells = self._bells, []
            if self._issued is not None:
                self._issued.set()
        for bell in bells:
            if not self.ring_when_done(bell):
                bell.ring()  # cannot arm it: wake the waiter now, it falls back to polling

    def _pending_issue(self) -> bool:
        issued = self._issued
        return issued is not None and not issued.is_set()

    def query(self) -> bool:
        if self._done:
            return True
        drv = self._driver
        if drv.broken is not None:
            self._finish(drv.broken)
            return True
        if self._pending_issue():
            return False
        events = self._events
        if events is None:
            return self._done
        try:
            drv.ensure_context()
            if not drv.query(events.done):
                return False
        except Exception as exc:
            if drv.broken is None:
                self._wait_out(events)
            self._finish(exc)
            return True
        self._finish(None)
        return True

    def _wait_out(self, events: _Events) -> None:
        """A query that failed without breaking the context says nothing of the copies:
        block until they are over before the job is reported failed, or its memory could
        be reused (a cache's chunks, the GPU blocks) while they still run."""
        try:
            self._driver.synchronize(events.done)
            return
        except Exception:
            pass
        if self._bell_stream is not None:
            try:
                self._driver.stream_synchronize(self._bell_stream)
            except Exception:
                pass  # a context that fails this too fails every job anyway

    def wait(self, timeout: float | None = None) -> bool:
        if self.query():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._issued is not None and not self._issued.wait(timeout):
            return self.query()
        if timeout is None:
            with self._lock:
                events = self._events
                if events is None:
                    return True
                self._waiting += 1
            error: Exception | None = None
            try:
                self._driver.synchronize(events.done)
            except Exception as exc:
                error = exc
            finally:
                with self._lock:
                    self._waiting -= 1
                    orphan = self._orphan if self._waiting == 0 else None
                    if orphan is not None:
                        self._orphan = None
                if orphan is not None:
                    self._driver.give_job_events(orphan)
            if error is not None:
                self._finish(error)
                return True
            return self.query()
        pause = 20e-6
        while not self.query():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def ring_when_done(self, bell: Doorbell) -> bool:
        with self._lock:
            events = self._events
            if events is not None and not self._done:
                if self._bell_stream is None:
                    return False
                if self._pending_issue():
                    if not self._driver.can_ring():
                        return False
                    self._bells.append(bell)  # armed by ``_mark_issued``
                    return True
                try:
                    return self._driver.ring_after(self._bell_stream, events.done, bell)
                except Exception:
                    return False  # the driver refused; a sticky error shows at the next query
        bell.ring()
        return True

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            events, self._events = self._events, None
            if self._error is None:
                self._error = error
            self._done = True
            if self._error is None:
                self._unsettled = events  # timed and pooled by ``settle``
                return
        self._pool(events)

    def settle(self) -> None:
        with self._lock:
            events, self._unsettled = self._unsettled, None
            if events is None:
                return
            drv = self._driver
            try:
                drv.ensure_context()  # any thread may read a result's transfer_time
                self._elapsed = drv.elapsed(events.start, events.stop)
            except Exception:
                self._elapsed = None  # the time is lost (a broken device), never the result
        self._pool(events)

    def _pool(self, events: _Events | None) -> None:
        """Give the job's events back, or to the last thread still waiting on them."""
        with self._lock:
            if events is not None and self._waiting:
                self._orphan, events = events, None  # the last waiter gives them back
        if events is not None and self._driver.broken is None:
            self._driver.give_job_events(events)



# torch's raw-handle lookup (what its compiler uses) took 5-7 us on the H200's host, where
# ``torch.cuda.current_stream(index)`` took 38-58 us and the same inside
# ``torch.cuda.device()`` 43-64 us (probes/probe_submit.py, runs 29 and 32).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """The calling thread's current torch stream on device ``index``, as a raw handle."""
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


class _Dependency:
    """What a copy waits for: a pooled event recorded at submit time, ours to give back."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event


class CudaLane(Lane):
    """One direction: a main stream whose job end events mark completion, in order.

    With ``issue_thread``, jobs of ``ISSUE_THREAD_BYTES`` or more (and any job behind one)
    are enqueued by the lane's issuer thread: ``launch`` returns once the job is planned
    and its dependency captured.
    """

    def __init__(self, backend: CudaBackend, direction: Direction, strategy: Any) -> None:
        self.direction = direction
        self._backend = backend
        self._driver = backend.driver
        self._strategy = strategy
        self.strategy_name: str = strategy.name
        self.stream = strategy.main_stream
        self._issuer = Issuer(f"aiokv-issue-{direction.value}") if backend.options.issue_thread else None
        # Jobs the issuer thread enqueued, the host seconds it spent on them and its CPU
        # seconds doing so (the bench reports them beside the caller's submit time).
        self.issued_later = 0
        self.issue_seconds = 0.0
        self.issue_cpu_seconds = 0.0
        # Where completion doorbells wait on job end events (see Driver.ring_after).
        try:
            self.bell_stream = self._driver.create_stream()
        except BaseException:
            strategy.close()
            raise

    def launch(self, plan: CopyPlan, dependency: Any) -> Completion:
        drv = self._driver
        dep: _Dependency | None = dependency
        events = None
        issuer = self._issuer
        defer = issuer is not None and plan.total_bytes >= ISSUE_THREAD_BYTES
        try:
            drv.ensure_context()
            drv.check_usable()
            events = drv.take_job_events()
        except BaseException:
            self._give_back(events, dep)
            raise
        completion = CudaCompletion(drv, events, None, self.bell_stream)
        work = functools.partial(self._issue, plan, dep, completion, events)
        if issuer is None:
            work()
            return completion
        completion._issued = threading.Event()
        ran = False

        def run_once() -> None:
            nonlocal ran
            ran = True  # from here on ``_issue`` owns the events, failures included
            work()

        try:
            issuer.run(run_once, defer)
        except BaseException:
            if not ran:  # closed since the core's check, or no thread to queue it on
                self._give_back(events, dep)
            raise
        return completion

    def _issue(self, plan: CopyPlan, dep: _Dependency | None, completion: CudaCompletion,
               events: _Events) -> None:
        """Prepare and enqueue one job, on the caller's thread or the issuer's, never both
        at once (the strategies' state is theirs alone). On the caller's thread a failure
        before anything was enqueued, or a sticky one, raises; otherwise it is the job's,
        reported once what was enqueued is over."""
        drv = self._driver
        later = self._issuer is not None and self._issuer.on_own_thread()
        error: BaseException | None = None
        cpu = time.thread_time() if later else 0.0
        began = started = time.perf_counter()
        enqueuing = False
        if later:
            drv._local.keep_gil = ISSUE_THREAD_KEEPS_GIL
        try:
            drv.ensure_context()
            drv.check_usable()
            prepared = self._strategy.prepare(plan)
            enqueuing = True
            started = time.perf_counter()  # the start event is recorded after this
            # The strategy records ``stop`` behind every copy: that is the job's end.
            dep_event = dep.event if dep is not None else None
            self._strategy.enqueue(prepared, dep_event, events.start, events.stop)
        except BaseException as exc:
            if not later and (not enqueuing or drv.broken is not None):
                self._give_back(events if drv.broken is None else None, dep)
                if drv.broken is not None and drv.broken is not exc:
                    raise drv.broken from exc
                raise
            if not later and not isinstance(exc, Exception):
                raise
            error = exc
            if drv.broken is None:
                try:
                    drv.record(events.done, self.stream)  # ends after the part enqueued
                except Exception:
                    # The event's last record is not this job's: wait out what was
                    # enqueued here, so the failure is not reported while copies still run.
                    try:
                        drv.stream_synchronize(self.stream)
                    except Exception:
                        pass  # a broken context fails every job anyway
        if dep is not None:
            drv.give_sync_event(dep.event)
        completion._mark_issued(started, error)
        if later:
            self.issued_later += 1
            self.issue_seconds += time.perf_counter() - began
            self.issue_cpu_seconds += time.thread_time() - cpu

    def _give_back(self, events: _Events | None, dep: _Dependency | None) -> None:
        """Return a job's pooled events when nothing of it was enqueued."""
        if events is not None:
            self._driver.give_job_events(events)
        if dep is not None:
            self._driver.give_sync_event(dep.event)

    def abandon(self) -> None:
        """Dropped unclosed: keep what queued copies may still read, and let the issuer
        thread end after its queue."""
        self._strategy.abandon()
        if self._issuer is not None:
            self._issuer.stop()

    def close(self) -> None:
        # Pending rings run before the stream goes (the doorbell is closed after this). A
        # dead context runs no host functions: their FILEs and descriptors are leaked.
        if self._issuer is not None:
            self._issuer.close()
        try:
            try:
                self._driver.stream_synchronize(self.bell_stream)
                # Every job's copies end on the main stream, also those of one that a
                # KeyboardInterrupt cut short mid-enqueue, which no job tracks.
                self._driver.stream_synchronize(self.stream)
            except Exception:
                pass
            self._driver.destroy_stream(self.bell_stream)
        finally:
            self._strategy.close()


class CudaBackend(Backend):
    """Copies between CUDA KV tensors and a ``cudaHostRegister``'d host pool."""

    name = "cuda"

    def __init__(self, kv: CanonicalKVCaches, options: Any = None) -> None:
        from ..options import WorkerOptions

        self.options = WorkerOptions.coerce(options)
        devices = {t.tensor.device for t in kv.tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise InvalidSpec(
                f"the CUDA backend needs every KV tensor on one CUDA device; got {sorted(map(str, devices))}"
            )
        dev = next(iter(devices))
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        from ..options import STRATEGIES

        if self.options.strategy not in STRATEGIES:
            raise InvalidSpec(f"strategy must be one of {STRATEGIES}, got {self.options.strategy!r}")
        if self.options.submit_threads < 0:
            raise InvalidSpec("submit_threads must be >= 0 (0 submits from the calling thread)")
        if self.options.streams_per_direction < 0:
            raise InvalidSpec("streams_per_direction must be >= 0 (0 picks a default)")
        torch.cuda.init()
        try:
            self.driver = Driver(self.torch_device.index)
        except AiokvError:
            raise
        self._lanes: list[CudaLane] = []
        self._capture_stream: Any = None  # where a caller's event is waited on (see capture)

    def check_caches(self, kv: CanonicalKVCaches) -> None:
        for i, t in enumerate(kv.tensors):
            if t.tensor.device != self.torch_device:
                raise InvalidSpec(f"tensors[{i}] is on {t.tensor.device}, expected {self.torch_device}")

    def allocate_pool(self, nbytes: int) -> HostPool:
        from ..host_pool import PinnedHostPool

        return PinnedHostPool(nbytes, self.driver)

    def capture(self, after: Any) -> Any:
        """Record (or take) the event a copy waits on, on the submitting thread."""
        drv = self.driver
        drv.ensure_context()
        drv.check_usable()
        what = self._waitable(after)
        if what is None:
            return None
        kind, handle = what
        if kind == "event":
            # The caller may record its event again before the copy's stream waits on it
            # (long jobs are enqueued later, by the lane's issuer thread): wait on its
            # current record now, from a side stream, and hand the copy an event of ours.
            if self._capture_stream is None:
                self._capture_stream = drv.create_stream()
            drv.stream_wait(self._capture_stream, cu.CUevent(handle))
            return self._record_on(self._capture_stream)
        return self._record_on(handle)

    def check_after(self, after: Any) -> None:
        if after is not None:
            self._waitable(after)

    def _waitable(self, after: Any) -> tuple[str, int] | None:
        """What ``after`` asks a copy to wait for, without touching the device: a stream to
        record on, an event to wait on (``("stream" | "event", handle)``), or None."""
        if after is None:
            return "stream", _current_stream(self.torch_device.index)
        if isinstance(after, torch.cuda.Event):
            handle = int(after.cuda_event) if getattr(after, "cuda_event", 0) else 0
            # Never recorded: nothing to wait for (torch does the same).
            return ("event", handle) if handle else None
        if isinstance(after, torch.cuda.Stream):
            return "stream", int(after.cuda_stream)
        proto = getattr(after, "__cuda_stream__", None)
        if proto is not None:
            value = proto() if callable(proto) else proto
            try:
                handle = int(value[1]) if isinstance(value, tuple) else int(value)
            except (TypeError, ValueError, IndexError) as exc:
                raise InvalidSpec(f"after.__cuda_stream__ returned {value!r}, not (version, handle)") from exc
            return "stream", handle
        if isinstance(after, int) and not isinstance(after, bool):
            if after < 0:
                raise InvalidSpec(f"after= stream handle must be >= 0, got {after}")
            return "stream", after
        raise InvalidSpec(
            f"after= must be None, a torch.cuda.Event, a torch.cuda.Stream, an object with "
            f"__cuda_stream__ or a raw stream handle (int); got {type(after).__name__}"
        )

    def _record_on(self, stream: Any) -> _Dependency:
        event = self.driver.take_sync_event()
        try:
            self.driver.record(event, int(stream))
        except BaseException:
            self.driver.give_sync_event(event)
            raise
        return _Dependency(event)

    def open_lane(
        self, direction: Direction, kv: CanonicalKVCaches, layout: HostLayout, pool: HostPool
    ) -> Lane:
        from ..copy import CopyContext, make_strategy

        self.driver.ensure_context()
        ctx = CopyContext(
            driver=self.driver,
            direction=direction,
            kv=kv,
            layout=layout,
            pool=pool,
            device=self.torch_device,
            streams=self.options.streams_per_direction,
            submit_threads=self.options.submit_threads,
            staging_bytes=self.options.staging_bytes,
        )
        lane = CudaLane(self, direction, make_strategy(self.options.strategy, ctx))
        self._lanes.append(lane)
        return lane

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device": str(self.torch_device),
            "driver_version": self.driver.driver_version,
            "memcpy": self.driver.batch_kind,
            "strategy": {lane.direction.value: lane.strategy_name for lane in self._lanes},
        }

    def close(self) -> None:
        if self._capture_stream is not None:
            self.driver.destroy_stream(self._capture_stream)
        self.driver.close()


def device_facts(index: int = 0) -> dict[str, Any]:
    """Driver version, batched-copy support and the PCIe link, for ``aiokv info``.

    Every fact is best effort: a missing one reads "unknown" rather than failing.
    """
    facts: dict[str, Any] = {}
    try:
        drv = Driver(index)
    except Exception as exc:  # info must print something useful even on a broken setup
        return {"driver": f"unusable ({exc})"}
    try:
        v = drv.driver_version
        facts["CUDA driver API"] = f"{v // 1000}.{(v % 1000) // 10}"
        facts["batched memcpy"] = drv.batch_kind or "no (one cuMemcpyAsync per copy)"
        code, bus = cu.cuDeviceGetPCIBusId(32, drv.device)
        if code == _OK:
            raw = bus.decode(errors="replace") if isinstance(bus, bytes) else str(bus)
            bus_id = raw.split("\x00", 1)[0].strip().lower()
            facts["PCI bus id"] = bus_id
            facts["PCIe link"] = _pcie_link(bus_id)
        code, engines = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, drv.device
        )
        if code == _OK:
            facts["copy engines"] = int(engines)
    finally:
        drv.close()
    return facts


def _pcie_link(bus_id: str) -> str:
    """Current link speed and width from sysfs (Linux); "unknown" elsewhere."""
    base = f"/sys/bus/pci/devices/{bus_id}"
    try:
        with open(f"{base}/current_link_speed") as fh:
            speed = fh.read().strip()
        with open(f"{base}/current_link_width") as fh:
            width = fh.read().strip()
    except (OSError, ValueError):
        return "unknown"
    return f"{speed} x{width}"
