"""The native issuer thread (``_native.Issuer``) and its tickets, on fake drivers (no GPU):
programs run in submission order from C memory (the caller may rewrite its arrays once
``submit`` returned); ``rows_done`` / ``wait_rows`` / ``result`` say how far a program got;
a failing row stops its program and records its end behind what it enqueued; a sticky code
fails every later program uncalled; close issues what is queued within a bound and joins
the thread; and neither the thread's calls nor the doorbell it arms for an await that began
before the issue ever need the GIL (proven while this thread holds it throughout)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.backends.cuda import native
from aiokv.backends.cuda.native import NativeIssuer, NativeWaiter
from aiokv.backends.cuda.program import OP_RECORD, Program
from aiokv.doorbell import Doorbell
from aiokv.errors import InvalidSpec, WorkerClosed

from .native_fakes import ATTRS, ORDER, FakeTable, SemEvents, release_while_caller_in_driver, until
from .test_cuda_native_waiter import _poll_holding_the_gil, _wait_rung

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

MAIN, SIDE, RESCUE, END = 0x100, 0x200, 0x300, 0x3E0
U64 = np.uint64


def records(*events: int, stream: int = MAIN) -> Program:
    p = Program()
    for e in events:
        p.record(e, stream)
    return p


def submit(issuer: NativeIssuer, p: Program, end: int = END, run_here: bool = False) -> Any:
    return issuer.submit(p.words, tuple(p.buffers), MAIN, RESCUE, end, run_here)


def noop_table() -> Any:
    """A table whose every entry point is a C function that does nothing: no call of it
    can take the GIL."""
    fakes = native.helper().FAKES
    procs = [fakes["noop"]] * len(ORDER)
    procs[ORDER.index("cuEventCreate")] = fakes["event_create"]
    return native.helper().Table(tuple(procs), 13000, ATTRS, 0)


def test_programs_run_in_order_from_c_memory() -> None:
    """Three programs queued behind a pause: their batch tables are rewritten after
    ``submit`` returned, and the calls still read what they held at submit."""
    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    try:
        issuer.pause()
        arrays, tickets = [], []
        for j in range(3):
            dst, src = np.arange(4, dtype=U64) + 100 * j, np.arange(4, dtype=U64) + 1000 * j
            sizes = np.full(4, 64 + j, dtype=U64)
            p = records(0xE0 + j)
            p.batch(dst, src, sizes, SIDE, 1, 4)
            tickets.append(submit(issuer, p))
            arrays.append((dst, src, sizes))
        for dst, src, sizes in arrays:
            dst[:] = src[:] = sizes[:] = 7  # the caller reuses its arrays at once
        assert fake.calls == [] and not any(t.issued for t in tickets)
        assert [t.rows_done for t in tickets] == [0, 0, 0] and tickets[0].result() is None
        issuer.resume()
        assert all(t.wait(10) for t in tickets)
        assert [t.result() for t in tickets] == [(2, 0, 0, True)] * 3
        batches = [c for c in fake.calls if c[0] == "cuMemcpyBatchAsync"]
        assert [c[1] for c in batches] == [
            [(100 * j + i, 1000 * j + i, 64 + j) for i in range(4)] for j in range(3)]
        assert [c[1] for c in fake.calls if c[0] == "cuEventRecord"] == [0xE0, 0xE1, 0xE2]
        assert {name for name, _ in fake.threads} != {threading.current_thread().name}
        started = [t.started_at for t in tickets]
        assert started == sorted(started) and all(t.queued_at <= t.started_at for t in tickets)
    finally:
        assert issuer.close()
    assert issuer.stats() == {"running": False}


def test_rows_done_and_wait_rows_follow_the_thread() -> None:
    """A row that blocks inside the driver: ``rows_done`` says how far the thread got,
    ``wait_rows`` waits for a row count (False on timeout), ``result`` waits for the end."""
    gate = threading.Event()

    def record(event: int | None, stream: int | None) -> int:
        if event == 0xE5:
            gate.wait(10)
        return 0

    fake = FakeTable(extra={"cuEventRecord": record})
    issuer = NativeIssuer(fake.table)
    try:
        t = submit(issuer, records(*range(0xE0, 0xEA)))
        assert t.rows == 10
        assert t.wait_rows(5, 10) and t.rows_done == 5
        assert not t.wait_rows(6, 0.05) and t.rows_done == 5 and not t.issued
        assert t.result() is None and not t.wait(0.01)
        gate.set()
        assert t.wait_rows(10, 10) and t.wait(10) and t.result() == (10, 0, 0, True)
    finally:
        gate.set()
        issuer.close()


def test_a_ticket_stamps_each_row_as_its_call_returns_when_asked() -> None:
    """``stamps``: one CLOCK_MONOTONIC time a row run (``time.perf_counter``'s clock), in
    order, between the program's start and end; only the rows run so far; None unasked."""
    gate = threading.Event()

    def record(event: int | None, stream: int | None) -> int:
        if event == 0xE3:
            gate.wait(10)
        return 0

    fake = FakeTable(extra={"cuEventRecord": record})
    issuer = NativeIssuer(fake.table)
    try:
        before = time.perf_counter()
        p = records(*range(0xE0, 0xE6))
        t = issuer.submit(p.words, (), MAIN, RESCUE, END, False, True)
        assert t.wait_rows(3, 10)
        time.sleep(0.02)
        partial = t.stamps()
        assert partial is not None and len(partial) == t.rows_done == 3
        gate.set()
        assert t.wait(10)
        stamps = t.stamps()
        assert len(stamps) == 6 and list(stamps) == sorted(stamps) and stamps[:3] == partial
        assert before <= t.started_at <= stamps[0] and stamps[-1] <= t.finished_at <= time.perf_counter()
        assert stamps[3] - stamps[2] >= 0.015  # row 3's call held until the gate opened
        plain = submit(issuer, records(0xE7))
        assert plain.wait(10) and plain.stamps() is None
    finally:
        gate.set()
        issuer.close()


def test_a_pitched_row_reads_its_ops_from_its_first_one() -> None:
    """A PITCHED row's word 4 is the first op of the buffer it passes: a layerwise load's
    layers share one table of packed ops."""
    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    try:
        ops = np.arange(5 * 14, dtype=U64).reshape(5, 14)
        words = [5, SIDE, 0, 2, 3, 0, 0, 0, 5, SIDE, 0, 1, 0, 0, 0, 0]  # ops 3-4, then op 0
        t = issuer.submit(words, (ops,), MAIN, RESCUE, END, False)
        assert t.wait(10) and t.result() == (2, 0, 0, True)
        calls = [c[1] for c in fake.calls if c[0] == "cuMemcpy3DBatchAsync"]
        assert calls == [ops[3:5].tolist(), ops[:1].tolist()]
        with pytest.raises(InvalidSpec, match="pitched ops"):  # ops 4-5 of five: past the end
            issuer.submit([5, SIDE, 0, 2, 4, 0, 0, 0], (ops,), MAIN, RESCUE, END, False)
    finally:
        issuer.close()


def test_a_failing_row_stops_its_program_and_records_its_end_behind_it() -> None:
    fake = FakeTable()
    fake.fail["cuMemcpyAsync"] = (1, 2)
    issuer = NativeIssuer(fake.table)
    try:
        p = records(0xE0)
        p.wait(SIDE, 0xE0)
        p.copy(0xD0, 0xD1, 64, SIDE)
        p.record(0xE1, MAIN)
        t = submit(issuer, p)
        assert t.wait(10) and t.result() == (2, 2, 4, True)  # opcode 4: COPY
        assert not t.wait_rows(4, 0)  # it ended short of them
        assert fake.calls[3:] == [("cuEventRecord", RESCUE, SIDE), ("cuStreamWaitEvent", MAIN, RESCUE, 0),
                                  ("cuEventRecord", END, MAIN)]
        assert issuer.stats()["failed"] == 1
    finally:
        issuer.close()


def test_a_sticky_code_fails_every_later_program_without_a_call() -> None:
    fake = FakeTable()
    fake.fail["cuEventRecord"] = (2, 700)
    issuer = NativeIssuer(fake.table, sticky=(700,))
    try:
        issuer.pause()
        tickets = [submit(issuer, records(0xE0 + 2 * j, 0xE1 + 2 * j)) for j in range(3)]
        issuer.resume()
        assert all(t.wait(10) for t in tickets)
        assert [t.result()[:2] for t in tickets] == [(1, 700), (0, 700), (0, 700)]
        events = [c[1] for c in fake.calls if c[0] == "cuEventRecord"]
        assert events[:2] == [0xE0, 0xE1] and 0xE2 not in events, "a program ran after the sticky code"
        assert issuer.stats()["broken"] == 700
    finally:
        issuer.close()


def test_close_issues_what_is_queued_within_a_bound_then_cancels_the_rest() -> None:
    """Driver calls that take 20 ms each and 200 programs queued: close gives them 0.2 s,
    cancels what is left (nothing of it runs: CANCELLED, ``end_recorded`` False) and joins
    the thread well within a second more."""
    made: list[int] = []
    fake = FakeTable(extra={"cuEventRecord": lambda e, s: made.append(e or 0) or time.sleep(0.02) or 0})
    issuer = NativeIssuer(fake.table)
    issuer.pause()
    tickets = [submit(issuer, records(0xE0 + j)) for j in range(200)]
    t0 = time.monotonic()
    assert issuer.close(0.2) is True
    assert time.monotonic() - t0 < 1.5
    results = [t.result() for t in tickets]
    assert None not in results
    ran = [r for r in results if r[1] == 0]
    cancelled = [r for r in results if r[1] == issuer.cancelled]
    assert ran and cancelled and len(ran) + len(cancelled) == 200
    assert results[: len(ran)] == ran, "programs ran out of order"
    assert all(r == (0, issuer.cancelled, 0, False) for r in cancelled)
    assert made == [0xE0 + j for j in range(len(ran))]
    with pytest.raises(WorkerClosed):
        submit(issuer, records(0xEF))


def test_bad_rows_raise_at_submit_and_queue_nothing() -> None:
    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    try:
        p = records(0xE0)
        p.words += [OP_RECORD, 0, MAIN, 0, 0, 0, 0, 0]  # a null event
        with pytest.raises(InvalidSpec, match="null event"):
            submit(issuer, p)
        with pytest.raises(InvalidSpec, match="rows of 8"):
            issuer.submit([OP_RECORD, 1], (), MAIN, RESCUE, END)
        with pytest.raises(InvalidSpec, match="rescue"):
            issuer.submit(records(0xE0).words, (), MAIN, 0, END)
        assert issuer.drain(1) and fake.calls == [] and issuer.stats()["issued"] == 0
    finally:
        issuer.close()


def test_a_tiny_program_runs_at_submit_only_on_an_idle_issuer() -> None:
    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    try:
        here = submit(issuer, records(0xE0), run_here=True)
        assert here.inline and here.issued and here.result() == (1, 0, 0, True)
        assert fake.threads == [(threading.current_thread().name, "cuEventRecord")]
        assert here.ring_fd(1) is False  # issued: whoever asks arms the ring itself
        issuer.pause()
        queued = submit(issuer, records(0xE1))
        behind = submit(issuer, records(0xE2), run_here=True)  # not idle: it queues, in order
        assert not behind.inline and not behind.issued
        issuer.resume()
        assert queued.wait(10) and behind.wait(10)
        assert [c[1] for c in fake.calls] == [0xE0, 0xE1, 0xE2]
        assert issuer.stats()["inline"] == 1 and issuer.lags()[0] == 0.0
    finally:
        issuer.close()


def test_another_lanes_issuer_holds_its_next_call_while_a_program_runs_at_submit() -> None:
    """A tiny program run on the caller's thread is on the latency path as its dependency
    record is: while the caller is in the driver for it, another lane's issuer thread,
    mid-program, makes no call; it goes on once the caller's call returned."""
    fake_a, fake_b = FakeTable(), FakeTable()
    a, b = NativeIssuer(fake_a.table), NativeIssuer(fake_b.table)
    a_go, b_go = threading.Event(), threading.Event()
    try:
        fake_a.hold["cuEventRecord"] = (1, a_go)  # lane a's thread, at its program's first row
        first = submit(a, records(0xA1, 0xA2, 0xA3))
        until(lambda: bool(fake_a.calls))
        assert fake_a.calls == [("cuEventRecord", 0xA1, MAIN)], "lane a's thread never reached its row"
        fake_b.hold["cuEventRecord"] = (1, b_go)  # the caller, inside lane b's program
        helper, seen = release_while_caller_in_driver(lambda: bool(fake_b.calls), a_go, b_go, fake_a.calls)
        helper.start()
        here = submit(b, records(0xB1), run_here=True)
        helper.join(10)
        assert here.inline and first.wait(10)
        assert seen == [[("cuEventRecord", 0xA1, MAIN)]], f"lane a's thread called {seen} meanwhile"
        assert [c[1] for c in fake_a.calls] == [0xA1, 0xA2, 0xA3], "lane a's thread never went on"
    finally:
        a_go.set()
        b_go.set()
        a.close()
        b.close()


def test_the_thread_issues_and_arms_the_doorbell_without_the_gil() -> None:
    """An await that began before the issue: the doorbell is asked of the ticket while the
    program is queued. Then this thread holds the GIL throughout (a switch interval far
    longer than the test) while the issuer thread runs the program and arms the ring
    through the waiter, the job's event completes, and the waiter rings: the bell becomes
    readable, so no native thread needed Python."""
    sems = SemEvents()
    waiter_table = sems.table()  # create: a Python callback (used once, below); sync: sem_wait
    fakes = native.helper().FAKES
    procs = [fakes["noop"]] * len(ORDER)
    procs[ORDER.index("cuEventCreate")] = int(waiter_table.addresses[ORDER.index("cuEventCreate")])
    procs[ORDER.index("cuEventSynchronize")] = sems.sem_wait_address
    table = native.helper().Table(tuple(procs), 13000, ATTRS, 0)
    bell = Doorbell()
    waiter = NativeWaiter(table, 0x77)
    issuer = NativeIssuer(noop_table(), waiter)
    try:
        # The waiter's one slot (a semaphore) is made now, by a ring armed from here.
        assert waiter.watch(0xE9, bell.ring_fd()) == 0
        assert len(sems.sems) == 1
        slot = ctypes.addressof(sems.sems[0])
        sems.complete(slot)
        _wait_rung(waiter, 1)
        assert bell.drain() == 1
        issuer.pause()
        ticket = submit(issuer, records(*range(0xE0, 0xE8)))
        assert ticket.ring_fd(bell.ring_fd()) is True
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            issuer.resume()
            deadline = time.monotonic() + 10
            while not ticket.issued and time.monotonic() < deadline:
                pass  # pure Python: this thread never lets the GIL go
            issued = ticket.issued
            while waiter.stats()["armed"] < 2 and time.monotonic() < deadline:
                pass
            sems.complete(slot)
            ready = _poll_holding_the_gil(bell.fileno(), 10_000)
        finally:
            sys.setswitchinterval(old)
        assert issued, "the issuer thread needed the GIL to issue"
        assert ready == 1, "the doorbell armed by the issuer thread did not ring without the GIL"
        assert bell.drain() == 1 and ticket.result() == (8, 0, 0, True)
    finally:
        issuer.close()
        waiter.close()
        bell.close()


# -- the worker: an await that began before the issue still wakes ----------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_awaited_job_wakes_when_issued_late(backend: str) -> None:
    """The twin of the GPU suite's test of that name, on a CUDA worker whose driver calls
    are C no-ops: the poller naps on the doorbell while the job's program waits for the
    lane's issuer; the bell it asked for then is armed by the issuer thread once issued."""
    import torch

    from aiokv import CanonicalKVCaches
    from aiokv.bench.hostside import noop_cuda

    kv = CanonicalKVCaches.from_tensors([torch.zeros(16, 4096, dtype=torch.uint8)])

    async def main() -> None:
        with noop_cuda():
            w = AsyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", options={"native": True})
        async with w:
            lane = next(h.lane for d, h in w._core.handlers.items() if d.to_host)
            assert lane.native is not None and lane.waiter is not None
            w._core.backend.driver.ring_after = None  # the host-function ring must not be used
            lane.native.pause()
            fut = w.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([6]))
            await anyio.sleep(0.05)  # long enough for the poller to nap on the doorbell
            assert not fut.done() and lane.waiter.stats()["armed"] == 0
            lane.native.resume()
            with anyio.fail_after(10):
                res = await fut
            assert res.success
            armed = lane.waiter.stats()["armed"]
            assert armed >= 1, "the doorbell asked for before the issue was never armed"

    anyio.run(main, backend=backend)


