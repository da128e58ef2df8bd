"""An ``OffloadCache`` in Prometheus, through prometheus_client's real registry: its copies
feed ``OffloadMetrics``' histograms (they stayed empty before), ``CacheCollector`` exports
its own counters (hits, stores, restores, staging, drops), and ``examples/async_server.py
--serve --metrics`` serves both at ``/metrics``."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv import AsyncOffloadingWorker, InvalidSpec, OffloadCache
from tests.conftest import make_layers
from tests.test_examples import _server, load_example
from tests.test_tiers_cascade import MemTier, store_generations, tiered
from tests.test_tiers_lifecycle import StuckTier

prometheus_client = pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.anyio


def sample(registry: Any, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_the_caches_copies_feed_the_histograms() -> None:
    from aiokv.metrics import OffloadMetrics

    registry = prometheus_client.CollectorRegistry()
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        metrics = OffloadMetrics(worker, registry=registry)
        async with OffloadCache(worker, policy="lru", metrics=metrics) as cache:
            await cache.offload(["a", "b", "c"], [1, 2, 3])
            await cache.offload(["d"], [4])
            assert await cache.restore(["a", "b"], [8, 9])
            assert await cache.restore(["c"], [10], expedited=True)
            # Observed at the next offload or restore, or stats(): the last restore not yet.
            assert sample(registry, "aiokv_transfer_seconds_count", direction="load") == 1
            assert sample(registry, "aiokv_transfer_seconds_count", direction="expedited_load") is None
            st = cache.stats()
            assert sample(registry, "aiokv_transfer_seconds_count", direction="expedited_load") == 1
            await cache.offload(["e"], [5])
        # The exit folds what the last call left.
        assert sample(registry, "aiokv_transfer_seconds_count", direction="store") == 3
        stored = cache.stats().store_bytes
        assert sample(registry, "aiokv_transfer_size_bytes_sum", direction="store") == stored
        assert st.store_bytes == 4 * worker.chunk_bytes
        assert sample(registry, "aiokv_transfer_seconds_count", direction="load") == 1
        assert sample(registry, "aiokv_transfer_seconds_count", direction="expedited_load") == 1
        loads = sum(sample(registry, "aiokv_transfer_size_bytes_sum", direction=d) or 0
                    for d in ("load", "expedited_load"))
        assert loads == st.load_bytes == 3 * worker.chunk_bytes
        seconds = sample(registry, "aiokv_transfer_seconds_sum", direction="store")
        assert seconds == pytest.approx(cache.stats().store_seconds) and seconds > 0
        # The worker's own counters agree (the collector of the same OffloadMetrics).
        assert sample(registry, "aiokv_transfers_total", direction="store") == 3
        metrics.unregister()


async def test_metrics_that_are_no_offload_metrics_are_refused() -> None:
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec, match="OffloadMetrics"):
            OffloadCache(worker, metrics=prometheus_client.CollectorRegistry())
        OffloadCache(worker)  # the refused one claimed no chunks


async def test_cache_collector_exports_the_cache_counters() -> None:
    from aiokv.metrics import CacheCollector

    registry = prometheus_client.CollectorRegistry()
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        cache = OffloadCache(worker, policy="lru")
        registry.register(CacheCollector(cache, labels={"rank": "0"}))
        await cache.offload(["a", "b", "c"], [1, 2, 3])
        await cache.offload(["d", "e"], [4, 5])  # evicts one key
        assert cache.lookup(["b", "c", "x"]) == 2
        assert await cache.restore(["b"], [9])
        assert not await cache.restore(["x"], [10])
        st = cache.stats()
        value = {name: sample(registry, f"aiokv_cache_{name}", rank="0") for name in (
            "hits_total", "host_hits_total", "misses_total", "offered_keys_total", "stored_keys_total",
            "evictions_total", "restores_total", "restored_keys_total", "restore_misses_total",
            "store_bytes_total", "load_bytes_total", "keys", "chunks", "pinned_keys",
            "copies_in_flight", "staging_chunks", "demotions_dropped_total")}
        assert value["hits_total"] == st.hits == 2 and value["misses_total"] == st.misses == 1
        assert value["host_hits_total"] == 2
        assert value["offered_keys_total"] == 5 and value["stored_keys_total"] == 5
        assert value["evictions_total"] == st.evictions == 1
        assert value["restores_total"] == 2 and value["restored_keys_total"] == 1
        assert value["restore_misses_total"] == 1
        assert value["store_bytes_total"] == st.store_bytes == 5 * worker.chunk_bytes
        assert value["load_bytes_total"] == worker.chunk_bytes
        assert value["keys"] == 4 and value["chunks"] == 4 and value["pinned_keys"] == 0
        assert value["copies_in_flight"] == 0 and value["staging_chunks"] == 0
        assert value["demotions_dropped_total"] == 0


async def test_cache_collector_exports_staging_and_drops() -> None:
    from aiokv.metrics import CacheCollector

    registry = prometheus_client.CollectorRegistry()
    async with tiered([MemTier()]) as (kv, _w, cache):
        registry.register(CacheCollector(cache))
        await store_generations(kv, cache, 8)
        await cache.drain()
        st = cache.stats()
        assert sample(registry, "aiokv_cache_staging_chunks") == st.staging_chunks > 0
        assert sample(registry, "aiokv_cache_staging_free") == st.staging_free
    registry = prometheus_client.CollectorRegistry()
    tier = StuckTier()  # never writes: what is queued at the exit is dropped
    async with tiered([tier], drain_timeout=0.3) as (kv, _w, cache):
        registry.register(CacheCollector(cache))
        await store_generations(kv, cache, 12)
    dropped = cache.stats().tiers[0].demotions_dropped
    assert dropped > 0 and sample(registry, "aiokv_cache_demotions_dropped_total") == dropped


async def test_the_example_server_serves_metrics_with_metrics_on() -> None:
    pytest.importorskip("fastapi")
    import httpx

    mod = load_example("async_server")
    registry = prometheus_client.CollectorRegistry()
    server = _server(mod, num_gpu_blocks=32, num_cpu_chunks=64, metrics_registry=registry)
    app = mod.create_app(server)
    prompt = "You are a terse assistant. " * 3
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/generate", json={"prompt": prompt})
            await server.cache.drain()  # the first request's offload (a background task)
            second = (await client.post("/generate", json={"prompt": prompt})).json()
            assert second["hit_blocks"] > 0
            await client.get("/stats")  # a call into the cache after the restore: observed
            text = (await client.get("/metrics")).text
    assert 'aiokv_transfer_seconds_count{direction="load"} 1.0' in text
    assert 'aiokv_transfer_seconds_count{direction="store"}' in text
    assert f"aiokv_cache_hits_total {float(second['hit_blocks'])}" in text
    assert "aiokv_cache_stored_keys_total" in text and "aiokv_transfers_total" in text
    assert server.cache.closed  # the lifespan closed it before the worker


def test_the_example_builds_a_server_with_metrics_from_its_flag() -> None:
    pytest.importorskip("fastapi")
    mod = load_example("async_server")
    small = mod.ModelConfig(hidden=64, num_layers=2, heads=2, head_dim=32)
    server = mod.build_server(metrics=True, cfg=small, device="cpu")
    assert server.metrics is not None
    names = {m.name for m in server.metrics.registry.collect()}
    assert {"aiokv_cache_hits", "aiokv_transfer_seconds", "aiokv_transfers"} <= names
    assert mod.build_server(cfg=small, device="cpu").metrics is None
    with pytest.raises(SystemExit):
        mod.main(["--metrics"])  # no /metrics without --serve


async def test_a_scrape_from_its_own_thread_neither_loses_nor_doubles_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prometheus_client's own server scrapes on a thread of its own, so ``stats()`` (and the
    fold of finished copies into the histograms) runs there while the loop folds at each
    call's entry and done callbacks add copies: every copy is observed exactly once."""
    import threading
    import time

    from aiokv.metrics import CacheCollector, OffloadMetrics

    real = OffloadMetrics.observe

    def observe(self: Any, result: Any, direction: Any) -> None:
        time.sleep(2e-4)  # on CUDA the read of a copy's device time lets other threads run
        real(self, result, direction)

    monkeypatch.setattr(OffloadMetrics, "observe", observe)
    registry = prometheus_client.CollectorRegistry()
    kv = make_layers(num_layers=2, num_blocks=64)
    rounds = 150
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=32) as worker:
        metrics = OffloadMetrics(worker, registry=registry)
        cache = OffloadCache(worker, policy="lru", metrics=metrics)
        registry.register(CacheCollector(cache))
        stop = threading.Event()

        def scrape() -> None:
            while not stop.is_set():
                prometheus_client.generate_latest(registry)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            for i in range(rounds):
                assert (await cache.offload([f"k{i}"], [i % 32])).stored == 1
                assert await cache.restore([f"k{i}"], [32 + i % 32])
        finally:
            stop.set()
            scraper.join()
        await cache.aclose()
        st = cache.stats()
    assert sample(registry, "aiokv_transfer_seconds_count", direction="store") == rounds
    assert sample(registry, "aiokv_transfer_seconds_count", direction="load") == rounds
    assert sample(registry, "aiokv_transfer_size_bytes_sum", direction="store") == st.store_bytes
    seconds = {d: sample(registry, "aiokv_transfer_seconds_sum", direction=d) for d in ("store", "load")}
    assert seconds == {"store": pytest.approx(st.store_seconds), "load": pytest.approx(st.load_seconds)}
    metrics.unregister()


