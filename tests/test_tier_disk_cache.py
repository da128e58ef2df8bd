"""DiskTier under a real OffloadCache: persistence across caches, a full disk, a torn file."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokv import AsyncOffloadingWorker, DiskTier, OffloadCache
from aiokv.cache.tiers import codec
from tests.conftest import KV, make_layers, same_bytes

pytestmark = pytest.mark.anyio

HOST = 4
STAGING = 2
NUM_BLOCKS = 48
PAGE = (16, 8, 64)  # bf16: 16 KiB per K or V page, 64 KiB per block over two layers


@asynccontextmanager
async def cache_on(kv: KV, tier: DiskTier, *, staging: int = STAGING,
                   **options: Any) -> AsyncIterator[OffloadCache]:
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + staging) as worker:
        async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=staging,
                                **options) as cache:
            yield cache


def block(kv: KV, b: int) -> list[torch.Tensor]:
    return [t[:, b].clone() for t in kv.layers]


def fill(kv: KV, blocks: Sequence[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.layers:
        for b in blocks:
            page = t.view(torch.uint8)[:, b]
            page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))


async def offload_generations(kv: KV, cache: OffloadCache, n: int) -> dict[str, list[torch.Tensor]]:
    """Offload ``n`` keys four at a time from GPU blocks 0..3 refilled with random bytes, so
    the host (four chunks) evicts, and demotes, every earlier generation."""
    expected: dict[str, list[torch.Tensor]] = {}
    for start in range(0, n, 4):
        keys = [f"k{i}" for i in range(start, start + 4)]
        fill(kv, range(4), seed=1000 + start)
        expected.update((key, block(kv, i)) for i, key in enumerate(keys))
        assert (await cache.offload(keys, list(range(4)))).stored == 4
    await cache.drain()
    return expected


def restored_exactly(kv: KV, keys: Sequence[str], first_block: int,
                     expected: dict[str, list[torch.Tensor]]) -> bool:
    return all(
        same_bytes(a, b)
        for i, key in enumerate(keys)
        for a, b in zip(block(kv, first_block + i), expected[key])
    )


async def test_a_new_cache_on_the_same_directory_restores_what_the_first_stored(
        tmp_path: Path) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=3)
    async with cache_on(kv, DiskTier(tmp_path, capacity_bytes=1 << 26)) as first:
        expected = await offload_generations(kv, first, 16)
        assert first.stats().tiers[0].demoted == 12

    # Another process would start here: a new worker over other GPU memory, same layout.
    other = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=4)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26)
    async with cache_on(other, tier) as second:
        keys = [f"k{i}" for i in range(12)]
        assert second.lookup(keys) == 12  # the rebuilt index answers without I/O
        result = await second.restore(keys, list(range(20, 32)))
        assert result and result.restored == 12
        assert restored_exactly(other, keys, 20, expected)
        assert tier.statistics().read_hits == 12 and tier.statistics().corrupt == 0


async def test_a_torn_file_ends_the_restore_there(tmp_path: Path) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=5)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26)
    async with cache_on(kv, tier) as cache:
        expected = await offload_generations(kv, cache, 12)
        keys = [f"k{i}" for i in range(8)]  # demoted: only the disk has them
        victim = tier._opened().path(codec.key_bytes("k3"))
        raw = bytearray(Path(victim).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        Path(victim).write_bytes(raw)
        before = block(kv, 40 + 3)
        result = await cache.restore(keys, list(range(40, 48)))
        assert not result and result.restored == 3
        assert restored_exactly(kv, keys[:3], 40, expected)
        assert all(same_bytes(a, b) for a, b in zip(block(kv, 43), before))  # never written
        assert tier.statistics().corrupt == 1 and not tier.holds(codec.key_bytes("k3"))
        assert cache.lookup(keys) == 3


async def test_a_full_disk_drops_demotions_and_loses_nothing_from_the_host(
        small_disk: Path) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=6)
    tier = DiskTier(small_disk, capacity_bytes=1 << 26)  # the disk fills long before this
    async with cache_on(kv, tier) as cache:
        expected = await offload_generations(kv, cache, 40)
        st = cache.stats().tiers[0]
        on_disk = [f"k{i}" for i in range(36) if tier.holds(codec.key_bytes(f"k{i}"))]
        assert 0 < len(on_disk) < 36 and tier.statistics().errors > 0
        assert st.demoted == len(on_disk) and st.demotions_dropped == 36 - len(on_disk)
        assert not [n for n in os.listdir(tier.directory) if n.startswith(".tmp-")]
        host = [f"k{i}" for i in range(36, 40)]
        assert cache.lookup(host) == 4
        assert (await cache.restore(host, list(range(10, 14)))).restored == 4
        assert restored_exactly(kv, host, 10, expected)
        # What did reach the disk before it filled reads back whole.
        got = await cache.restore(on_disk, list(range(14, 14 + len(on_disk))))
        assert got.restored == len(on_disk)
        assert restored_exactly(kv, on_disk, 14, expected)


@pytest.mark.parametrize("persist", [True, False])
async def test_persist_on_close_lets_the_next_process_find_the_host_blocks(tmp_path: Path,
                                                                         persist: bool) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=7)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", tiers=[DiskTier(tmp_path, capacity_bytes=1 << 26)],
                             staging_chunks=STAGING, persist_on_close=persist)
        async with cache:
            expected = await offload_generations(kv, cache, 8)  # k4..k7 only in the host
        assert cache.stats().tiers[0].persisted == (4 if persist else 0)
        assert cache.stats().tiers[0].demoted == 4

    other = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=8)
    async with cache_on(other, DiskTier(tmp_path, capacity_bytes=1 << 26)) as second:
        keys = [f"k{i}" for i in range(8)]
        found = second.lookup(keys)
        assert found == (8 if persist else 4)
        result = await second.restore(keys[:found], list(range(20, 20 + found)))
        assert result.restored == found
        assert restored_exactly(other, keys[:found], 20, expected)


async def test_a_cache_left_through_an_error_does_not_persist(tmp_path: Path) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=9)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", tiers=[DiskTier(tmp_path, capacity_bytes=1 << 26)],
                             staging_chunks=STAGING, persist_on_close=True)
        with pytest.raises(KeyError):
            async with cache:
                await offload_generations(kv, cache, 4)
                raise KeyError("the server failed")
        assert cache.stats().tiers[0].persisted == 0


async def test_a_slow_full_disk_never_lets_the_cache_find_more_than_it_holds(tmp_path: Path) -> None:
    """Blocks on their way down never outnumber what the disk holds. Otherwise a disk full
    of blocks still being written refuses the next ones, which wait in memory for a retry
    and are found there only while the writer lags: what the cache finds (and a replay's
    hit rate) would hang on the disk's speed."""
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=10)
    disk_blocks = 8
    tier = DiskTier(tmp_path, capacity_bytes=disk_blocks * (64 << 10), simulated_latency=0.05)
    most = 0
    async with cache_on(kv, tier) as cache:
        offered: list[str] = []
        expected: dict[str, list[torch.Tensor]] = {}
        for start in range(0, 40, 4):
            keys = [f"k{i}" for i in range(start, start + 4)]
            fill(kv, range(4), seed=2000 + start)
            expected.update((key, block(kv, i)) for i, key in enumerate(keys))
            assert (await cache.offload(keys, list(range(4)))).stored == 4
            offered += keys
            most = max(most, sum(cache.lookup([k]) for k in offered))
        await cache.drain()
        assert most <= HOST + disk_blocks
        st = cache.stats().tiers[0]
        assert st.demotions_dropped == 0 and st.demoted == 36
        found = [k for k in offered if cache.lookup([k])]
        assert len(found) == HOST + disk_blocks
        result = await cache.restore(found[:disk_blocks], list(range(20, 20 + disk_blocks)))
        assert result.restored == disk_blocks
        assert restored_exactly(kv, found[:disk_blocks], 20, expected)


async def test_writes_a_bounded_exit_stops_count_what_reached_the_disk(tmp_path: Path) -> None:
    """A disk write cannot be abandoned half way: its threads finish even when the exit's
    bound cancels it. What they wrote counts as written, not dropped, so the counters say
    what the next cache on the directory finds."""
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=11)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, simulated_latency=0.3)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=STAGING,
                             drain_timeout=0.05)
        async with cache:
            for start in range(0, 16, 4):
                fill(kv, range(4), seed=3000 + start)
                await cache.offload([f"k{i}" for i in range(start, start + 4)], list(range(4)))
    st = cache.stats().tiers[0]
    assert st.demoted + st.demotions_dropped == 12 and st.queued_blocks == 0

    async with cache_on(kv, DiskTier(tmp_path, capacity_bytes=1 << 26)) as second:
        found = sum(second.lookup([f"k{i}"]) for i in range(12))
    assert found == st.demoted > 0
