"""Bad input raises a typed error before anything is enqueued; the worker stays usable."""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable

import anyio
import numpy as np
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    DuplicateJob,
    GPULoadStoreSpec,
    HostMemoryError,
    InvalidSpec,
    TransferFailed,
    UsageError,
    WorkerBroken,
    WorkerClosed,
)
from aiokv.backends.cpu import CpuBackend, CpuCompletion, CpuLane
from aiokv.core import OffloadCore
from tests.conftest import make_layers, same_bytes

pytestmark = pytest.mark.anyio


def copies_ending(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """A way to block the calling thread (a loop's included, which then does not poll)
    until ``n`` more copies have ended on the CPU backend."""
    ended = threading.Semaphore(0)
    finish = CpuCompletion._finish

    def counted(self: CpuCompletion, error: BaseException | None, elapsed: float | None) -> None:
        finish(self, error, elapsed)
        ended.release()

    monkeypatch.setattr(CpuCompletion, "_finish", counted)

    def wait(n: int) -> None:
        for _ in range(n):
            assert ended.acquire(timeout=10), "a copy did not end"

    return wait


class Spec:
    """An engine's own spec object: only attributes matter."""

    def __init__(self, block_ids, group_sizes=None, block_indices=None) -> None:
        self.block_ids = block_ids
        self.group_sizes = group_sizes
        self.block_indices = block_indices


BAD_STORES = [
    (lambda: (GPULoadStoreSpec([0, 40]), CPULoadStoreSpec([0, 1])), InvalidSpec, r"\[0, 32\)"),
    (lambda: (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0, 9])), InvalidSpec, r"\[0, 8\)"),
    (lambda: (GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0])), InvalidSpec, "needed"),
    (lambda: (GPULoadStoreSpec([0.0, 1.0]), CPULoadStoreSpec([0, 1])), InvalidSpec, "integers"),
    (lambda: (GPULoadStoreSpec(np.array([0, 1], dtype=np.float32)), CPULoadStoreSpec([0, 1])), InvalidSpec,
     "integers"),
    (lambda: (GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([3, 3])), InvalidSpec, "twice"),
    (lambda: (GPULoadStoreSpec([0, 1], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1])), InvalidSpec, "groups"),
    (lambda: (object(), CPULoadStoreSpec([0])), InvalidSpec, "block_ids"),
]


@pytest.mark.parametrize("make, error, message", BAD_STORES)
async def test_bad_store_input_is_rejected_and_the_worker_stays_usable(make, error, message) -> None:
    kv = make_layers(num_blocks=32)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        src, dst = make()
        with pytest.raises(error, match=message):
            worker.submit_store(1, src, dst)
        assert worker.statistics().in_flight["store"] == 0
        # the same job id is free, and the worker still moves bytes
        want = kv.kv.tensors[1].tensor[3].clone()
        await worker.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]))
        kv.kv.tensors[1].tensor[3] = 0
        await worker.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([3]))
        assert same_bytes(kv.kv.tensors[1].tensor[3], want)


async def test_a_load_may_not_write_one_block_twice() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec, match="twice"):
            worker.submit_load(1, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([4, 4]))


async def test_blocks_per_chunk_mismatch_names_the_rule() -> None:
    kv = make_layers(num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, blocks_per_chunk=4) as worker:
        with pytest.raises(InvalidSpec, match="blocks_per_chunk=4"):
            worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4]), CPULoadStoreSpec([0]))
        ok = await worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4]), CPULoadStoreSpec([0, 1]))
        assert ok.success


async def test_duplicate_in_flight_job_id_is_rejected() -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        fut = worker.submit_store(5, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
        with pytest.raises(DuplicateJob, match="job 5"):
            worker.submit_load(5, CPULoadStoreSpec([2]), GPULoadStoreSpec([2]))
        latch.set()
        await fut
        assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}


@pytest.mark.parametrize("job_id", [[1], "1", 1.0, True, None])
async def test_a_job_id_that_is_no_int_is_invalid_spec(job_id) -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(job_id, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_load(job_id, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]))
        assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}


@pytest.mark.parametrize("expedited", ["no", 1, None])
async def test_expedited_must_be_a_bool(expedited) -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="expedited must be a bool"):
            worker.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]), expedited=expedited)
        assert (await worker.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]),
                                         expedited=np.bool_(True))).success
        assert worker.statistics().completed == {"store": 0, "load": 0, "expedited_load": 1}


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


async def test_entering_twice_is_an_error() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(UsageError, match="already open; enter it once"):
            await worker.__aenter__()
        assert (await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))).success


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


async def test_after_of_the_wrong_kind_is_rejected() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match=r"threading\.Event"):
            worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after="stream")
        assert worker.statistics().in_flight["store"] == 0


