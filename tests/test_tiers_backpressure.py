"""Backpressure in the write queues: a tier slower than the offers slows them down instead
of dropping blocks, in turns and in parts; a tier that stalls costs one bounded wait; a
wait is cancellable and leaks nothing."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import anyio
import pytest

from aiokv import Tier, TierStatistics
from aiokv.cache.room import WriteRoom
from tests.conftest import same_bytes
from tests.test_tiers_cascade import gpu_block, randomize, settled, tiered

pytestmark = pytest.mark.anyio

BLOCK = 2 * 2 * (4 * 2 * 16) * 2  # make_layers(num_layers=2): two K/V pages of 256 bytes each


class SlowTier(Tier):
    """A dict-backed tier whose every write call takes ``delay`` seconds (or waits for
    ``gate``): a disk slower than the traffic, that keeps writing."""

    name = "slow"
    remote = False

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.gate: anyio.Event | None = None
        self.values: dict[bytes, bytes] = {}
        self.calls = 0
        self.largest = 0  # blocks in the largest write call

    async def open(self, fingerprint: bytes) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def holds(self, key: bytes) -> bool:
        return key in self.values

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        await anyio.lowlevel.checkpoint()
        return [k in self.values for k in keys]

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        await anyio.lowlevel.checkpoint()
        got = []
        for key, view in zip(keys, out):
            value = self.values.get(key)
            if value is not None:
                view[:] = value
            got.append(value is not None)
        return got

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        data = [bytes(p) for p in payloads]  # read before returning, as the contract says
        self.calls += 1
        self.largest = max(self.largest, len(keys))
        if self.gate is not None:
            await self.gate.wait()
        await anyio.sleep(self.delay)
        self.values.update(zip(keys, data))
        return [True] * len(keys)

    def statistics(self) -> TierStatistics:
        return TierStatistics(self.name, len(self.values), 0, 0, 0, 0, self.calls, 0, 0, 0, 0)


# -- WriteRoom on its own --------------------------------------------------------------


async def test_room_is_handed_out_in_turns_and_in_parts() -> None:
    room = WriteRoom(8, wait=math.inf)
    assert room.step == 2
    assert await room.take(5) == 2  # a part is a quarter of the room at most
    assert [await room.take(2) for _ in range(3)] == [2, 2, 2]
    order: list[str] = []

    async def offer(name: str, n: int) -> None:
        order.append(f"{name} got {await room.take(n)}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(offer, "a", 2)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(offer, "b", 1)  # would fit before a's 2 do: still waits its turn
        await anyio.wait_all_tasks_blocked()
        room.give(1)
        await anyio.wait_all_tasks_blocked()
        assert order == []  # the first in line needs 2; nobody jumps the line
        room.give(1)
        await anyio.wait_all_tasks_blocked()
        room.give(1)
    assert order == ["a got 2", "b got 1"]
    assert room.pending == 8 - 3 + 3 and room.waits == 2 and not room.stalled


async def test_a_stalled_room_releases_every_waiter_after_one_wait() -> None:
    room = WriteRoom(4, wait=0.2)
    assert [await room.take(1) for _ in range(4)] == [1, 1, 1, 1]
    got: list[int] = []

    async def offer() -> None:
        got.append(await room.take(1))

    began = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(offer)
    elapsed = time.monotonic() - began
    assert got == [0, 0, 0] and room.stalled  # nothing fit: each dropped its block
    assert 0.2 <= elapsed < 1.0  # one wait for all three, not one each
    t0 = time.monotonic()
    assert await room.take(1) == 0 and time.monotonic() - t0 < 0.1  # stalled: no wait at all
    room.give(2)  # half the room free again: offers wait their turn once more
    assert await room.take(1) == 1 and not room.stalled


async def test_a_stall_leaves_a_patient_waiter_in_line() -> None:
    """``persist_on_close`` takes room patiently (the close has its own bound): a stall
    declared by an impatient offer ahead of it must not hand it nothing, or the host's
    blocks it was to write would be skipped without a count."""
    room = WriteRoom(1, wait=0.1)
    assert await room.take(1) == 1
    got: dict[str, int] = {}

    async def offer(name: str, patient: bool) -> None:
        got[name] = await room.take(1, patient=patient)

    async with anyio.create_task_group() as tg:
        tg.start_soon(offer, "impatient", False)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(offer, "patient", True)
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):
            while "impatient" not in got:  # its wait ran out: the tier stalled
                await anyio.sleep(0.01)
        assert got == {"impatient": 0} and room.stalled
        room.give(1)  # the tier answers again: the patient one gets its room
    assert got == {"impatient": 0, "patient": 1} and room.pending == 1


async def test_room_that_keeps_coming_back_never_stalls() -> None:
    """A slow writer that frees room every 0.1 s, with waits of 0.25 s: the line behind it
    is long, but each offer at its head sees room come back in time, so none drops."""
    room = WriteRoom(2, wait=0.25)
    got: list[int] = []

    async def writer() -> None:
        for _ in range(6):
            await anyio.sleep(0.1)
            room.give(1)

    async def offer() -> None:
        got.append(await room.take(1))

    assert await room.take(1) == 1 and await room.take(1) == 1
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        for _ in range(6):
            tg.start_soon(offer)
    assert got == [1] * 6 and not room.stalled  # six offers waited up to 0.6 s in all


async def test_a_cancelled_wait_holds_nothing_and_lets_the_next_in() -> None:
    room = WriteRoom(4, wait=math.inf)
    assert [await room.take(1) for _ in range(4)] == [1, 1, 1, 1]
    got: list[int] = []

    async def second() -> None:
        got.append(await room.take(1))

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as first:
            async with anyio.create_task_group() as inner:
                inner.start_soon(room.take, 1)
                await anyio.wait_all_tasks_blocked()  # first in line
                tg.start_soon(second)
                await anyio.wait_all_tasks_blocked()  # second in line
                first.cancel()
        room.give(1)
    assert got == [1] and room.pending == 4  # the cancelled wait took nothing
    room.close()
    assert await room.take(1) == 0


# -- under a cache ---------------------------------------------------------------------


async def test_a_slow_tier_slows_the_offers_and_drops_nothing() -> None:
    """Room for 4 blocks (parts of 1), a tier whose every write takes 20 ms, offers that
    evict 4 blocks each: the offers wait their turn for room, every evicted block is
    written, none is dropped, and each comes back byte-exact."""
    tier = SlowTier(delay=0.02)
    async with tiered([tier], queue_bytes=4 * BLOCK, queue_wait=1.0) as (kv, _w, cache):
        expected = {}
        with anyio.fail_after(20):
            for start in range(0, 40, 4):
                keys = [f"k{i}" for i in range(start, start + 4)]
                randomize(kv, range(4), seed=100 + start)
                expected.update((key, gpu_block(kv, i)) for i, key in enumerate(keys))
                await cache.offload(keys, list(range(4)))
            await cache.drain()
        st = cache.stats().tiers[0]
        assert st.demotions_dropped == 0 and st.demoted == 36
        assert st.room_waits > 0 and st.room_wait_seconds > 0  # it slowed the offers down
        assert tier.largest == 1  # every write call was one part
        keys = [f"k{i}" for i in range(36)]
        for lo in range(0, 36, 12):
            part = keys[lo:lo + 12]
            result = await cache.restore(part, list(range(20, 32)))
            assert result.restored == 12 and result.from_tiers == 12
            for i, key in enumerate(part):
                assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 20 + i), expected[key]))
        settled(cache)


async def test_an_offer_larger_than_the_queue_goes_down_in_parts() -> None:
    """An offer that evicts 16 blocks into a queue with room for 4 goes down in parts as
    the tier writes, instead of waiting for the queue to empty and dropping the rest."""
    tier = SlowTier(delay=0.01)
    async with tiered([tier], host=16, queue_bytes=4 * BLOCK, queue_wait=1.0) as (_kv, _w, cache):
        with anyio.fail_after(20):
            await cache.offload([f"a{i}" for i in range(16)], list(range(16)))
            await cache.offload([f"b{i}" for i in range(16)], list(range(16, 32)))  # evicts a0..a15
            await cache.drain()
        st = cache.stats().tiers[0]
        assert st.demoted == 16 and st.demotions_dropped == 0
        assert tier.largest == 1 and tier.calls == 16  # one write call per part
        assert cache.lookup([f"a{i}" for i in range(16)]) == 16
        settled(cache)


async def test_a_tier_that_never_answers_costs_one_bounded_wait() -> None:
    tier = SlowTier()
    tier.gate = anyio.Event()  # its first write never returns
    async with tiered([tier], queue_bytes=2 * BLOCK, queue_wait=0.2, drain_timeout=0.5) as (_kv, _w, cache):
        began = time.monotonic()
        for start in range(0, 40, 4):
            await cache.offload([f"k{i}" for i in range(start, start + 4)], list(range(4)))
        elapsed = time.monotonic() - began
        st = cache.stats().tiers[0]
        assert elapsed < 1.5  # one wait of 0.2 s, then drops at once
        assert st.queued_blocks == 2 and st.demotions_dropped == 36 - 2 and st.room_waits >= 1
        assert cache.lookup(["k36", "k37", "k38", "k39"]) == 4  # the host lost nothing
    tier.gate.set()


async def test_cancelling_an_offer_in_line_returns_at_once_and_keeps_the_cache_whole() -> None:
    tier = SlowTier()
    tier.gate = anyio.Event()
    async with tiered([tier], queue_bytes=BLOCK, queue_wait=math.inf) as (kv, _w, cache):
        await cache.offload(["a0", "a1", "a2", "a3"], list(range(4)))
        randomize(kv, range(4), seed=9)
        expected = {f"b{i}": gpu_block(kv, i) for i in range(4)}
        with anyio.move_on_after(0.3) as scope:  # evicts a0..a3: a0 takes the room, a1 waits
            await cache.offload(["b0", "b1", "b2", "b3"], list(range(4)))
        assert scope.cancelled_caught
        st = cache.stats().tiers[0]
        assert st.queued_blocks == 1 and st.demotions_dropped == 3  # a1..a3: never copied
        assert cache.lookup(["b0"]) == 0  # the store never started, and freed its chunks
        tier.gate.set()
        await cache.drain()
        assert cache.stats().tiers[0].demoted == 1
        await cache.offload(list(expected), list(range(4)))  # the cache goes on
        result = await cache.restore(list(expected), list(range(10, 14)))
        assert result.restored == 4
        for i, key in enumerate(expected):
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 10 + i), expected[key]))
        settled(cache)


async def test_a_large_offer_beside_a_steady_stream_of_small_ones_drops_nothing() -> None:
    """A server's offers overlap: small ones keep a few blocks on their way down all the
    time while a large one arrives. The large one goes down in parts, in turn with the
    small ones, instead of waiting for an empty queue that never comes (and dropping)."""
    tier = SlowTier(delay=0.01)
    async with tiered([tier], host=24, queue_bytes=4 * BLOCK, queue_wait=0.3) as (_kv, _w, cache):
        await cache.offload([f"old{i}" for i in range(24)], list(range(24)))  # the host is full
        stop = anyio.Event()

        async def small_offers() -> None:
            i = 0
            while not stop.is_set():
                await cache.offload([f"s{i}"], [30])  # each evicts one block
                i += 1
                await anyio.sleep(0.003)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(small_offers)
                await anyio.sleep(0.05)
                await cache.offload([f"big{i}" for i in range(16)], list(range(31, 47)))  # evicts 16
                await anyio.sleep(0.05)
                stop.set()
            await cache.drain()
        st = cache.stats().tiers[0]
        assert st.demotions_dropped == 0 and st.demoted >= 16 and st.room_waits > 0
        settled(cache)


async def test_write_calls_start_in_the_order_the_cache_decided(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two offers' evictions copied off the loop, the first copy slower than the second: the
    tier still gets the first offer's blocks first, since it orders blocks for eviction as
    their write starts, and that order must not hang on the threads' timing."""
    from aiokv.cache import staging as staging_mod
    from aiokv.cache.pages import PageMap

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)  # every copy on a thread
    gather = PageMap.gather
    calls = 0

    def slow_first(self: PageMap, pool: object, chunks: Sequence[int]) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            time.sleep(0.3)
        return gather(self, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", slow_first)
    tier = SlowTier()
    written: list[list[bytes]] = []
    write = tier.write

    async def record(keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        written.append(list(keys))
        return await write(keys, payloads)

    tier.write = record  # type: ignore[method-assign]
    async with tiered([tier], host=8) as (_kv, _w, cache):
        calls = -100  # the first offer below fills the host: no copy down yet
        await cache.offload([f"old{i}" for i in range(8)], list(range(8)))
        calls = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.offload, ["x0", "x1"], [10, 11])  # evicts old0, old1: slow copy
            await anyio.sleep(0.1)
            tg.start_soon(cache.offload, ["y0", "y1"], [12, 13])  # evicts old2, old3: fast copy
        await cache.drain()
    assert [sorted(k) for k in written] == [
        sorted(codec_keys(["old0", "old1"])), sorted(codec_keys(["old2", "old3"]))]


def codec_keys(keys: Sequence[str]) -> list[bytes]:
    from aiokv.cache.tiers.codec import key_bytes

    return [key_bytes(k) for k in keys]


def test_a_block_used_again_while_being_written_moves_up_in_the_disk_order() -> None:
    """``DiskTier.touch`` (the cache calls it for a block the host lets go again while its
    first copy is on its way): a key being written moves up as a held one does, so how fast
    the write lands does not decide which block the disk evicts first."""
    from aiokv.cache.tiers.disk_index import DiskIndex

    index = DiskIndex(capacity_bytes=3 * 16, policy="lru")
    index.block_bytes = 16
    stored: list[bool | None] = [None] * 3
    todo, doomed, _ = index.plan_write([b"a", b"b", b"c"], stored)  # ordered a, b, c; being written
    index.touch([b"a", b"unknown"])  # a used again before its write landed; unknown: ignored
    for i in todo:
        stored[i] = True
    index.after_write([b"a", b"b", b"c"], stored, todo, doomed)
    assert index.policy is not None
    assert index.policy.victims(2, lambda k: True) == [b"b", b"c"]  # a is the newest now


async def test_blocks_waiting_their_turn_for_room_are_found_and_restored() -> None:
    """The host evicted a0..a3 for b0..b3; a0 took the only room and its write hangs, so
    a1..a3 wait their turn, still in their host chunks. They are on their way down all the
    same: lookup counts them and a restore brings their bytes back, none dropped."""
    tier = SlowTier()
    tier.gate = anyio.Event()
    async with tiered([tier], queue_bytes=BLOCK, queue_wait=math.inf, drain_timeout=2) as (kv, _w, cache):
        randomize(kv, range(4), seed=5)
        expected = {f"a{i}": gpu_block(kv, i) for i in range(4)}
        await cache.offload(list(expected), list(range(4)))
        randomize(kv, range(4), seed=6)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cache.offload, ["b0", "b1", "b2", "b3"], list(range(4)))
                await anyio.wait_all_tasks_blocked()  # a1 waits for room behind a0's write
                assert cache.stats().tiers[0].queued_blocks == 1
                assert cache.lookup(list(expected)) == 4
                result = await cache.restore(list(expected), list(range(10, 14)))
                assert result.restored == 4 and result.from_tiers == 4
                for i, key in enumerate(expected):
                    assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 10 + i), expected[key]))
                tier.gate.set()
            await cache.drain()
        st = cache.stats().tiers[0]
        assert st.demoted == 4 and st.demotions_dropped == 0
        settled(cache)


