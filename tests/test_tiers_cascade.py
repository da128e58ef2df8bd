"""OffloadCache over lower tiers: demotion of evicted blocks, write-through, lookups across
tiers, pipelined restores that stop at the first bad key, a slow tier, and cancellation."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    DiskTier,
    OffloadCache,
    SyncOffloadingWorker,
    Tier,
    TierStatistics,
    UsageError,
)
from aiokv.cache.tiers import codec
from tests.conftest import KV, make_layers, same_bytes

pytestmark = pytest.mark.anyio

NUM_BLOCKS = 48
STAGING = 2


class MemTier(Tier):
    """A dict-backed tier: real bytes, with knobs for faults and slowness."""

    name = "mem"

    def __init__(self, *, remote: bool = False, write_through: bool = False) -> None:
        self.remote = remote
        self.write_through = write_through
        self.values: dict[bytes, bytes] = {}
        self.fail_reads: set[bytes] = set()
        self.read_gate: anyio.Event | None = None
        self.write_gate: anyio.Event | None = None
        self.reads = self.writes = 0
        self.opened_with: bytes | None = None
        self.closed = False

    async def open(self, fingerprint: bytes) -> None:
        self.opened_with = fingerprint

    async def aclose(self) -> None:
        self.closed = True

    def holds(self, key: bytes) -> bool:
        return not self.remote and key in self.values

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        await anyio.lowlevel.checkpoint()
        return [k in self.values for k in keys]

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        if self.read_gate is not None:
            await self.read_gate.wait()
        await anyio.lowlevel.checkpoint()
        self.reads += len(keys)
        got = []
        for key, view in zip(keys, out):
            value = self.values.get(key)
            if value is None or key in self.fail_reads:
                got.append(False)
                continue
            view[:] = value
            got.append(True)
        return got

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        if self.write_gate is not None:
            await self.write_gate.wait()
        await anyio.lowlevel.checkpoint()
        for key, payload in zip(keys, payloads):
            self.values[key] = bytes(payload)
        self.writes += len(keys)
        return [True] * len(keys)

    def statistics(self) -> TierStatistics:
        return TierStatistics(self.name, len(self.values), sum(map(len, self.values.values())),
                              self.reads, 0, 0, self.writes, 0, 0, 0, 0)


def gpu_block(kv: KV, block: int) -> list[torch.Tensor]:
    return [t[:, block].clone() for t in kv.layers]


def randomize(kv: KV, blocks: Sequence[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in kv.layers:
        view = t.view(torch.uint8)
        for b in blocks:
            page = view[:, b]
            page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=gen))


@asynccontextmanager
async def tiered(tiers: Sequence[Tier], host: int = 4, queue_bytes: int = 1 << 30, seed: int = 0,
                 **options: Any) -> AsyncIterator[tuple[KV, AsyncOffloadingWorker, OffloadCache]]:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, seed=seed)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=host + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", tiers=tiers, staging_chunks=STAGING,
                             queue_bytes=queue_bytes, **options)
        async with cache:
            yield kv, worker, cache


def settled(cache: OffloadCache) -> None:
    """Nothing pinned, pending, in flight or on its way down; every staging chunk free."""
    st = cache.stats()
    assert st.manager.pinned_keys == 0 and st.manager.pending_keys == 0 and st.in_flight == 0
    assert st.staging_free == st.staging_chunks > 0
    assert all(t.queued_blocks == 0 for t in st.tiers)
    cache.manager.check_invariants()


async def store_generations(kv: KV, cache: OffloadCache, n: int) -> dict[str, list[torch.Tensor]]:
    """Offload ``n`` keys four at a time from blocks 0..3 (rewritten with fresh random
    bytes each time), so each offload evicts the previous keys and reuses their chunks."""
    expected: dict[str, list[torch.Tensor]] = {}
    for start in range(0, n, 4):
        keys = [f"k{i}" for i in range(start, start + 4)]
        randomize(kv, range(4), seed=100 + start)
        for i, key in enumerate(keys):
            expected[key] = gpu_block(kv, i)
        res = await cache.offload(keys, list(range(4)))
        assert res.stored == 4
    return expected


@pytest.fixture(params=["mem", "disk"])
def local_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "mem":
        return MemTier()
    return DiskTier(tmp_path / "tier", capacity_bytes=1 << 24)


async def test_evicted_blocks_come_back_byte_exact(local_tier: Tier) -> None:
    async with tiered([local_tier]) as (kv, _w, cache):
        expected = await store_generations(kv, cache, 16)
        await cache.drain()
        keys = list(expected)
        assert cache.lookup(keys) == 16  # 4 in the host, 12 in the tier, no I/O
        randomize(kv, range(16, 32), seed=9)  # the targets hold other bytes first
        result = await cache.restore(keys, list(range(16, 32)))
        assert result and result.restored == 16 and result.from_tiers == 12 and result.from_host == 4
        for i, key in enumerate(keys):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 16 + i), expected[key])), key
        st = cache.stats()
        tier = st.tiers[0]
        assert tier.demoted == 12 and tier.demotions_dropped == 0 and tier.restored_keys == 12
        assert tier.hits == 12 and st.host_hits == 4 and st.hits == 16
        settled(cache)


async def test_a_failed_tier_read_ends_the_restore_there() -> None:
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        expected = await store_generations(kv, cache, 12)
        await cache.drain()
        keys = [f"k{i}" for i in range(8)]  # all demoted
        tier.fail_reads.add(codec.key_bytes("k5"))
        sentinel = [b.clone() for b in gpu_block(kv, 40 + 5)]
        result = await cache.restore(keys, list(range(40, 48)))
        assert not result and result.restored == 5 and result.requested == 8
        for i in range(5):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 40 + i), expected[keys[i]]))
        assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 45), sentinel))  # never written
        missing = await cache.restore(["nowhere", "k0"], [30, 31])
        assert missing.restored == 0 and not missing
        settled(cache)


async def test_restores_larger_than_staging_pipeline_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokv.cache.restore as restore_mod

    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 3)
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        expected = await store_generations(kv, cache, 20)
        await cache.drain()
        keys = [f"k{i}" for i in range(16)]
        result = await cache.restore(keys, list(range(20, 36)))
        assert result.restored == 16
        for i, key in enumerate(keys):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 20 + i), expected[key]))
        settled(cache)


async def test_write_through_shares_a_prefix_with_another_cache() -> None:
    shared = MemTier(remote=True, write_through=True)
    async with tiered([shared], seed=1) as (kv_a, _w, cache_a):
        randomize(kv_a, range(3), seed=5)
        expected = [gpu_block(kv_a, i) for i in range(3)]
        await cache_a.offload(["p0", "p1", "p2"], [0, 1, 2])
        await cache_a.drain()
        assert cache_a.stats().tiers[0].write_throughs == 3
    async with tiered([shared], seed=2) as (kv_b, _w, cache_b):
        assert cache_b.lookup(["p0", "p1", "p2"]) == 0  # remote: no I/O in lookup
        assert await cache_b.alookup(["p0", "p1", "p2", "other"]) == 3
        result = await cache_b.restore(["p0", "p1", "p2"], [7, 8, 9])
        assert result.restored == 3
        for i in range(3):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv_b, 7 + i), expected[i]))
        assert cache_b.stats().tiers[0].hits == 3
        settled(cache_b)


async def test_a_stalled_tier_drops_demotions_and_never_stalls_the_cache(
        caplog: pytest.LogCaptureFixture) -> None:
    tier = MemTier()
    tier.write_gate = anyio.Event()
    async with tiered([tier], queue_bytes=1, queue_wait=0.2) as (kv, _w, cache):
        try:
            with anyio.fail_after(5):  # the writer is stuck; offloads and restores go on
                expected = await store_generations(kv, cache, 24)
                assert cache.lookup(["k20", "k21", "k22", "k23"]) == 4
                assert await cache.restore(["k20", "k23"], [40, 41])
            st = cache.stats().tiers[0]
            # Room for one block: the first eviction takes it; the next waits its turn, first
            # in line, for 0.2 s with no room coming back: the tier has stalled, and from
            # then on what does not fit drops at once (one wait, not one per offer).
            assert st.queued_blocks == 1 and st.demotions_dropped == 19
            assert st.room_waits == 1 and 0.2 <= st.room_wait_seconds < 1
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 41), expected["k23"]))
            lines = [r for r in caplog.records if "dropped" in r.getMessage()]
            assert len(lines) == 1 and "mem tier" in lines[0].getMessage()  # once a minute
            assert cache.lookup(["k0", "k1"]) == 1  # queued: still found, in memory
        finally:
            tier.write_gate.set()
        await cache.drain()
        assert cache.stats().tiers[0].demoted == 1
        settled(cache)
    assert tier.closed


async def test_cancelled_restore_returns_its_chunks_and_pins() -> None:
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        await store_generations(kv, cache, 12)
        await cache.drain()
        tier.read_gate = anyio.Event()
        keys = ["k8", "k9", "k0", "k1"]  # two host keys pinned, then tier reads that hang
        with anyio.move_on_after(0.2) as scope:
            await cache.restore(keys, [30, 31, 32, 33])
        assert scope.cancelled_caught
        await cache.drain()
        settled(cache)
        tier.read_gate.set()
        assert (await cache.restore(keys, [30, 31, 32, 33])).restored == 4


async def test_tiers_need_an_entered_cache_and_the_async_worker(tmp_path: Path) -> None:
    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        cache = OffloadCache(worker, tiers=[MemTier()])
        with pytest.raises(UsageError, match="async with cache"):
            await cache.offload(["a"], [0])
        with pytest.raises(UsageError, match="async with cache"):
            await cache.alookup(["a"])
    sync_worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    try:
        with pytest.raises(UsageError, match="AsyncOffloadingWorker"):
            OffloadCache(sync_worker)  # type: ignore[arg-type]
    finally:
        sync_worker.shutdown()


async def test_unstable_keys_are_refused_with_tiers() -> None:
    from aiokv import InvalidSpec

    async with tiered([MemTier()]) as (_kv, _w, cache):
        with pytest.raises(InvalidSpec, match="int, bytes, str"):
            await cache.offload(["a", (1, 2.5)], [0, 1])
        assert cache.lookup(["a"]) == 0
        settled(cache)


async def test_blocks_the_host_turns_away_spill_to_the_tier(local_tier: Tier) -> None:
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, seed=3)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4 + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", admission="second-offer", tiers=[local_tier],
                             staging_chunks=STAGING)
        async with cache:
            randomize(kv, range(5), seed=11)
            keys = [f"s{i}" for i in range(5)]
            expected = [gpu_block(kv, i) for i in range(5)]
            res = await cache.offload(keys, range(5))
            # First offers: the host admits none. Two staging chunks carry them all to the
            # tier, two at a time (the first two ride along with the offer's own store).
            assert res.stored == 0 and res.spilled == 5 and res.not_stored == 5
            assert cache.lookup(keys) == 5 and len(cache.manager) == 0  # no drain needed
            await cache.drain()
            assert cache.lookup(keys) == 5
            result = await cache.restore(keys, range(10, 15))
            assert result.restored == 5 and result.from_tiers == 5
            for i in range(5):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 10 + i), expected[i]))
            st = cache.stats().tiers[0]
            assert st.demoted == 5 and st.demotions_dropped == 0
            settled(cache)


@pytest.mark.parametrize("portable_in_place", [False, True])
async def test_restores_through_both_page_paths(portable_in_place: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages read in place (host order is the portable order) or through rows put in host
    order on a thread while the next batch reads; both byte-exact."""
    import aiokv.cache.restore as restore_mod

    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 2)
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        pages = cache._cascade.pages  # type: ignore[union-attr]
        if portable_in_place and not pages.identity:
            # Make the host order the portable one for this test by reading it as such.
            pages.portable, pages.identity = list(pages.host), True
        elif not portable_in_place:
            pages.identity = False
        expected = await store_generations(kv, cache, 16)
        await cache.drain()
        keys = [f"k{i}" for i in range(12)]
        result = await cache.restore(keys, list(range(20, 32)))
        assert result.restored == 12 and result.from_tiers == 12
        for i, key in enumerate(keys):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 20 + i), expected[key]))
        settled(cache)


