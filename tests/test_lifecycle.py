"""The worker's states, driven directly: new -> open -> closing -> closed, once each, from
any thread, and what each refusal says."""

from __future__ import annotations

import threading

import pytest

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.errors import UsageError, WorkerClosed
from aiokv.lifecycle import Lifecycle, State
from tests.conftest import make_layers


def test_a_lifecycle_goes_new_open_closing_closed() -> None:
    life = Lifecycle()
    assert life.state is State.NEW and not life.closed.is_set()
    life.open()
    assert life.state is State.OPEN
    life.check_open()  # takes work: no refusal
    assert life.begin_close() is State.OPEN  # this caller drains
    assert life.state is State.CLOSING and not life.closed.is_set()
    life.finish_close()
    assert life.state is State.CLOSED and life.closed.is_set()


def test_a_lifecycle_never_opened_closes_at_once() -> None:
    life = Lifecycle()
    assert life.begin_close() is State.NEW  # nothing ever ran: the caller frees at once
    life.finish_close()
    assert life.state is State.CLOSED


def test_each_refusal_says_why_and_is_typed() -> None:
    life = Lifecycle()
    with pytest.raises(WorkerClosed, match=r"not open yet: use `async with worker:`"):
        life.check_open()
    life.open()
    with pytest.raises(UsageError, match="already open; enter it once") as twice:
        life.open()
    assert not isinstance(twice.value, WorkerClosed)  # the worker is fine: a misuse
    life.begin_close()
    with pytest.raises(WorkerClosed, match=r"closed \(its jobs in flight are draining\)"):
        life.check_open()
    with pytest.raises(WorkerClosed, match="draining"):
        life.open()
    life.finish_close()
    with pytest.raises(WorkerClosed, match="closed; create a new one") as closed:
        life.check_open()
    with pytest.raises(WorkerClosed, match="closed; create a new one"):
        life.open()
    assert "draining" not in str(closed.value)


def test_closing_twice_tells_the_second_closer_it_is_not_its_drain() -> None:
    life = Lifecycle()
    life.open()
    assert life.begin_close() is State.OPEN
    assert life.begin_close() is State.CLOSING  # another caller has it: wait for `closed`
    life.finish_close()
    assert life.begin_close() is State.CLOSED  # closed already: nothing to do
    assert life.state is State.CLOSED


def test_of_many_threads_closing_at_once_exactly_one_drains_and_the_rest_can_wait() -> None:
    life = Lifecycle()
    life.open()
    start = threading.Barrier(8)
    found: list[State] = []
    lock = threading.Lock()
    waited: list[bool] = []

    def close() -> None:
        start.wait()
        before = life.begin_close()
        with lock:
            found.append(before)
        if before is State.OPEN:
            life.finish_close()  # the drainer, after its drain
        else:
            waited.append(life.closed.wait(10))  # the others wait for it

    threads = [threading.Thread(target=close) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert found.count(State.OPEN) == 1
    assert all(s in (State.CLOSING, State.CLOSED) for s in found if s is not State.OPEN)
    assert waited == [True] * 7 and life.state is State.CLOSED


def test_closing_from_another_thread_refuses_the_opener_at_once() -> None:
    life = Lifecycle()
    life.open()
    closer = threading.Thread(target=life.begin_close)
    closer.start()
    closer.join(10)
    with pytest.raises(WorkerClosed):
        life.check_open()
    assert not life.closed.is_set()  # closing, not closed: the drain is the closer's


@pytest.mark.anyio
async def test_closed_and_unopened_workers_refuse_work() -> None:
    kv = make_layers(num_blocks=8)
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    with pytest.raises(WorkerClosed, match="not open yet"):
        worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    async with worker:
        pass
    with pytest.raises(WorkerClosed, match="closed"):
        worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    with pytest.raises(WorkerClosed):
        async with worker:
            pass


@pytest.mark.anyio
async def test_entering_twice_is_an_error() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(UsageError, match="already open; enter it once"):
            await worker.__aenter__()
        assert (await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))).success
