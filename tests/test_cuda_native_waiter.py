"""The native waiter thread (``_native.Waiter``) on fake events, no GPU: it rings the
doorbell without ever taking the GIL (proven while this thread holds the GIL throughout),
in the order rings were asked for, also when the wait fails; an event loop napping on the
bell wakes on its ring on asyncio, uvloop and trio with a busy pure-Python thread beside;
and close / abandon end the thread without losing or misdirecting a ring."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any

import anyio
import pytest

from aiokv.backends.cuda import native
from aiokv.backends.cuda.native import NativeWaiter
from aiokv.doorbell import Doorbell

from .native_fakes import FakeTable, SemEvents

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

STREAM = 0x77


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _poll_holding_the_gil(fd: int, timeout_ms: int) -> int:
    """libc ``poll`` through ``ctypes.PyDLL``: the GIL is never released while it waits."""
    poll = ctypes.PyDLL(None).poll
    poll.argtypes, poll.restype = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int], ctypes.c_int
    pfd = _PollFd(fd, 1, 0)  # POLLIN
    return int(poll(ctypes.addressof(pfd), 1, timeout_ms))


def _armed(sems: SemEvents, job_event: int) -> int:
    """The waiter event recorded for the latest ring (behind a wait on ``job_event``)."""
    event, stream = sems.records[-1]
    assert stream == STREAM
    return event


@pytest.fixture
def bell() -> Any:
    b = Doorbell()
    yield b
    b.close()


def test_the_ring_needs_no_gil(bell: Doorbell) -> None:
    """This thread completes the job's event and then waits for the bell without ever
    letting the GIL go (and with a switch interval far longer than the wait, so no drop is
    ever requested of it): the bell still becomes readable, so the waiter thread rang it
    without Python."""
    sems = SemEvents()
    fake = sems.table()
    waiter = NativeWaiter(fake.table, STREAM)
    try:
        assert waiter.watch(0xE1, bell.ring_fd()) == 0
        waits = [c for c in fake.calls if c[0] == "cuStreamWaitEvent"]
        assert waits == [("cuStreamWaitEvent", STREAM, 0xE1, 0)]
        slot = _armed(sems, 0xE1)
        assert _poll_holding_the_gil(bell.fileno(), 0) == 0, "rang before the event completed"
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            sems.complete(slot)
            ready = _poll_holding_the_gil(bell.fileno(), 10_000)
        finally:
            sys.setswitchinterval(old)
        assert ready == 1, "the waiter needed the GIL to ring"
        assert bell.drain() == 1
    finally:
        waiter.close()
    assert waiter.stats()["running"] is False


def test_rings_come_in_order_and_a_failed_wait_rings_too(bell: Doorbell) -> None:
    """A wait that returns an error (a sticky one, say) rings all the same, so the poller
    looks and finds the error; slots are reused once rung."""
    sems = SemEvents()
    fake = sems.table()
    waiter = NativeWaiter(fake.table, STREAM, slots=2)
    try:
        for job in (0xE1, 0xE2):
            assert waiter.watch(job, bell.ring_fd()) == 0
        first, second = (e for e, _ in sems.records)
        assert waiter.watch(0xE3, bell.ring_fd()) == -1, "no slot free: cannot arm"
        sems.complete(second)  # the later one ends first: its ring waits for the first's
        time.sleep(0.05)
        assert bell.drain() == 0
        sems.complete(first)
        _wait_rung(waiter, 2)
        assert bell.drain() == 2
        assert waiter.watch(0xE3, bell.ring_fd()) == 0 and sems.records[-1][0] in (first, second)
        sems.complete(sems.records[-1][0])
        _wait_rung(waiter, 3)
        assert bell.drain() == 1
    finally:
        waiter.close()
    failing = FakeTable()
    failing.fail["cuEventSynchronize"] = (1, 700)
    waiter = NativeWaiter(failing.table, STREAM)
    try:
        assert waiter.watch(0xE1, bell.ring_fd()) == 0
        _wait_rung(waiter, 1)
        stats = waiter.stats()
        assert stats["errors"] == 1 and stats["last_error"] == 700
        assert bell.drain() == 1
    finally:
        waiter.close()


def _wait_rung(waiter: NativeWaiter, n: int) -> None:
    deadline = time.monotonic() + 10
    while waiter.stats()["rung"] < n:
        assert time.monotonic() < deadline, waiter.stats()
        time.sleep(0.001)


def test_an_arm_the_driver_refuses_returns_its_code_and_arms_nothing(bell: Doorbell) -> None:
    fake = FakeTable()
    fake.fail["cuEventRecord"] = (1, 2)
    waiter = NativeWaiter(fake.table, STREAM)
    try:
        assert waiter.watch(0xE1, bell.ring_fd()) == 2
        assert waiter.stats()["armed"] == 0
        assert waiter.watch(0xE1, bell.ring_fd()) == 0  # the slot went back
        _wait_rung(waiter, 1)
    finally:
        waiter.close()
    with pytest.raises(Exception, match="null event"):
        waiter.watch(0, bell.ring_fd())


def test_close_waits_for_armed_rings_and_abandon_drops_them(bell: Doorbell) -> None:
    sems = SemEvents()
    waiter = NativeWaiter(sems.table().table, STREAM)
    assert waiter.watch(0xE1, bell.ring_fd()) == 0
    closer = threading.Thread(target=waiter.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive(), "close returned before the armed ring's event completed"
    sems.complete(sems.records[-1][0])
    closer.join(10)
    assert not closer.is_alive() and bell.drain() == 1
    assert waiter.watch(0xE2, bell.ring_fd()) == -1  # closed
    assert len(sems.records) == 1

    sems = SemEvents()
    fake = sems.table()
    waiter = NativeWaiter(fake.table, STREAM)
    assert waiter.watch(0xE1, bell.ring_fd()) == 0
    waiter.abandon()  # returns at once: a finalizer must not block on the device
    sems.complete(sems.records[-1][0])
    time.sleep(0.05)
    assert bell.drain() == 0, "an abandoned waiter must not ring a bell nobody owns any more"
    assert not any(c[0] == "cuEventDestroy" for c in fake.calls)  # its events may be in use


class _Busy:
    """A pure-Python thread that never lets the GIL go by itself."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self.stop.is_set():
            self.count += 1

    def __enter__(self) -> _Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_a_loop_napping_on_the_bell_wakes_on_the_waiters_ring(loop: str, bell: Doorbell) -> None:
    """The poller's nap (on the bell's descriptor, a 30 s backstop) ends on the ring the
    waiter thread writes when another thread completes the job's event, with a busy
    pure-Python thread in the process, on every loop the async face supports."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    from aiokv.poller import _BellNaps, _ReaderNaps

    sems = SemEvents()
    waiter = NativeWaiter(sems.table().table, STREAM)

    async def main() -> float:
        if loop == "trio":
            naps: Any = _BellNaps(bell)
        else:
            import asyncio

            naps = _ReaderNaps(bell, asyncio.get_running_loop())
            naps.start()
        assert waiter.watch(0xE1, bell.ring_fd()) == 0
        slot = sems.records[-1][0]
        threading.Timer(0.05, sems.complete, (slot,)).start()
        t0 = time.monotonic()
        try:
            await naps.nap(30.0)
        finally:
            naps.stop()
        return time.monotonic() - t0

    backend = "trio" if loop == "trio" else "asyncio"
    options = {"use_uvloop": True} if loop == "uvloop" else {}
    try:
        with _Busy() as busy:
            napped = anyio.run(main, backend=backend, backend_options=options)
        assert napped < 30.0, "the nap ran to its backstop: the ring never woke the loop"
        assert busy.count > 0
        assert waiter.stats()["rung"] == 1
    finally:
        waiter.close()


def test_a_closed_waiter_is_not_initialised_again() -> None:
    """``__init__`` on a closed waiter started a thread that nothing could stop any more
    (close, abandon and the finalizer all saw it closed): refused like a second init."""
    import os

    fake = FakeTable()
    waiter = native.helper().Waiter(fake.table, STREAM)
    with pytest.raises(RuntimeError, match="once"):
        waiter.__init__(fake.table, STREAM)
    waiter.close()
    threads = len(os.listdir("/proc/self/task"))
    with pytest.raises(RuntimeError, match="once"):
        waiter.__init__(fake.table, STREAM)
    assert len(os.listdir("/proc/self/task")) == threads, "a thread was started that nothing stops"
