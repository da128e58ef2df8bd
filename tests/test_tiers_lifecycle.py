"""OffloadCache with tiers: what drain() waits for, bad ``tiers=`` arguments, lookups on a
cache that is not entered, and lookups that cross between tiers."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import pytest

from aiokv import AsyncOffloadingWorker, InvalidSpec, OffloadCache, UsageError
from aiokv.cache.tiers import codec
from tests.conftest import make_layers, same_bytes
from tests.test_tiers_cascade import MemTier, gpu_block, randomize, settled, store_generations, tiered

pytestmark = pytest.mark.anyio


class OneByOneTier(MemTier):
    """Each write waits for its own gate, so a test can finish one batch and hold the next."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[anyio.Event] = []
        self.open_all = False

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        gate = anyio.Event()
        self.gates.append(gate)
        if not self.open_all:
            await gate.wait()
        return await super().write(keys, payloads)

    def release(self) -> None:
        """Let every write through (a failing test must still close its cache)."""
        self.open_all = True
        for gate in self.gates:
            gate.set()


async def wait_for(predicate: object) -> None:
    with anyio.fail_after(5):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.001)


async def test_drain_does_not_wait_for_demotions_queued_after_it_was_called() -> None:
    tier = OneByOneTier()
    async with tiered([tier]) as (kv, _w, cache):
        for gen in range(2):  # the second offload evicts the first four keys: one batch
            randomize(kv, range(4), seed=gen)
            await cache.offload([f"g{gen}-{i}" for i in range(4)], range(4))
        await wait_for(lambda: len(tier.gates) == 1)  # the writer holds batch 1
        drained = anyio.Event()

        async def drain() -> None:
            await cache.drain()
            drained.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                await anyio.sleep(0.01)
                randomize(kv, range(4), seed=2)
                await cache.offload([f"g2-{i}" for i in range(4)], range(4))  # batch 2, after drain
                assert cache.stats().tiers[0].queued_blocks == 8
                tier.gates[0].set()
                with anyio.fail_after(5):
                    await drained.wait()  # batch 2 is still held: drain must not wait for it
                assert len(tier.values) == 4
                await wait_for(lambda: len(tier.gates) == 2)
        finally:
            tier.release()
        await cache.drain()
        assert len(tier.values) == 8 and cache.stats().tiers[0].demoted == 8
        settled(cache)


@pytest.mark.parametrize("bad", [MemTier(), None, "disk", 3, [MemTier(), "disk"]])
async def test_a_bad_tiers_argument_is_refused_and_changes_nothing(bad: object) -> None:
    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec, match="tiers"):
            OffloadCache(worker, tiers=bad)  # type: ignore[arg-type]
        tier = MemTier()
        with pytest.raises(InvalidSpec, match="twice"):
            OffloadCache(worker, tiers=[tier, tier])
        cache = OffloadCache(worker, tiers=[tier])  # the chunks are still free
        async with cache:
            assert cache.tiers == [tier]


async def test_lookup_needs_an_entered_cache_with_tiers() -> None:
    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        tier = MemTier()
        cache = OffloadCache(worker, tiers=[tier])
        with pytest.raises(UsageError, match="async with cache"):
            cache.lookup(["a"])
        async with cache:
            await cache.offload(["a"], [0])
            assert cache.lookup(["a", "b"]) == 1
        assert tier.closed
        with pytest.raises(UsageError, match="async with cache"):
            cache.lookup(["a"])  # its tiers are closed


async def test_alookup_counts_on_past_a_remote_hit_as_restore_does() -> None:
    near, far = MemTier(), MemTier(remote=True)
    async with tiered([near, far]) as (kv, _w, cache):
        randomize(kv, range(3), seed=7)
        await cache.offload(["h", "b", "c"], [0, 1, 2])
        await cache.drain()
        assert cache._cascade is not None
        rows = cache._cascade.pages.gather(cache._cascade.pool, [cache.chunks.start + c for c in range(3)])
        # "b" only in the remote tier, "c" only in the local one, after a host key.
        far.values[codec.key_bytes("b")] = rows[1].tobytes()
        near.values[codec.key_bytes("c")] = rows[2].tobytes()
        randomize(kv, range(4), seed=8)
        await cache.offload([f"x{i}" for i in range(4)], range(4))  # evicts h, b, c
        await cache.drain()
        near.values.pop(codec.key_bytes("b"))
        randomize(kv, [9], seed=9)
        await cache.offload(["h"], [9])  # "h" back in the host
        keys = ["h", "b", "c", "nothing"]
        assert cache.lookup(keys) == 1  # no I/O: "b" is only known remotely
        assert await cache.alookup(keys) == 3
        assert [t.hits for t in cache.stats().tiers] == [1, 1]
        assert (await cache.restore(keys[:3], [20, 21, 22])).restored == 3
        settled(cache)


