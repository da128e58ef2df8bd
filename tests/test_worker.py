"""Round trips, ordering and expedited loads through AsyncOffloadingWorker (CPU backend)."""

from __future__ import annotations

import os
import threading

import anyio
import numpy as np
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidSpec,
    PollerStatistics,
    QueueFull,
    TransferResult,
    WorkerClosed,
)
from tests.conftest import KV, make_layers, make_two_groups, random_bytes_, same_bytes

pytestmark = pytest.mark.anyio


def blocks_of(kv: KV, blocks: list[int]) -> list[torch.Tensor]:
    """Every page of the given blocks (per layer, K and V), copied out."""
    return [t.tensor[blocks].clone() for t in kv.kv.tensors]


def clobber(kv: KV, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.kv.tensors:
        t.tensor[blocks] = torch.randint(0, 256, (len(blocks), t.tensor.shape[1]), dtype=torch.uint8,
                                         generator=gen)


async def test_round_trip_is_byte_exact_and_touches_nothing_else() -> None:
    kv = make_layers(num_blocks=32)
    rng = np.random.default_rng(0)
    blocks = rng.choice(32, 12, replace=False).tolist()
    chunks = rng.choice(16, 12, replace=False).tolist()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=16) as worker:
        before = blocks_of(kv, blocks)
        everything = kv.snapshot()
        result = await worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
        nbytes = 12 * 4 * 2 * (4 * 2 * 16 * 2)
        assert result == TransferResult(1, True, nbytes, result.transfer_time, ("GPU", "CPU"))
        assert all(same_bytes(a, b) for a, b in zip(kv.layers, everything)), "a store changed its source"
        clobber(kv, blocks, seed=9)
        others = [b for b in range(32) if b not in blocks]
        untouched = blocks_of(kv, others)
        await worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, blocks), before))
        assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, others), untouched))


@pytest.mark.parametrize("bpc", [1, 3])
async def test_id_arrays_reused_by_the_caller_after_submit_do_not_change_the_job(bpc: int) -> None:
    # Engines refill one numpy buffer of ids every step; the job must keep the ids it had.
    kv = make_layers(num_blocks=64)
    rng = np.random.default_rng(4)
    blocks = rng.choice(64, 40, replace=False).astype(np.int64)
    chunks = rng.choice(48, -(-40 // bpc), replace=False).astype(np.int64)
    wanted = blocks_of(kv, blocks.tolist())
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=48, blocks_per_chunk=bpc) as worker:
        latch = threading.Event()
        store = worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks), after=latch)
        saved_blocks, saved_chunks = blocks.copy(), chunks.copy()
        blocks[:] = blocks[::-1]
        chunks[:] = chunks[::-1]
        latch.set()
        await store
        clobber(kv, saved_blocks.tolist(), seed=5)
        await worker.submit_load(2, CPULoadStoreSpec(saved_chunks), GPULoadStoreSpec(saved_blocks))
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(kv, saved_blocks.tolist()), wanted))


