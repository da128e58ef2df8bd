"""Disk reads straight into a staging chunk's pages (``DiskTier.read_parts``): byte-exact on
random data in every mode (direct into aligned pages, through the bounce buffer for
unaligned ones, buffered), a truncated or corrupt file a miss that is dropped, a short read
continued, and a restore of a reordered layout that stops at its first bad key and gives
every staging chunk and pin back."""

from __future__ import annotations

import itertools
import mmap
import os
import random
import zlib
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from aiokv import CanonicalKVCaches, DiskTier
from aiokv.backends.cpu import CpuHostPool
from aiokv.cache import restore as restore_mod
from aiokv.cache.pages import PageMap
from aiokv.cache.tiers import codec, disk_io, disk_native
from aiokv.cache.tiers.disk_io import ALIGN
from tests.conftest import KV, random_bytes_, same_bytes
from tests.test_tier_disk import FP, keys_of
from tests.test_tier_disk_cache import (
    NUM_BLOCKS,
    PAGE,
    block,
    cache_on,
    offload_generations,
    restored_exactly,
)
from tests.test_tier_disk_restore import directs

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("disk_reader")]

PAGES = 4
BLOCK = PAGES * 2 * ALIGN  # four pages of 8 KiB: each page can take direct I/O


def random_payloads(n: int, seed: int) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()) for _ in range(n)]


def scattered_parts(n: int, *, aligned: bool, seed: int) -> tuple[mmap.mmap, list[list[memoryview]]]:
    """Each block's pages at shuffled places of one mapping (as a host chunk keeps them),
    page-aligned or each moved off the page by a few bytes. The mapping goes with its
    views (closing it while they live would raise)."""
    shift = 0 if aligned else 24
    stride = BLOCK // PAGES + ALIGN
    area = mmap.mmap(-1, n * PAGES * stride)
    view = memoryview(area)
    rng = random.Random(seed)
    parts = []
    for b in range(n):
        slots = list(range(PAGES))
        rng.shuffle(slots)
        base = b * PAGES * stride
        parts.append([view[base + s * stride + shift: base + s * stride + shift + BLOCK // PAGES]
                      for s in slots])
    return area, parts


@pytest.mark.parametrize("aligned", [True, False])
async def test_read_parts_is_byte_exact_on_random_data(tmp_path: Path, aligned: bool) -> None:
    for direct in directs(tmp_path):
        tier = DiskTier(tmp_path / f"{direct}-{aligned}", capacity_bytes=1 << 24, direct=direct)
        await tier.open(FP)
        keys, data = keys_of(6), random_payloads(6, seed=40)
        assert all(await tier.write(keys, data))
        _area, parts = scattered_parts(6, aligned=aligned, seed=41)
        try:
            assert await tier.read_parts(keys, parts) == [True] * 6
            for want, got in zip(data, parts):
                assert b"".join(bytes(p) for p in got) == bytes(want)
            assert tier.statistics().read_hits == 6
        finally:
            await tier.aclose()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
async def test_a_damaged_file_read_in_parts_is_a_miss_and_is_dropped(tmp_path: Path, damage: str) -> None:
    for direct in directs(tmp_path):
        tier = DiskTier(tmp_path / f"{direct}", capacity_bytes=1 << 24, direct=direct)
        await tier.open(FP)
        keys, data = keys_of(3), random_payloads(3, seed=42)
        assert all(await tier.write(keys, data))
        victim = tier._opened().path(keys[1])
        raw = bytearray(Path(victim).read_bytes())
        if damage == "truncated":
            raw = raw[: len(raw) - ALIGN]
        else:
            raw[ALIGN + BLOCK - 5] ^= 0x01  # the last page of the payload: header still whole
        Path(victim).write_bytes(raw)
        _area, parts = scattered_parts(3, aligned=True, seed=43)
        try:
            assert await tier.read_parts(keys, parts) == [True, False, True]
            for i in (0, 2):
                assert b"".join(bytes(p) for p in parts[i]) == bytes(data[i])
            assert not tier.holds(keys[1]) and not os.path.exists(victim)
            assert tier.statistics().corrupt == 1
        finally:
            await tier.aclose()


async def test_a_short_read_is_continued_not_taken_for_truncation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk_reader: str) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 24, direct=False)
    await tier.open(FP)
    keys, data = keys_of(2), random_payloads(2, seed=44)
    assert all(await tier.write(keys, data))
    calls = []
    if disk_reader == "native":  # the reader asks for at most 3000 bytes a call
        native = disk_native.reader()
        start = native.set_read_cap(3000)
        count = lambda: native.set_read_cap(3000) - start  # noqa: E731
    else:
        preadv = os.preadv

        def short(fd: int, buffers: list[memoryview], offset: int) -> int:
            calls.append(offset)
            first = memoryview(buffers[0]).cast("B")
            return preadv(fd, [first[: min(first.nbytes, 3000)]], offset)  # at most 3000 bytes a call

        monkeypatch.setattr(disk_io.os, "preadv", short)
        count = lambda: len(calls)  # noqa: E731
    _area, parts = scattered_parts(2, aligned=False, seed=45)
    try:
        assert await tier.read_parts(keys, parts) == [True, True]
        for want, got in zip(data, parts):
            assert b"".join(bytes(p) for p in got) == bytes(want)
        assert count() > 2 * (PAGES + 1) and tier.statistics().corrupt == 0
    finally:
        if disk_reader == "native":
            disk_native.reader().set_read_cap(0)
        monkeypatch.undo()
        await tier.aclose()


