"""Restores from a DiskTier through the cache's concurrent batches: byte-exact, every batch
read at once, a truncated file or a full disk a miss that ends the restore there (never
wrong bytes), reads never queued behind writes, and an exit with reads and writes in
flight bounded."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import anyio
import pytest

from aiokv import DiskTier
from aiokv.cache import restore as restore_mod
from aiokv.cache.tiers import codec, disk_io
from aiokv.cache.tiers.disk_direct import probe_direct
from tests.conftest import make_layers, same_bytes
from tests.test_tier_disk_cache import (
    NUM_BLOCKS,
    PAGE,
    block,
    cache_on,
    offload_generations,
    restored_exactly,
)

pytestmark = pytest.mark.anyio


def directs(tmp_path: Path) -> list[bool]:
    """Buffered, and direct I/O where this filesystem takes it."""
    return [False, True] if probe_direct(str(tmp_path)) else [False]


class Concurrency:
    """Counts how many of a function's calls run at once, each held a little."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.now = self.most = 0
        self.lock = threading.Lock()

    def wrap(self, fn):  # type: ignore[no-untyped-def]
        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            try:
                time.sleep(self.hold)
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.now -= 1
        return counted


@pytest.mark.parametrize("direct", [False, True])
async def test_a_restore_reads_its_batches_at_once_and_comes_back_byte_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    if direct and not probe_direct(str(tmp_path)):
        pytest.skip("this filesystem does not take O_DIRECT")
    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 1)  # a read call per block
    seen = Concurrency(0.02)
    monkeypatch.setattr(disk_io.BlockFiles, "read_many", seen.wrap(disk_io.BlockFiles.read_many))
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=21)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, direct=direct)
    async with cache_on(kv, tier, staging=8) as cache:
        expected = await offload_generations(kv, cache, 24)
        keys = [f"k{i}" for i in range(20)]  # evicted: only the disk has them
        assert tier.direct is direct
        result = await cache.restore(keys, list(range(24, 44)))
        assert result and result.restored == 20 and result.from_tiers == 20
        assert restored_exactly(kv, keys, 24, expected)
        assert seen.most > 1  # batches read side by side, not one after the other
        st = cache.stats()
        assert st.tiers[0].restored_keys == 20 and st.staging_free == st.staging_chunks
        assert st.manager.pinned_keys == 0


async def test_a_truncated_file_in_a_later_batch_ends_the_restore_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 3)
    for direct in directs(tmp_path):
        kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=22)
        tier = DiskTier(tmp_path / f"direct-{direct}", capacity_bytes=1 << 26, direct=direct)
        async with cache_on(kv, tier, staging=9) as cache:
            expected = await offload_generations(kv, cache, 20)
            keys = [f"k{i}" for i in range(16)]
            victim = tier._opened().path(codec.key_bytes("k7"))
            with open(victim, "r+b") as f:
                f.truncate(os.path.getsize(victim) // 2)
            before = block(kv, 30 + 7)
            result = await cache.restore(keys, list(range(30, 46)))
            assert not result and result.restored == 7 and result.from_tiers == 7
            assert restored_exactly(kv, keys[:7], 30, expected)
            assert all(same_bytes(a, b) for a, b in zip(block(kv, 37), before))  # never written
            assert tier.statistics().corrupt == 1 and not os.path.exists(victim)
            assert cache.stats().tiers[0].read_misses == 1
            assert cache.lookup(keys) == 7
            st = cache.stats()  # the batches read past the miss gave everything back
            assert st.staging_free == st.staging_chunks and st.manager.pinned_keys == 0


async def test_a_full_disk_is_a_miss_at_the_first_block_it_lost(
        small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 2)
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=23)
    tier = DiskTier(small_disk, capacity_bytes=1 << 26)  # the disk fills long before this
    async with cache_on(kv, tier, staging=6) as cache:
        expected = await offload_generations(kv, cache, 40)
        keys = [f"k{i}" for i in range(36)]
        held = [tier.holds(codec.key_bytes(k)) for k in keys]
        lost = held.index(False)
        st = cache.stats().tiers[0]
        assert 0 < lost and st.demotions_dropped == held.count(False) and tier.statistics().errors > 0
        assert cache.lookup(keys) == lost
        result = await cache.restore(keys, list(range(4, 40)))
        assert result.restored == lost
        assert restored_exactly(kv, keys[:lost], 4, expected)


