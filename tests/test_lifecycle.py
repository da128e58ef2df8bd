"""Who opened a worker and whether it takes work: unopened and closed workers refuse it, a
second entry is refused, and one face cannot enter a worker the other face owns."""

from __future__ import annotations

import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    UsageError,
    WorkerClosed,
)
from tests.conftest import make_layers

pytestmark = pytest.mark.anyio


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


async def test_the_async_face_refuses_a_worker_the_sync_adapter_owns() -> None:
    from aiokv import SyncOffloadingWorker

    kv = make_layers(num_blocks=8)
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    adapter = SyncOffloadingWorker(worker)
    with pytest.raises(UsageError, match="a SyncOffloadingWorker owns this worker") as info:
        worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert not isinstance(info.value, WorkerClosed)
    with pytest.raises(UsageError, match="SyncOffloadingWorker owns"):
        async with worker:
            pass
    assert adapter.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    adapter.shutdown()
    with pytest.raises(WorkerClosed, match="closed"):
        async with worker:
            pass
