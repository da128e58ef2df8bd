"""aiokv.metrics: the statistics collector and the per-job histograms, on the CPU backend."""

from __future__ import annotations

import sys
import threading

import anyio
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    InvalidSpec,
    SyncOffloadingWorker,
    TransferResult,
)

prometheus_client = pytest.importorskip("prometheus_client")

from aiokv.metrics import OffloadMetrics, WorkerCollector  # noqa: E402


def _kv(num_blocks: int = 8) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    layers = [torch.randn(2, num_blocks, 4, 8) for _ in range(2)]
    return layers, CanonicalKVCaches.from_tensors(layers, block_dim=1)


def _sync_worker(num_chunks: int = 8) -> SyncOffloadingWorker:
    return SyncOffloadingWorker(_kv()[1], num_cpu_chunks=num_chunks)


def test_collector_exports_statistics_per_direction() -> None:
    registry = prometheus_client.CollectorRegistry()
    worker = _sync_worker()
    metrics = OffloadMetrics(worker, registry=registry, labels={"rank": "0"})
    try:
        worker.submit_store(1, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0, 1, 2]))
        worker.wait({1})
        worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([5]), True)
        worker.wait({2})
        results = {r.job_id: r for r in worker.get_finished()}
        assert set(results) == {1, 2}
        metrics.observe(results[1], "store")
        metrics.observe(results[2], Direction.EXPEDITED_LOAD)

        def sample(name: str, direction: str | None = None) -> float | None:
            labels = {"rank": "0"} | ({"direction": direction} if direction else {})
            return registry.get_sample_value(name, labels)

        block_bytes = 2 * 2 * 4 * 8 * 4  # layers * K/V * tokens * head_dim * float32
        assert sample("aiokv_transferred_bytes_total", "store") == 3 * block_bytes
        assert sample("aiokv_transferred_bytes_total", "expedited_load") == block_bytes
        assert sample("aiokv_transferred_bytes_total", "load") == 0
        assert sample("aiokv_transfers_total", "store") == 1
        assert sample("aiokv_transfer_failures_total", "store") == 0
        assert sample("aiokv_jobs_in_flight", "load") == 0
        assert sample("aiokv_host_pool_chunks") == 8
        assert sample("aiokv_host_pool_bytes") == 8 * worker.statistics().chunk_bytes
        assert sample("aiokv_transfer_size_bytes_sum", "store") == 3 * block_bytes
        assert sample("aiokv_transfer_size_bytes_count", "expedited_load") == 1
        assert sample("aiokv_transfer_seconds_count", "store") == 1
        assert sample("aiokv_transfer_seconds_sum", "store") == pytest.approx(results[1].transfer_time)
        text = prometheus_client.generate_latest(registry).decode()
        assert 'aiokv_transferred_bytes_total{direction="store",rank="0"}' in text
    finally:
        worker.shutdown()


def test_in_flight_gauge_counts_jobs_not_yet_completed() -> None:
    registry = prometheus_client.CollectorRegistry()
    worker = _sync_worker()
    registry.register(WorkerCollector(worker))
    latch = threading.Event()
    try:
        worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]), after=latch)
        worker.submit_store(2, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        assert registry.get_sample_value("aiokv_jobs_in_flight", {"direction": "store"}) == 2
        latch.set()
        worker.wait({1, 2})
        worker.get_finished()
        assert registry.get_sample_value("aiokv_jobs_in_flight", {"direction": "store"}) == 0
        assert registry.get_sample_value("aiokv_transfers_total", {"direction": "store"}) == 2
    finally:
        latch.set()
        worker.shutdown()


def test_observe_skips_failures_and_rejects_unknown_directions() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = OffloadMetrics(registry=registry)
    metrics.observe(TransferResult(7, False), "load")
    assert registry.get_sample_value("aiokv_transfer_seconds_count", {"direction": "load"}) is None
    metrics.observe(TransferResult(8, True, 4096, 0.002), "load")
    assert registry.get_sample_value("aiokv_transfer_seconds_count", {"direction": "load"}) == 1
    assert registry.get_sample_value("aiokv_transfer_size_bytes_sum", {"direction": "load"}) == 4096
    with pytest.raises(InvalidSpec, match="direction must be one of"):
        metrics.observe(TransferResult(9, True, 1, 0.1), "upload")
    with pytest.raises(InvalidSpec, match="expected a worker with statistics"):
        WorkerCollector(object())  # type: ignore[arg-type]


def test_track_observes_async_futures() -> None:
    registry = prometheus_client.CollectorRegistry()
    layers, kv = _kv()

    async def scenario() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=4) as worker:
            metrics = OffloadMetrics(worker, registry=registry)
            store = worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]))
            stored = await metrics.track(store, "store")
            load = worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([6]))
            loaded = await metrics.track(load, "load")
            assert stored.success and loaded.success

    anyio.run(scenario)
    assert torch.equal(layers[0][:, 6], layers[0][:, 2])
    for direction in ("store", "load"):
        assert registry.get_sample_value("aiokv_transfer_seconds_count", {"direction": direction}) == 1
        # The collector still reads the closed worker's last snapshot.
        assert registry.get_sample_value("aiokv_transfers_total", {"direction": direction}) == 1


