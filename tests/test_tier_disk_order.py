"""The disk tier's read order (``disk_order``): read calls served earliest restore first,
writes one at a time while reads wait, staging chunks to the earliest restore, and nothing
dropped or torn on the way, on real files of random bytes."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiokv.cache.staging import Staging
from aiokv.cache.tiers import disk_io
from aiokv.cache.tiers.disk import DiskTier
from aiokv.cache.tiers.disk_io import ALIGN
from aiokv.cache.tiers.disk_order import UNORDERED, ReadOrder, WriteGate, rank_of
from tests.conftest import make_layers
from tests.test_tier_disk import FP, keys_of
from tests.test_tier_disk_cache import (
    NUM_BLOCKS,
    PAGE,
    block,
    cache_on,
    fill,
    offload_generations,
    restored_exactly,
)

pytestmark = pytest.mark.anyio

BLOCK = 16 * ALIGN  # 64 KiB: page-aligned, so direct I/O reads in place


def random_payloads(n: int) -> list[memoryview]:
    return [memoryview(os.urandom(BLOCK)) for _ in range(n)]


def out_parts(n: int) -> list[list[memoryview]]:
    """Each block's buffer in four parts, the last first (as a host chunk may keep them)."""
    out = []
    for _ in range(n):
        buf = memoryview(bytearray(BLOCK))
        q = BLOCK // 4
        out.append([buf[i * q:(i + 1) * q] for i in (3, 2, 1, 0)])
    return out


def joined(parts: Sequence[memoryview]) -> bytes:
    """The payload as read: the parts take it one after another."""
    return b"".join(bytes(p) for p in parts)


async def opened(path: Path, **kwargs: Any) -> DiskTier:
    kwargs.setdefault("capacity_bytes", 256 * BLOCK)
    tier = DiskTier(path, **kwargs)
    await tier.open(FP)
    return tier


class Entries:
    """``BlockFiles.read_many`` wrapped: which call (by its first key) a thread took, in
    order, and calls whose first key is in ``held`` wait for ``release`` before reading."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, held: set[bytes]) -> None:
        self.taken: list[bytes] = []
        self.waiting = 0
        self.release = threading.Event()
        self._held = held
        self._lock = threading.Lock()
        inner: Callable[..., None] = disk_io.BlockFiles.read_many

        def read_many(files: disk_io.BlockFiles, keys: Sequence[bytes], *args: Any) -> None:
            with self._lock:
                self.taken.append(keys[0])
                if keys[0] in self._held:
                    self.waiting += 1
            if keys[0] in self._held:
                assert self.release.wait(30)
            inner(files, keys, *args)

        monkeypatch.setattr(disk_io.BlockFiles, "read_many", read_many)

    async def until_waiting(self, n: int) -> None:
        while self.waiting < n:
            await anyio.sleep(0.001)


@pytest.mark.usefixtures("disk_reader")
async def test_serialized_reads_finish_the_earliest_restore_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One read thread: three restores queued latest first (C, B, A) while it is busy
    finish A, B, C, each byte-exact."""
    tier = await opened(tmp_path, io_threads=1)
    tier._reads = ReadOrder(1, tier._gate)  # serialized: one thread reads
    blocker, groups = keys_of(1, 100), {name: keys_of(6, 10 * i) for i, name in enumerate("ABC")}
    data = {name: random_payloads(6) for name in "ABC"}
    assert all(await tier.write(blocker, random_payloads(1)))
    for name in "ABC":
        assert all(await tier.write(groups[name], data[name]))
    entries = Entries(monkeypatch, {blocker[0]})
    done: list[str] = []
    outs = {name: out_parts(6) for name in "ABC"}

    async def restore(name: str, ticket: int) -> None:
        assert await tier.read_parts(groups[name], outs[name], order=(ticket, 0)) == [True] * 6
        done.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: tier.read_parts(blocker, out_parts(1), order=(0, 0)))
        await entries.until_waiting(1)
        for name, ticket in (("C", 3), ("B", 2), ("A", 1)):
            tg.start_soon(restore, name, ticket)
            await anyio.sleep(0.01)
        entries.release.set()
    assert done == ["A", "B", "C"]
    assert entries.taken == [blocker[0], groups["A"][0], groups["B"][0], groups["C"][0]]
    for name in "ABC":
        assert [joined(p) for p in outs[name]] == [bytes(d) for d in data[name]]
    await tier.aclose()