@pytest.mark.parametrize("bpc", [1, 3])
async def test_sub_blocks_with_skips_and_two_groups(bpc: int) -> None:
    kv = make_two_groups()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=12, blocks_per_chunk=bpc) as worker:
        # Fill chunks 0-5 completely from blocks 0.. of both groups (old contents).
        full_a = list(range(6 * bpc))
        full_b = list(range(6 * bpc))
        spec = GPULoadStoreSpec(full_a + full_b, group_sizes=[6 * bpc, 6 * bpc])
        await worker.submit_store(1, spec, CPULoadStoreSpec(list(range(6)) + list(range(6, 12))))
        # Partial store with skips: group 0 starts at logical block 5, group 1 at 4.
        a, b = [30, 31, 32, 33], [20, 21]
        spec = GPULoadStoreSpec(a + b, group_sizes=[4, 2], block_indices=[5, 4])
        ca = -(-(4 + 5 % bpc) // bpc)
        cb = -(-(2 + 4 % bpc) // bpc)
        chunks_a, chunks_b = [1, 2][:ca] if bpc == 3 else [1, 2, 3, 4], [7][:cb] if bpc == 3 else [7, 8]
        want_a = [kv.kv.tensors[i].tensor[a].clone() for i in range(3)]
        want_b = [kv.kv.tensors[3].tensor[b, :96].clone(), kv.kv.tensors[4].tensor[b, :64].clone()]
        await worker.submit_store(2, spec, CPULoadStoreSpec(chunks_a + chunks_b))
        # Read the chunks back whole into scratch blocks to see mapped and unmapped bytes.
        scratch_a = list(range(20, 20 + len(chunks_a) * bpc))
        scratch_b = list(range(10, 10 + len(chunks_b) * bpc))
        old_a = [kv.kv.tensors[i].tensor[[full_a[c * bpc + s] for c in chunks_a for s in range(bpc)]].clone()
                 for i in range(3)]
        old_b = [kv.kv.tensors[i].tensor[[full_b[(c - 6) * bpc + s] for c in chunks_b for s in range(bpc)]]
                 .clone() for i in (3, 4)]
        await worker.submit_load(
            3, CPULoadStoreSpec(chunks_a + chunks_b),
            GPULoadStoreSpec(scratch_a + scratch_b, group_sizes=[len(scratch_a), len(scratch_b)]),
        )
        skip_a, skip_b = 5 % bpc, 4 % bpc
        for i in range(3):
            got = kv.kv.tensors[i].tensor[scratch_a]
            for pos in range(len(scratch_a)):
                j = pos - skip_a
                expect = want_a[i][j] if 0 <= j < len(a) else old_a[i][pos]
                assert torch.equal(got[pos], expect), (i, pos)
        for k, (i, width) in enumerate(((3, 96), (4, 64))):
            got = kv.kv.tensors[i].tensor[scratch_b, :width]
            for pos in range(len(scratch_b)):
                j = pos - skip_b
                expect = want_b[k][j] if 0 <= j < len(b) else old_b[k][pos, :width]
                assert torch.equal(got[pos], expect), (i, pos)


async def test_per_direction_fifo_under_hundreds_of_concurrent_jobs() -> None:
    kv = make_layers(num_layers=2, num_blocks=64, page_shape=(2, 2, 8))
    order: list[tuple[str, int]] = []
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=64) as worker:
        futures = []
        for i in range(300):
            block = i % 64
            if i % 3 == 2:
                fut = worker.submit_load(i, CPULoadStoreSpec([block]), GPULoadStoreSpec([block]),
                                         after=latch if i == 2 else None)
                fut.add_done_callback(lambda f: order.append(("load", f.job_id)))
            else:
                fut = worker.submit_store(i, GPULoadStoreSpec([block]), CPULoadStoreSpec([block]),
                                          after=latch if i == 0 else None)
                fut.add_done_callback(lambda f: order.append(("store", f.job_id)))
            futures.append(fut)
        await anyio.sleep(0.05)
        assert not any(f.done() for f in futures), "jobs behind a held head completed first"
        latch.set()
        async with anyio.create_task_group() as tg:
            for fut in futures:
                tg.start_soon(_await, fut)
    stores = [j for d, j in order if d == "store"]
    loads = [j for d, j in order if d == "load"]
    assert stores == sorted(stores) and len(stores) == 200
    assert loads == sorted(loads) and len(loads) == 100


async def _await(fut) -> None:
    await fut


async def test_expedited_loads_do_not_wait_behind_ordinary_loads(kv4: KV) -> None:
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        await worker.submit_store(0, GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0, 1]))
        slow = worker.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([5]), after=latch)
        behind = worker.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([6]))
        fast = worker.submit_load(3, CPULoadStoreSpec([1]), GPULoadStoreSpec([7]), expedited=True)
        with anyio.fail_after(5):
            result = await fast
        assert result.success and not slow.done() and not behind.done()
        assert torch.equal(kv4.kv.tensors[0].tensor[7], kv4.kv.tensors[0].tensor[1])
        latch.set()
        assert (await behind).success and slow.done()


async def test_a_future_can_be_awaited_many_times_from_many_tasks(kv4: KV) -> None:
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        latch = threading.Event()
        fut = worker.submit_store(7, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]), after=latch)
        results: list[TransferResult] = []

        async def waiter() -> None:
            results.append(await fut)

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(waiter)
            await anyio.sleep(0.01)
            assert not results
            latch.set()
        assert len(results) == 10 and all(r is results[0] for r in results)
        assert (await fut) is fut.result() and fut.done()


async def test_job_ids_may_be_reused_once_reported(kv4: KV) -> None:
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        for _ in range(3):
            assert (await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))).success