async def test_an_offer_reuses_its_evicted_chunks_only_after_a_restore_copied_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore copies a block waiting for room out of its host chunk on a worker thread;
    the offer that evicted it must not store into that chunk until the copy is over, or
    the restore would hand back the new block's bytes under the old key."""
    from aiokv.cache import staging as staging_mod
    from aiokv.cache.pages import PageMap

    monkeypatch.setattr(staging_mod, "INLINE_COPY_BYTES", 0)  # every copy on a thread
    gather = PageMap.gather
    slow = {"on": False}

    def gather_slowly(self: PageMap, pool: object, chunks: Sequence[int]) -> object:
        if slow["on"]:
            slow["on"] = False
            time.sleep(0.3)  # the offer would store into the chunk meanwhile
        return gather(self, pool, chunks)  # type: ignore[arg-type]

    monkeypatch.setattr(PageMap, "gather", gather_slowly)
    tier = SlowTier()
    tier.gate = anyio.Event()
    async with tiered([tier], queue_bytes=BLOCK, queue_wait=math.inf, drain_timeout=2) as (kv, _w, cache):
        randomize(kv, range(4), seed=7)
        expected = {f"a{i}": gpu_block(kv, i) for i in range(4)}
        await cache.offload(list(expected), list(range(4)))
        randomize(kv, range(4), seed=8)
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cache.offload, ["b0", "b1", "b2", "b3"], list(range(4)))
                await anyio.wait_all_tasks_blocked()
                slow["on"] = True
                tier.gate.set()  # the room comes back while the restore copies a3
                result = await cache.restore(["a3"], [13])
            assert result.restored == 1
            assert all(same_bytes(a, b) for a, b in zip(gpu_block(kv, 13), expected["a3"]))
            await cache.drain()
        settled(cache)