@pytest.mark.usefixtures("disk_reader")
async def test_free_threads_take_the_earliest_call_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both read threads busy; calls queued with orders (5, 0), (2, 1), (2, 0) and one
    without: as threads come free, the loop hands them (2, 0), (2, 1), (5, 0), then the
    unordered one (in the order the loop starts them, which their threads' first steps
    may not keep)."""
    tier = await opened(tmp_path, io_threads=1)  # two read threads
    blockers = [keys_of(1, 200), keys_of(1, 201)]
    calls = {order: keys_of(2, 10 * i) for i, order in enumerate([(5, 0), (2, 1), (2, 0), None])}
    data = {order: random_payloads(2) for order in calls}
    for keys in blockers:
        assert all(await tier.write(keys, random_payloads(1)))
    for order, keys in calls.items():
        assert all(await tier.write(keys, data[order]))
    entries = Entries(monkeypatch, {k[0] for k in blockers})
    started: list[bytes] = []
    run_sync = anyio.to_thread.run_sync

    async def spy(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(fn, "func", None), "__name__", "") == "read_many":
            started.append(fn.args[0][0])  # the call's first key, as the loop starts it
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)
    outs = {order: out_parts(2) for order in calls}
    async with anyio.create_task_group() as tg:
        for keys in blockers:
            tg.start_soon(lambda keys=keys: tier.read_parts(keys, out_parts(1), order=(0, 0)))
        await entries.until_waiting(2)
        for order, keys in calls.items():
            tg.start_soon(lambda keys=keys, order=order: tier.read_parts(keys, outs[order], order=order))
            await anyio.sleep(0.01)
        assert len(started) == 2  # the blockers: the calls wait for a thread
        entries.release.set()
    assert started[2:] == [calls[(2, 0)][0], calls[(2, 1)][0], calls[(5, 0)][0], calls[None][0]]
    for order in calls:
        assert [joined(p) for p in outs[order]] == [bytes(d) for d in data[order]]
    await tier.aclose()


@pytest.mark.usefixtures("disk_reader")
async def test_a_queued_read_cancelled_before_it_began_never_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call still queued behind busy threads is cancelled at once, reads nothing and
    leaves its keys evictable; the tier reads on after it."""
    tier = await opened(tmp_path, io_threads=1)
    blockers = [keys_of(1, 200), keys_of(1, 201)]
    keys, data = keys_of(3), random_payloads(3)
    for b in blockers:
        assert all(await tier.write(b, random_payloads(1)))
    assert all(await tier.write(keys, data))
    entries = Entries(monkeypatch, {b[0] for b in blockers})
    async with anyio.create_task_group() as tg:
        for b in blockers:
            tg.start_soon(lambda b=b: tier.read_parts(b, out_parts(1), order=(0, 0)))
        await entries.until_waiting(2)
        with anyio.move_on_after(0.05) as scope:
            await tier.read_parts(keys, out_parts(3), order=(1, 0))
        assert scope.cancelled_caught
        assert keys[0] not in entries.taken and not set(keys) & set(tier._index.pins)
        entries.release.set()
    out = out_parts(3)
    assert await tier.read_parts(keys, out) == [True] * 3
    assert [joined(p) for p in out] == [bytes(d) for d in data]
    await tier.aclose()


@pytest.mark.usefixtures("disk_reader")
async def test_a_truncated_file_among_ordered_reads_is_a_counted_miss(tmp_path: Path) -> None:
    """Three restores read at once, one of their files cut short: that block is a miss,
    dropped and counted corrupt; every other block arrives byte-exact."""
    tier = await opened(tmp_path)
    groups = [keys_of(8, 20 * i) for i in range(3)]
    data = [random_payloads(8) for _ in groups]
    for keys, payload in zip(groups, data):
        assert all(await tier.write(keys, payload))
    bad = groups[1][3]
    path = tier._opened().path(bad)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - ALIGN)
    outs = [out_parts(8) for _ in groups]
    got: dict[int, list[bool]] = {}

    async def restore(i: int) -> None:
        got[i] = await tier.read_parts(groups[i], outs[i], order=(i, 0))

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(restore, i)
    assert got[0] == got[2] == [True] * 8 and got[1] == [True] * 3 + [False] + [True] * 4
    for i in range(3):
        for j, parts in enumerate(outs[i]):
            if (i, j) != (1, 3):
                assert joined(parts) == bytes(data[i][j])
    assert tier.statistics().corrupt == 1 and not tier.holds(bad) and not os.path.exists(path)
    await tier.aclose()


