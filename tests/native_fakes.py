"""A driver table of C-callable fakes for the native helper (``_native.Table``), so its
tests run without a GPU: each entry point is a ctypes callback that logs the call (name
and arguments, tables read during the call as the driver reads them) and forwards it to a
Python target, such as ``sim_device.SimDriver``; any call can be made to fail with a code.

``sem_events`` builds waiter fakes that stay in C: an "event" is a POSIX semaphore,
``cuEventSynchronize`` is libc's ``sem_wait`` and completing an event is ``sem_post``, so
a waiter thread can be proven to ring without ever taking the GIL.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from aiokv.backends.cuda import native
from aiokv.backends.cuda.driver.codes import translate
from aiokv.backends.cuda.program import Recorder

INT, P, U, S = ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
PROTOS = {
    "cuStreamWaitEvent": ctypes.CFUNCTYPE(INT, P, P, U),
    "cuEventRecord": ctypes.CFUNCTYPE(INT, P, P),
    "cuMemcpyAsync": ctypes.CFUNCTYPE(INT, ctypes.c_uint64, ctypes.c_uint64, S, P),
    "cuLaunchKernel": ctypes.CFUNCTYPE(INT, P, U, U, U, U, U, U, U, P, P, P),
    "cuMemcpyBatchAsync": ctypes.CFUNCTYPE(INT, P, P, P, S, P, P, S, P),  # CUDA 13's
    "cuMemcpy3DBatchAsync": ctypes.CFUNCTYPE(INT, S, P, ctypes.c_ulonglong, P),
    "cuEventSynchronize": ctypes.CFUNCTYPE(INT, P),
    "cuEventCreate": ctypes.CFUNCTYPE(INT, P, U),
    "cuEventDestroy": ctypes.CFUNCTYPE(INT, P),
    "cuCtxSetCurrent": ctypes.CFUNCTYPE(INT, P),
}
ORDER = list(PROTOS)  # the order ``Table(procs)`` takes
ATTRS = (0xA0, 0xA1, 0xA2, 0xA3)  # fake CUmemcpyAttributes addresses, one per batch flags
PARAMS = 9  # the piece kernel's parameters


# Every table's callbacks, for the life of the process: a lane a test dropped without
# closing it may still have its issuer thread inside a program (a layerwise load's later
# layers, say), and the table holds only their addresses, so a freed callback would crash
# the process in whatever test runs then.
_KEPT_CALLBACKS: list[Any] = []


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0) if fn is not None else 0


def _u64s(address: int, n: int) -> list[int]:
    return list((ctypes.c_uint64 * n).from_address(address)) if n else []


class FakeTable:
    """The callbacks, their log (``calls``), and a ``_native.Table`` over them.

    ``fail[name] = (nth, code)``: the nth call (from 1) of ``name`` returns ``code``;
    ``hold[name] = (nth, event)``: the nth call blocks until ``event`` is set.
    ``target`` gets the calls that move bytes (a ``SimDriver``'s methods), if given.
    ``missing``: entry points left out of the table (address 0).
    """

    def __init__(self, target: Any = None, missing: tuple[str, ...] = (),
                 extra: dict[str, Callable[..., int]] | None = None) -> None:
        self.target = target
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[tuple[str, str]] = []  # (thread name, call) of every call
        self.contexts: list[tuple[str, int]] = []  # (thread name, context) made current
        self.fail: dict[str, tuple[int, int]] = {}
        self.hold: dict[str, tuple[int, Any]] = {}  # the nth call of name blocks until the event is set
        self._counts: dict[str, int] = {}
        impl: dict[str, Callable[..., int]] = {
            "cuStreamWaitEvent": self._wait, "cuEventRecord": self._record,
            "cuMemcpyAsync": self._copy, "cuLaunchKernel": self._launch,
            "cuMemcpyBatchAsync": self._batch, "cuMemcpy3DBatchAsync": self._pitched,
            "cuEventSynchronize": lambda ev: self._log("cuEventSynchronize", ev or 0),
            "cuEventCreate": self._create,
            "cuEventDestroy": lambda ev: self._log("cuEventDestroy", ev or 0),
            "cuCtxSetCurrent": self._set_context,
        }
        impl.update(extra or {})
        self.callbacks = {name: PROTOS[name](impl[name]) for name in ORDER if name not in missing}
        _KEPT_CALLBACKS.append(self.callbacks)
        self.addresses = tuple(_address(self.callbacks.get(name)) for name in ORDER)
        self.table = native.helper().Table(self.addresses, 13000, ATTRS, 0xC0)
        self._next_event = 0x5000

    def _log(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        self.threads.append((threading.current_thread().name, name))
        n = self._counts[name] = self._counts.get(name, 0) + 1
        nth_held, release = self.hold.get(name, (0, None))
        if nth_held == n and release is not None:
            assert release.wait(10), f"{name} held for ever"
        nth, code = self.fail.get(name, (0, 0))
        return code if nth == n else 0

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def _set_context(self, ctx: int | None) -> int:
        """Kept apart from ``calls``: each waiter or issuer thread makes its context current
        once as it starts, whenever that is."""
        self.contexts.append((threading.current_thread().name, ctx or 0))
        return 0

    def _wait(self, stream: int | None, event: int | None, flags: int) -> int:
        code = self._log("cuStreamWaitEvent", stream or 0, event or 0, flags)
        if not code and self.target is not None:
            self.target.stream_wait(stream or 0, event or 0)
        return code

    def _record(self, event: int | None, stream: int | None) -> int:
        code = self._log("cuEventRecord", event or 0, stream or 0)
        if not code and self.target is not None:
            self.target.record(event or 0, stream or 0)
        return code

    def _copy(self, dst: int, src: int, nbytes: int, stream: int | None) -> int:
        code = self._log("cuMemcpyAsync", dst, src, nbytes, stream or 0)
        if not code and self.target is not None:
            self.target.memcpy(dst, src, nbytes, stream or 0)
        return code

    def _batch(self, dst: int, src: int, sizes: int, n: int, attrs: int, idx: int, nattrs: int,
               stream: int | None) -> int:
        """Reads the tables now, as the driver does during the call."""
        copies = list(zip(_u64s(dst, n), _u64s(src, n), _u64s(sizes, n)))
        first = _u64s(idx, nattrs)
        code = self._log("cuMemcpyBatchAsync", copies, attrs or 0, first, stream or 0)
        if not code and self.target is not None:
            self.target.memcpy_batch_at(dst, src, sizes, n, stream or 0)
        return code

    def _pitched(self, n: int, ops: int, flags: int, stream: int | None) -> int:
        rows = [_u64s(ops + 112 * i, 14) for i in range(n)]
        code = self._log("cuMemcpy3DBatchAsync", rows, flags, stream or 0)
        if not code and self.target is not None and hasattr(self.target, "memcpy_pitched"):
            import numpy as np

            self.target.memcpy_pitched(np.array(rows, dtype=np.uint64), stream or 0)
        return code

    def _launch(self, function: int | None, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                shmem: int, stream: int | None, params: int | None, extra: int | None) -> int:
        pointers = (ctypes.c_void_p * PARAMS).from_address(params or 0)
        code = self._log("cuLaunchKernel", function or 0, (gx, gy, gz), (bx, by, bz), stream or 0,
                         extra or 0, list(pointers))
        if not code and self.target is not None:
            self.target.launch(function, (gx, gy, gz), bx, stream or 0, pointers)
        return code

    def _create(self, out: int | None, flags: int) -> int:
        self._next_event += 1
        code = self._log("cuEventCreate", flags)
        if not code:
            ctypes.c_void_p.from_address(out or 0).value = self._next_event
        return code

    def recorder(self, driver: Any, main: int, rescue: int) -> Recorder:
        """A ``Recorder`` that runs its programs through this table (and keeps it, and
        so its callbacks, alive: the table holds only their addresses)."""
        rec = Recorder(driver, self.table, main, rescue, translate)
        rec.fake = self  # type: ignore[attr-defined]
        return rec


class SemEvents:
    """Waiter fakes kept in C: ``cuEventCreate`` makes a semaphore (through a callback,
    on the arming thread), ``cuEventSynchronize`` is libc's ``sem_wait`` (on the waiter
    thread: no Python), ``complete`` posts one through a call that keeps the GIL."""

    SEM_BYTES = 64

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.pylibc = ctypes.PyDLL(None)  # its calls never drop the GIL
        self._init = libc.sem_init
        self._init.argtypes, self._init.restype = [P, INT, U], INT
        self.post = self.pylibc.sem_post
        self.post.argtypes, self.post.restype = [P], INT
        self.sem_wait_address = int(ctypes.cast(libc.sem_wait, ctypes.c_void_p).value or 0)
        self.sems: list[Any] = []
        self.records: list[tuple[int, int]] = []  # (event, stream) of every record, in order

    def create(self, out: int | None, flags: int) -> int:
        sem = ctypes.create_string_buffer(self.SEM_BYTES)
        if self._init(ctypes.addressof(sem), 0, 0) != 0:
            return 999
        self.sems.append(sem)
        ctypes.c_void_p.from_address(out or 0).value = ctypes.addressof(sem)
        return 0

    def record(self, event: int | None, stream: int | None) -> int:
        self.records.append((event or 0, stream or 0))
        return 0

    def complete(self, event: int) -> None:
        if self.post(event) != 0:
            raise OSError("sem_post failed")

    def table(self) -> FakeTable:
        """A table whose waiter calls are these (synchronize straight into libc)."""
        fake = FakeTable(extra={"cuEventCreate": self.create, "cuEventRecord": self.record})
        procs = list(fake.addresses)
        procs[ORDER.index("cuEventSynchronize")] = self.sem_wait_address
        procs[ORDER.index("cuCtxSetCurrent")] = 0  # the thread makes no call but waits
        fake.table = native.helper().Table(tuple(procs), 13000, ATTRS, 0)
        self.fake = fake  # the table holds only the callbacks' addresses: keep them alive
        return fake


def submit_paths() -> list[Any]:
    """The submit paths a test can run on here: "python", and "native" where built."""
    import pytest

    skip = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")
    return ["python", pytest.param("native", marks=skip)]


def native_enqueue(sim: Any, strategy: Any = None, recorder: Recorder | None = None) -> Any:
    """Without a strategy: a ``Recorder`` over ``sim`` whose programs run through a
    ``FakeTable`` forwarding to it. With one (built on that recorder): make each of its
    ``enqueue`` calls one native call, as ``CudaLane`` does (abort on a failure)."""
    if strategy is None:
        return FakeTable(target=sim).recorder(sim, 0, 0)
    assert recorder is not None
    recorder.bind(strategy.main_stream, sim.create_event())
    plain = strategy.enqueue

    def enqueue(*args: Any, **kwargs: Any) -> None:
        recorder.open()
        try:
            plain(*args, **kwargs)
        except BaseException:
            recorder.abort()
            raise
        recorder.commit()

    strategy.enqueue = enqueue
    return strategy


def until(cond: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Look at ``cond`` every 10 ms until it holds or ``seconds`` passed: whether it held."""
    for _ in range(int(seconds / 0.01)):
        if cond():
            return True
        threading.Event().wait(0.01)
    return cond()


def release_while_caller_in_driver(caller_in: Callable[[], bool], issuer_go: threading.Event,
                                   caller_go: threading.Event, issuer_calls: list[Any]
                                   ) -> tuple[threading.Thread, list[list[Any]]]:
    """A thread that, once the caller is inside its held driver call (``caller_in()``), lets
    the issuer's held call return, gives the issuer 0.2 s, keeps a copy of
    ``issuer_calls`` (what the issuer called meanwhile: nothing, if it gives way) and lets
    the caller's call return. Start it, make the caller's call, join it."""
    seen: list[list[Any]] = []

    def release() -> None:
        until(caller_in)
        issuer_go.set()
        threading.Event().wait(0.2)
        seen.append(list(issuer_calls))
        caller_go.set()

    return threading.Thread(target=release), seen
