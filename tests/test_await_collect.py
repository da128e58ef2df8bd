"""An await that finds its job already over resolves it itself (``TransferFuture``'s
``collect``), without waiting for the poller: byte-exact data, per-direction order, failed
jobs still raising, the loop still getting its turn, and the poller settling behind it
(every loop of the matrix, CPU backend)."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec, TransferFailed, TransferFuture
from aiokv.backends.cpu import CpuCompletion, CpuLane
from tests.conftest import copies_ending, make_layers, random_bytes_

pytestmark = pytest.mark.anyio


async def test_an_await_pops_a_finished_job_itself_and_the_data_is_exact(monkeypatch) -> None:
    kv = make_layers(num_blocks=16, seed=3)
    wait_ends = copies_ending(monkeypatch)
    rng = np.random.default_rng(5)
    blocks = rng.choice(16, 6, replace=False).tolist()
    chunks = rng.choice(8, 6, replace=False).tolist()
    before = [t.tensor[blocks].clone() for t in kv.kv.tensors]
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
            await anyio.sleep(0.01)  # the poller is idle, waiting for work
            polls = worker.poller_statistics().polls
            store = worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
            wait_ends(1)  # over, and the loop has not run since: only the await can see it
            assert not store.done()
            assert (await store).success
            # The await resolved it: no poll of the poller found it.
            assert worker.poller_statistics().polls == polls
            gen = torch.Generator().manual_seed(11)
            for t in kv.kv.tensors:  # clobber the blocks with other random bytes
                t.tensor[blocks] = random_bytes_(torch.empty_like(t.tensor[blocks]), gen)
            load = worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))
            wait_ends(1)
            result = await load
            assert result.success and result.transfer_size == store.result().transfer_size
            assert worker.poller_statistics().polls == polls
            await anyio.sleep(0.01)  # the poller settles them: device times read, pooled
            assert store.result().transfer_time is not None and worker.in_flight == 0
    assert all(torch.equal(t.tensor[blocks], b) for t, b in zip(kv.kv.tensors, before))


async def test_a_job_found_done_behind_an_unfinished_one_waits_for_it(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    held: list[CpuCompletion] = []
    gate = threading.Event()
    real = CpuCompletion.query

    def query(self: CpuCompletion) -> bool:  # the first job reads as running until the gate
        if held and self is held[0] and not gate.is_set():
            return False
        return real(self)

    monkeypatch.setattr(CpuCompletion, "query", query)
    order: list[int] = []
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            held.append(worker._core._jobs[1].completion)  # type: ignore[arg-type]
            second = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
            for fut in (first, second):
                fut.add_done_callback(lambda f: order.append(f.job_id))
            wait_ends(2)  # both copies over; the second's own query says done
            with anyio.move_on_after(0.05) as scope:
                await second
            assert scope.cancelled_caught and not second.done() and not first.done()
            gate.set()
            assert (await second).success and first.done()
    assert order == [1, 2]


async def test_a_failed_job_found_done_at_the_await_still_raises(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    real = CpuLane._copy

    def fail_first(self: CpuLane, plan: object) -> None:
        if not failed:
            failed.append(True)
            raise OSError("simulated device fault")
        real(self, plan)

    failed: list[bool] = []
    monkeypatch.setattr(CpuLane, "_copy", fail_first)
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            bad = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            wait_ends(1)
            with pytest.raises(TransferFailed, match="simulated device fault") as info:
                await bad
            assert isinstance(info.value.__cause__, OSError) and info.value.result.success is False
            good = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
            wait_ends(1)
            assert (await good).success


async def test_awaits_of_jobs_found_done_still_let_other_tasks_run(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    ticks = 0
    stop = False

    async def other() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await anyio.sleep(0)

    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            async with anyio.create_task_group() as tg:
                tg.start_soon(other)
                await anyio.sleep(0)
                start = ticks
                for i in range(20):
                    fut = worker.submit_store(i, GPULoadStoreSpec([i % 8]), CPULoadStoreSpec([i % 4]))
                    wait_ends(1)
                    assert (await fut).success
                stop = True
            # Each await yielded once (as a checkpoint), so the other task ran in between.
            assert ticks - start >= 19


async def test_a_cancelled_waiter_leaves_the_job_to_the_poller_and_other_waiters(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
            with anyio.move_on_after(0.02) as scope:
                await fut  # not over: the await found nothing and slept
            assert scope.cancelled_caught and not fut.done() and fut._waiters == []
            results = []

            async def waiter() -> None:
                results.append(await fut)

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                tg.start_soon(waiter)
                await anyio.sleep(0.01)
                latch.set()
            assert len(results) == 2 and results[0] is results[1] and results[0].success


def test_the_bench_counts_the_awaits_that_found_their_job_over() -> None:
    """On no-op drivers a 1-block job is over when its submit returns, so the bench's
    ``found`` share (the GPU rows "found over at the await") reads nearly all of them."""
    import asyncio

    from aiokv.backends.cuda import native
    from aiokv.bench.cuda_wakeup import _wakeups
    from aiokv.bench.hostside import noop_cuda, tiny_kv

    if native.helper() is None:
        pytest.skip("the no-op driver needs the native helper built")

    async def run() -> dict[str, float]:
        with noop_cuda():
            worker = AsyncOffloadingWorker(tiny_kv(), num_cpu_chunks=64, backend="cuda")
        async with worker:
            def submit(i: int) -> TransferFuture:
                return worker.submit_store(i, GPULoadStoreSpec([i % 64]), CPULoadStoreSpec([i % 64]))

            return await _wakeups(worker, submit, 40)

    figures = asyncio.run(run())
    assert figures["found"] >= 0.9 and figures["polls"] <= 0.1
    assert 0 < figures["wake50"] < figures["trip50"]


async def test_a_poll_failing_at_the_await_is_left_to_the_poller(monkeypatch) -> None:
    from aiokv.core import OffloadCore

    kv = make_layers(num_blocks=8)
    wait_ends = copies_ending(monkeypatch)
    real = OffloadCore.poll
    calls = {"n": 0}

    def poll_failing_once(self: OffloadCore) -> list:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a poll that failed once")
        return real(self)

    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            wait_ends(1)
            monkeypatch.setattr(OffloadCore, "poll", poll_failing_once)
            assert (await fut).success  # the await's poll failed; the poller's found it
            assert calls["n"] >= 2


def test_the_hostside_await_bench_runs_and_finds_jobs_over_at_once() -> None:
    from aiokv.backends.cuda import native
    from aiokv.bench import hostside_await

    if native.helper() is None:
        pytest.skip("the no-op driver needs the native helper built")
    figures = hostside_await.await_figures(jobs=30, delays=(0.0, 5e-3))
    assert figures[0.0]["found"] >= 0.9  # over when the submit returned: the await pops it
    assert figures[5e-3]["found"] <= 0.1 and figures[5e-3]["trip50"] >= 5e-3
    assert all(0 < f["wake50"] < f["trip50"] for f in figures.values())
