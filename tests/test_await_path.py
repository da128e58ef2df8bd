"""The small-job await path after issue 37's trims (asyncio waiters as bare loop futures,
the poller reusing its wake event, one poll call per direction, results built without the
dataclass ``__init__``): byte-exact data for a job over before its await, per-direction
order, failed jobs still raising, the loop still getting its turn, cancelled waiters
(every loop of the matrix, CPU backend)."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec, TransferFailed
from aiokv.backends.cpu import CpuCompletion, CpuLane
from tests.conftest import copies_ending, make_layers, random_bytes_

pytestmark = pytest.mark.anyio


async def test_a_job_over_before_its_await_round_trips_exactly(monkeypatch) -> None:
    kv = make_layers(num_blocks=16, seed=3)
    wait_ends = copies_ending(monkeypatch)
    rng = np.random.default_rng(5)
    blocks = rng.choice(16, 6, replace=False).tolist()
    chunks = rng.choice(8, 6, replace=False).tolist()
    before = [t.tensor[blocks].clone() for t in kv.kv.tensors]
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
            await anyio.sleep(0.01)  # the poller is idle, waiting for work
            store = worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
            wait_ends(1)  # over, and the loop has not run since
            assert not store.done()
            assert (await store).success
            gen = torch.Generator().manual_seed(11)
            for t in kv.kv.tensors:  # clobber the blocks with other random bytes
                t.tensor[blocks] = random_bytes_(torch.empty_like(t.tensor[blocks]), gen)
            load = worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))
            wait_ends(1)
            result = await load
            assert result.success and result.transfer_size == store.result().transfer_size
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


def test_the_hostside_await_bench_runs() -> None:
    from aiokv.backends.cuda import native
    from aiokv.bench import hostside_await

    if native.helper() is None:
        pytest.skip("the no-op driver needs the native helper built")
    figures = hostside_await.await_figures(jobs=30, delays=(0.0, 5e-3))
    assert figures[5e-3]["trip50"] >= 5e-3  # the end came 5 ms after the submit
    assert all(0 < f["wake50"] < f["trip50"] and f["cpu_job"] > 0 for f in figures.values())


async def test_the_poller_keeps_its_wake_event_on_asyncio(anyio_backend: tuple[str, dict]) -> None:
    kv = make_layers(num_blocks=8)
    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            poller = worker._poller
            assert poller is not None
            await anyio.sleep(0.01)
            wake = poller._wake
            for i in range(5):
                fut = worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i % 4]))
                assert (await fut).success
            # asyncio's event (uvloop's too) is cleared and kept; anyio's (trio) is replaced.
            assert (poller._wake is wake) == (anyio_backend[0] == "asyncio")


def test_a_result_timed_later_is_the_dataclass_it_would_have_built() -> None:
    import copy
    import dataclasses
    import pickle

    from aiokv import TransferResult

    reads: list[int] = []

    def timer() -> float:
        reads.append(1)
        return 2.5e-3

    fast = TransferResult.timed_later(9, 4096, timer, ("GPU", "CPU"))
    assert reads == []  # read on first access only
    plain = TransferResult(9, True, 4096, 2.5e-3, ("GPU", "CPU"))
    assert fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain) and reads == [1]
    assert fast.transfer_time == 2.5e-3 and reads == [1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.success = False  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(fast)) == plain and copy.copy(fast) == plain
    assert dataclasses.asdict(fast) == dataclasses.asdict(plain)


def test_a_handler_poll_settles_what_the_last_one_popped_and_skips_an_empty_direction() -> None:
    from aiokv.backends.base import Completion
    from aiokv.handler import Handler
    from aiokv.specs import Direction

    class Done(Completion):
        settled = 0
        _error = None
        _elapsed = 1e-6

        def query(self) -> bool:
            return True

        def wait(self, timeout: float | None = None) -> bool:
            return True

        def settle(self) -> None:
            Done.settled += 1

    class Lane:
        def launch(self, plan: object, dependency: object) -> Completion:
            return Done()

    class Plan:
        total_bytes = 64

    handler = Handler(Direction.STORE, Lane())  # type: ignore[arg-type]
    assert handler.poll() == []
    handler.submit(1, Plan(), None)  # type: ignore[arg-type]
    handler.submit(2, Plan(), None)  # type: ignore[arg-type]
    done = handler.poll()
    assert [job.job_id for job in done] == [1, 2] and Done.settled == 0  # not on the wake-up path
    assert handler.poll() == [] and Done.settled == 2  # the next poll settles them