async def test_one_registry_exports_several_caches_told_apart_by_labels() -> None:
    """Two caches of one process (one per rank, per model) in one registry: prometheus_client
    refuses a second collector of the same names, so the collector takes both, each under
    its own label values, and drops one that is gone."""
    from aiokv.metrics import CacheCollector

    registry = prometheus_client.CollectorRegistry()
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        a = OffloadCache(worker, policy="lru", chunks=range(0, 4))
        b = OffloadCache(worker, policy="lru", chunks=range(4, 8))
        collector = CacheCollector(a, labels={"cache": "a"})
        registry.register(collector)
        collector.add(b, {"cache": "b"})
        await a.offload(["x"], [1])
        await b.offload(["y", "z"], [2, 3])
        assert sample(registry, "aiokv_cache_stored_keys_total", cache="a") == 1
        assert sample(registry, "aiokv_cache_stored_keys_total", cache="b") == 2
        with pytest.raises(InvalidSpec, match="exported here already"):
            collector.add(b, {"cache": "a"})
        with pytest.raises(InvalidSpec, match="labels must name"):
            collector.add(b, {"rank": "1"})
        with pytest.raises(InvalidSpec, match="OffloadCache"):
            collector.add(object(), {"cache": "c"})  # type: ignore[arg-type]
        assert collector.discard({"cache": "a"}) is True  # b is left
        assert sample(registry, "aiokv_cache_stored_keys_total", cache="a") is None
        assert sample(registry, "aiokv_cache_stored_keys_total", cache="b") == 2