def test_parts_are_checksummed_as_one_payload() -> None:
    data = os.urandom(70_001)
    cuts = [0, 1, 4096, 4097, 50_000, 70_001]
    parts = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    assert codec.checksum_parts(parts) == zlib.crc32(data) & 0xFFFFFFFF == codec.checksum(data)
    assert codec.checksum_parts([]) == 0


def test_a_page_map_reads_adjacent_pages_as_one_part() -> None:
    # Pages 0,1 follow each other in both orders; page 2 sits before them in the chunk.
    pages = PageMap(64, [8, 8, 16], [16, 24, 0])
    assert not pages.identity and pages.runs == [(16, 16), (0, 16)]
    pool = np.arange(128, dtype=np.uint8)
    parts = pages.parts(pool, 1)
    assert [bytes(p) for p in parts] == [bytes(range(80, 96)), bytes(range(64, 80))]
    assert all(not p.readonly for p in parts)


def test_the_cpu_host_pool_starts_on_a_page() -> None:
    for nbytes in (1, 4096, (1 << 20) + 3):
        pool = CpuHostPool(nbytes)
        assert pool.tensor.numel() == nbytes and pool.tensor.data_ptr() % 4096 == 0
        pool.close()


def reordered_kv(seed: int) -> KV:
    """Two layers with layer 0 at the higher address: host chunks keep pages out of the
    layout's order, so restores read blocks into the chunks' pages in parts."""
    whole = random_bytes_(torch.empty(2, 2, NUM_BLOCKS, *PAGE, dtype=torch.bfloat16),
                          torch.Generator().manual_seed(seed))
    layers = [whole[1], whole[0]]
    return KV(layers, CanonicalKVCaches.from_tensors(layers, block_dim=1))


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
async def test_a_damaged_file_ends_a_restore_in_parts_at_the_first_bad_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 3)
    for direct in directs(tmp_path):
        kv = reordered_kv(seed=46)
        tier = DiskTier(tmp_path / f"direct-{direct}", capacity_bytes=1 << 26, direct=direct)
        async with cache_on(kv, tier, staging=9) as cache:
            assert not cache._cascade.pages.identity  # type: ignore[union-attr]
            expected = await offload_generations(kv, cache, 20)
            keys = [f"k{i}" for i in range(16)]
            for bad in ("k7", "k11"):  # the first bad key ends it; a later one changes nothing
                victim = tier._opened().path(codec.key_bytes(bad))
                raw = bytearray(Path(victim).read_bytes())
                if damage == "truncated":
                    raw = raw[: len(raw) // 2]
                else:
                    raw[-ALIGN - 1] ^= 0x80  # the payload's last bytes (the file is page-padded)
                Path(victim).write_bytes(raw)
            before = block(kv, 30 + 7)
            result = await cache.restore(keys, list(range(30, 46)))
            assert not result and result.restored == 7 and result.from_tiers == 7
            assert restored_exactly(kv, keys[:7], 30, expected)
            assert all(same_bytes(a, b) for a, b in zip(block(kv, 37), before))  # never written
            assert tier.statistics().corrupt >= 1 and cache.lookup(keys) == 7
            st = cache.stats()
            assert st.staging_free == st.staging_chunks and st.manager.pinned_keys == 0


async def test_a_cancelled_restore_in_parts_leaks_nothing(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore_mod, "BATCH_KEYS", 2)
    kv = reordered_kv(seed=47)
    tier = DiskTier(tmp_path, capacity_bytes=1 << 26)
    async with cache_on(kv, tier, staging=6) as cache:
        expected = await offload_generations(kv, cache, 20)
        keys = [f"k{i}" for i in range(16)]
        tier._opened().delay = 0.05  # every read call sleeps first: the cancel lands mid-read
        with anyio.move_on_after(0.02):
            await cache.restore(keys, list(range(30, 46)))
        tier._opened().delay = 0.0
        with anyio.fail_after(10):  # each submitted load gives its chunks back when it is over
            while (st := cache.stats()).staging_free < st.staging_chunks:
                await anyio.sleep(0.01)
        assert st.staging_free == st.staging_chunks and st.manager.pinned_keys == 0
        result = await cache.restore(keys, list(range(30, 46)))  # everything is still there
        assert result and restored_exactly(kv, keys, 30, expected)


@pytest.mark.parametrize("batch", [2, 3, 16])
async def test_a_mixed_restore_in_parts_puts_every_source_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """Host, disk (in parts) and a remote tier (rows scattered into place) in one restore of
    a reordered layout, interleaved: the remote's good bytes overwrite what a corrupt disk
    file left in the chunk's pages, and the disk's in-place blocks are not overwritten by
    rows never read."""
    from aiokv import AsyncOffloadingWorker, OffloadCache
    from tests.test_tier_disk_cache import HOST
    from tests.test_tiers_cascade import MemTier

    monkeypatch.setattr(restore_mod, "BATCH_KEYS", batch)
    for direct in directs(tmp_path):
        kv = reordered_kv(seed=48)
        disk = DiskTier(tmp_path / f"direct-{direct}", capacity_bytes=1 << 26, direct=direct)
        remote = MemTier(remote=True)
        async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=HOST + 9) as worker:
            async with OffloadCache(worker, policy="lru", tiers=[disk, remote],
                                    staging_chunks=9) as cache:
                assert not cache._cascade.pages.identity  # type: ignore[union-attr]
                expected = await offload_generations(kv, cache, 16)  # k0..k11 on disk, k12.. host
                remote.values.clear()
                for name in ("k2", "k5", "k6", "k9"):  # on the remote only; disk files corrupt
                    tk = codec.key_bytes(name)
                    buf = bytearray(cache._cascade.block_bytes)  # type: ignore[union-attr]
                    assert await disk.read([tk], [memoryview(buf)]) == [True]
                    remote.values[tk] = bytes(buf)
                    victim = disk._opened().path(tk)
                    raw = bytearray(Path(victim).read_bytes())
                    for at in range(ALIGN, len(raw) - ALIGN, 997):
                        raw[at] ^= 0x5A
                    Path(victim).write_bytes(raw)
                keys = ["k0", "k12", "k2", "k3", "k13", "k5", "k6", "k1", "k14", "k9", "k4",
                        "k10", "k15", "k7"]
                result = await cache.restore(keys, list(range(30, 30 + len(keys))))
                assert result and result.restored == len(keys)
                assert restored_exactly(kv, keys, 30, expected)
                assert disk.statistics().corrupt == 4 and remote.reads >= 4
                st = cache.stats()
                assert st.staging_free == st.staging_chunks and st.manager.pinned_keys == 0
