"""Faults and misuse around the async face: done callbacks that raise (Exceptions, base
exceptions, a cancellation), polls that fail, calls from the wrong thread. Every future
still resolves, every drain still ends, and the worker keeps serving where it can."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    UsageError,
)
from aiokv.core import OffloadCore
from tests.conftest import copies_ending, make_layers

pytestmark = pytest.mark.anyio


async def test_submit_from_another_thread_is_refused() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        caught: list[BaseException] = []

        def other() -> None:
            try:
                worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            except BaseException as exc:
                caught.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(caught) == 1 and type(caught[0]) is UsageError
        assert "SyncOffloadingWorker" in str(caught[0])


async def test_aclose_from_another_thread_is_refused_and_the_worker_stays_whole() -> None:
    kv = make_layers(num_blocks=8)
    caught: list[BaseException] = []

    def close_elsewhere(worker: AsyncOffloadingWorker) -> None:
        try:
            anyio.run(worker.aclose)
        except BaseException as exc:
            caught.append(exc)

    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            thread = threading.Thread(target=close_elsewhere, args=(worker,))
            thread.start()
            await anyio.to_thread.run_sync(thread.join)
            assert len(caught) == 1 and type(caught[0]) is UsageError
            assert "event loop thread" in str(caught[0])
            assert (await fut).success  # still open: the refusal touched nothing
            assert (await worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))).success
    assert worker.closed
    thread = threading.Thread(target=close_elsewhere, args=(worker,))  # closed: returns at once
    thread.start()
    thread.join(10)
    assert len(caught) == 1


async def test_a_future_awaited_on_another_thread_says_so_instead_of_hanging() -> None:
    import asyncio

    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)

        async def wait_there() -> object:
            return await fut

        try:
            with pytest.raises(UsageError, match="another thread"):
                await anyio.to_thread.run_sync(lambda: asyncio.run(asyncio.wait_for(wait_there(), 5)))
        finally:
            latch.set()
        assert (await fut).success


async def test_a_raising_done_callback_costs_no_other_job_its_result(caplog) -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
            first.add_done_callback(lambda f: 1 / 0)
            second = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
            latch.set()  # both finish in one poll
            assert (await second).success and (await first).success
    assert "done callback of job 1 raised" in caplog.text


class _Escape(BaseException):
    """Not an Exception: a done callback raising it is not swallowed."""


async def test_a_callback_raising_a_base_exception_leaves_no_future_unresolved() -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    released: list[int] = []
    with anyio.fail_after(10):
        with pytest.raises(BaseException) as info:
            async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
                first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
                second = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))

                def escape(_f: object) -> None:
                    raise _Escape()

                first.add_done_callback(escape)
                first.add_done_callback(lambda f: released.append(f.job_id))  # e.g. freeing blocks
                latch.set()
                await anyio.sleep(5)  # the poller's failure cancels this
    escaped = info.value
    while getattr(escaped, "exceptions", None):  # unwrap (Base)ExceptionGroups (3.10: a backport)
        escaped = escaped.exceptions[0]  # type: ignore[attr-defined]
    assert isinstance(escaped, _Escape)
    assert first.done() and second.done() and second.result().success
    assert released == [1]  # the future's later callbacks ran before it was raised on


async def test_a_cancellation_raised_by_a_done_callback_cancels_nothing(caplog) -> None:
    """A callback that raises asyncio's CancelledError (say, it read a cancelled future) is
    logged like any failing callback: nobody cancelled the poller or the opener."""
    import asyncio

    kv = make_layers(num_blocks=8)
    ran: list[int] = []
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))

            def cancelled(_f: object) -> None:
                raise asyncio.CancelledError()

            fut.add_done_callback(cancelled)
            fut.add_done_callback(lambda f: ran.append(f.job_id))
            assert (await fut).success
            assert (await worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))).success
    assert ran == [1] and "done callback of job 1 raised" in caplog.text


async def test_a_logging_filter_that_raises_costs_no_callback_nor_the_poller() -> None:
    """A raising callback is logged; if the log call itself raises (a user's filter), the
    future's next callback still runs and the worker keeps serving."""
    import logging

    class Broken(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("filter bug")

    log = logging.getLogger("aiokv")
    broken = Broken()
    log.addFilter(broken)
    ran: list[int] = []
    try:
        kv = make_layers(num_blocks=8)
        with anyio.fail_after(10):
            async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
                fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
                fut.add_done_callback(lambda f: 1 / 0)
                fut.add_done_callback(lambda f: ran.append(f.job_id))
                assert (await fut).success
                later = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
                assert (await later).success
    finally:
        log.removeFilter(broken)
    assert ran == [1]


async def test_closing_does_not_wait_out_a_long_poll_interval() -> None:
    """The closing drain polls on its own, not on the doorbell: with poll_interval=5 it used
    to sleep 5 s after a job that ended within 50 ms."""
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    timer = threading.Timer(0.05, latch.set)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"poll_interval": 5.0}) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
        timer.start()
        t0 = time.monotonic()
    closing = time.monotonic() - t0  # the drain is shielded: a deadline could not cut it
    timer.join()
    assert fut.done() and fut.result().success
    assert closing < 2.5, f"closing took {closing:.2f} s after a job that ended within 50 ms"


async def test_a_callback_raising_in_the_closing_drain_still_lets_the_drain_finish(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    wait_ends = copies_ending(monkeypatch)
    with anyio.fail_after(10):
        worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
        async with worker:
            first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            second = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]), after=latch)

            def escape(_f: object) -> None:
                raise _Escape()

            first.add_done_callback(escape)
            # Only the drain pops jobs: job 1 in its first poll, job 2 in a later one.
            worker._poller._poll = lambda: 0  # type: ignore[union-attr]
            wait_ends(1)  # job 1 is over; the poller has not looked (no await since)
            release = threading.Timer(0.05, latch.set)
            release.start()
            with pytest.raises(_Escape):
                await worker.aclose()  # its drain pops job 1 first
    assert first.done() and second.done() and second.result().success


async def test_a_callback_raising_in_the_exit_drain_still_leaves_the_task_group(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    with anyio.fail_after(10):
        worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
        with pytest.raises(_Escape):
            async with worker:
                first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))

                def escape(_f: object) -> None:
                    raise _Escape()

                first.add_done_callback(escape)
                wait_ends(1)  # over, and no await since: the exit's drain pops it
        assert worker._task_group is None and first.done()
        with anyio.move_on_after(0.01) as scope:  # this task's cancel scopes still work
            await anyio.sleep(5)
        assert scope.cancelled_caught


async def test_a_failing_poll_ends_the_closing_drain_instead_of_hanging_it(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            wait_ends(1)
            real = OffloadCore.poll

            def poll_then_fail(self: OffloadCore) -> list:
                real(self)  # job 1 is popped from the core, then the poll fails
                raise _Escape()

            monkeypatch.setattr(OffloadCore, "poll", poll_then_fail)
            with pytest.raises(_Escape):
                await worker.aclose()  # shielded: a hang here could not even be cancelled
    assert not fut.done()  # lost to the failing poll, but nothing waits forever on aclose