async def test_a_failed_copy_fails_its_future_and_not_the_next(monkeypatch, caplog) -> None:
    kv = make_layers(num_blocks=8)
    real = CpuLane._copy
    calls = {"n": 0}

    def flaky(self, plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("simulated device fault")
        real(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", flaky)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        bad = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        good = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
        with pytest.raises(TransferFailed, match="simulated device fault") as info:
            await bad
        assert info.value.result.job_id == 1 and info.value.result.success is False
        assert isinstance(info.value.__cause__, OSError)  # what failed it, not only its text
        with pytest.raises(TransferFailed) as again:
            await bad
        # Each await raises its own exception: one object raised again would grow its
        # traceback with every await.
        assert again.value is not info.value and again.value.__cause__ is info.value.__cause__
        assert len(traceback.extract_tb(again.value.__traceback__)) == len(
            traceback.extract_tb(info.value.__traceback__)
        )
        assert (await good).success
        assert worker.statistics().failed["store"] == 1
    assert "store job 1 failed: OSError('simulated device fault')" in caplog.text


async def test_a_logging_filter_that_raises_loses_no_failed_job(monkeypatch) -> None:
    import logging

    kv = make_layers(num_blocks=8)

    def fail(self, plan):
        raise OSError("simulated device fault")

    class Raising(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            raise RuntimeError("a broken log filter")

    monkeypatch.setattr(CpuLane, "_copy", fail)
    log, raising = logging.getLogger("aiokv"), Raising()
    log.addFilter(raising)
    try:
        with anyio.fail_after(10):
            async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
                with pytest.raises(TransferFailed, match="simulated device fault"):
                    await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
                assert worker.statistics().failed["store"] == 1
    finally:
        log.removeFilter(raising)


def test_constructor_rejects_bad_sizes_backends_and_devices() -> None:
    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="exactly one"):
        AsyncOffloadingWorker(kv.kv)
    with pytest.raises(InvalidSpec, match="exactly one"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, cpu_bytes=1 << 20)
    with pytest.raises(InvalidSpec, match="positive"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=0)
    with pytest.raises(InvalidSpec, match="at least one chunk"):
        AsyncOffloadingWorker(kv.kv, cpu_bytes=10)
    with pytest.raises(InvalidSpec, match="blocks_per_chunk"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, blocks_per_chunk=0)
    with pytest.raises(InvalidSpec, match="backend must be"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, backend="tpu")
    with pytest.raises(InvalidSpec, match="CanonicalKVCaches"):
        AsyncOffloadingWorker([torch.zeros(4, 4)], num_cpu_chunks=4)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="strategy must be one of"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, strategy="fastest")
    with pytest.raises(InvalidSpec, match="submit_threads"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"submit_threads": -1})
    for bad in (-1, 1.5, True, 100):
        with pytest.raises(InvalidSpec, match="staging_bytes"):
            AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"staging_bytes": bad})
    with pytest.raises(InvalidSpec, match="poll_interval"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"poll_interval": "1ms"})
    for name in ("poll_interval", "spin_seconds"):  # inf made the closing drain sleep for good
        for bad in (float("inf"), float("nan")):
            with pytest.raises(InvalidSpec, match=f"{name} must be a finite"):
                AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={name: bad})
    with pytest.raises(InvalidSpec, match="doorbell must be a bool"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"doorbell": "yes"})
    with pytest.raises(InvalidSpec, match="issue_thread must be a bool"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"issue_thread": 1})
    with pytest.raises(InvalidSpec, match="unknown worker options"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"nope": 1})
    with pytest.raises(InvalidSpec, match="unknown worker options"):  # removed in 0.1.0's lifetime
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"wait_threads": True})
    meta = CanonicalKVCaches.from_tensors([torch.empty(2, 8, 4, device="meta")], block_dim=1)
    with pytest.raises(InvalidSpec, match="CPU backend needs CPU tensors"):
        AsyncOffloadingWorker(meta, num_cpu_chunks=4, backend="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidSpec, match="usable CUDA device"):
            AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, backend="cuda")


async def test_foreign_spec_objects_with_numpy_int32_ids_work() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        want = kv.kv.tensors[0].tensor[[6, 7]].clone()
        src = Spec(np.array([6, 7], dtype=np.int32), group_sizes=[2], block_indices=[0])
        assert (await worker.submit_store(1, src, Spec(np.array([3, 0], dtype=np.int32)))).success
        kv.kv.tensors[0].tensor[[6, 7]] = 0
        await worker.submit_load(2, Spec(np.array([3, 0], dtype=np.int32)), Spec(np.array([6, 7], np.int32)))
        assert same_bytes(kv.kv.tensors[0].tensor[[6, 7]], want)


