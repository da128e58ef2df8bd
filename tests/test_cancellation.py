"""Cancelling a wait never cancels a copy; closing drains what is in flight."""

from __future__ import annotations

import math
import random
import threading
import time
import warnings

import anyio
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    CudaCallFailed,
    GPULoadStoreSpec,
    TransferFailed,
    WorkerClosed,
)
from aiokv.backends.cpu import CpuHostPool
from tests.conftest import make_layers, same_bytes

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


def _host_chunk(worker: AsyncOffloadingWorker, chunk: int) -> torch.Tensor:
    return worker.host_pool[chunk * worker.chunk_bytes : (chunk + 1) * worker.chunk_bytes].clone()


async def test_a_drain_that_never_ends_gives_up_names_the_job_and_keeps_the_pool() -> None:
    """An ``after=`` event nobody sets used to hang the exit for good."""
    kv = make_layers(num_blocks=8)
    never = threading.Event()
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"drain_timeout": 0.2})
    with pytest.warns(RuntimeWarning, match=r"2 job\(s\) still in flight .*drain_timeout.*"
                                            r"store job 7, store job 8"), anyio.fail_after(10):
        async with worker:
            done = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            await done
            # Host memory is not cleared: a pool recycled from an earlier run of this test may
            # hold these very bytes already, so put others there first.
            cb = worker.chunk_bytes
            worker.host_pool[2 * cb : 3 * cb] = torch.randint(0, 256, (cb,), dtype=torch.uint8)
            stuck = worker.submit_store(7, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]), after=never)
            behind = worker.submit_store(8, GPULoadStoreSpec([3]), CPULoadStoreSpec([3]))
            pool = worker.host_pool
    assert worker.closed
    for fut in (stuck, behind):
        with pytest.raises(TransferFailed) as info:
            fut.result()
        assert isinstance(info.value.__cause__, WorkerClosed) and "abandoned" in str(info.value.__cause__)
    assert done.result().success
    # The copies were abandoned, not the memory they write: once the event is set they
    # land in the pool that is still there, byte-exact.
    chunk = pool[2 * worker.chunk_bytes : 3 * worker.chunk_bytes]
    want = torch.cat([p[2] for p in sorted((t.tensor for t in kv.kv.tensors), key=lambda t: t.data_ptr())])
    assert not same_bytes(chunk[: want.numel()], want)
    never.set()
    deadline = time.monotonic() + 10
    while not same_bytes(chunk[: want.numel()], want) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert same_bytes(chunk[: want.numel()], want)


async def test_a_drain_whose_jobs_keep_ending_in_the_poller_does_not_give_up() -> None:
    """The poller runs on during the drain and, woken by the doorbell, pops most ends
    first; the drain counted only its own pops, so it gave up after ``drain_timeout``
    on jobs that were ending every 50 ms and failed them as abandoned."""
    kv = make_layers(num_blocks=16)
    latches = [threading.Event() for _ in range(12)]
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=16, options={"drain_timeout": 0.4})

    def release() -> None:
        for latch in latches:
            time.sleep(0.05)
            latch.set()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an abandoning close warns
        with anyio.fail_after(10):
            async with worker:
                futures = [worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]), after=latch)
                           for i, latch in enumerate(latches)]
                threading.Thread(target=release, daemon=True).start()
    assert [f.result().success for f in futures] == [True] * len(latches)
    assert worker.statistics().completed["store"] == len(latches)


async def test_a_teardown_error_after_the_drain_still_resolves_every_future() -> None:
    """The futures of jobs the closing core gave up on were resolved only after it let
    lanes and memory go: an error there (a driver call, an interrupt) left them pending
    for ever, and a task awaiting one hung."""
    kv = make_layers(num_blocks=8)
    never = threading.Event()
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"drain_timeout": 0.1})

    def failing(self) -> None:  # the last step of letting go of an abandoning worker
        raise CudaCallFailed("cuMemHostUnregister failed", 1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CpuHostPool, "abandon", failing, raising=False)
        with pytest.raises(CudaCallFailed), pytest.warns(RuntimeWarning, match="store job 1"), \
                anyio.fail_after(10):
            async with worker:
                fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)
    assert worker.closed and fut.done()
    with pytest.raises(TransferFailed) as info:
        fut.result()
    assert isinstance(info.value.__cause__, WorkerClosed)
    never.set()


async def test_a_keyboard_interrupt_in_the_drain_ends_it_the_first_time() -> None:
    """The shielded drain swallowed the first Ctrl-C and then blocked in a wait for the
    copy. An interrupt in the drain now abandons what is in flight and propagates."""
    kv = make_layers(num_blocks=8)
    never = threading.Event()
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"drain_timeout": math.inf})
    naps = []
    real_nap = worker._drain_nap

    def nap() -> float:
        naps.append(1)
        if len(naps) == 3:
            raise KeyboardInterrupt  # where a signal lands: between two polls of the drain
        return real_nap()

    with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="interrupted.*store job 1"):
        async with worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)
            worker._drain_nap = nap  # type: ignore[method-assign]
    assert worker.closed and fut.done() and not fut._result.success
    never.set()


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], indirect=True)
async def test_an_asyncio_cancellation_of_the_closing_task_ends_the_drain() -> None:
    """Under ``asyncio.run`` the first Ctrl-C cancels the main task: the drain must end."""
    import asyncio

    kv = make_layers(num_blocks=8)
    never = threading.Event()
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"drain_timeout": math.inf})

    async def main() -> None:
        async with worker:
            worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)

    task = asyncio.ensure_future(main())
    while not repr(worker).startswith("<AsyncOffloadingWorker closing"):
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)  # well into the drain
    with pytest.warns(RuntimeWarning, match="interrupted"):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
    assert worker.closed
    never.set()