def test_writes_go_one_at_a_time_while_reads_wait() -> None:
    """Four write slots: with reads queued, a second writer waits until the first is out
    or the reads are over; without reads, four write at once."""
    gate = WriteGate(4)
    inside, most = 0, 0
    lock = threading.Lock()
    go = threading.Event()

    def write() -> None:
        nonlocal inside, most
        with gate:
            with lock:
                inside += 1
                most = max(most, inside)
            go.wait(10)
            with lock:
                inside -= 1

    gate.reading(2)
    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    while gate.waits < 3:
        threading.Event().wait(0.001)
    assert most == 1
    gate.reading(0)  # the reads are over: the waiting writers go at once
    while inside < 4:
        threading.Event().wait(0.001)
    go.set()
    for t in threads:
        t.join()
    assert most == 4


def test_ranks_order_restores_then_batches_then_calls_without_order() -> None:
    assert rank_of((1, 0)) < rank_of((1, 5)) < rank_of((2, 0)) < rank_of(None) == UNORDERED
    assert rank_of((1, 1 << 30)) < rank_of((2, 0))  # a position never spills into the ticket


async def test_staging_chunks_go_to_the_earliest_restore_then_to_spills() -> None:
    staging = Staging(range(3))
    held = staging.take(3)
    got: list[tuple[str, list[int]]] = []

    async def wait(name: str, rank: int | None) -> None:
        got.append((name, await staging.take_some(1, rank)))

    async with anyio.create_task_group() as tg:
        for name, rank in (("spill", None), ("late", 7), ("early", 2)):
            tg.start_soon(wait, name, rank)
            await anyio.sleep(0.001)
        staging.give(held[:1])
        assert staging.take(1) == []  # a spill riding along waits behind the restores in line
        await anyio.sleep(0.01)
        for chunk in held[1:]:
            staging.give([chunk])
            await anyio.sleep(0.01)
    assert got == [("early", [held[0]]), ("late", [held[1]]), ("spill", [held[2]])]
    staging.give([9])
    assert staging.take(2) == [9]  # nobody in line: at once


@pytest.mark.usefixtures("disk_reader")
async def test_restores_beside_demotions_drop_nothing_and_arrive_exactly(tmp_path: Path) -> None:
    """Restores read while the host evicts to the disk (writes gated to one at a time):
    every demotion is written, none dropped, and every restore is byte-exact."""
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=40)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, io_threads=2)
    async with cache_on(kv, tier, staging=4) as cache:
        expected = await offload_generations(kv, cache, 24)
        old = [f"k{i}" for i in range(12)]

        async def restore(keys: list[str], first: int) -> None:
            result = await cache.restore(keys, list(range(first, first + len(keys))))
            assert result.restored == len(keys) and result.from_tiers == len(keys)

        async def demote() -> None:
            for start in range(100, 132, 4):
                fill(kv, range(40, 44), seed=start)
                assert (await cache.offload([f"k{i}" for i in range(start, start + 4)],
                                            list(range(40, 44)))).stored == 4

        async with anyio.create_task_group() as tg:
            tg.start_soon(demote)
            tg.start_soon(restore, old[:6], 8)
            tg.start_soon(restore, old[6:], 20)
        await cache.drain()
        assert restored_exactly(kv, old[:6], 8, expected) and restored_exactly(kv, old[6:], 20, expected)
        st = cache.stats().tiers[0]
        assert st.demotions_dropped == 0 and st.demoted > 0
        assert tier.statistics().writes == st.demoted