async def test_reads_never_wait_behind_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One I/O thread, taken by a write that hangs: a restore still reads (reads have
    threads of their own), so a request never waits for blocks on their way down."""
    hang, writing, release = threading.Event(), threading.Event(), threading.Event()
    write_many = disk_io.BlockFiles.write_many

    def slow_write(self, *args):  # type: ignore[no-untyped-def]
        if hang.is_set():
            writing.set()
            release.wait(10)
        return write_many(self, *args)

    monkeypatch.setattr(disk_io.BlockFiles, "write_many", slow_write)
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=24)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, io_threads=1)
    async with cache_on(kv, tier) as cache:
        expected = await offload_generations(kv, cache, 12)  # k0..k7 on the disk
        hang.set()
        try:
            await cache.offload([f"n{i}" for i in range(4)], list(range(4)))  # evicts k8..k11
            assert await anyio.to_thread.run_sync(writing.wait, 5)  # the write thread hangs
            with anyio.fail_after(5):
                result = await cache.restore([f"k{i}" for i in range(8)], list(range(20, 28)))
            assert result.restored == 8 and result.from_tiers == 8
            assert restored_exactly(kv, [f"k{i}" for i in range(8)], 20, expected)
        finally:
            release.set()


async def test_an_exit_with_reads_and_writes_in_flight_is_bounded(tmp_path: Path) -> None:
    """Reads and writes that each take 1 s when the cache is left with a drain bound of
    0.3 s: the exit ends within the bound plus the one I/O each thread is in, and nothing
    is left pinned, staged or queued."""
    kv = make_layers(num_layers=2, num_blocks=NUM_BLOCKS, page_shape=PAGE, seed=25)
    directory = tmp_path / "tier"
    async with cache_on(kv, DiskTier(directory, capacity_bytes=1 << 26)) as cache:
        await offload_generations(kv, cache, 12)  # k0..k7 on the disk
    tier = DiskTier(directory, capacity_bytes=1 << 26, simulated_latency=1.0)
    async with cache_on(kv, tier, drain_timeout=0.3) as cache:
        assert cache.lookup([f"k{i}" for i in range(8)]) == 8
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.restore, [f"k{i}" for i in range(8)], list(range(20, 28)))
            tg.start_soon(cache.offload, [f"m{i}" for i in range(8)], list(range(30, 38)))
            await anyio.sleep(0.2)  # reads and writes are in their threads now
            tg.cancel_scope.cancel()
        began = time.monotonic()
    elapsed = time.monotonic() - began
    assert elapsed < 0.3 + 1.0 + 1.5
    st = cache.stats()
    assert st.in_flight == 0 and st.staging_free == st.staging_chunks
    assert st.manager.pinned_keys == 0 and st.manager.pending_keys == 0
    assert st.tiers[0].queued_blocks == 0


async def test_direct_reads_land_straight_in_the_rows_of_a_reordered_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk_reader: str) -> None:
    """A host chunk whose pages are not in the layout's order (tensors at descending
    addresses) is read straight into its staging chunk's pages, in portable order: with
    direct I/O every page takes the read as it is (page-aligned), with no bounce buffer,
    no row and no copy into host order after."""
    if not probe_direct(str(tmp_path)):
        pytest.skip("this filesystem does not take O_DIRECT")
    import torch

    from aiokv import CanonicalKVCaches
    from aiokv.cache.tiers import disk_direct
    from tests.conftest import KV, random_bytes_

    whole = random_bytes_(torch.empty(2, 2, NUM_BLOCKS, *PAGE, dtype=torch.bfloat16),
                          torch.Generator().manual_seed(26))
    layers = [whole[1], whole[0]]  # layer 0 at the higher address
    kv = KV(layers, CanonicalKVCaches.from_tensors(layers, block_dim=1))
    straight: list[bool] = []
    aligned = disk_direct.aligned

    def spy(view: memoryview) -> bool:
        straight.append(aligned(view))
        return straight[-1]

    tier = DiskTier(tmp_path, capacity_bytes=1 << 26, direct=True)
    async with cache_on(kv, tier) as cache:
        assert not cache._cascade.pages.identity  # type: ignore[union-attr]
        expected = await offload_generations(kv, cache, 12)  # k0..k7 on the disk
        # drain() waits for the writes on their way by then, not for blocks that still
        # waited for room (a loaded machine leaves some): a key held in memory is read into
        # a row and copied into place, which this test counts as a miss of the in-place path.
        links = cache._cascade.links  # type: ignore[union-attr]
        with anyio.fail_after(10):
            while any(link.inflight or link.waiting for link in links):
                await cache.drain()
                await anyio.sleep(0.005)
        monkeypatch.setattr(disk_io, "aligned", spy)
        python_reads: list[int] = []
        read_one = disk_io.BlockFiles.read_one
        monkeypatch.setattr(disk_io.BlockFiles, "read_one",
                            lambda self, *a: python_reads.append(1) or read_one(self, *a))
        batches: list[object] = []
        read_queue = disk_io.BlockFiles.read_queue

        def spy_queue(self, *args):  # type: ignore[no-untyped-def]
            queue = read_queue(self, *args)
            batches.append(queue.batch)
            return queue

        monkeypatch.setattr(disk_io.BlockFiles, "read_queue", spy_queue)
        scattered: list[int] = []
        pages = cache._cascade.pages  # type: ignore[union-attr]
        monkeypatch.setattr(pages, "scatter", lambda *a: scattered.append(1))
        keys = [f"k{i}" for i in range(8)]
        result = await cache.restore(keys, list(range(20, 28)))
        assert result.restored == 8 and result.from_tiers == 8
        assert restored_exactly(kv, keys, 20, expected)
        runs = len(pages.runs)
        assert tier._opened().native is (disk_reader == "native")
    if disk_reader == "native":  # every block in place: none through a bounce buffer
        assert runs == 2 and not python_reads and not straight and batches
        assert all(b is not None and not b.bounced for b in batches)
    else:
        assert runs == 2 and len(python_reads) == 8 and len(straight) == 8 * runs and all(straight)
    assert not scattered
