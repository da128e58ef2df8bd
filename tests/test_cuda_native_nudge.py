"""The native issuer's nudge (``Issuer(nudge_us=...)``), on fake drivers (no GPU): as the
lane's waiter rings a job's end it wakes the issuer thread into a short spin, so a submit
made inside that window is picked up by the spinning thread with no futex wake-up (the
submit never signals it); an issuer without a nudge sleeps and is signalled; programs keep
their order; close and abandon end a spinning thread; a waiter that outlives its issuer
stops nudging it."""

from __future__ import annotations

import ctypes
import re
import threading
import time
from typing import Any

import pytest

from aiokv.backends.cuda import native
from aiokv.backends.cuda.lane import NATIVE_NUDGE_US
from aiokv.backends.cuda.native import NativeIssuer, NativeWaiter
from aiokv.doorbell import Doorbell
from aiokv.errors import InvalidSpec

from .native_fakes import ATTRS, ORDER, FakeTable, SemEvents
from .test_cuda_native_issuer import noop_table, records, submit
from .test_cuda_native_waiter import _wait_rung

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

WINDOW_US = 10_000.0  # the longest window: wide enough for a loaded machine's scheduling


def _asleep(issuer: NativeIssuer) -> None:
    """Let the thread finish what it ran and fall asleep (no spin after programs here)."""
    assert issuer.drain(10)
    time.sleep(0.03)


def _unsignalled_pickup(issuer: NativeIssuer, event: int, tries: int = 5) -> tuple[bool, list[Any]]:
    """Nudge a sleeping thread and submit soon after (once it had time to wake, well
    inside the window), up to ``tries`` times: whether one such submit was picked up by the
    spinning thread without signalling it, and the tickets."""
    tickets = []
    for i in range(tries):
        _asleep(issuer)
        before = issuer.stats()
        issuer.nudge()
        time.sleep(0.001)  # a submit racing the wake-up is found on waking, not by the spin
        ticket = submit(issuer, records(event + i))
        tickets.append(ticket)
        assert ticket.wait(10)
        after = issuer.stats()
        if after["signalled"] == before["signalled"] and after["spin_picked"] == before["spin_picked"] + 1:
            return True, tickets
    return False, tickets


def test_a_nudged_issuer_picks_up_a_submit_inside_its_window_unsignalled() -> None:
    fake = FakeTable()
    issuer = NativeIssuer(fake.table, spin_us=0.0, nudge_us=WINDOW_US)
    try:
        picked, tickets = _unsignalled_pickup(issuer, 0xE0)
        assert picked, issuer.stats()
        assert issuer.stats()["nudges"] == len(tickets)
        assert [t.result() for t in tickets] == [(1, 0, 0, True)] * len(tickets)
        assert [c[1] for c in fake.calls] == [0xE0 + i for i in range(len(tickets))]
        assert {name for name, _ in fake.threads} != {threading.current_thread().name}
        assert issuer.stats()["spin_seconds"] > 0
    finally:
        assert issuer.close()


def test_a_submit_racing_the_nudged_threads_wake_up_does_not_signal_it_again() -> None:
    """The nudge woke the sleeping thread already: a submit made before the thread has its
    lock back (the loop's, right after the ring) must not pay for a second signal."""
    issuer = NativeIssuer(noop_table(), spin_us=0.0, nudge_us=WINDOW_US)
    try:
        for i in range(20):
            _asleep(issuer)
            before = issuer.stats()["signalled"]
            issuer.nudge()
            ticket = submit(issuer, records(0xE0 + i))  # at once: mostly before the thread woke
            assert ticket.wait(10) and ticket.result() == (1, 0, 0, True)
            assert issuer.stats()["signalled"] == before, i
    finally:
        assert issuer.close()