def test_a_page_table_slot_is_not_reused_while_a_queued_program_copies_out_of_it() -> None:
    """``PieceKernel.upload`` reuses a pinned table slot once its copy to the device is over
    (its event done); on a native lane the copy is a row of a program that may still be
    queued, and an event never recorded reads as done, so the slot waits for the issue."""
    from types import SimpleNamespace

    from aiokv.backends.cuda.pieces import _TableSlot

    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    driver = SimpleNamespace(query=lambda event: True)  # the event reads as done throughout
    try:
        issuer.pause()
        program = records(0xE0)
        slot = _TableSlot(None, None, 0xE0, program)  # type: ignore[arg-type]
        assert slot.free(driver), "a program never submitted holds nothing"
        program.ticket = submit(issuer, program)
        assert not slot.free(driver), "reused while the copy out of it is still queued"
        issuer.resume()
        assert program.ticket.wait(10) and slot.free(driver)
    finally:
        issuer.close()


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("call", ["wait", "wait_rows", "drain"])
def test_a_wait_with_no_timeout_is_interrupted_by_a_signal(call: str) -> None:
    """Ctrl-C (or a test's timeout) must reach a thread blocked on a program that never
    issues: the wait runs the signal's handler, which raises, while the program is still
    queued. A watchdog resumes the issuer after a while, so a wait deaf to signals fails
    this test (the exception only comes once the program has run) instead of hanging it."""
    import signal

    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    issuer.pause()
    ticket = submit(issuer, records(0xE0, 0xE1))
    main = threading.main_thread().ident
    assert threading.get_ident() == main  # handlers run on the main thread only

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGUSR1, interrupt)
    kill = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGUSR1))
    watchdog = threading.Timer(5.0, issuer.resume)
    kill.start()
    watchdog.start()
    issued_then = None
    try:
        with pytest.raises(_Interrupted):
            try:
                if call == "wait":
                    ticket.wait()
                elif call == "wait_rows":
                    ticket.wait_rows(2)
                else:
                    issuer.drain()
            finally:
                issued_then = ticket.issued
    finally:
        signal.signal(signal.SIGUSR1, old)
        kill.cancel()
        watchdog.cancel()
        issuer.resume()
        assert ticket.wait(10)
        issuer.close()
    assert issued_then is False, "the wait ignored the signal until its program had run"
