"""Closing an ``OffloadCache``: leaving it by any path (normal, error, an anyio cancel scope,
asyncio's ``task.cancel()``, a trio cancel) gives its chunks back at once, so a second cache
opens on the same worker right after, with or without tiers; every later call on the
closed cache raises ``UsageError``; a copy still running past the drain bound keeps its
chunks owned until it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from aiokv import AsyncOffloadingWorker, InvalidSpec, OffloadCache, UsageError
from aiokv.specs import Direction
from tests.conftest import KV, make_layers, same_bytes
from tests.test_offload_cache import Gate
from tests.test_tiers_cascade import MemTier, gpu_block, randomize

NUM_CHUNKS = 8
STAGING = 2


def new_cache(worker: AsyncOffloadingWorker, tiered: bool, **options: Any) -> OffloadCache:
    """A cache over the whole pool (so a second one overlaps it unless the first is gone)."""
    if tiered:
        return OffloadCache(worker, policy="lru", tiers=[MemTier()], staging_chunks=STAGING, **options)
    return OffloadCache(worker, policy="lru", **options)


async def fill(kv: KV, cache: OffloadCache) -> None:
    randomize(kv, [1, 2], seed=7)
    await cache.offload(["a", "b"], [1, 2])


async def assert_closed_and_replaceable(kv: KV, worker: AsyncOffloadingWorker, cache: OffloadCache,
                                        tiered: bool) -> None:
    """The closed cache refuses every call; a new cache over the same chunks works at once."""
    assert cache.closed and bool(cache)
    with pytest.raises(UsageError, match="closed"):
        cache.lookup(["a"])
    with pytest.raises(UsageError, match="closed"):
        await cache.alookup(["a"])
    with pytest.raises(UsageError, match="closed"):
        await cache.restore(["a", "b"], [5, 6])  # it used to load the closed cache's bytes
    with pytest.raises(UsageError, match="closed"):
        await cache.offload(["c"], [3])
    with pytest.raises(UsageError, match="closed"):
        await cache.drain()
    with pytest.raises(UsageError, match="closed"):
        async with cache:
            pass
    await cache.aclose()  # idempotent
    assert cache.stats().stored_keys == 2  # what it did stays readable
    again = new_cache(worker, tiered)
    async with again:
        assert again.lookup(["a"]) == 0  # a new cache starts empty
        randomize(kv, [3, 4], seed=11)
        expected = [gpu_block(kv, 3), gpu_block(kv, 4)]
        assert (await again.offload(["x", "y"], [3, 4])).stored == 2
        randomize(kv, [8, 9], seed=12)
        assert await again.restore(["x", "y"], [8, 9])
        for want, block in zip(expected, (8, 9)):
            assert all(same_bytes(a, b) for a, b in zip(want, gpu_block(kv, block)))


class Boom(Exception):
    pass


async def leave(kv: KV, cache: OffloadCache, how: str) -> None:
    """Enter ``cache``, store two keys, and leave it the way ``how`` says."""
    if how == "aclose":
        if cache.tiers:
            await cache.__aenter__()
        await fill(kv, cache)
        await cache.aclose()
        return
    if how == "error":
        with pytest.raises(Boom):
            async with cache:
                await fill(kv, cache)
                raise Boom
        return
    if how == "cancel scope":
        with anyio.move_on_after(0.05) as scope:
            async with cache:
                await fill(kv, cache)
                await anyio.sleep(10)
        assert scope.cancelled_caught
        return
    async with cache:
        await fill(kv, cache)


@pytest.mark.anyio
@pytest.mark.parametrize("tiered", [False, True], ids=["host", "tiers"])
@pytest.mark.parametrize("how", ["normal", "error", "cancel scope", "aclose"])
async def test_a_second_cache_opens_right_after_the_first_is_left(how: str, tiered: bool) -> None:
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        cache = new_cache(worker, tiered)
        with pytest.raises(InvalidSpec, match="already belong"):
            new_cache(worker, tiered)  # while the first is open, its chunks are its own
        await leave(kv, cache, how)
        await assert_closed_and_replaceable(kv, worker, cache, tiered)


@pytest.mark.anyio
async def test_a_cache_without_tiers_closes_without_having_been_entered() -> None:
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        cache = new_cache(worker, False)
        await fill(kv, cache)  # no `async with` needed without tiers
        assert not cache.closed
        await cache.aclose()
        await assert_closed_and_replaceable(kv, worker, cache, False)


@pytest.mark.anyio
async def test_a_tiered_cache_closed_before_entering_opens_no_tier() -> None:
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        tier = MemTier()
        cache = OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=STAGING)
        await cache.aclose()
        assert tier.opened_with is None and not tier.closed  # never opened, so not closed
        async with new_cache(worker, True):
            pass


async def cancelled_owner(tiered: bool, start: Callable[[Callable[[], Awaitable[None]]], Any],
                          cancel: Callable[[Any], Awaitable[None]]) -> None:
    """A task owns a cache and is cancelled from outside by the event loop's own means;
    then the same worker takes a second cache over the same chunks."""
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        entered = anyio.Event()
        cache = new_cache(worker, tiered)

        async def owner() -> None:
            async with cache:
                await fill(kv, cache)
                entered.set()
                await anyio.sleep(30)

        handle = await start(owner)
        with anyio.fail_after(10):
            await entered.wait()
            await cancel(handle)
        await assert_closed_and_replaceable(kv, worker, cache, tiered)


@pytest.mark.parametrize("tiered", [False, True], ids=["host", "tiers"])
def test_asyncio_task_cancel_of_the_owner_frees_the_chunks(tiered: bool) -> None:
    async def start(owner: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        return asyncio.ensure_future(owner())

    async def cancel(task: asyncio.Task[None]) -> None:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancelled_owner(tiered, start, cancel), 20))


@pytest.mark.parametrize("tiered", [False, True], ids=["host", "tiers"])
def test_trio_cancel_of_the_owner_frees_the_chunks(tiered: bool) -> None:
    trio = pytest.importorskip("trio")

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def start(owner: Callable[[], Awaitable[None]]) -> tuple[trio.CancelScope, trio.Event]:
                scope, done = trio.CancelScope(), trio.Event()

                async def run() -> None:
                    with scope:
                        await owner()
                    done.set()

                nursery.start_soon(run)
                return scope, done

            async def cancel(handle: tuple[trio.CancelScope, trio.Event]) -> None:
                scope, done = handle
                scope.cancel()
                await done.wait()
                assert scope.cancelled_caught

            with trio.fail_after(20):
                await cancelled_owner(tiered, start, cancel)

    trio.run(main)


@pytest.mark.anyio
async def test_a_copy_running_past_the_drain_bound_keeps_its_chunks_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The exit gives up waiting after ``drain_timeout``; the chunks the copy still writes
    are not handed to a new cache until the copy is over."""
    gate = Gate(monkeypatch, Direction.STORE)
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        cache = new_cache(worker, False, drain_timeout=0.2)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fill, kv, cache)
                await anyio.to_thread.run_sync(gate.entered.wait, 5)
                with anyio.fail_after(5):
                    await cache.aclose()  # bounded: the store is still held on the lane
                assert cache.closed
                with pytest.raises(InvalidSpec, match="already belong"):
                    new_cache(worker, False)
                gate.open.set()
        finally:
            gate.open.set()
        with anyio.fail_after(5):
            while True:
                try:
                    second = new_cache(worker, False)
                    break
                except InvalidSpec:
                    await anyio.sleep(0.01)
        assert cache.stats().stored_keys == 2  # the store landed in the closed cache
        randomize(kv, [3], seed=5)
        expected = gpu_block(kv, 3)
        await second.offload(["z"], [3])
        assert await second.restore(["z"], [10])
        assert all(same_bytes(a, b) for a, b in zip(expected, gpu_block(kv, 10)))


