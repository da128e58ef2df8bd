"""OffloadCache on the CPU backend: byte-exact round trips, prefix lookups, eviction order,
failures that degrade to misses, and many cancelled tasks that leak nothing."""

from __future__ import annotations

import random
import threading
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import anyio
import numpy as np
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidSpec,
    LookupResult,
    OffloadCache,
    WorkerClosed,
)
from aiokv.backends.cpu import CpuLane
from aiokv.bench.trace import simulate
from aiokv.specs import Direction
from tests.conftest import KV, make_layers, make_two_groups, same_bytes

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def open_cache(
    num_chunks: int = 8, num_blocks: int = 32, policy: str | None = "lru", **layer_args
) -> AsyncIterator[tuple[KV, AsyncOffloadingWorker, OffloadCache]]:
    kv = make_layers(num_layers=2, num_blocks=num_blocks, **layer_args)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=num_chunks) as worker:
        yield kv, worker, OffloadCache(worker, policy=policy)


def block_of(kv: KV, block: int) -> list[torch.Tensor]:
    """Every layer's K and V page of one GPU block."""
    return [t[:, block].clone() for t in kv.layers]


def pattern(like: torch.Tensor, key_id: int, layer: int) -> torch.Tensor:
    """The bytes a key's KV "computes" to: they depend on the key, the layer and the position."""
    ramp = torch.arange(like.numel(), dtype=torch.int64) * 31 + key_id * 131 + layer * 7
    return (ramp % 251).to(torch.uint8).view(like.shape)


def fill(kv: KV, block: int, key_id: int) -> None:
    for i, t in enumerate(kv.layers):
        page = t.view(torch.uint8)[:, block]
        page.copy_(pattern(page, key_id, i))


def holds(kv: KV, block: int, key_id: int) -> bool:
    return all(
        torch.equal(page, pattern(page, key_id, i))
        for i, page in enumerate(t.view(torch.uint8)[:, block] for t in kv.layers)
    )


def assert_settled(cache: OffloadCache) -> None:
    """Nothing pinned, pending or in flight, and every chunk is either held or free."""
    mgr = cache.manager
    mgr.check_invariants()
    st = cache.stats()
    assert st.in_flight == 0
    assert st.manager.pending_keys == 0 and st.manager.pinned_keys == 0
    assert mgr.num_free_chunks + len(mgr) == mgr.num_chunks


async def drain(cache: OffloadCache) -> None:
    """Wait for every copy the cache started; fail (not hang) if bookkeeping lost one."""
    with anyio.fail_after(5):
        await cache.drain()