async def test_a_sticky_device_error_fails_pending_jobs_and_refuses_new_ones(monkeypatch) -> None:
    kv = make_layers(num_blocks=8)

    def broken(self, plan):
        raise WorkerBroken("simulated sticky context error")

    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        monkeypatch.setattr(CpuLane, "_copy", broken)
        futures = [worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i])) for i in range(3)]
        for fut in futures:
            with pytest.raises(TransferFailed, match="sticky"):
                await fut
        with pytest.raises(WorkerBroken, match="create a new worker"):
            worker.submit_store(9, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert worker.statistics().failed["store"] == 3


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


async def test_a_callback_may_not_reuse_an_id_whose_future_is_not_resolved_yet(monkeypatch) -> None:
    # Jobs 1 and 2 end in one poll; job 1's callback runs before job 2's future resolves.
    # Reusing id 2 then must be refused, not mixed up with the finished job 2.
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    refused: list[BaseException] = []
    wait_ends = copies_ending(monkeypatch)

    def reuse(_f: object) -> None:
        try:
            worker.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]))
        except DuplicateJob as exc:
            refused.append(exc)

    with anyio.fail_after(10):
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
            first = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
            second = worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
            first.add_done_callback(reuse)
            latch.set()
            wait_ends(2)  # both over before the poller looks: one poll pops both
            assert (await first).success and (await second).success
            assert len(refused) == 1 and "not resolved yet" in str(refused[0])
            assert worker.statistics().in_flight["load"] == 0
            # Once its future is done, the id is free again.
            assert (await worker.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]))).success


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


async def test_a_kept_failed_future_does_not_keep_the_closed_workers_pool(monkeypatch) -> None:
    import gc
    import weakref

    def fail(self, plan):
        try:
            raise ValueError("what the driver said")
        except ValueError as exc:  # a chained cause keeps frames of its own
            raise OSError("simulated device fault") from exc

    monkeypatch.setattr(CpuLane, "_copy", fail)
    lanes: list[weakref.ref] = []
    open_lane = CpuBackend.open_lane
    monkeypatch.setattr(CpuBackend, "open_lane", lambda self, d, *a: lanes.append(
        weakref.ref(lane := open_lane(self, d, *a))) or lane)

    async def failed_future() -> tuple[object, weakref.ref]:
        async with AsyncOffloadingWorker(make_layers(num_blocks=8).kv, num_cpu_chunks=4) as worker:
            # The lane holds a view of the pool; its thread's frames were the error's traceback.
            lane = lanes[0]  # the store lane: directions open in order
            assert lane().direction.value == "store"  # type: ignore[union-attr]
            fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
            with pytest.raises(TransferFailed):
                await fut
        return fut, lane

    fut, lane = await failed_future()
    gc.collect()
    assert lane() is None, "the failed future's cause keeps the lane's frames, and the pool"
    with pytest.raises(TransferFailed, match="simulated device fault"):
        fut.result()  # type: ignore[attr-defined]


async def test_an_in_flight_duplicate_says_so() -> None:
    kv = make_layers(num_blocks=8)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
        try:
            with pytest.raises(DuplicateJob, match="still in flight; use a new id"):
                worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
        finally:
            latch.set()
        assert (await fut).success


def test_bool_sizes_are_rejected() -> None:
    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="positive int"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=True)


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


def test_a_pool_that_cannot_be_allocated_still_releases_the_backend(monkeypatch) -> None:
    from aiokv.backends.cpu import CpuBackend

    released: list[bool] = []
    monkeypatch.setattr(CpuBackend, "allocate_pool", lambda self, nbytes: (_ for _ in ()).throw(
        InvalidSpec("could not map that many bytes")))
    monkeypatch.setattr(CpuBackend, "close", lambda self: released.append(True))
    with pytest.raises(InvalidSpec, match="could not map"):
        AsyncOffloadingWorker(make_layers(num_blocks=8).kv, num_cpu_chunks=4)
    assert released == [True]


async def test_two_groups_storing_into_one_chunk_are_refused() -> None:
    """Each group's blocks start at byte 0 of their chunk, so group 0 at sub-block 0 and group
    1 at sub-block 1 of one chunk would overwrite each other: refused, nothing enqueued."""
    from tests.conftest import make_two_groups

    kv = make_two_groups()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, blocks_per_chunk=2) as worker:
        shared = GPULoadStoreSpec([0, 1], group_sizes=[1, 1], block_indices=[0, 1])
        with pytest.raises(InvalidSpec, match="two groups store into one chunk"):
            worker.submit_store(1, shared, CPULoadStoreSpec([3, 3]))
        assert worker.statistics().in_flight["store"] == 0
        apart = GPULoadStoreSpec([0, 1], group_sizes=[1, 1], block_indices=[0, 1])
        assert (await worker.submit_store(2, apart, CPULoadStoreSpec([3, 4]))).success