@pytest.mark.anyio
async def test_an_empty_cache_is_truthy_and_len_counts_held_keys() -> None:
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        cache = new_cache(worker, False)
        assert len(cache) == 0 and bool(cache)  # `if cache:` means "a cache", not "not empty"
        await fill(kv, cache)
        assert len(cache) == 2 and bool(cache)


@pytest.mark.anyio
async def test_a_second_aclose_while_the_first_drains_returns_once_the_cache_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tasks close the cache at once (a shutdown path and the owner's exit): the later
    ``aclose()`` waits for the exit under way as the first does, so neither returns while
    the cache's copies still run or before its chunks are free."""
    gate = Gate(monkeypatch, Direction.STORE)
    kv = make_layers(num_layers=2, num_blocks=16)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=NUM_CHUNKS) as worker:
        cache = new_cache(worker, False)
        returned: list[str] = []

        async def close(name: str) -> None:
            await cache.aclose()
            returned.append(name)
            assert cache.stats().in_flight == 0  # its copies are over when aclose returns
            new_cache(worker, False)  # and its chunks free

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(fill, kv, cache)
                await anyio.to_thread.run_sync(gate.entered.wait, 5)
                tg.start_soon(close, "first")
                await anyio.sleep(0.05)
                tg.start_soon(close, "second")
                await anyio.sleep(0.1)
                assert returned == []  # the store is still held on the lane
                gate.open.set()
        finally:
            gate.open.set()
        assert sorted(returned) == ["first", "second"]