async def test_statistics_and_repr_count_per_direction(kv4: KV) -> None:
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([1, 2]), after=latch)
        assert "store=1 load=0" in repr(worker)
        assert worker.statistics().in_flight["store"] == 1
        latch.set()
        await fut
        await worker.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([3]))
        stats = worker.statistics()
        assert stats.completed == {"store": 1, "load": 1, "expedited_load": 0}
        page_bytes = sum(t.page_size_bytes for t in kv4.kv.tensors)
        assert stats.bytes_moved["store"] == 2 * page_bytes and stats.bytes_moved["load"] == page_bytes
    assert "closed" in repr(worker)


async def test_repr_closed_and_in_flight_follow_the_states(kv4: KV) -> None:
    worker = AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8)
    assert repr(worker) == ("<AsyncOffloadingWorker new backend=cpu chunks=8 in_flight: store=0 load=0 "
                            "expedited_load=0>")
    assert not worker.closed and worker.kv_caches is kv4.kv
    latch = threading.Event()
    async with worker:
        assert repr(worker).startswith("<AsyncOffloadingWorker open ")
        fut = worker.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), after=latch)
        assert worker.in_flight == 1 and "in_flight: store=0 load=1 " in repr(worker)
        latch.set()
        await fut
        assert worker.in_flight == 0 and not worker.closed
    assert worker.closed and repr(worker).startswith("<AsyncOffloadingWorker closed ")


async def test_check_submittable_refuses_a_bad_after_through_the_core(kv4: KV) -> None:
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        worker.check_submittable()
        worker.check_submittable(threading.Event())
        with pytest.raises(InvalidSpec, match=r"threading\.Event"):
            worker.check_submittable(after="now")
    with pytest.raises(WorkerClosed):
        worker.check_submittable()


async def test_cpu_bytes_sizes_the_pool_in_whole_chunks() -> None:
    kv = make_layers(num_layers=1, num_blocks=4)
    w = AsyncOffloadingWorker(kv.kv, cpu_bytes=10_000)
    assert w.num_cpu_chunks == 10_000 // w.chunk_bytes
    assert w.host_pool.numel() == w.num_cpu_chunks * w.chunk_bytes
    await w.aclose()


@pytest.mark.asyncio
async def test_plain_asyncio_with_pytest_asyncio(kv4: KV) -> None:
    random_bytes_(kv4.layers[0], torch.Generator().manual_seed(3))
    want = kv4.kv.tensors[0].tensor[4].clone()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=4) as worker:
        await worker.submit_store(1, GPULoadStoreSpec([4]), CPULoadStoreSpec([3]))
        kv4.kv.tensors[0].tensor[4] = 0
        await worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([4]))
    assert torch.equal(kv4.kv.tensors[0].tensor[4], want)


@pytest.mark.parametrize("anyio_backend", [("trio", {})], indirect=True)
async def test_awaiting_a_done_future_still_checkpoints(kv4: KV) -> None:
    import trio.testing

    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=4) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        await fut
        with trio.testing.assert_checkpoints():
            await fut
        with trio.testing.assert_no_checkpoints():
            fut.done()
            fut.result()
            worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))


async def test_by_default_a_long_wait_naps_on_the_doorbell(kv4: KV) -> None:
    """The held job is asked to ring the doorbell; the poller naps up to 10 ms at a time
    on it (a timer-only poller would nap ~1 ms at a time) and wakes when the job ends."""
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]), after=latch)
        await anyio.sleep(0.1)
        assert 1 <= worker._poller.sleeps <= 30
        assert list(worker._armed.values()) == [True]  # the one job in flight was asked
        worker._poller._max_nap = 60.0  # from the next nap on, only the ring can end it
        await anyio.sleep(0.03)
        latch.set()
        with anyio.fail_after(10):
            assert (await fut).success


async def test_a_job_that_cannot_ring_is_asked_once_and_timer_naps_take_over(
    kv4: KV, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiokv.backends.cpu import CpuCompletion

    asked = []
    monkeypatch.setattr(CpuCompletion, "ring_when_done", lambda self, bell: asked.append(self) or False)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]), after=latch)
        await anyio.sleep(0.1)
        assert len(asked) == 1 and list(worker._armed.values()) == [None]
        assert worker._poller.sleeps >= 20  # ~1 ms timer naps, not a spin on its own ring
        latch.set()
        assert (await fut).success


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
async def test_the_doorbell_costs_four_descriptors_and_returns_them(kv4: KV) -> None:
    before = _open_fds()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        assert _open_fds() == before + 4  # pipe (2), timerfd, epoll
        assert (await worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]))).success
    assert _open_fds() == before


