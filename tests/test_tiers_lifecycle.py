"""OffloadCache with tiers: what drain() waits for, bad ``tiers=`` arguments, lookups on a
cache that is not entered, and lookups that cross between tiers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

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
        with pytest.raises(UsageError, match="is closed"):
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


# -- leaving the cache by any path ends within a bound and closes every tier ---------------


class StuckTier(MemTier):
    """A tier whose writes never return until released (a hung server)."""

    def __init__(self) -> None:
        super().__init__()
        self.write_gate = anyio.Event()


async def test_a_cancelled_exit_with_writes_queued_ends_within_the_drain_bound() -> None:
    tier = StuckTier()
    begin = anyio.current_time()
    with anyio.move_on_after(0.3) as scope:  # a timeout, or a task group cancelled on SIGTERM
        async with tiered([tier], drain_timeout=1.0) as (kv, _w, cache):
            await store_generations(kv, cache, 16)  # 12 demotions, their writer stuck
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert anyio.current_time() - begin < 5  # the drain bound (1 s), not forever
    st = cache.stats().tiers[0]
    assert st.demoted == 0 and st.demotions_dropped == 12 and st.queued_blocks == 0
    assert tier.closed


async def test_an_exit_with_a_stuck_tier_is_bounded_as_a_whole() -> None:
    tier = StuckTier()
    begin = anyio.current_time()
    async with tiered([tier], drain_timeout=0.5) as (kv, _w, cache):
        for gen in range(7):  # seven queued batches: the bound is for the exit, not per batch
            randomize(kv, range(4), seed=gen)
            await cache.offload([f"g{gen}-{i}" for i in range(4)], range(4))
    assert anyio.current_time() - begin < 4
    assert cache.stats().tiers[0].demotions_dropped == 24 and tier.closed


def test_a_task_cancel_of_the_owner_closes_every_tier(tmp_path: Path) -> None:
    """asyncio's ``task.cancel()`` lands in the cache's exit: the disk tier's directory lock
    is released and a new cache opens the same directory at once, in the same process."""
    import asyncio

    from aiokv import DiskTier

    entered = asyncio.Event()

    async def owner() -> None:
        kv = make_layers(num_layers=2, num_blocks=16)
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=6) as worker:
            tier = DiskTier(tmp_path, capacity_bytes=1 << 24)
            async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=2) as cache:
                for gen in range(3):
                    randomize(kv, range(4), seed=gen)
                    await cache.offload([f"g{gen}-{i}" for i in range(4)], range(4))
                entered.set()
                await asyncio.sleep(30)

    async def main() -> list[str]:
        task = asyncio.create_task(owner())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        kv = make_layers(num_layers=2, num_blocks=16)
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=6) as worker:
            async with OffloadCache(worker, policy="lru", tiers=[DiskTier(tmp_path, capacity_bytes=1 << 24)],
                                    staging_chunks=2) as again:
                return [k for k in (f"g0-{i}" for i in range(4)) if again.lookup([k])]

    assert asyncio.run(asyncio.wait_for(main(), 20)) == [f"g0-{i}" for i in range(4)]


async def test_errors_opening_a_tier_are_raised_as_themselves(tmp_path: Path) -> None:
    from aiokv import DiskTier, TierError

    kv = make_layers(num_layers=2, num_blocks=8)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        near = MemTier()
        cache = OffloadCache(worker, tiers=[near, DiskTier(blocker / "tier", capacity_bytes=1 << 20)])
        try:
            async with cache:
                pytest.fail("a tier under a file opened")
        except TierError:  # not an ExceptionGroup
            pass
        assert near.closed  # the tier opened before it is closed again
        with pytest.raises(UsageError, match="async with cache"):
            cache.lookup(["a"])
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        first = OffloadCache(worker, chunks=range(0, 4), tiers=[DiskTier(tmp_path, capacity_bytes=1 << 20)])
        second = OffloadCache(worker, chunks=range(4, 8), tiers=[DiskTier(tmp_path, capacity_bytes=1 << 20)])
        async with first:
            try:
                async with second:
                    pytest.fail("two tiers locked one directory")
            except UsageError as exc:  # the directory's lock: one directory per process
                assert "directory" in str(exc)
        async with second:  # free again once the first cache left
            assert second.lookup(["x"]) == 0


async def test_write_through_copies_of_large_blocks_never_block_the_next_eviction(tmp_path: Path) -> None:
    """Blocks over the inline copy size, a host the size of one request and a disk tier plus
    a write-through one: every request stores, and every block reaches both tiers."""
    from aiokv import DiskTier

    kv = make_layers(num_layers=3, num_blocks=8, page_shape=(128, 8, 128), seed=5)  # 1.5 MiB blocks
    shared = MemTier(remote=True, write_through=True)
    disk = DiskTier(tmp_path, capacity_bytes=64 << 20)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4 + 2) as worker:
        assert worker.chunk_bytes > 1 << 20
        async with OffloadCache(worker, policy="lru", tiers=[disk, shared], staging_chunks=2) as cache:
            expected = {}
            for r in range(6):
                randomize(kv, range(4), seed=r)
                keys = [f"r{r}-{i}" for i in range(4)]
                expected.update({k: gpu_block(kv, i) for i, k in enumerate(keys)})
                assert (await cache.offload(keys, range(4))).stored == 4
            await cache.drain()
            st = cache.stats().tiers
            assert st[0].demoted == 20 and st[1].write_throughs == 24
            assert st[0].demotions_dropped == st[1].demotions_dropped == 0
            keys = list(expected)[:4]
            assert (await cache.restore(keys, range(4, 8))).restored == 4
            for i, k in enumerate(keys):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 4 + i), expected[k])), k
            settled(cache)


@pytest.mark.parametrize("option", [{"drain_timeout": 0}, {"drain_timeout": True}, {"drain_timeout": "1"},
                                    {"queue_wait": -1}, {"queue_wait": True}, {"queue_bytes": -1},
                                    {"staging_chunks": 1.5}])
async def test_bad_lifecycle_options_are_refused(option: dict[str, object]) -> None:
    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec):
            OffloadCache(worker, tiers=[MemTier()], **option)  # type: ignore[arg-type]
        async with OffloadCache(worker, tiers=[MemTier()]) as cache:  # nothing was taken
            assert cache.stats().staging_chunks == 2


async def test_calls_on_a_tiered_cache_that_do_no_io_still_checkpoint() -> None:
    """An alookup that misses with only local tiers, an offload of held keys and a restore
    of no keys yield to the loop once, as an awaited round trip would."""
    async with tiered([MemTier()]) as (kv, _w, cache):
        randomize(kv, range(2), seed=1)
        await cache.offload(["a", "b"], [0, 1])
        calls = {
            "alookup past the host": lambda: cache.alookup(["a", "nowhere"]),
            "offload of held keys": lambda: cache.offload(["a"], [0]),
            "restore of no keys": lambda: cache.restore([], []),
        }
        for what, call in calls.items():
            with anyio.CancelScope() as scope:
                scope.cancel()
                await call()
            assert scope.cancelled_caught, what
        settled(cache)


async def test_a_disk_tier_on_a_read_only_filesystem_raises_tier_error(tmp_path: Path) -> None:
    import subprocess

    from aiokv import DiskTier, TierError

    mount = tmp_path / "ro"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                          capture_output=True, timeout=10)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs (needs root): {done.stderr.decode().strip()}")
    try:
        kv = make_layers(num_layers=2, num_blocks=8)
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
            cache = OffloadCache(worker, tiers=[DiskTier(mount / "tier", capacity_bytes=1 << 20)])
            try:
                async with cache:
                    pytest.fail("a tier opened on a read-only filesystem")
            except TierError as exc:
                assert "read-only" in str(exc).lower() or "errno 30" in str(exc).lower()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


async def test_a_store_landing_after_the_exit_counts_its_copies_down_as_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit's bound ran out while a store was still copying: once it lands, the copies
    it would have sent down cannot go (the tiers are closed) and count as dropped."""
    from aiokv import Direction
    from tests.test_offload_cache import Gate

    tier = MemTier(write_through=True)
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=6) as worker:
        cache = OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=2, drain_timeout=0.1)
        gate = Gate(monkeypatch, Direction.STORE)
        try:
            async with anyio.create_task_group() as tg:
                async with cache:
                    tg.start_soon(cache.offload, [f"k{i}" for i in range(4)], range(4))
                    await anyio.to_thread.run_sync(gate.entered.wait, 5)
                assert tier.closed  # left within the bound, the store still copying
                gate.open.set()
        finally:
            gate.open.set()
    st = cache.stats().tiers[0]
    assert st.write_throughs == 0 and st.demotions_dropped == 4 and st.queued_blocks == 0
    assert cache.stats().stored_keys == 4


async def test_a_copy_down_that_fails_drops_its_blocks_and_spares_the_callers_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write-through copy off the pool that fails (out of memory for its rows) runs in the
    cache's task group: its blocks are dropped and counted, and neither the offer nor the
    code inside ``async with cache`` is cancelled by it."""
    from aiokv.cache.pages import PageMap

    tier = MemTier(write_through=True)
    real = PageMap.gather
    calls = 0

    def gather(pages: PageMap, pool: object, chunks: Sequence[int]) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise MemoryError("no room for the rows")
        return real(pages, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", gather)
    async with tiered([tier]) as (kv, _w, cache):
        randomize(kv, range(4), seed=1)
        first = await cache.offload([f"a{i}" for i in range(4)], range(4))
        await anyio.sleep(0.01)  # the body goes on, not cancelled
        randomize(kv, range(4), seed=2)
        second = await cache.offload([f"b{i}" for i in range(4)], range(4))
        await cache.drain()
        st = cache.stats().tiers[0]
        assert first.stored == 4 and second.stored == 4
        assert st.demotions_dropped == 4 and st.write_throughs == 4
        settled(cache)