def test_registering_twice_clashes_and_unregister_cleans_up() -> None:
    registry = prometheus_client.CollectorRegistry()
    worker = _sync_worker()
    try:
        metrics = OffloadMetrics(worker, registry=registry)
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            registry.register(WorkerCollector(worker))
        metrics.unregister()
        assert registry.get_sample_value("aiokv_host_pool_chunks") is None
        OffloadMetrics(worker, registry=registry)  # the names are free again
    finally:
        worker.shutdown()


def test_missing_prometheus_client_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = _sync_worker()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    try:
        with pytest.raises(ImportError, match=r"pip install -e '\.\[metrics\]'"):
            OffloadMetrics()
        with pytest.raises(ImportError, match=r"pip install -e '\.\[metrics\]'"):
            WorkerCollector(worker)
    finally:
        worker.shutdown()


def test_several_workers_share_one_registry_under_their_own_labels() -> None:
    """One process exporting two ranks: each worker's counters and histogram series under
    its label values; reused label values or other label names are refused; unregistering
    one leaves the other, and the last frees the names."""
    registry = prometheus_client.CollectorRegistry()
    workers = [_sync_worker(), _sync_worker(num_chunks=4)]
    try:
        ranks = [OffloadMetrics(w, registry=registry, labels={"rank": str(i)}) for i, w in enumerate(workers)]
        for i, (w, m) in enumerate(zip(workers, ranks)):
            w.submit_store(1, GPULoadStoreSpec(list(range(i + 1))), CPULoadStoreSpec(list(range(i + 1))))
            w.wait({1})
            (result,) = w.get_finished()
            m.observe(result, "store")
        block_bytes = 2 * 2 * 4 * 8 * 4

        def sample(name: str, rank: str, **more: str) -> float | None:
            return registry.get_sample_value(name, {"rank": rank, **more})

        for rank, blocks, chunks in (("0", 1, 8), ("1", 2, 4)):
            assert sample("aiokv_transferred_bytes_total", rank, direction="store") == blocks * block_bytes
            assert sample("aiokv_host_pool_chunks", rank) == chunks
            assert sample("aiokv_transfer_size_bytes_sum", rank, direction="store") == blocks * block_bytes
        with pytest.raises(InvalidSpec, match="exported here already"):
            OffloadMetrics(workers[0], registry=registry, labels={"rank": "0"})
        with pytest.raises(InvalidSpec, match="same label names"):
            OffloadMetrics(workers[0], registry=registry, labels={"host": "a"})
        ranks[0].unregister()
        ranks[0].unregister()  # idempotent
        assert sample("aiokv_host_pool_chunks", "0") is None
        assert sample("aiokv_transfer_size_bytes_sum", "0", direction="store") is None
        assert sample("aiokv_host_pool_chunks", "1") == 4
        ranks[1].unregister()
        assert registry.get_sample_value("aiokv_host_pool_chunks", {"rank": "1"}) is None
        OffloadMetrics(workers[0], registry=registry)  # the names are free again, other labels too
    finally:
        for w in workers:
            w.shutdown()


def test_a_refused_first_registration_leaves_the_registry_as_it_was() -> None:
    registry = prometheus_client.CollectorRegistry()
    worker = _sync_worker()
    try:
        direct = WorkerCollector(worker)
        registry.register(direct)
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            OffloadMetrics(worker, registry=registry)
        registry.unregister(direct)
        metrics = OffloadMetrics(worker, registry=registry)  # no histogram was left behind
        assert registry.get_sample_value("aiokv_host_pool_chunks") == 8
        metrics.unregister()
    finally:
        worker.shutdown()
