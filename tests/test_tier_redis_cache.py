"""OffloadCache over a real Redis: blocks the host evicted come back byte-exact, a second
cache on its own worker restores a prefix the first wrote through, and a server killed
during a restore costs misses (no hang) until it returns, without rebuilding the tier."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import torch

from aiokv import AsyncOffloadingWorker, OffloadCache
from tests.conftest import KV, make_layers, same_bytes
from tests.redis_server import RedisServer, need_redis, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NUM_BLOCKS = 32
HOST = 4
STAGING = 2


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    need_redis()
    with running(RedisServer(tmp_path / "redis")) as started:
        assert isinstance(started, RedisServer)
        yield started


def redis_tier(url: str, **kwargs: object):  # type: ignore[no-untyped-def]
    from aiokv import RedisTier

    return RedisTier(url, namespace="cache-tests", timeout=1.0, **kwargs)  # type: ignore[arg-type]


@asynccontextmanager
async def cache_over(tier: object, seed: int) -> AsyncIterator[tuple[KV, OffloadCache]]:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, seed=seed)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + STAGING) as worker:
        async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=STAGING) as cache:
            yield kv, cache


def block(kv: KV, index: int) -> list[torch.Tensor]:
    return [t[:, index].clone() for t in kv.layers]


def fresh_bytes(kv: KV, blocks: Sequence[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.layers:
        view = t.view(torch.uint8)
        for b in blocks:
            view[:, b].copy_(torch.randint(0, 256, view[:, b].shape, dtype=torch.uint8, generator=gen))


async def offload_generations(kv: KV, cache: OffloadCache, n: int, tag: str) -> dict[str, list[torch.Tensor]]:
    """Offload ``n`` keys four at a time from GPU blocks 0..3 (fresh random bytes each time),
    so each batch evicts the previous one from the four host chunks into Redis."""
    expected: dict[str, list[torch.Tensor]] = {}
    for start in range(0, n, 4):
        keys = [f"{tag}{i}" for i in range(start, start + 4)]
        fresh_bytes(kv, range(4), seed=start + 7)
        expected.update({key: block(kv, i) for i, key in enumerate(keys)})
        assert (await cache.offload(keys, list(range(4)))).stored == 4
    return expected


def restored_exactly(kv: KV, keys: Sequence[str], first: int,
                     expected: dict[str, list[torch.Tensor]]) -> bool:
    return all(all(same_bytes(a, b) for a, b in zip(block(kv, first + i), expected[key]))
               for i, key in enumerate(keys))


async def test_evicted_blocks_come_back_from_redis_byte_exact(server: RedisServer) -> None:
    tier = redis_tier(server.url)
    async with cache_over(tier, seed=1) as (kv, cache):
        expected = await offload_generations(kv, cache, 16, "k")
        await cache.drain()
        keys = list(expected)
        assert cache.lookup(keys) == 0  # the host holds the last four, not the first
        assert await cache.alookup(keys[:12]) == 12  # the twelve the host evicted
        fresh_bytes(kv, range(16, 32), seed=99)
        result = await cache.restore(keys, list(range(16, 32)))
        assert result.restored == 16 and result.from_tiers == 12 and result.from_host == 4
        assert restored_exactly(kv, keys, 16, expected)
        stats = tier.statistics()
        assert stats.read_hits == 12 and stats.corrupt == 0 and stats.errors == 0


async def test_a_second_cache_restores_a_prefix_written_through(server: RedisServer) -> None:
    async with cache_over(redis_tier(server.url, write_through=True), seed=2) as (kv_a, cache_a):
        fresh_bytes(kv_a, range(3), seed=5)
        expected = {f"p{i}": block(kv_a, i) for i in range(3)}
        assert (await cache_a.offload(list(expected), [0, 1, 2])).stored == 3
        await cache_a.drain()
    async with cache_over(redis_tier(server.url), seed=3) as (kv_b, cache_b):
        assert await cache_b.alookup(["p0", "p1", "p2", "elsewhere"]) == 3
        result = await cache_b.restore(["p0", "p1", "p2"], [9, 10, 11])
        assert result.restored == 3
        assert restored_exactly(kv_b, ["p0", "p1", "p2"], 9, expected)


async def test_a_server_killed_during_a_restore_costs_misses_then_recovers(server: RedisServer) -> None:
    tier = redis_tier(server.url, write_through=True)
    async with cache_over(tier, seed=4) as (kv, cache):
        await offload_generations(kv, cache, 12, "k")
        await cache.drain()
        keys = [f"k{i}" for i in range(8)]  # only in Redis now
        assert server.process is not None
        server.process.send_signal(signal.SIGSTOP)  # the restore's reads will hang ...
        results = []

        async def restore() -> None:
            results.append(await cache.restore(keys, list(range(16, 24))))

        begin = time.monotonic()
        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(restore)
                await anyio.sleep(0.2)
                server.kill()  # ... until the server dies under them
        assert time.monotonic() - begin < 10
        assert results[0].restored == 0 and not results[0]
        assert tier.statistics().errors >= 1
        stats = cache.stats()
        assert stats.manager.pinned_keys == 0 and stats.in_flight == 0
        server.start()  # the same port, an empty store; the same tier object
        assert (await cache.restore(keys[:2], [16, 17])).restored == 0  # gone with the server
        again = await offload_generations(kv, cache, 8, "after")
        await cache.drain()
        fresh_bytes(kv, range(16, 24), seed=42)
        result = await cache.restore(list(again), list(range(16, 24)))
        assert result.restored == 8 and result.from_tiers == 4
        assert restored_exactly(kv, list(again), 16, again)


async def test_a_hung_server_bounds_the_exit_as_a_whole(server: RedisServer) -> None:
    """A server that stops answering (SIGSTOP) with seven batches queued: leaving the cache
    takes the drain bound and one socket timeout, not two timeouts per batch."""
    tier = redis_tier(server.url)  # a 1 s timeout on every call
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, seed=6)
    assert server.process is not None
    try:
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + STAGING) as worker:
            cache = OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=STAGING,
                                 drain_timeout=1.0)
            async with cache:
                server.process.send_signal(signal.SIGSTOP)
                await offload_generations(kv, cache, 32, "k")  # seven batches go down
                begin = time.monotonic()
        assert time.monotonic() - begin < 6
        st = cache.stats().tiers[0]
        assert st.demoted + st.demotions_dropped == 28 and st.queued_blocks == 0
    finally:
        server.process.send_signal(signal.SIGCONT)


async def test_a_tier_that_cannot_open_raises_its_own_error(anyio_backend: tuple[str, dict]) -> None:
    """The asyncio Redis client under trio: entering the cache raises the tier's
    ``UsageError`` itself (not an ExceptionGroup), and nothing is left open."""
    pytest.importorskip("redis")
    if anyio_backend[0] != "trio":
        pytest.skip("the asyncio client opens on asyncio loops")
    from aiokv import RedisTier, UsageError

    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        cache = OffloadCache(worker, tiers=[RedisTier("redis://127.0.0.1:1", client="asyncio")])
        try:
            async with cache:
                pytest.fail("the asyncio client opened under trio")
        except UsageError as exc:
            assert "asyncio" in str(exc)