class Gate:
    """Holds the CPU lane of one direction inside its copy until released (a slow DMA)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, direction: Direction, fail: bool = False) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        real = CpuLane._copy

        def copy(lane: CpuLane, plan) -> None:
            if lane.direction is direction:
                self.entered.set()
                self.open.wait(10)
                if fail:
                    raise OSError("simulated device fault")
            real(lane, plan)

        monkeypatch.setattr(CpuLane, "_copy", copy)


def failing(monkeypatch: pytest.MonkeyPatch, direction: Direction) -> None:
    """Every copy of ``direction`` fails on the device."""
    gate = Gate(monkeypatch, direction, fail=True)
    gate.open.set()


# -- the basics -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc", None])
async def test_offload_then_restore_is_byte_exact(policy: str | None) -> None:
    async with open_cache(policy=policy) as (kv, _, cache):
        want = [block_of(kv, b) for b in (1, 2, 3)]
        res = await cache.offload(["a", "b", "c"], [1, 2, 3])
        assert (res.stored, res.skipped, res.failed, int(res)) == (3, 0, False, 3)
        for t in kv.layers:
            t[:, 5:8] = 0
        assert await cache.restore(["a", "b", "c"], [5, 6, 7])
        for pages, block in zip(want, (5, 6, 7)):
            assert all(same_bytes(a, b) for a, b in zip(pages, block_of(kv, block)))
        st = cache.stats()
        assert st.stored_keys == 3 and st.restored_keys == 3 and st.failed_stores == st.failed_loads == 0
        assert st.store_bytes == st.load_bytes == 3 * kv.kv.tensors[0].page_size_bytes * 4
        assert st.store_gbps > 0 and st.load_gbps > 0
        assert_settled(cache)


async def test_default_policy_is_the_recommended_one_and_bad_workers_are_refused() -> None:
    async with open_cache(policy=None) as (kv, _, cache):
        assert type(cache.manager.policy).__name__ == "AdaptivePolicy"
        with pytest.raises(InvalidSpec, match="pass one block per key"):
            await cache.offload(["a", "b"], [1])
        with pytest.raises(InvalidSpec, match="pass one block per key"):
            await cache.restore(["a"], [1, 2])
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(ValueError, match="unknown eviction policy"):
            OffloadCache(worker, policy="nope")
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, blocks_per_chunk=2) as worker:
        with pytest.raises(InvalidSpec, match="blocks_per_chunk=1"):
            OffloadCache(worker)
    async with AsyncOffloadingWorker(make_two_groups().kv, num_cpu_chunks=8) as worker:
        assert worker.num_groups == 2
        with pytest.raises(InvalidSpec, match="has 2 groups"):
            OffloadCache(worker)


async def test_calls_the_worker_refuses_count_nowhere(monkeypatch) -> None:
    async with open_cache() as (kv, worker, cache):
        await cache.offload(["a"], [1])
        before = cache.stats()

        def refuse(*_a, **_k):
            raise WorkerClosed("closed under the cache")

        monkeypatch.setattr(worker, "submit_store", refuse)
        monkeypatch.setattr(worker, "submit_load", refuse)
        with pytest.raises(WorkerClosed):
            await cache.offload(["b", "c", "a"], [2, 3, 1])
        with pytest.raises(WorkerClosed):
            await cache.restore(["a"], [4])
        after = cache.stats()
        assert (after.offered_keys, after.skipped_keys, after.restores) == (
            before.offered_keys, before.skipped_keys, before.restores,
        )
        # A store that never started is no failed store, in either set of counters.
        assert (after.failed_stores, after.manager.failed_stores) == (0, 0)
        assert "b" not in cache.manager and cache.lookup(["a"]) == 1
        assert_settled(cache)
        monkeypatch.undo()
        res = await cache.offload(["b", "a"], [2, 1])
        assert (res.stored, res.skipped) == (1, 1)
        assert await cache.restore(["a", "b"], [4, 5])
        st = cache.stats()
        assert (st.offered_keys, st.skipped_keys, st.restores) == (3, 1, 1)
        assert same_bytes(kv.layers[0][:, 2], kv.layers[0][:, 5])


async def test_lookup_counts_leading_hits_and_offload_skips_held_keys() -> None:
    async with open_cache() as (_, _, cache):
        await cache.offload(["a", "b", "c"], [1, 2, 3])
        assert cache.lookup(["a", "b", "c", "d"]) == 3
        assert cache.lookup(["x", "a", "b"]) == 0
        assert cache.lookup(["a", "b", "x", "c"]) == 2
        assert cache.lookup([]) == 0
        res = await cache.offload(["a", "b", "c", "d"], [1, 2, 3, 4])
        assert (res.stored, res.skipped) == (1, 3)
        st = cache.stats()
        assert (st.hits, st.misses) == (5, 6)
        empty = await cache.restore([], [])  # the README's `n = lookup(); restore(keys[:n])`
        assert not empty and empty.restored == empty.requested == 0  # at n == 0: a miss
        assert not await cache.restore(["a", "x"], [5, 6])  # all or nothing
        assert cache.stats().restore_misses == 2  # both restored nothing
        assert_settled(cache)


async def test_restore_accepts_numpy_block_ids() -> None:
    import numpy as np

    async with open_cache() as (kv, _, cache):
        want = block_of(kv, 4)
        await cache.offload(["k"], np.array([4], dtype=np.int32))
        assert await cache.restore(["k"], np.array([9], dtype=np.int64))
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 9)))


async def test_lru_order_through_the_face() -> None:
    async with open_cache(num_chunks=4) as (_, _, cache):
        for i, key in enumerate("abcd"):
            await cache.offload([key], [i])
        assert await cache.restore(["a"], [10])  # a is now the most recently used
        res = await cache.offload(["e"], [4])
        assert res.evicted == 1
        assert [cache.lookup([k]) for k in "abcde"] == [1, 0, 1, 1, 1]
        await cache.offload(["f", "g"], [5, 6])  # evicts c then d
        assert [cache.lookup([k]) for k in "acdefg"] == [1, 0, 0, 1, 1, 1]
        assert cache.stats().evictions == 3
        assert_settled(cache)


async def test_an_offer_larger_than_the_pool_stores_nothing() -> None:
    async with open_cache(num_chunks=2) as (_, _, cache):
        res = await cache.offload(["a", "b", "c"], [1, 2, 3])
        assert (res.stored, res.not_stored) == (0, 3)
        assert len(cache) == 0
        assert_settled(cache)


# -- failures degrade to misses ---------------------------------------------------------


async def test_a_failed_store_leaves_no_loadable_key(monkeypatch) -> None:
    async with open_cache() as (kv, _, cache):
        failing(monkeypatch, Direction.STORE)
        res = await cache.offload(["a", "b"], [1, 2])
        assert res.failed and res.stored == 0 and res.not_stored == 2
        assert cache.lookup(["a"]) == 0 and "a" not in cache.manager
        assert not await cache.restore(["a"], [3])
        assert cache.stats().failed_stores == 2
        assert_settled(cache)
        assert cache.manager.num_free_chunks == cache.manager.num_chunks
        monkeypatch.undo()  # the device recovers: the same keys store and load again
        want = block_of(kv, 1)
        assert (await cache.offload(["a", "b"], [1, 2])).stored == 2
        assert await cache.restore(["a"], [3])
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 3)))


async def test_a_failed_load_returns_false_and_unpins(monkeypatch) -> None:
    async with open_cache() as (kv, _, cache):
        await cache.offload(["a", "b"], [1, 2])
        failing(monkeypatch, Direction.LOAD)
        assert not await cache.restore(["a", "b"], [5, 6])
        st = cache.stats()
        assert st.failed_loads == 1 and st.restored_keys == 0 and st.manager.pinned_keys == 0
        assert cache.lookup(["a", "b"]) == 2  # the host copy is still good
        assert_settled(cache)
        monkeypatch.undo()
        want = block_of(kv, 1)
        assert await cache.restore(["a"], [5])
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 5)))


async def test_a_failed_copy_cannot_corrupt_a_chunk_that_is_reused(monkeypatch) -> None:
    async with open_cache(num_chunks=1) as (kv, _, cache):
        failing(monkeypatch, Direction.STORE)
        await cache.offload(["a"], [1])
        monkeypatch.undo()
        want = block_of(kv, 2)
        assert (await cache.offload(["b"], [2])).stored == 1  # same chunk, now good bytes
        assert await cache.restore(["b"], [3]) and cache.lookup(["a"]) == 0
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 3)))


# -- concurrency and cancellation -------------------------------------------------------


async def test_a_pending_key_is_skipped_by_other_offers_and_is_a_miss(monkeypatch) -> None:
    async with open_cache() as (_, _, cache):
        gate = Gate(monkeypatch, Direction.STORE)
        results = {}

        async def offer(name: str, keys: list[str], blocks: list[int]) -> None:
            results[name] = await cache.offload(keys, blocks)

        async with anyio.create_task_group() as tg:
            tg.start_soon(offer, "A", ["a", "b"], [1, 2])
            await anyio.sleep(0.01)
            assert cache.manager.lookup("a") is LookupResult.HIT_PENDING
            assert cache.lookup(["a"]) == 0
            assert not await cache.restore(["a"], [5])  # a miss: we never wait on a store
            tg.start_soon(offer, "B", ["a", "b", "c"], [1, 2, 3])
            await anyio.sleep(0.01)
            gate.open.set()
        assert (results["A"].stored, results["A"].skipped) == (2, 0)
        assert (results["B"].stored, results["B"].skipped) == (1, 2)
        assert cache.lookup(["a", "b", "c"]) == 3
        assert_settled(cache)


async def test_a_cancelled_offload_still_completes_its_bookkeeping(monkeypatch) -> None:
    async with open_cache() as (kv, _, cache):
        gate = Gate(monkeypatch, Direction.STORE)
        want = block_of(kv, 1)
        with anyio.move_on_after(0.01) as scope:
            await cache.offload(["a"], [1])
        assert scope.cancelled_caught
        assert cache.manager.lookup("a") is LookupResult.HIT_PENDING and cache.stats().in_flight == 1
        gate.open.set()
        await drain(cache)
        assert cache.lookup(["a"]) == 1
        assert_settled(cache)
        assert await cache.restore(["a"], [4])
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 4)))


async def test_a_cancelled_restore_unpins_when_the_copy_is_over(monkeypatch) -> None:
    async with open_cache() as (kv, _, cache):
        await cache.offload(["a"], [1])
        want = block_of(kv, 1)
        gate = Gate(monkeypatch, Direction.LOAD)
        with anyio.move_on_after(0.01) as scope:
            await cache.restore(["a"], [6])
        assert scope.cancelled_caught and cache.stats().manager.pinned_keys == 1
        gate.open.set()
        await drain(cache)
        assert_settled(cache)
        assert all(same_bytes(a, b) for a, b in zip(want, block_of(kv, 6)))  # the copy did land


async def test_many_cancelled_tasks_on_overlapping_keys_leak_nothing() -> None:
    num_tasks, blocks_per_task, num_chunks = 50, 4, 24
    rng = random.Random(7)
    ids: dict[Hashable, int] = {}

    def key_id(key: Hashable) -> int:
        return ids.setdefault(key, len(ids))

    verified = cancelled = 0
    async with open_cache(num_chunks=num_chunks, num_blocks=num_tasks * blocks_per_task + 1,
                          page_shape=(2, 16)) as (kv, _, cache):

        async def client(t: int) -> None:
            nonlocal verified, cancelled
            mine = list(range(1 + t * blocks_per_task, 1 + (t + 1) * blocks_per_task))
            for _ in range(8):
                conv = rng.randrange(6)  # few conversations: heavy key overlap between tasks
                keys = [(conv, i) for i in range(rng.randint(1, blocks_per_task))]
                blocks = mine[: len(keys)]
                deadline = rng.choice([0.0, rng.uniform(0, 0.0003)]) if rng.random() < 0.4 else None
                with anyio.move_on_after(deadline) as scope:
                    n = cache.lookup(keys)
                    if n and await cache.restore(keys[:n], blocks[:n]):
                        assert all(holds(kv, b, key_id(k)) for k, b in zip(keys[:n], blocks[:n]))
                        verified += 1
                    for k, b in zip(keys[n:], blocks[n:]):
                        fill(kv, b, key_id(k))
                    await cache.offload(keys, blocks)
                if scope.cancelled_caught:
                    cancelled += 1
                    # A cancelled copy still owns our blocks: wait for it before reusing them.
                    await drain(cache)

        async with anyio.create_task_group() as tg:
            for t in range(num_tasks):
                tg.start_soon(client, t)
        await drain(cache)
        assert_settled(cache)
        assert cancelled > 0 and verified > 0, (cancelled, verified)
        # Every loadable key holds exactly the bytes computed for it.
        for key in list(cache.manager._entries):
            assert await cache.restore([key], [0])
            assert holds(kv, 0, key_id(key)), key
        assert_settled(cache)


async def test_job_ids_the_caller_uses_on_the_same_worker_are_skipped(monkeypatch) -> None:
    async with open_cache() as (_, worker, _whole):
        del _whole  # this test's cache leaves chunk 7 to the caller
        cache = OffloadCache(worker, policy="lru", chunks=range(7))
        gate = Gate(monkeypatch, Direction.STORE)
        mine = worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([7]))  # the cache's first id
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.offload, ["a"], [1])
            await anyio.sleep(0.01)
            gate.open.set()
        assert (await mine).success and cache.lookup(["a"]) == 1
        assert_settled(cache)


async def test_a_closed_worker_raises_and_leaks_nothing() -> None:
    async with open_cache() as (_, _, cache):
        await cache.offload(["a"], [1])
    with pytest.raises(WorkerClosed):
        await cache.offload(["b"], [2])
    with pytest.raises(WorkerClosed):
        await cache.restore(["a"], [3])
    assert cache.lookup(["a", "b"]) == 1
    assert_settled(cache)


# -- a prefix-reuse workload ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
async def test_prefix_reuse_workload_restores_what_was_computed(policy: str) -> None:
    rng = random.Random(3)
    systems = [[("sys", s, i) for i in range(3)] for s in range(3)]
    requests = []
    for r in range(60):
        sys_prompt = systems[rng.randrange(3)]
        turn = [("user", r % 17, i) for i in range(rng.randint(0, 4))]  # repeats every 17
        requests.append(sys_prompt + turn)
    ids: dict[Hashable, int] = {}
    num_chunks, width = 16, 8
    async with open_cache(num_chunks=num_chunks, num_blocks=width, policy=policy) as (kv, _, cache):
        restored = 0
        for keys in requests:
            blocks = list(range(len(keys)))
            n = cache.lookup(keys)
            if n:
                for b in blocks[:n]:
                    fill(kv, b, 10_000)  # garbage, so a missing copy cannot pass
                assert await cache.restore(keys[:n], blocks[:n])
                restored += n
                assert all(holds(kv, b, ids[k]) for k, b in zip(keys[:n], blocks[:n]))
            for k, b in zip(keys[n:], blocks[n:]):
                fill(kv, b, ids.setdefault(k, len(ids)))
            await cache.offload(keys, blocks)
        st = cache.stats()
        assert restored == st.hits == st.restored_keys > 0
        # The face makes the same decisions as the offline replay of the same requests.
        assert st.hit_rate == pytest.approx(simulate(requests, num_chunks, policy))
        assert_settled(cache)


async def test_bad_block_ids_are_refused_by_the_worker_and_leave_bookkeeping_consistent() -> None:
    # The worker's submit is the one place block ids are range-checked; the cache's
    # bookkeeping must come out of a refused submit with nothing pending or pinned.
    async with open_cache(num_chunks=4) as (_kv, _, cache):
        await cache.offload(["a", "b", "c", "d"], [1, 2, 3, 4])
        with pytest.raises(InvalidSpec, match=r"\[0, 32\)"):
            await cache.offload(["x", "y"], [999, 1000])
        assert cache.lookup(["x"]) == 0 and "x" not in cache.manager and "y" not in cache.manager
        held = [k for k in "abcd" if k in cache.manager]
        assert len(held) == 2  # the refused offer's evictions stay done, and counted
        assert cache.stats().evictions == 2
        with pytest.raises(InvalidSpec, match=r"\[0, 32\)"):
            await cache.restore(held[:1], [-1])
        st = cache.stats()
        assert st.manager.pinned_keys == 0 and st.manager.pending_keys == 0
        assert st.offered_keys == 4 and st.restores == 0
        assert await cache.restore(held[:1], [5])
        assert_settled(cache)


# -- sharing a worker, bad input, and what drain waits for ----------------------------------


async def test_caches_sharing_a_worker_own_disjoint_chunks() -> None:
    kv = make_layers(num_layers=2, num_blocks=32)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        first = OffloadCache(worker, policy="lru", chunks=range(0, 4))
        with pytest.raises(InvalidSpec, match="already belong to another OffloadCache"):
            OffloadCache(worker, policy="lru")  # the whole pool overlaps the first
        with pytest.raises(InvalidSpec, match="range"):
            OffloadCache(worker, policy="lru", chunks=range(6, 9))
        second = OffloadCache(worker, policy="lru", chunks=range(4, 8))
        fill(kv, 1, 11)
        fill(kv, 2, 22)
        await first.offload(["a"], [1])
        await second.offload(["x"], [2])  # its first chunk is the worker's chunk 4, not 0
        assert await first.restore(["a"], [9]) and await second.restore(["x"], [10])
        assert holds(kv, 9, 11) and holds(kv, 10, 22)
        assert_settled(first)
        assert_settled(second)


async def test_bad_input_evicts_nothing() -> None:
    async with open_cache(num_chunks=4) as (_, _, cache):
        await cache.offload(["a", "b", "c", "d"], [1, 2, 3, 4])  # full: the next store evicts
        with pytest.raises(InvalidSpec, match="after"):
            await cache.offload(["x"], [5], after="not-an-event")
        with pytest.raises(InvalidSpec, match="integers"):
            await cache.offload(["x"], [5.5])
        with pytest.raises(InvalidSpec, match="integers"):
            await cache.restore(["a"], np.array([5.0]))
        assert cache.lookup(["a", "b", "c", "d"]) == 4
        st = cache.stats()
        assert st.evictions == 0 and st.failed_stores == 0 and st.manager.failed_stores == 0
        assert_settled(cache)


async def test_restore_takes_an_array_of_keys() -> None:
    async with open_cache() as (kv, _, cache):
        assert not await cache.restore(np.array([0]), [5])  # never stored: a miss, not a hit
        fill(kv, 1, 1)
        fill(kv, 2, 2)
        await cache.offload(np.array([10, 20]), [1, 2])
        assert cache.lookup(np.array([10, 20])) == 2
        assert await cache.restore(np.array([10, 20]), [6, 7])
        assert holds(kv, 6, 1) and holds(kv, 7, 2)
        assert_settled(cache)


async def test_drain_waits_only_for_copies_started_before_it() -> None:
    # A busy server keeps offloading; drain() must not wait for those later copies.
    async with open_cache() as (_, _, cache):
        early, late = threading.Event(), threading.Event()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: cache.offload(["early"], [1], after=early))
                await anyio.sleep(0)
                drained = anyio.Event()

                async def drain_then_note() -> None:
                    await drain(cache)
                    drained.set()

                tg.start_soon(drain_then_note)
                await anyio.sleep(0)
                tg.start_soon(lambda: cache.offload(["late"], [2], after=late))
                await anyio.sleep(0.01)
                assert not drained.is_set()
                early.set()
                with anyio.fail_after(5):
                    await drained.wait()
                assert cache.lookup(["early", "late"]) == 1  # "late" is still pending
                late.set()
        finally:
            early.set()
            late.set()
        assert cache.lookup(["early", "late"]) == 2
        assert_settled(cache)


def test_a_policy_object_serves_one_cache_from_fresh() -> None:
    from aiokv.cache.admission import make_admission
    from aiokv.cache.policies import make_policy

    used = make_policy("lru", 4)
    used.on_insert(["a"])  # say, the policy of a cache rebuilt after its worker closed
    with pytest.raises(ValueError, match="tracks keys"):
        make_policy(used, 4)
    fresh = make_policy("lru", 4)
    assert make_policy(fresh, 4) is fresh
    with pytest.raises(ValueError, match="already serves a cache"):  # it would evict the other's keys
        make_policy(fresh, 4)
    admission = make_admission("adaptive", 4)
    assert make_admission(admission, 4) is admission
    with pytest.raises(ValueError, match="already serves a cache"):
        make_admission(admission, 4)


async def test_caches_sharing_a_worker_share_its_job_ids() -> None:
    kv = make_layers(num_layers=2, num_blocks=32)
    latch = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=16) as worker:
        first = OffloadCache(worker, policy="lru", chunks=range(0, 8))
        second = OffloadCache(worker, policy="lru", chunks=range(8, 16))
        try:
            async with anyio.create_task_group() as tg:
                for i in range(4):  # in flight: the first cache holds ids 1-4
                    tg.start_soon(lambda i=i: first.offload([f"a{i}"], [i], after=latch))
                await anyio.sleep(0.01)
                fill(kv, 20, 7)
                tg.start_soon(second.offload, ["x"], [20])
                await anyio.sleep(0.01)
                # The next id of the worker's one counter: none of the first cache's skipped.
                assert sorted(first._jobs.in_flight) == [1, 2, 3, 4] and list(second._jobs.in_flight) == [5]
                latch.set()
        finally:
            latch.set()
        assert await second.restore(["x"], [21]) and holds(kv, 21, 7)
        assert first.lookup([f"a{i}" for i in range(4)]) == 4


async def test_block_ids_as_a_torch_tensor_are_accepted() -> None:
    async with open_cache() as (kv, _, cache):
        fill(kv, 1, 1)
        fill(kv, 2, 2)
        await cache.offload(["a", "b"], torch.tensor([1, 2]))
        assert await cache.restore(["a", "b"], torch.tensor([5, 6], dtype=torch.int32))
        assert holds(kv, 5, 1) and holds(kv, 6, 2)
        with pytest.raises(InvalidSpec, match="integers"):
            await cache.offload(["c"], torch.tensor([3.0]))
        assert_settled(cache)


async def test_keys_as_a_torch_tensor_hash_by_value() -> None:
    """A tensor of keys is read as ints (its 0-d elements hash by identity and would never
    hit, filling the cache with unreachable entries); loose tensor keys are refused."""
    async with open_cache() as (kv, _, cache):
        fill(kv, 1, 1)
        fill(kv, 2, 2)
        assert (await cache.offload(torch.tensor([101, 102]), [1, 2])).stored == 2
        again = await cache.offload(torch.tensor([101, 102]), [1, 2])
        assert (again.stored, again.skipped) == (0, 2) and len(cache) == 2
        assert cache.lookup(torch.tensor([101, 102])) == 2 and cache.lookup([101, 102]) == 2
        assert await cache.restore(torch.tensor([101, 102]), [6, 7])
        assert holds(kv, 6, 1) and holds(kv, 7, 2)
        with pytest.raises(InvalidSpec, match="hash by value"):
            await cache.offload([torch.tensor(103)], [3])
        assert cache.lookup([torch.tensor(101)]) == 0  # a tensor is not the key 101
        with pytest.raises(InvalidSpec, match="1-D"):
            cache.lookup(np.array([[101, 102]]))
        assert len(cache) == 2
        assert_settled(cache)


async def test_a_refused_cache_leaves_the_policy_object_usable() -> None:
    from aiokv.cache.policies import make_policy

    kv = make_layers(num_layers=2, num_blocks=32)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        first = OffloadCache(worker, policy="lru", chunks=range(0, 4))
        policy = make_policy("lru", 4)
        with pytest.raises(InvalidSpec, match="already belong"):
            OffloadCache(worker, policy=policy, chunks=range(2, 6))
        cache = OffloadCache(worker, policy=policy, chunks=range(4, 8))  # the same object
        assert cache.manager.policy is policy and first.chunks == range(0, 4)


@pytest.mark.parametrize("twice", [[5, 5], [torch.tensor(5), torch.tensor(5)], np.array([5, 5])],
                         ids=["ints", "0-d tensors", "array"])
async def test_a_restore_into_one_block_twice_is_refused_before_it_counts_as_a_use(twice) -> None:
    async with open_cache(num_chunks=4) as (kv, _, cache):
        for i, key in enumerate("abcd"):
            fill(kv, i + 1, i + 1)
            await cache.offload([key], [i + 1])  # "a" is the least recently used
        with pytest.raises(InvalidSpec, match="appears twice"):
            await cache.restore(["a", "b"], twice)
        result = await cache.offload(["e"], [9])
        assert result.evicted == 1 and cache.lookup(["a"]) == 0 and cache.lookup(["b", "c", "d"]) == 3
        assert cache.stats().restores == 0
        assert_settled(cache)


@pytest.mark.parametrize("ids", [3, np.int64(3), np.array(3), "12"],
                         ids=["int", "numpy int", "0-d array", "str"])
async def test_block_ids_that_are_no_sequence_raise_invalid_spec(ids) -> None:
    async with open_cache() as (_, _, cache):
        await cache.offload(["a"], [1])
        before = cache.stats()
        with pytest.raises(InvalidSpec, match="sequence of integers"):
            await cache.offload(["c"], ids)
        with pytest.raises(InvalidSpec, match="sequence of integers"):
            await cache.restore(["a"], ids)
        assert cache.stats() == before and "c" not in cache.manager
        assert_settled(cache)


async def test_block_ids_given_as_0d_arrays_read_as_their_ints() -> None:
    async with open_cache() as (kv, _, cache):
        fill(kv, 1, 1)
        fill(kv, 2, 2)
        await cache.offload(["a", "b"], [np.array(1), np.array(2)])
        assert await cache.restore(["a", "b"], [np.array(3), np.array(4)])
        assert holds(kv, 3, 1) and holds(kv, 4, 2)
        assert_settled(cache)


async def test_unhashable_keys_are_invalid_spec_and_a_generator_of_keys_is_read_once() -> None:
    async with open_cache() as (kv, _, cache):
        fill(kv, 1, 1)
        await cache.offload(["a"], [1])
        before = cache.stats()
        with pytest.raises(InvalidSpec, match="hashable"):
            cache.lookup([["a"]])
        with pytest.raises(InvalidSpec, match="hashable"):
            await cache.offload([["b"]], [2])
        with pytest.raises(InvalidSpec, match="hashable"):
            await cache.restore(["a", ["b"]], [3, 4])
        with pytest.raises(InvalidSpec, match="hashable"):  # behind a miss, too
            await cache.restore(["z", ["b"]], [3, 4])
        for one in (b"ab", "ab", bytearray(b"ab")):  # one key, not a key per element
            with pytest.raises(InvalidSpec, match="wrap it in a list"):
                cache.lookup(one)
            with pytest.raises(InvalidSpec, match="wrap it in a list"):
                await cache.offload(one, [2, 3])
            with pytest.raises(InvalidSpec, match="wrap it in a list"):
                await cache.restore(one, [2, 3])
        assert cache.stats() == before and len(cache) == 1
        assert cache.lookup(k for k in ["a", "z"]) == 1  # counted as 1 hit and 1 miss
        st = cache.stats()
        assert (st.hits - before.hits, st.misses - before.misses) == (1, 1)
        assert await cache.restore(["a"], [5])
        assert holds(kv, 5, 1)
        assert_settled(cache)


async def test_calls_that_copy_nothing_still_checkpoint() -> None:
    """Held keys, a miss, an empty restore and an idle drain return without a copy, but
    still yield to the loop as an awaited copy does: a loop of them stays cancellable and
    the worker's poller runs between them."""
    async with open_cache() as (kv, _, cache):
        fill(kv, 1, 1)
        await cache.offload(["a"], [1])
        calls = {
            "offload of held keys": lambda: cache.offload(["a"], [1]),
            "restore of a missing key": lambda: cache.restore(["z"], [2]),
            "restore of no keys": lambda: cache.restore([], []),
            "drain with nothing in flight": lambda: cache.drain(),
        }
        for what, call in calls.items():
            with anyio.CancelScope() as scope:
                scope.cancel()
                await call()
            assert scope.cancelled_caught, what
        assert cache.lookup(["a"]) == 1
        assert_settled(cache)