async def test_without_the_doorbell_a_long_wait_polls_on_a_timer(kv4: KV) -> None:
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8, options={"doorbell": False}) as worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]), after=latch)
        # Timer naps, one after another while the job waits (counted, not timed: a busy
        # host may stretch each 1 ms nap).
        with anyio.fail_after(10):
            while worker._poller.sleeps < 40:
                await anyio.sleep(0.01)
        assert worker.in_flight == 1 and not worker._armed  # never asked: no bell to ring
        latch.set()
        assert (await fut).success


async def test_max_in_flight_refuses_past_the_bound_and_wait_for_room_waits_for_a_slot(kv4: KV) -> None:
    """A tight loop used to queue thousands of jobs; with a bound it is told to wait."""
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8, options={"max_in_flight": 3}) as worker:
        await worker.wait_for_room()  # room: returns at once
        held = [worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]),
                                    after=latch if i == 0 else None) for i in range(3)]
        with pytest.raises(QueueFull, match="max_in_flight=3"):
            worker.submit_load(9, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]))
        assert worker.statistics().in_flight == {"store": 3, "load": 0, "expedited_load": 0}
        with anyio.move_on_after(0.05) as scope:  # cancellable while full
            await worker.wait_for_room()
        assert scope.cancelled_caught
        threading.Timer(0.05, latch.set).start()
        with anyio.fail_after(10):
            await worker.wait_for_room()
        assert held[0].done()
        # Chunk 0's store is done; stores 1-2 may still run (directions are independent).
        fut = worker.submit_load(9, CPULoadStoreSpec([0]), GPULoadStoreSpec([5]))
        assert (await fut).success
        assert all([(await f).success for f in held])
        assert same_bytes(kv4.kv.tensors[0].tensor[5], kv4.kv.tensors[0].tensor[0])
        # A tight producer paced by wait_for_room never sees QueueFull.
        for i in range(20, 60):
            await worker.wait_for_room()
            worker.submit_store(i, GPULoadStoreSpec([i % 32]), CPULoadStoreSpec([i % 8 if i % 8 else 1]))
            assert worker.statistics().in_flight["store"] <= 3


async def test_a_task_waiting_for_room_is_told_when_the_worker_closes(kv4: KV) -> None:
    latch = threading.Event()
    outcome: list[BaseException] = []
    worker = AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8, options={"max_in_flight": 1})

    async def waiter() -> None:
        try:
            await worker.wait_for_room()
        except WorkerClosed as exc:
            outcome.append(exc)

    with pytest.raises(WorkerClosed):
        await worker.wait_for_room()  # not open yet
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with worker:
                worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
                tg.start_soon(waiter)
                await anyio.sleep(0.02)
                threading.Timer(0.05, latch.set).start()
    # The slot freed while the exit drained: the waiter woke and found the worker closing.
    assert len(outcome) == 1 and "closed" in str(outcome[0])


async def test_poller_statistics_report_a_detect_window_per_job(kv4: KV) -> None:
    worker = AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8)
    assert worker.poller_statistics() == PollerStatistics(0, 0, ())
    latch = threading.Event()
    async with worker:
        fut = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
        await anyio.sleep(0.03)
        latch.set()
        await fut
        for i in range(2, 6):
            await worker.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]))
        stats = worker.poller_statistics()
    assert len(stats.detect_windows) == 5 and all(0 <= w < 5 for w in stats.detect_windows)
    assert stats.polls >= 5 and stats.naps >= 1  # the held job was napped through
    with pytest.raises(AttributeError):
        stats.polls = 0  # type: ignore[misc]


async def test_check_store_and_check_load_refuse_what_submit_would_and_enqueue_nothing() -> None:
    from aiokv import InvalidSpec

    kv = make_layers(num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        worker.check_store(GPULoadStoreSpec([3, 4]), CPULoadStoreSpec([0, 1]))
        worker.check_load(CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 4]), expedited=True)
        bad = [
            (worker.check_load, CPULoadStoreSpec([0, 8]), GPULoadStoreSpec([3, 4])),  # chunk out of range
            (worker.check_load, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 16])),  # block out of range
            (worker.check_load, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 3])),  # written twice
            (worker.check_store, CPULoadStoreSpec([0]), GPULoadStoreSpec([3])),  # swapped
            (worker.check_store, GPULoadStoreSpec([3, 4]), CPULoadStoreSpec([0])),  # lengths
        ]
        for check, src, dst in bad:
            with pytest.raises(InvalidSpec):
                check(src, dst)
        assert worker.in_flight == 0
        assert sum(worker.statistics().completed.values()) == 0
    with pytest.raises(WorkerClosed):
        worker.check_store(GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
