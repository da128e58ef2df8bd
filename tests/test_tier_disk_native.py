"""The disk tier's two reads, native (``_diskread``, without the GIL) and Python, give the
same answers: byte-exact blocks from real files, a crc32 equal to zlib's, and the same
verdict and counters for every kind of bad block in one call beside good ones."""

from __future__ import annotations

import mmap
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest

from aiokv.cache.tiers import codec, disk_io, disk_native
from aiokv.cache.tiers.codec import layout_fingerprint
from aiokv.cache.tiers.disk import DiskTier
from aiokv.cache.tiers.disk_io import ALIGN, probe_direct
from tests.test_tier_disk import keys_of

pytestmark = pytest.mark.anyio

native = disk_native.reader()
needs_native = pytest.mark.skipif(native is None, reason=f"the native disk reader: {disk_native.status()}")


def directs(tmp_path: Path) -> list[bool]:
    return [False, True] if probe_direct(str(tmp_path)) else [False]


def random_blocks(n: int, size: int, seed: int) -> list[memoryview]:
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for _ in range(n)]


def pages_of(n: int, size: int, pages: int, seed: int) -> tuple[mmap.mmap, list[list[memoryview]]]:
    """Each block as ``pages`` page-aligned pieces at shuffled places of one mapping (the
    last piece takes what is left), as a staging chunk's pages in portable order."""
    piece = size // pages
    stride = -(-piece // ALIGN) * ALIGN + ALIGN
    area = mmap.mmap(-1, n * pages * stride)
    view = memoryview(area)
    rng = random.Random(seed)
    out = []
    for b in range(n):
        slots = list(range(pages))
        rng.shuffle(slots)
        lens = [piece] * (pages - 1) + [size - piece * (pages - 1)]
        base = b * pages * stride
        out.append([view[base + s * stride: base + s * stride + k] for s, k in zip(slots, lens)])
    return area, out


@needs_native
def test_the_native_crc_is_zlibs_over_many_lengths_and_chained_parts() -> None:
    rng = random.Random(50)
    data = os.urandom(300_000)
    lengths = list(range(0, 70)) + [rng.randrange(70, 300_000) for _ in range(200)]
    for n in lengths:
        start = rng.randrange(0, 300_000 - n + 1)
        piece = memoryview(data)[start:start + n]
        want = zlib.crc32(piece) & 0xFFFFFFFF
        assert native.crc32_parts([piece]) == want
        cuts = sorted(rng.randrange(0, n + 1) for _ in range(rng.randrange(0, 6)))
        parts = [piece[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        assert native.crc32_parts(parts) == want == codec.checksum_parts(parts)
        seed = rng.getrandbits(32)
        assert native.crc32_parts(parts, seed) == zlib.crc32(piece, seed) & 0xFFFFFFFF


@pytest.mark.parametrize("size,pages", [(4 * ALIGN, 4), (64 * ALIGN, 16), (3 * ALIGN + 123, 3)])
async def test_both_reads_are_byte_exact_through_real_files(
        tmp_path: Path, disk_reader: str, size: int, pages: int) -> None:
    """Whole-page pieces read in place (direct I/O too); a size off the page is read
    through the bounce buffer with direct I/O (the native call leaves it to Python)."""
    for direct in directs(tmp_path):
        tier = DiskTier(tmp_path / f"{direct}", capacity_bytes=64 * size, direct=direct, io_threads=3)
        await tier.open(layout_fingerprint(block_bytes=size))
        assert tier._opened().native is (disk_reader == "native")
        keys, data = keys_of(12), random_blocks(12, size, seed=51 + pages)
        assert all(await tier.write(keys, data))
        _area, parts = pages_of(12, size, pages, seed=52)
        order = list(range(12))
        random.Random(53).shuffle(order)
        assert await tier.read_parts([keys[i] for i in order], [parts[i] for i in order]) == [True] * 12
        for want, got in zip(data, parts):
            assert b"".join(bytes(p) for p in got) == bytes(want)
        st = tier.statistics()
        assert (st.read_hits, st.corrupt, st.errors) == (12, 0, 0)
        await tier.aclose()


async def test_a_call_with_every_kind_of_bad_block_beside_good_ones(
        tmp_path: Path, disk_reader: str) -> None:
    """One read call: good blocks between a truncated file, a flipped payload byte, a
    flipped header byte, another key's file in its place, a vanished file and a directory
    (an I/O error). Each gives the verdict it gave before, in both reads."""
    size = 8 * ALIGN
    for direct in directs(tmp_path):
        tier = DiskTier(tmp_path / f"{direct}", capacity_bytes=64 * size, direct=direct)
        await tier.open(layout_fingerprint(block_bytes=size))
        files = tier._opened()
        keys, data = keys_of(10), random_blocks(10, size, seed=54)
        assert all(await tier.write(keys, data))
        paths = [files.path(k) for k in keys]

        def damage(path: str, at: int) -> None:
            raw = bytearray(Path(path).read_bytes())
            raw[at] ^= 0x10
            Path(path).write_bytes(raw)

        with open(paths[1], "r+b") as f:  # truncated: the last page of the payload is gone
            f.truncate(os.path.getsize(paths[1]) - ALIGN)
        damage(paths[2], ALIGN + size - 1)  # the payload's last byte
        damage(paths[4], 3)  # the header
        Path(paths[5]).write_bytes(Path(paths[0]).read_bytes())  # key 0's file under key 5's name
        os.unlink(paths[6])  # vanished
        os.unlink(paths[8])
        os.mkdir(paths[8])  # open or read fails with an OSError: an I/O error, kept
        _area, parts = pages_of(10, size, 8, seed=55)
        for p in parts:  # nothing left from an earlier read could pass for the block
            for v in p:
                v[:] = bytes(v.nbytes)
        got = await tier.read_parts(keys, parts)
        assert got == [True, False, False, True, False, False, False, True, False, True]
        for i in (0, 3, 7, 9):
            assert b"".join(bytes(p) for p in parts[i]) == bytes(data[i])
        st = tier.statistics()
        assert (st.read_hits, st.corrupt, st.errors) == (4, 4, 2)  # vanished and the directory
        held = [tier.holds(k) for k in keys]
        assert held == [True, False, False, True, False, False, False, True, True, True]
        assert [os.path.exists(p) for p in paths] == [True, False, False, True, False, False,
                                                      False, True, True, True]
        assert isinstance(files.last_error, OSError) and files.last_error.errno  # the directory's
        os.rmdir(paths[8])
        await tier.aclose()


async def test_direct_reads_of_aligned_and_unaligned_blocks_in_one_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk_reader: str) -> None:
    """With direct I/O, blocks whose pieces all sit on pages are read in place; a block
    with a piece off the page goes through a bounce buffer (the native reader's own, or
    the Python read's), in the same call, and both arrive whole."""
    if not probe_direct(str(tmp_path)):
        pytest.skip("this filesystem does not take O_DIRECT")
    size = 4 * ALIGN
    tier = DiskTier(tmp_path, capacity_bytes=64 * size, direct=True)
    await tier.open(layout_fingerprint(block_bytes=size))
    keys, data = keys_of(4), random_blocks(4, size, seed=56)
    assert all(await tier.write(keys, data))
    python_reads: list[bytes] = []
    read_one = disk_io.BlockFiles.read_one
    monkeypatch.setattr(disk_io.BlockFiles, "read_one",
                        lambda self, key, parts: python_reads.append(key) or read_one(self, key, parts))
    queues: list[disk_io.ReadQueue] = []
    read_queue = disk_io.BlockFiles.read_queue
    monkeypatch.setattr(disk_io.BlockFiles, "read_queue",
                        lambda self, *a: queues.append(read_queue(self, *a)) or queues[-1])
    _area, parts = pages_of(4, size, 2, seed=57)
    off = memoryview(bytearray(size + 8))[8:]  # off the page
    parts[2] = [off[: size // 2], off[size // 2:]]
    assert await tier.read_parts(keys, parts) == [True] * 4
    for want, got in zip(data, parts):
        assert b"".join(bytes(p) for p in got) == bytes(want)
    if disk_reader == "native":
        assert not python_reads and [q.batch.bounced for q in queues] == [[2]]
    else:
        assert python_reads == keys
    await tier.aclose()


@needs_native
async def test_a_short_direct_read_is_continued(tmp_path: Path, disk_reader: str) -> None:
    """The native reader takes a short read (here every read stops after two pages) as
    more to read, never as the end of the file, with direct I/O too."""
    if disk_reader != "native" or not probe_direct(str(tmp_path)):
        pytest.skip("the native reader with direct I/O")
    size = 16 * ALIGN
    tier = DiskTier(tmp_path, capacity_bytes=64 * size, direct=True)
    await tier.open(layout_fingerprint(block_bytes=size))
    keys, data = keys_of(3), random_blocks(3, size, seed=58)
    assert all(await tier.write(keys, data))
    _area, parts = pages_of(3, size, 4, seed=59)
    before = native.set_read_cap(2 * ALIGN)
    try:
        assert await tier.read_parts(keys, parts) == [True] * 3
    finally:
        calls = native.set_read_cap(0) - before
    for want, got in zip(data, parts):
        assert b"".join(bytes(p) for p in got) == bytes(want)
    assert calls >= 3 * (1 + size // (2 * ALIGN)) and tier.statistics().corrupt == 0
    await tier.aclose()


def test_an_unknown_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.errors import InvalidSpec

    monkeypatch.setenv(disk_native.ENV, "maybe")
    with pytest.raises(InvalidSpec):
        disk_native.reader()
    monkeypatch.setenv(disk_native.ENV, "0")
    assert disk_native.reader() is None and "python" in disk_native.status()