async def test_a_disk_far_slower_than_the_traffic_drops_and_the_loop_stays_live(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "slow", capacity_bytes=1 << 24, simulated_latency=1.0)
    ticks = 0
    stop = anyio.Event()

    async def heartbeat() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with tiered([tier], queue_bytes=2 * 1024, queue_wait=0.1) as (kv, _w, cache):
            with anyio.fail_after(5):
                expected = await store_generations(kv, cache, 40)  # 36 evictions, room for 2
            st = cache.stats().tiers[0]
            # Every offload returned before the first (1 s) write did: the first two evictions
            # took the room, the next waited its turn for 0.1 s as the first in line with no
            # room coming back, and from then on the tier had stalled: the rest dropped at once.
            assert st.demoted == 0 and st.tier.writes == 0
            assert st.demotions_dropped == 34 and st.queued_blocks == 2 and st.room_waits == 1
            assert ticks > 0
            # Nothing is lost from the host tier: its four newest blocks are exact.
            result = await cache.restore(["k36", "k37", "k38", "k39"], [40, 41, 42, 43])
            assert result.restored == 4 and result.from_host == 4
            for i, key in enumerate(["k36", "k37", "k38", "k39"]):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 40 + i), expected[key]))
            await cache.drain()
            assert cache.stats().tiers[0].demoted + cache.stats().tiers[0].demotions_dropped == 36
        stop.set()