async def cancel_after(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def until(check: Callable[[], bool]) -> None:
    """Let other tasks run until ``check()`` holds (no clock involved)."""
    while not check():
        await anyio.lowlevel.checkpoint()


@pytest.mark.usefixtures("disk_reader")
@pytest.mark.parametrize("when", ["before", "at-the-hop"])
async def test_a_call_cancelled_as_its_helper_takes_an_earlier_call_leaves_that_call_read(
        tmp_path: Path, when: str) -> None:
    """A later restore's call is cancelled as its helper takes a thread for an earlier
    restore's queued call (a helper hands work to whichever call is earliest): before it
    takes it, or while the hop to the thread yields to the loop (the task that cancels
    runs then). The earlier call must still be read, byte-exact, not finished with
    nothing read (every block a miss) because a stranger was cancelled."""
    tier = await opened(tmp_path, io_threads=1)
    reads = tier._reads = ReadOrder(1, tier._gate)
    early, late = keys_of(3), keys_of(3, 10)
    data = random_payloads(3)
    assert all(await tier.write(early, data))
    assert all(await tier.write(late, random_payloads(3)))
    out = out_parts(3)
    got: list[list[bool]] = []

    async def read_early() -> None:
        got.append(await tier.read_parts(early, out, order=(1, 0)))

    reads._free = 0  # every read thread busy: the earlier call waits in the queue
    async with anyio.create_task_group() as tg:
        tg.start_soon(read_early)
        await until(lambda: reads._looking == 1)
        reads._free = 1  # a thread came free; the helpers it wakes have not run yet
        with anyio.CancelScope() as scope:
            if when == "before":
                scope.cancel()
            else:  # a task that runs at the first checkpoint of the hop cancels it
                go = anyio.Event()
                tg.start_soon(cancel_after, go, scope)
                await until(lambda: go.statistics().tasks_waiting == 1)
                go.set()
            await tier.read_parts(late, out_parts(3), order=(2, 0))
        assert scope.cancel_called
    assert got == [[True] * 3]
    assert [joined(p) for p in out] == [bytes(d) for d in data]
    assert reads._free == 1 and not reads._queue and reads._active == 0
    assert not tier._index.pins and tier.holds(early[0])
    await tier.aclose()


@pytest.mark.usefixtures("disk_reader")
async def test_a_spill_waiting_for_staging_goes_before_restores_that_start_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two staging chunks, both held by an earlier restore whose reads wait; a spill (a
    first offer the host turns away) then waits for chunks, and after it a later restore.
    The spill must get its chunks before the later restore: a spill behind every restore,
    whenever it started, waits as long as restores keep coming, holding the write-queue
    room it took. Every block still arrives byte-exact and nothing is dropped."""
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=48)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, io_threads=1)
    release = threading.Event()
    inner: Callable[..., None] = disk_io.BlockFiles.read_many

    def held_read(files: disk_io.BlockFiles, *args: Any) -> None:
        assert release.wait(30)
        inner(files, *args)

    async with cache_on(kv, tier, staging=2, admission="second-offer") as cache:
        keys = [f"k{i}" for i in range(8)]
        fill(kv, range(8), seed=480)
        expected = {key: block(kv, i) for i, key in enumerate(keys)}
        assert (await cache.offload(keys, list(range(8)))).spilled == 8  # first offers: all to the disk
        await cache.drain()
        staging = cache._cascade.staging  # type: ignore[union-attr]
        grants: list[str] = []
        take_some = Staging.take_some

        async def logged(self: Staging, n: int, *args: Any) -> list[int]:
            got = await take_some(self, n, *args)
            grants.append(anyio.get_current_task().name)
            return got

        monkeypatch.setattr(Staging, "take_some", logged)
        monkeypatch.setattr(disk_io.BlockFiles, "read_many", held_read)
        results: dict[str, Any] = {}

        async def restore(name: str, first: int, last: int, at: int) -> None:
            results[name] = await cache.restore(keys[first:last], list(range(at, at + last - first)))

        async def spill() -> None:
            results["spill"] = await cache.offload(["s0", "s1"], [40, 41])

        fill(kv, range(40, 42), seed=481)
        spilled = {"s0": block(kv, 40), "s1": block(kv, 41)}
        async with anyio.create_task_group() as tg:
            tg.start_soon(restore, "early", 0, 6, 20, name="early")
            await until(lambda: len(staging._waiting) == 1)  # both chunks read into, a third wanted
            tg.start_soon(spill, name="spill")
            await until(lambda: len(staging._waiting) == 2)
            tg.start_soon(restore, "late", 6, 8, 30, name="late")
            await until(lambda: len(staging._waiting) == 3)
            release.set()
        assert grants.index("spill") < grants.index("late"), grants
        assert results["early"].restored == 6 and results["late"].restored == 2
        assert results["spill"].spilled == 2
        assert restored_exactly(kv, keys[:6], 20, expected) and restored_exactly(kv, keys[6:], 30, expected)
        await cache.drain()
        assert cache.stats().tiers[0].demotions_dropped == 0
        assert await cache.restore(["s0", "s1"], [44, 45])
        assert restored_exactly(kv, ["s0", "s1"], 44, spilled)
