"""The driver facade: context, streams, events, pinned memory and kernels of one device.

Every driver call the CUDA wing makes goes through ``Driver``, so every return code is
checked in one place and translated into ``aiokv.errors`` (``codes.translate``); the
batched copy calls are mixed in from ``batch``. Hot calls are bound through ctypes, with or
without dropping the GIL as each call's cost asks (docs/performance.md, "GIL").

Threads: the driver is called from the submitting thread (an event loop or an engine
thread), from whoever polls, and from whoever waits. ``Driver.ensure_context`` makes the
device's primary context (the one torch uses) current in each such thread once.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as cu

from ....doorbell import Doorbell
from ....errors import HostMemoryError, WorkerBroken
from .batch import BatchCopies, holding_gil
from .codes import NOT_READY, OK, OUT_OF_MEMORY, driver_error, translate

__all__ = ["Driver", "JobEvents"]

# The copy attributes handed to the native helper (see ``native_procs``): a few per worker.
_KEPT_ATTRS: list[Any] = []


@dataclass
class JobEvents:
    """A timing pair around one job's copies; ``stop`` (blocking-sync) also marks completion.

    One event for both saves a record, and its host time, per job (docs/performance.md, "GIL").
    """

    start: Any
    stop: Any

    @property
    def done(self) -> Any:
        return self.stop


class Driver(BatchCopies):
    """A thin, checked facade over the driver for one device (streams, events, copies).

    Also holds the backend-wide ``broken`` state: once a sticky error is seen, every
    pending completion reports it and every launch raises ``WorkerBroken``.
    """

    # Tell the driver where each side of a batched copy lives (off: the bench's rates did not move).
    use_location_hints = False

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
        self._timing_pool: list[Any] = []
        self._all_events: list[Any] = []
        self._batch_fn, self.batch_kind = self._load_batch()
        self._batch3d_fn = self._load_batch3d()
        self._batch_fn_gil = holding_gil(self._batch_fn)
        self._batch3d_fn_gil = holding_gil(self._batch3d_fn)
        # Through ctypes CFUNCTYPE, which drops the GIL while the driver blocks: a thread
        # waiting for a copy must never stall the event loop.
        sync_proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
        self._event_sync = self._load_proc(b"cuEventSynchronize", sync_proto)
        vp = ctypes.c_void_p
        # A job makes ~16 records and waits, and every poll a query. They return at once, so
        # they keep the GIL (PYFUNCTYPE): a call that drops it may have to win it back from
        # another Python thread, which takes up to the switch interval (5 ms). Through
        # ctypes a record is short enough to keep it (docs/performance.md, "GIL").
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
        if code != OK:
            raise self.fail(int(code), what)
        if isinstance(ret, tuple):
            return ret[1] if len(ret) == 2 else ret[1:]
        return None

    def fail(self, code: int, what: str) -> Exception:
        """Translate ``code``; a sticky one also marks the whole backend broken."""
        err = translate(code, what)
        if isinstance(err, WorkerBroken) and self.broken is None:
            self.broken = err
        return err

    def ensure_context(self) -> None:
        """Make the primary context current in the calling thread (once per thread)."""
        if getattr(self._local, "ready", False):
            return
        ret = cu.cuCtxSetCurrent(self.context)
        if ret[0] != OK:
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

    def take_sync_events(self, n: int) -> list[Any]:
        """``n`` calls of ``take_sync_event`` under one hold of the pool's lock: the same
        events in the same order (a layerwise job takes one a layer)."""
        with self._pool_lock:
            pool = self._sync_pool
            k = min(n, len(pool))
            out = pool[len(pool) - k:][::-1]
            del pool[len(pool) - k:]
        while len(out) < n:
            out.append(self.create_event())
        return out

    def give_sync_event(self, event: Any) -> None:
        with self._pool_lock:
            self._sync_pool.append(event)

    def take_timing_event(self) -> Any:
        """A timing (non-blocking) event: a measured layer's end, or a timeline's origin."""
        with self._pool_lock:
            if self._timing_pool:
                return self._timing_pool.pop()
        return self.create_event(timing=True)

    def give_timing_event(self, event: Any) -> None:
        with self._pool_lock:
            self._timing_pool.append(event)

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (a ``CUstream`` or a raw handle)."""
        if self._record_fn is not None:
            code = self._record_fn(int(event), int(stream))
        else:
            code = cu.cuEventRecord(event, cu.CUstream(int(stream)))[0]
        if code != OK:
            raise self.fail(int(code), "cuEventRecord")

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Enqueue a wait on the event's latest record; the event may be re-recorded after."""
        if self._wait_fn is not None:
            code = self._wait_fn(int(stream), int(event), 0)
        else:
            code = cu.cuStreamWaitEvent(stream, event, 0)[0]
        if code != OK:
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
        if code == OK:
            return True
        if code == NOT_READY:
            return False
        raise self.fail(int(code), "cuEventQuery")

    def synchronize(self, event: Any) -> None:
        """Block (GIL released, no spin for blocking-sync events) until the event lands."""
        if self._event_sync is not None:
            code = self._event_sync(int(event))
        else:
            code = cu.cuEventSynchronize(event)[0]
        if code != OK:
            raise self.fail(int(code), "cuEventSynchronize")

    def elapsed(self, start: Any, stop: Any) -> float | None:
        """Seconds between two completed timing events (None if the driver cannot say)."""
        ret = cu.cuEventElapsedTime(start, stop)
        return float(ret[1]) / 1e3 if ret[0] == OK else None

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
            if code != OK:
                raise self.fail(int(code), "cuLaunchHostFunc")
        except BaseException:
            Doorbell.cancel_deferred(handle)
            raise
        return True

    def stream_synchronize(self, stream: Any) -> None:
        code = cu.cuStreamSynchronize(stream)[0]
        if code != OK:
            raise self.fail(int(code), "cuStreamSynchronize")

    # -- host memory ----------------------------------------------------------------------

    def host_register(self, address: int, nbytes: int) -> int:
        """Pin (page-lock) host memory; returns its device (UVA) address.

        Raises:
            HostMemoryError: the driver could not pin that much memory.
        """
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        code = int(cu.cuMemHostRegister(address, nbytes, flags)[0])
        if code == OUT_OF_MEMORY:
            raw = driver_error(code, "cuMemHostRegister")
            raise HostMemoryError(
                f"could not pin {nbytes} bytes of host memory ({raw}): "
                "ask for fewer chunks (num_cpu_chunks= or cpu_bytes=), or raise the locked-memory "
                "limit (ulimit -l)"
            ) from raw
        if code != OK:
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

    def load_function(self, image: bytes, name: bytes) -> Any:
        """Load a module image (PTX is compiled by the driver here) and return one kernel."""
        module = self._check(cu.cuModuleLoadData(image), "cuModuleLoadData")
        self._modules.append(module)
        return self._check(cu.cuModuleGetFunction(module, name), "cuModuleGetFunction")

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: Any,
               params: ctypes.Array[ctypes.c_void_p], packed: Any = None) -> None:
        """Enqueue ``function`` on ``stream``. ``params`` points at the ctypes values of its
        parameters in order; the caller may rewrite them once this returns (the driver
        copies them at launch). ``packed`` (the same values as one blob, and offsets) is
        for a ``program.Recorder`` and unused here."""
        gx, gy, gz = grid
        if self._launch_fn is not None:
            code = self._launch_fn(int(function), gx, gy, gz, block, 1, 1, 0, int(stream),
                                   ctypes.addressof(params), None)
        else:
            code = cu.cuLaunchKernel(function, gx, gy, gz, block, 1, 1, 0, stream,
                                     ctypes.addressof(params), 0)[0]
        if code != OK:
            raise self.fail(int(code), "cuLaunchKernel")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """One async copy; keeps the GIL (it returns at once), like a record."""
        if self._memcpy_fn is not None:
            code = self._memcpy_fn(dst, src, nbytes, int(stream))
        else:
            code = cu.cuMemcpyAsync(dst, src, nbytes, stream)[0]
        if code != OK:
            raise self.fail(int(code), "cuMemcpyAsync")

    def wrap_event(self, handle: int) -> Any:
        """A raw event handle (e.g. a ``torch.cuda.Event``'s) as the driver calls take it."""
        return cu.CUevent(handle)

    # -- the native helper ----------------------------------------------------------------

    def native_procs(self) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
        """What ``_native.Table`` takes: the driver's entry points as addresses (from
        ``cuGetProcAddress`` of the libcuda loaded here; 0 where absent), the batched calls'
        signature version, the ``CUmemcpyAttributes`` address of each batch flag (bit 0
        stream-ordered, bit 1 to host) and the context a waiter thread makes current."""
        def at(fn: Any) -> int:
            return int(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0

        def proc(name: bytes) -> int:
            flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
            ret = cu.cuGetProcAddress(name, 12000, flags)
            return int(ret[1]) if ret[0] == OK else 0

        procs = (at(self._wait_fn), at(self._record_fn), at(self._memcpy_fn), at(self._launch_fn),
                 at(self._batch_fn), at(self._batch3d_fn), at(self._event_sync),
                 proc(b"cuEventCreate"), proc(b"cuEventDestroy"), proc(b"cuCtxSetCurrent"))
        batched = self._batch_fn is not None
        attrs = tuple(self._attr_at(bool(f & 1), bool(f & 2)) if batched else 0 for f in range(4))
        # An issuer thread of a worker dropped unclosed may still be in a batched call that
        # reads them after this driver is gone: they are kept for the process's life.
        _KEPT_ATTRS.extend(self._attrs.values())
        version = 13000 if self.batch_kind == "batch13" else 12080
        return procs, version, attrs, int(self.context)

    # -- device facts ---------------------------------------------------------------------

    def pci_bus_id(self) -> str | None:
        """The device's PCI bus id (e.g. "0000:1b:00.0"), or None where the driver cannot say."""
        code, bus = cu.cuDeviceGetPCIBusId(32, self.device)
        if code != OK:
            return None
        raw = bus.decode(errors="replace") if isinstance(bus, bytes) else str(bus)
        return raw.split("\x00", 1)[0].strip().lower()

    def copy_engines(self) -> int | None:
        """How many copy engines the device has, or None where the driver cannot say."""
        code, engines = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, self.device
        )
        return int(engines) if code == OK else None

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