async def test_a_block_queued_for_the_disk_is_restored_from_memory_without_the_writer(
        tmp_path: Path) -> None:
    """Evicted from the host and still queued for a disk whose writes take 2 s: lookup finds
    it and restore brings it back byte-exact at once, read from memory."""
    tier = DiskTier(tmp_path, capacity_bytes=1 << 24, simulated_latency=2.0)
    async with tiered([tier], drain_timeout=0.5) as (kv, _w, cache):
        with anyio.fail_after(1):  # well before the first write can have finished
            expected = await store_generations(kv, cache, 12)  # k0..k7 on their way down
            keys = [f"k{i}" for i in range(8)]
            assert cache.lookup(keys) == 8 and await cache.alookup(keys) == 8
            randomize(kv, range(20, 28), seed=3)
            result = await cache.restore(keys, list(range(20, 28)))
        assert result and result.from_tiers == 8
        for i, key in enumerate(keys):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 20 + i), expected[key])), key
        st = cache.stats().tiers[0]
        assert st.tier.writes == 0 and st.restored_keys == 8 and st.hits == 16
        assert st.queued_blocks == 8


async def test_an_offload_cancelled_between_spill_rounds_leaks_nothing() -> None:
    tier = MemTier()
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, seed=4)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4 + STAGING) as worker:
        cache = OffloadCache(worker, policy="lru", admission="second-offer", tiers=[tier],
                             staging_chunks=STAGING)
        async with cache:
            keys = [f"s{i}" for i in range(12)]
            with anyio.CancelScope() as scope:
                scope.cancel()  # lands at the first checkpoint: the first round's store runs
                await cache.offload(keys, range(12))
            await cache.drain()
            st = cache.stats().tiers[0]
            assert st.demoted + st.demotions_dropped == 12 and st.demoted >= STAGING
            assert cache.lookup(keys) == st.demoted
            settled(cache)