class CPULoadStoreSpecLike:
    """An engine's host spec (vLLM names its classes so): ids by attribute."""

    def __init__(self, ids: list[int]) -> None:
        self.block_ids = np.asarray(ids, dtype=np.int32)


class GPULoadStoreSpecLike(CPULoadStoreSpecLike):
    pass


@pytest.mark.parametrize("ours", [True, False], ids=["ours", "engine's"])
async def test_specs_swapped_between_source_and_destination_are_refused(ours: bool) -> None:
    """A store given (CPU spec, GPU spec) used to copy host chunks 0, 1 into blocks 3, 7."""
    gpu_spec, cpu_spec = (GPULoadStoreSpec, CPULoadStoreSpec) if ours else (GPULoadStoreSpecLike,
                                                                            CPULoadStoreSpecLike)
    kv = make_layers(num_blocks=8)
    before = [t.clone() for t in kv.layers]
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec, match="swapped"):
            worker.submit_store(1, cpu_spec([0, 1]), gpu_spec([3, 7]))
        with pytest.raises(InvalidSpec, match=r"GPU side of a load got a CPULoadStoreSpec"):
            worker.submit_load(2, cpu_spec([0, 1]), cpu_spec([3, 7]))
        with pytest.raises(InvalidSpec, match=r"CPU side of a expedited_load got a GPU"):
            worker.submit_load(3, gpu_spec([0, 1]), gpu_spec([3, 7]), expedited=True)
        assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}
        assert (await worker.submit_store(1, gpu_spec([3, 7]), cpu_spec([0, 1]))).success
        assert (await worker.submit_load(2, cpu_spec([0, 1]), gpu_spec([4, 5]))).success
    assert all(same_bytes(a[:, :4], b[:, :4]) and same_bytes(a[:, 6:], b[:, 6:])
               for a, b in zip(kv.layers, before))
    assert all(same_bytes(a[:, 4:6], b[:, [3, 7]]) for a, b in zip(kv.layers, before))


async def test_numpy_integer_job_ids_and_sizes_are_accepted_bools_are_not() -> None:
    kv = make_layers(num_blocks=8)
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=np.int64(8), blocks_per_chunk=np.int32(1),
                                   options={"max_in_flight": np.int64(4)})
    assert type(worker.num_cpu_chunks) is int and worker.num_cpu_chunks == 8
    assert AsyncOffloadingWorker(kv.kv, cpu_bytes=np.uint64(3 * worker.chunk_bytes + 1)).num_cpu_chunks == 3
    async with worker:
        fut = worker.submit_store(np.int64(5), GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        result = await fut
        assert result.job_id == 5 and type(result.job_id) is int and fut.job_id == 5
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(True, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(np.bool_(True), GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(5.0, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    with pytest.raises(InvalidSpec, match="positive int"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=np.float64(8))


def test_a_pool_larger_than_the_host_memory_is_a_host_memory_error() -> None:
    from aiokv.core import available_host_memory

    kv = make_layers(num_blocks=8)
    available = available_host_memory()
    assert available is not None and available > 0
    with pytest.raises(HostMemoryError, match=r"10+ chunks .* but only .* GiB of host memory is available"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=10**12)
    with pytest.raises(HostMemoryError, match="available"):
        AsyncOffloadingWorker(kv.kv, cpu_bytes=available + (1 << 30))


def test_an_allocation_that_fails_anyway_is_a_host_memory_error(monkeypatch) -> None:
    """With the memory check passed (here: unknown), torch's raw allocation error becomes
    ``HostMemoryError`` too, and the backend is released."""
    import aiokv.core
    from aiokv.backends.cpu import CpuBackend

    released: list[bool] = []
    monkeypatch.setattr(aiokv.core, "available_host_memory", lambda: None)
    monkeypatch.setattr(CpuBackend, "close", lambda self: released.append(True))
    with pytest.raises(HostMemoryError, match="could not allocate a host pool") as info:
        AsyncOffloadingWorker(make_layers(num_blocks=8).kv, cpu_bytes=1 << 62)
    assert isinstance(info.value.__cause__, RuntimeError) and released == [True]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "30", True])
async def test_a_drain_timeout_that_is_no_positive_number_is_invalid_spec(bad: object) -> None:
    from aiokv import SyncOffloadingWorker

    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="drain_timeout must be"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"drain_timeout": bad})
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="drain_timeout must be"):
            await worker.aclose(drain_timeout=bad)  # type: ignore[arg-type]
        assert (await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))).success
    sync = SyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    with pytest.raises(InvalidSpec, match="drain_timeout must be"):
        sync.shutdown(drain_timeout=bad)  # type: ignore[arg-type]
    assert sync.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    sync.shutdown(drain_timeout=math.inf)
    assert [r.success for r in sync.get_finished()] == [True]
