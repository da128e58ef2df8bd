"""One direction's FIFO over a real CPU lane: pops in submission order from the head only,
counts, timestamps, settles, and gives up what is in flight when abandoned."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec, TransferFailed
from aiokv.backends.cpu import CpuBackend, CpuHostPool, CpuLane
from aiokv.handler import Handler
from aiokv.plan import CopyPlan, HostLayout, map_blocks, plan_copies
from aiokv.specs import Direction
from tests.conftest import make_layers, same_bytes


class _Rig:
    def __init__(self, direction: Direction = Direction.STORE, num_blocks: int = 32) -> None:
        self.kv = make_layers(num_layers=2, num_blocks=num_blocks, page_shape=(2, 2, 8), seed=3)
        self.layout = HostLayout.build(self.kv.kv, 1)
        self.pool = CpuHostPool(num_blocks * self.layout.chunk_bytes)
        self.pool.tensor.zero_()
        self.lane = CpuLane(direction, self.kv.kv, self.pool)
        self.handler = Handler(direction, self.lane)
        self.num_blocks = num_blocks

    def plan(self, blocks: list[int], chunks: list[int]) -> CopyPlan:
        return plan_copies(map_blocks(blocks, chunks, layout=self.layout, num_chunks=self.num_blocks),
                           self.layout)

    def wait_done(self) -> None:
        for job in self.handler.pending():
            assert job.completion.wait(10)

    def close(self) -> None:
        self.lane.close()
        self.pool.close()


def test_jobs_pop_in_submission_order_and_only_from_the_head() -> None:
    rig = _Rig()
    h = rig.handler
    latch = threading.Event()
    head = h.submit(10, rig.plan([1, 2], [1, 2]), latch)
    behind = [h.submit(11 + i, rig.plan([3 + i], [3 + i]), None) for i in range(5)]
    assert h.in_flight == 6 and h.head is head and h.submitted == 6
    time.sleep(0.02)
    assert h.pop_finished() == []  # the head is held: nothing behind it is popped either
    missed = time.perf_counter()
    latch.set()
    rig.wait_done()
    done = h.pop_finished()
    assert [j.job_id for j in done] == [10, 11, 12, 13, 14, 15] and h.in_flight == 0 and h.head is None
    assert done[0] is head and done[1:] == behind
    assert all(j.result is not None and j.result.success for j in done)
    assert {j.result.transfer_type for j in done if j.result} == {("GPU", "CPU")}
    assert h.completed == 6 and h.failed == 0
    page_bytes = sum(t.page_size_bytes for t in rig.kv.kv.tensors)
    assert h.bytes_moved == sum(j.nbytes for j in done) == 7 * page_bytes
    # The held head's end was noticed after the poll that missed it; later jobs' windows
    # start no earlier than their own launch.
    assert head.running_seen_at <= missed <= head.noticed_at
    for job in done:
        assert job.launched_at <= job.running_seen_at <= job.noticed_at
        assert job.plan is None  # dropped once the copy is over
    rig.close()


def test_the_bytes_land_where_the_plan_says() -> None:
    rig = _Rig()
    h = rig.handler
    h.submit(1, rig.plan([5, 9], [0, 3]), None)
    rig.wait_done()
    (job,) = h.pop_finished()
    assert job.result is not None and job.result.success
    pool = rig.pool.tensor
    for block, chunk in ((5, 0), (9, 3)):
        by_address = sorted(rig.kv.kv.tensors, key=lambda t: t.tensor.data_ptr())
        want = torch.cat([t.tensor[block] for t in by_address])
        got = pool[chunk * rig.layout.chunk_bytes : chunk * rig.layout.chunk_bytes + want.numel()]
        assert same_bytes(got, want)
    rig.close()


def test_settle_reads_device_times_of_popped_jobs_once() -> None:
    rig = _Rig()
    h = rig.handler
    settled: list[object] = []
    h.submit(1, rig.plan([1], [1]), None)
    rig.wait_done()
    (job,) = h.pop_finished()
    real_settle = job.completion.settle
    job.completion.settle = lambda: settled.append(job) or real_settle()  # type: ignore[method-assign]
    h.settle()
    h.settle()  # nothing left to settle
    assert settled == [job]
    assert job.result is not None and job.result.transfer_time is not None and job.result.transfer_time >= 0
    rig.close()


def test_a_failed_copy_counts_as_failed_and_its_error_keeps_no_frames(monkeypatch) -> None:
    def fail(self, plan):
        try:
            raise OSError("the device said no")
        except OSError as inner:
            raise RuntimeError("copy failed") from inner

    monkeypatch.setattr(CpuLane, "_copy", fail)
    rig = _Rig()
    h = rig.handler
    h.submit(1, rig.plan([1], [1]), None)
    rig.wait_done()
    (job,) = h.pop_finished()
    assert job.result is not None and not job.result.success and job.result.transfer_size is None
    assert isinstance(job.error, RuntimeError) and job.error.__traceback__ is None
    assert job.error.__cause__ is not None and job.error.__cause__.__traceback__ is None
    assert h.failed == 1 and h.completed == 0 and h.bytes_moved == 0
    rig.close()


def test_abandon_gives_up_every_pending_job_oldest_first() -> None:
    rig = _Rig(Direction.LOAD)
    h = rig.handler
    never = threading.Event()
    jobs = [h.submit(i, rig.plan([i], [i]), never if i == 0 else None) for i in range(3)]
    assert h.abandon() == jobs and h.in_flight == 0 and h.failed == 3
    assert h.pop_finished() == []
    never.set()
    assert all(j.completion.wait(10) for j in jobs)
    rig.close()


@pytest.mark.parametrize("direction", list(Direction))
def test_every_direction_reports_its_transfer_type(direction: Direction) -> None:
    rig = _Rig(direction)
    rig.handler.submit(1, rig.plan([1], [1]), None)
    rig.wait_done()
    (job,) = rig.handler.pop_finished()
    assert job.direction is direction and job.result is not None
    assert job.result.transfer_type == direction.transfer_type
    assert repr(rig.handler) == f"<Handler {direction.value} in_flight=0 completed=1>"
    rig.close()


@pytest.mark.anyio
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