@pytest.mark.parametrize("chunks", [2, 3, 5, 8])
async def test_small_pools_with_tiers_work_with_the_default_staging(chunks: int) -> None:
    from aiokv import InvalidSpec

    kv = make_layers(num_layers=2, num_blocks=16, seed=chunks)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=chunks) as worker:
        with pytest.raises(InvalidSpec, match="at least 2 chunks"):
            OffloadCache(worker, tiers=[MemTier()], chunks=range(1))
        async with OffloadCache(worker, tiers=[MemTier()]) as cache:
            st = cache.stats()
            assert st.staging_chunks == max(1, chunks // 4)
            assert st.manager.num_chunks == chunks - st.staging_chunks
            randomize(kv, range(8), seed=1)
            expected = {f"x{i}": gpu_block(kv, i) for i in range(8)}
            for _ in range(2):  # the default admission stores on a second offer
                await cache.offload(list(expected), range(8))
            result = await cache.restore(list(expected), range(8, 16))
            assert result.restored == 8
            for i, key in enumerate(expected):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 8 + i), expected[key])), key
            assert cache.stats().tiers[0].demotions_dropped == 0
            await cache.drain()
            settled(cache)


class LruTier(MemTier):
    """A bounded LRU tier that, as the disk tier does, makes room when a write starts (the
    blocks being written take room, only landed ones are evicted, and what finds no room
    is refused) and lands the bytes ``delay`` seconds later."""

    def __init__(self, capacity: int, delay: float) -> None:
        super().__init__()
        self.capacity, self.delay = capacity, delay
        self.order: dict[bytes, None] = {}  # oldest first, landed or being written

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        got = await super().read(keys, out)
        for key, ok in zip(keys, got):
            if ok and key in self.order:
                self.order[key] = self.order.pop(key)
        return got

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        taken = []
        for key in keys:
            if key in self.order:  # held (or on its way): a touch
                self.order[key] = self.order.pop(key)
                taken.append(False)
                continue
            landed = (k for k in self.order if k in self.values)
            if len(self.order) >= self.capacity and (oldest := next(landed, None)) is not None:
                del self.order[oldest], self.values[oldest]
            taken.append(len(self.order) < self.capacity)
            if taken[-1]:
                self.order[key] = None
        data = [bytes(p) for p in payloads]
        await anyio.sleep(self.delay)
        for key, value, new in zip(keys, data, taken):
            if new:
                self.values[key] = value
        return [new or key in self.order for key, new in zip(keys, taken)]