def test_an_issuer_without_a_nudge_sleeps_and_is_signalled() -> None:
    fake = FakeTable()
    issuer = NativeIssuer(fake.table, spin_us=0.0, nudge_us=0.0)
    try:
        picked, tickets = _unsignalled_pickup(issuer, 0xE0, tries=3)
        assert not picked
        stats = issuer.stats()
        assert stats["nudges"] == 0 and stats["spin_picked"] == 0 and stats["signalled"] == 3
        assert stats["spin_seconds"] == 0.0
        assert [t.result() for t in tickets] == [(1, 0, 0, True)] * 3
        assert [c[1] for c in fake.calls] == [0xE0, 0xE1, 0xE2]
    finally:
        assert issuer.close()


def test_programs_submitted_in_a_window_run_in_order_and_after_a_paused_queue() -> None:
    """Programs queued behind a pause, then more inside a nudge's window: one order."""
    fake = FakeTable()
    issuer = NativeIssuer(fake.table, spin_us=0.0, nudge_us=WINDOW_US)
    try:
        issuer.pause()
        first = [submit(issuer, records(0xE0 + j)) for j in range(3)]
        issuer.nudge()  # paused: taken for nothing
        assert issuer.stats()["nudges"] == 0
        issuer.resume()
        issuer.nudge()
        later = [submit(issuer, records(0xE3 + j, 0xF3 + j)) for j in range(4)]
        assert all(t.wait(10) for t in first + later)
        pairs = [e for j in range(4) for e in (0xE3 + j, 0xF3 + j)]
        assert [c[1] for c in fake.calls] == [0xE0, 0xE1, 0xE2] + pairs
        started = [t.started_at for t in first + later]
        assert started == sorted(started)
    finally:
        assert issuer.close()


@pytest.mark.parametrize("how", ["close", "abandon"])
def test_a_spinning_thread_ends_at_close_or_abandon(how: str) -> None:
    issuer = NativeIssuer(noop_table(), spin_us=0.0, nudge_us=WINDOW_US)
    ticket = submit(issuer, records(0xE0))
    assert ticket.wait(10)
    issuer.nudge()
    if how == "close":
        assert issuer.close() is True
        assert issuer.stats() == {"running": False}
    else:
        issuer.abandon()
    with pytest.raises(Exception, match="closed"):
        issuer.nudge()


def test_nudge_windows_are_bounded() -> None:
    for bad, shown in ((-1.0, "-1.0"), (10_001.0, "10001.0"), (float("nan"), "nan"), (-0.5, "-0.5"),
                       (10_000.5, "10000.5"), (1e300, "1e+300")):
        for name in ("nudge_us", "spin_us"):
            with pytest.raises(InvalidSpec, match=rf"^{name} must be 0-10000, got {re.escape(shown)}$"):
                NativeIssuer(noop_table(), **{name: bad})
    assert 0 < NATIVE_NUDGE_US <= 1000  # a lane's default: a few hundred microseconds


def _sem_waiter() -> tuple[SemEvents, NativeWaiter]:
    sems = SemEvents()
    waiter_table = sems.table()
    fakes = native.helper().FAKES
    procs = [fakes["noop"]] * len(ORDER)
    procs[ORDER.index("cuEventCreate")] = int(waiter_table.addresses[ORDER.index("cuEventCreate")])
    procs[ORDER.index("cuEventSynchronize")] = sems.sem_wait_address
    table = native.helper().Table(tuple(procs), 13000, ATTRS, 0)
    return sems, NativeWaiter(table, 0x77)


def _ring_once(sems: SemEvents, waiter: NativeWaiter, bell: Doorbell, n: int) -> None:
    assert waiter.watch(0xE9, bell.ring_fd()) == 0
    sems.complete(ctypes.addressof(sems.sems[0]))
    _wait_rung(waiter, n)
    assert bell.drain() == 1