async def test_large_evictions_are_copied_out_off_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cache import staging as staging_mod
    from aiokv.cache.pages import PageMap

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)
    threads: list[int] = []
    gather = PageMap.gather

    def recording(self: PageMap, pool: object, chunks: Sequence[int]) -> object:
        threads.append(threading.get_ident())
        return gather(self, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", recording)
    async with tiered([MemTier()]) as (kv, _w, cache):
        expected = await store_generations(kv, cache, 16)
        await cache.drain()
        assert len(threads) == 3 and threading.get_ident() not in threads
        keys = list(expected)
        randomize(kv, range(16, 32), seed=9)
        result = await cache.restore(keys, list(range(16, 32)))
        assert result.restored == 16 and result.from_tiers == 12
        for i, key in enumerate(keys):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 16 + i), expected[key])), key
        settled(cache)


async def test_large_write_throughs_are_copied_off_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cache import staging as staging_mod
    from aiokv.cache.pages import PageMap

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)
    threads: list[int] = []
    gather = PageMap.gather

    def recording(self: PageMap, pool: object, chunks: Sequence[int]) -> object:
        threads.append(threading.get_ident())
        return gather(self, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", recording)
    shared = MemTier(remote=True, write_through=True)
    async with tiered([shared]) as (kv, _w, cache):
        randomize(kv, range(4), seed=11)
        expected = {f"w{i}": gpu_block(kv, i) for i in range(4)}
        assert (await cache.offload(list(expected), range(4))).stored == 4
        await cache.drain()
        assert threads and threading.get_ident() not in threads
        assert cache.stats().tiers[0].write_throughs == 4
        settled(cache)
    async with tiered([MemTier(remote=True)], seed=1) as (kv2, _w2, other):
        other_tier = other.tiers[0]
        assert isinstance(other_tier, MemTier)
        other_tier.values.update(shared.values)  # another server reading the shared store
        assert (await other.restore(list(expected), [5, 6, 7, 8])).restored == 4
        for i, key in enumerate(expected):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv2, 5 + i), expected[key])), key


async def test_large_spills_are_copied_off_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cache import staging as staging_mod
    from aiokv.cache.pages import PageMap

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)
    threads: list[int] = []
    gather = PageMap.gather

    def recording(self: PageMap, pool: object, chunks: Sequence[int]) -> object:
        threads.append(threading.get_ident())
        return gather(self, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", recording)
    kv = make_layers(num_layers=2, num_blocks=16, seed=3)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=6) as worker:
        cache = OffloadCache(worker, policy="lru", admission="second-offer", tiers=[MemTier()],
                             staging_chunks=2)
        async with cache:
            randomize(kv, range(2), seed=11)
            expected = [gpu_block(kv, i) for i in range(2)]
            assert (await cache.offload(["s0", "s1"], [0, 1])).spilled == 2  # the host admits none
            await cache.drain()
            assert threads and threading.get_ident() not in threads
            result = await cache.restore(["s0", "s1"], [10, 11])
            assert result.restored == 2 and result.from_tiers == 2
            for i in range(2):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 10 + i), expected[i]))
            settled(cache)


async def test_an_offload_cancelled_during_its_eviction_copy_still_stores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cache import staging as staging_mod

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)
    tier = MemTier()
    async with tiered([tier]) as (kv, _w, cache):
        randomize(kv, range(4), seed=1)
        old = {f"a{i}": gpu_block(kv, i) for i in range(4)}
        await cache.offload(list(old), range(4))
        randomize(kv, range(4, 8), seed=2)
        new = {f"b{i}": gpu_block(kv, 4 + i) for i in range(4)}
        with anyio.CancelScope() as scope:
            scope.cancel()  # lands at the first unshielded await, after the store's submit
            await cache.offload(list(new), range(4, 8))
        await cache.drain()
        assert cache.lookup(list(new)) == 4 and cache.lookup(list(old)) == 4
        both = {**old, **new}
        result = await cache.restore(list(both), range(20, 28))
        assert result.restored == 8 and result.from_tiers == 4
        for i, key in enumerate(both):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 20 + i), both[key])), key
        settled(cache)


class ClosedTier(MemTier):
    """A tier whose reads are misuse (as a closed DiskTier's are)."""

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        raise UsageError("this tier is closed")


async def test_a_restore_that_raises_counts_in_no_restore_figure() -> None:
    tier = ClosedTier()
    async with tiered([tier]) as (kv, _w, cache):
        randomize(kv, range(8), seed=4)
        for start in (0, 4):  # the second offload evicts the first four keys to the tier
            await cache.offload([f"k{i}" for i in range(start, start + 4)], range(start, start + 4))
        await cache.drain()
        before = cache.stats()
        with pytest.raises(UsageError, match="closed"):
            await cache.restore(["k4", "k0"], [20, 21])
        after = cache.stats()
        assert (after.restores, after.restore_misses, after.restored_keys) == (
            before.restores, before.restore_misses, before.restored_keys)
        settled(cache)
