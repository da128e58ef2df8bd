"""Cancelling a wait never cancels a copy; closing drains what is in flight."""

from __future__ import annotations

import random
import threading

import anyio
import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec, WorkerClosed
from tests.conftest import make_layers

pytestmark = pytest.mark.anyio


def release_later(latch: threading.Event, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, latch.set)
    timer.start()
    return timer


async def test_cancellation_storm_loses_no_job_and_no_byte() -> None:
    kv = make_layers(num_layers=2, num_blocks=128, page_shape=(2, 2, 8))
    want = [t.tensor.clone() for t in kv.kv.tensors]
    latch = threading.Event()
    rng = random.Random(5)
    cancelled = completed = 0
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=128) as worker:
        futures = [
            worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([127 - i]),
                                after=latch if i == 0 else None)
            for i in range(128)
        ]

        async def waiter(fut, deadline: float | None) -> None:
            nonlocal cancelled, completed
            with anyio.CancelScope() as scope:
                if deadline is not None:
                    scope.deadline = anyio.current_time() + deadline
                await fut
                completed += 1
            if scope.cancelled_caught:
                cancelled += 1

        async with anyio.create_task_group() as tg:
            for fut in futures:
                for _ in range(3):
                    tg.start_soon(waiter, fut, rng.choice([None, 0.0, 0.001, 0.01]))
            await anyio.sleep(0.03)
            latch.set()
        assert cancelled > 0 and completed > 0 and cancelled + completed == 3 * 128
        assert all(f.done() and f.result().success for f in futures)
        assert worker.statistics().completed["store"] == 128
        for t in kv.kv.tensors:
            t.tensor.zero_()
        await worker.submit_load(1000, CPULoadStoreSpec(list(range(128))),
                                 GPULoadStoreSpec(list(range(127, -1, -1))))
    assert all(torch.equal(t.tensor, w) for t, w in zip(kv.kv.tensors, want))


async def test_cancelling_the_awaiting_task_does_not_cancel_the_copy() -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        source = kv.kv.tensors[0].tensor[5].clone()
        fut = worker.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([2]), after=latch)
        with anyio.move_on_after(0.01) as scope:
            await fut
        assert scope.cancelled_caught and not fut.done()
        assert worker.statistics().in_flight["store"] == 1
        latch.set()
        result = await fut
        assert result.success
        kv.kv.tensors[0].tensor[6] = 0
        await worker.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([6]))
        assert torch.equal(kv.kv.tensors[0].tensor[6], source)


async def test_closing_with_jobs_in_flight_drains_them_first() -> None:
    kv = make_layers(num_blocks=16)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=16) as worker:
        futures = [worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]),
                                       after=latch if i == 0 else None) for i in range(16)]
        futures.append(worker.submit_load(99, CPULoadStoreSpec([3]), GPULoadStoreSpec([15]), expedited=True))
        release_later(latch, 0.05)
    assert all(f.done() for f in futures)
    assert all(f.result().success for f in futures[:16])
    assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}


async def test_cancelling_the_closing_task_still_drains() -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    with anyio.move_on_after(0.02) as scope:
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
            release_later(latch, 0.1)
            await anyio.sleep(5)  # cancelled at 20 ms; the exit still drains the copy
    assert scope.cancelled_caught
    assert fut.done() and fut.result().success
    await worker.aclose()  # idempotent


async def test_another_task_may_close_the_worker_without_cancelling_the_opener() -> None:
    # A shutdown handler closing the worker: its aclose drains and returns; the opener's
    # body runs on (its submits are refused) and its `async with` exit completes.
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    events: list[str] = []
    opened = anyio.Event()
    futures = []

    async def opener() -> None:
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
            holder.append(worker)
            futures.append(worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch))
            opened.set()
            await closed.wait()
            events.append("opener body ran on")
            with pytest.raises(WorkerClosed):
                worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
        events.append("opener exited")

    async def closer() -> None:
        await opened.wait()
        release_later(latch, 0.05)
        await holder[0].aclose()
        events.append(f"closer: drained={futures[0].done()}")
        closed.set()

    holder: list[AsyncOffloadingWorker] = []
    closed = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(opener)
            tg.start_soon(closer)
    assert events == ["closer: drained=True", "opener body ran on", "opener exited"]
    assert futures[0].result().success