def digest(kv: KV, block: int) -> str:
    return hashlib.sha1(b"".join(t.view(torch.uint8).numpy().tobytes() for t in gpu_block(kv, block)))\
        .hexdigest()


async def test_how_fast_writes_land_never_decides_a_hit() -> None:
    """The same requests over a tier whose writes land at once and one whose writes take
    10 ms: every lookup and every restore answers the same, with the right bytes."""
    import random

    rng = random.Random(3)
    requests = [[rng.randrange(90) for _ in range(rng.randint(1, 5))] for _ in range(200)]
    answers = []
    of_key: dict[int, str] = {}
    for delay in (0.0, 0.01):
        # Room for far more blocks than are ever on their way at once: the oldest blocks,
        # which a write evicts, have landed long before, whatever the delay.
        tier = LruTier(capacity=48, delay=delay)
        seen = []
        async with tiered([tier], host=4) as (kv, _w, cache):
            for r, keys in enumerate(requests):
                n = cache.lookup(keys)
                got = await cache.restore(keys[:n], range(20, 20 + n)) if n else None
                seen.append((n, got.restored if got else 0))
                for i, key in enumerate(keys[: got.restored if got else 0]):
                    assert digest(kv, 20 + i) == of_key[key], (r, key)
                for i, key in enumerate(keys):  # a key's block always holds the same bytes
                    randomize(kv, [i], seed=key)
                    of_key[key] = digest(kv, i)
                await cache.offload(keys, range(len(keys)))
                await anyio.sleep(0.005)  # a server's pace: a few batches on their way at once
            await cache.drain()
            assert cache.stats().tiers[0].demotions_dropped == 0
            settled(cache)
        answers.append(seen)
    assert answers[0] == answers[1]
    assert sum(n for n, _ in answers[0]) > 0