def test_the_waiter_nudges_its_issuer_as_it_rings_a_jobs_end() -> None:
    sems, waiter = _sem_waiter()
    bell = Doorbell()
    issuer = NativeIssuer(noop_table(), waiter, spin_us=0.0, nudge_us=WINDOW_US)
    try:
        _ring_once(sems, waiter, bell, 1)
        assert waiter.stats()["nudged"] == 1
        deadline = time.monotonic() + 10
        while issuer.stats()["nudges"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        ticket = submit(issuer, records(0xE0))
        assert ticket.wait(10) and ticket.result() == (1, 0, 0, True)
    finally:
        assert issuer.close()
        waiter.close()
        bell.close()


def test_a_waiter_does_not_nudge_an_issuer_without_a_window_nor_one_freed() -> None:
    sems, waiter = _sem_waiter()
    bell = Doorbell()
    try:
        quiet = NativeIssuer(noop_table(), waiter, nudge_us=0.0)
        _ring_once(sems, waiter, bell, 1)
        assert waiter.stats()["nudged"] == 0 and quiet.stats()["nudges"] == 0
        assert quiet.close()
        nudged = NativeIssuer(noop_table(), waiter, nudge_us=WINDOW_US)
        _ring_once(sems, waiter, bell, 2)
        assert waiter.stats()["nudged"] == 1
        assert nudged.close()
        del nudged  # freed: the waiter must not reach it any more
        _ring_once(sems, waiter, bell, 3)
        assert waiter.stats()["nudged"] == 1 and waiter.stats()["rung"] == 3
    finally:
        waiter.close()
        bell.close()


def test_a_pickup_lag_leaves_out_the_wait_behind_the_program_before() -> None:
    """The first program blocks inside the driver while a second queues behind it: the
    second's lag counts that wait, its pickup lag starts at the first's end."""
    gate = threading.Event()

    def record(event: int | None, stream: int | None) -> int:
        if event == 0xE0:
            gate.wait(10)
        return 0

    fake = FakeTable(extra={"cuEventRecord": record})
    issuer = NativeIssuer(fake.table)
    try:
        first = submit(issuer, records(0xE0))
        assert first.wait_rows(0, 10)
        deadline = time.monotonic() + 10
        while first.started_at is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        second = submit(issuer, records(0xE1))
        time.sleep(0.01)
        gate.set()
        assert first.wait(10) and second.wait(10)
        lags, pickups = issuer.lags(), issuer.lags(pickup=True)
        assert len(lags) == len(pickups) == 2
        # The helper's own object takes it by keyword too, as its docstring (and
        # docs/native.md) spell it.
        assert issuer._issuer.lags(pickup=True) == pickups
        assert issuer._issuer.lags(False) == issuer._issuer.lags(pickup=False) == lags
        assert lags[1] == pytest.approx(second.started_at - second.queued_at)
        assert pickups[1] == pytest.approx(second.started_at - first.finished_at)
        assert 0 <= pickups[1] < lags[1]
        assert pickups[0] == pytest.approx(lags[0])
    finally:
        gate.set()
        issuer.close()


def test_the_bench_reads_pickups_and_nudges_of_a_native_worker() -> None:
    """``cuda_wakeup._pickups`` on a worker whose driver calls are C no-ops, and the
    no-GPU wake-up bench: each ring nudges the issuer (none without a window)."""
    from aiokv import CPULoadStoreSpec, GPULoadStoreSpec, SyncOffloadingWorker
    from aiokv.bench.cuda_wakeup import _pickups
    from aiokv.bench.hostside import noop_cuda, tiny_kv
    from aiokv.bench.hostside_wakeup import issuer_lags

    with noop_cuda():
        w = SyncOffloadingWorker(tiny_kv(), num_cpu_chunks=64, backend="cuda", options={"native": True})
        try:
            for i in range(4):
                w.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i + 3]))
            w.wait(range(4))
            pickups, spun, issued = _pickups(w)
            assert all(lag > 0 for lag in pickups) and 0 <= spun <= issued
        finally:
            w.shutdown()
    lags, stats = issuer_lags(300.0, jobs=5, transfer_s=1e-3)
    assert len(lags) == 4 and stats["nudges"] == 5
    lags, stats = issuer_lags(0.0, jobs=3, transfer_s=1e-3)
    assert len(lags) == 2 and stats["nudges"] == 0 and stats["spin_picked"] <= 3
