"""Per-tier Prometheus series of an OffloadCache with a lower tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiokv.cache.tiers import codec
from tests.test_tiers_cascade import MemTier, store_generations, tiered

prometheus_client = pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.anyio


async def test_tier_series_follow_the_cache_stats() -> None:
    from aiokv.metrics import CacheTierCollector

    registry = prometheus_client.CollectorRegistry()
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        registry.register(CacheTierCollector(cache, labels={"rank": "0"}))
        await store_generations(kv, cache, 12)
        await cache.drain()
        assert cache.lookup([f"k{i}" for i in range(8)]) == 8
        assert (await cache.restore(["k0", "k1"], [20, 21])).restored == 2
        labels = {"rank": "0", "tier": "mem"}
        value = registry.get_sample_value
        st = cache.stats().tiers[0]
        assert value("aiokv_cache_tier_hits_total", labels) == st.hits == 8
        assert value("aiokv_cache_tier_demoted_blocks_total", labels) == st.demoted == 8
        assert value("aiokv_cache_tier_restored_bytes_total", labels) == st.restored_bytes > 0
        assert value("aiokv_cache_tier_demotions_dropped_total", labels) == 0
        assert value("aiokv_cache_tier_held_bytes", labels) == st.tier.bytes_held > 0
        assert value("aiokv_cache_tier_queued_blocks", labels) == 0


async def test_two_tiers_of_one_name_get_distinct_series() -> None:
    from aiokv.metrics import CacheTierCollector

    registry = prometheus_client.CollectorRegistry()
    near, far = MemTier(), MemTier(remote=True)
    async with tiered([near, far]) as (kv, _w, cache):
        registry.register(CacheTierCollector(cache))
        await store_generations(kv, cache, 12)
        await cache.drain()
        assert (await cache.alookup(["k0", "k1"])) == 2
        value = registry.get_sample_value
        st = cache.stats().tiers
        assert value("aiokv_cache_tier_demoted_blocks_total", {"tier": "mem-1"}) == st[0].demoted == 8
        assert value("aiokv_cache_tier_demoted_blocks_total", {"tier": "mem-2"}) == st[1].demoted == 0
        assert value("aiokv_cache_tier_hits_total", {"tier": "mem-1"}) == st[0].hits == 2
        samples = [s for m in registry.collect() for s in m.samples]
        keys = [(s.name, tuple(sorted(s.labels.items()))) for s in samples]
        assert len(keys) == len(set(keys)) == 2 * 11


async def test_blocks_persisted_on_close_are_exported(tmp_path: Path) -> None:
    from aiokv import DiskTier
    from aiokv.metrics import CacheTierCollector

    registry = prometheus_client.CollectorRegistry()
    async with tiered([DiskTier(tmp_path, capacity_bytes=1 << 24)], persist_on_close=True) as (kv, _w, cache):
        registry.register(CacheTierCollector(cache))
        await store_generations(kv, cache, 8)  # k4..k7 only in the host
    st = cache.stats().tiers[0]
    assert st.persisted == 4
    assert registry.get_sample_value("aiokv_cache_tier_persisted_blocks_total", {"tier": "disk"}) == 4


async def test_read_misses_are_exported() -> None:
    from aiokv.metrics import CacheTierCollector

    registry = prometheus_client.CollectorRegistry()
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        registry.register(CacheTierCollector(cache))
        await store_generations(kv, cache, 8)
        await cache.drain()
        tier.fail_reads.add(codec.key_bytes("k1"))
        assert (await cache.restore(["k0", "k1"], [20, 21])).restored == 1
        st = cache.stats().tiers[0]
        assert st.read_misses == 1
        assert registry.get_sample_value("aiokv_cache_tier_read_misses_total", {"tier": "mem"}) == 1
