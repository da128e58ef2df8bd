"""What the core refuses and what it fails: bad input raises a typed error before anything is
enqueued and the worker stays usable; a host pool that cannot be had is a
``HostMemoryError``; a failed copy fails its own job only, a sticky device error every
pending one."""

from __future__ import annotations

import threading
import traceback

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
    WorkerBroken,
)
from aiokv.backends.cpu import CpuLane
from tests.conftest import copies_ending, make_layers, same_bytes

pytestmark = pytest.mark.anyio


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


def test_constructor_rejects_bad_sizes_and_caches() -> None:
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
    with pytest.raises(InvalidSpec, match="CanonicalKVCaches"):
        AsyncOffloadingWorker([torch.zeros(4, 4)], num_cpu_chunks=4)  # type: ignore[arg-type]


def test_bool_sizes_are_rejected() -> None:
    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="positive int"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=True)


def test_a_pool_that_cannot_be_allocated_still_releases_the_backend(monkeypatch) -> None:
    from aiokv.backends.cpu import CpuBackend

    released: list[bool] = []
    monkeypatch.setattr(CpuBackend, "allocate_pool", lambda self, nbytes, file=None: (_ for _ in ()).throw(
        InvalidSpec("could not map that many bytes")))
    monkeypatch.setattr(CpuBackend, "close", lambda self: released.append(True))
    with pytest.raises(InvalidSpec, match="could not map"):
        AsyncOffloadingWorker(make_layers(num_blocks=8).kv, num_cpu_chunks=4)
    assert released == [True]


def test_a_pool_larger_than_the_host_memory_is_a_host_memory_error() -> None:
    from aiokv.host_memory import available_host_memory

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
    import aiokv.host_memory
    from aiokv.backends.cpu import CpuBackend

    released: list[bool] = []
    monkeypatch.setattr(aiokv.host_memory, "available_host_memory", lambda: None)
    monkeypatch.setattr(CpuBackend, "close", lambda self: released.append(True))
    with pytest.raises(HostMemoryError, match="could not allocate a host pool") as info:
        AsyncOffloadingWorker(make_layers(num_blocks=8).kv, cpu_bytes=1 << 62)
    assert isinstance(info.value.__cause__, RuntimeError) and released == [True]


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


async def test_after_of_the_wrong_kind_is_rejected() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match=r"threading\.Event"):
            worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after="stream")
        assert worker.statistics().in_flight["store"] == 0


def test_a_worker_on_the_cpu_backend_refuses_caches_off_the_cpu() -> None:
    meta = CanonicalKVCaches.from_tensors([torch.empty(2, 8, 4, device="meta")], block_dim=1)
    with pytest.raises(InvalidSpec, match="CPU backend needs CPU tensors"):
        AsyncOffloadingWorker(meta, num_cpu_chunks=4, backend="cpu")
