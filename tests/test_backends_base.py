"""``WorkerStatistics.lanes``: one ``LaneStatistics`` record per direction, read from the
lanes. The CPU backend's lanes have no copy strategies, so theirs are the defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.backends.base import LaneStatistics


@pytest.mark.anyio
async def test_cpu_worker_reports_default_lane_records_per_direction() -> None:
    kv = torch.randint(0, 255, (8, 512), dtype=torch.uint8)
    async with AsyncOffloadingWorker(CanonicalKVCaches.from_tensors([kv]), num_cpu_chunks=4,
                                     backend="cpu") as worker:
        await worker.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]))
        stats = worker.statistics()
    assert stats.lanes == {d: LaneStatistics() for d in ("store", "load", "expedited_load")}
    assert stats.completed["store"] == 1


def test_lane_statistics_is_a_frozen_record() -> None:
    record = LaneStatistics(strategy="dma", pitched_jobs=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.pitched_jobs = 3  # type: ignore[misc]
    assert record.last_started_at is None and record.pitched_heights == ()
