"""The lane issuer: work runs once, in submission order, never two at a time, inline only
when nothing is queued or running; errors of inline work reach the caller."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from aiokv.backends.cuda.issuer import Issuer
from aiokv.errors import WorkerClosed


class Recorder:
    """Records which work ran, on which thread, and how many ran at once."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.threads: list[str] = []
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        self.started = threading.Event()  # some work began

    def work(self, n: int, gate: threading.Event | None = None, nap: float = 0.0):
        def run() -> None:
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            self.started.set()
            time.sleep(nap)  # gives an overlapping run the time to show
            if gate is not None:
                assert gate.wait(10)
            with self.lock:
                self.order.append(n)
                self.threads.append(threading.current_thread().name)
                self.running -= 1
        return run


def test_idle_issuer_runs_work_on_the_caller() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    try:
        assert issuer.run(rec.work(1), defer=False) is True
        assert rec.order == [1] and rec.threads == [threading.current_thread().name]
        assert issuer.idle
    finally:
        issuer.close()


def test_work_behind_deferred_work_is_queued_in_order() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    gate = threading.Event()
    try:
        assert issuer.run(rec.work(0, gate), defer=True) is False
        assert rec.started.wait(10)  # held on the issuer's thread, nothing queued
        # Neither small (inline) nor large work may overtake the held job.
        ran_here = [issuer.run(rec.work(n), defer=n % 3 == 0) for n in range(1, 40)]
        assert not any(ran_here)
        assert not issuer.idle and rec.order == []
        gate.set()
        assert issuer.drain(10)
        assert rec.order == list(range(40))
        assert set(rec.threads) == {"test-issuer"}
        assert rec.most == 1
        # Drained: the next small job runs here again.
        assert issuer.run(rec.work(40), defer=False) is True
        assert rec.threads[-1] == threading.current_thread().name
    finally:
        issuer.close()


def test_callers_on_many_threads_never_overlap() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    per_thread = 200

    def submit(base: int) -> None:
        for i in range(per_thread):
            issuer.run(rec.work(base + i, nap=1e-4), defer=i % 2 == 0)

    threads = [threading.Thread(target=submit, args=(k * per_thread,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert issuer.drain(10)
    issuer.close()
    assert sorted(rec.order) == list(range(4 * per_thread))
    assert rec.most == 1
    for k in range(4):  # each caller's own work kept its order
        mine = [n for n in rec.order if k * per_thread <= n < (k + 1) * per_thread]
        assert mine == sorted(mine)


def test_inline_errors_reach_the_caller_and_deferred_ones_are_logged(caplog) -> None:
    issuer = Issuer("test-issuer")
    rec = Recorder()

    def boom() -> None:
        raise ValueError("inline failure")

    try:
        with pytest.raises(ValueError, match="inline failure"):
            issuer.run(boom, defer=False)
        assert issuer.idle  # the failure released the issuer
        with caplog.at_level(logging.ERROR, logger="aiokv"):
            issuer.run(boom, defer=True)
            issuer.run(rec.work(1), defer=True)
            assert issuer.drain(10)
        assert rec.order == [1], "the thread died with the failing work"
        assert any("issue work raised" in r.getMessage() for r in caplog.records)
    finally:
        issuer.close()


def test_close_runs_what_is_queued_then_refuses_work() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    gate = threading.Event()
    issuer.run(rec.work(0, gate), defer=True)
    for n in range(1, 5):
        issuer.run(rec.work(n), defer=True)
    threading.Timer(0.05, gate.set).start()
    issuer.close()
    assert rec.order == [0, 1, 2, 3, 4]
    with pytest.raises(WorkerClosed, match="closed"):
        issuer.run(rec.work(9), defer=False)


def test_drain_times_out_while_work_is_held() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    gate = threading.Event()
    try:
        issuer.run(rec.work(0, gate), defer=True)
        assert issuer.drain(0.05) is False
        gate.set()
        assert issuer.drain(10) is True
    finally:
        issuer.close()


def test_a_thread_that_cannot_start_queues_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start"):
            issuer.run(rec.work(1), defer=True)
    assert issuer.idle, "the refused work stayed queued"
    assert issuer.run(rec.work(2), defer=False) is True
    assert issuer.run(rec.work(3), defer=True) is False  # the thread starts now
    assert issuer.drain(10)
    issuer.close()
    assert rec.order == [2, 3]


def test_stop_returns_at_once_and_the_thread_ends_after_its_queue() -> None:
    rec, issuer = Recorder(), Issuer("test-issuer")
    gate = threading.Event()
    issuer.run(rec.work(0, gate), defer=True)
    issuer.run(rec.work(1), defer=True)
    assert rec.started.wait(10)
    thread = issuer._thread
    assert thread is not None
    issuer.stop()  # must not wait for the held work
    assert thread.is_alive()
    with pytest.raises(WorkerClosed):
        issuer.run(rec.work(2), defer=True)
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and rec.order == [0, 1]
