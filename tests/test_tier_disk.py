"""DiskTier on real files: round trips, persistence, corruption, capacity, faults, threads."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import anyio
import pytest

from aiokv.cache.policies import available_policies
from aiokv.cache.tiers.codec import layout_fingerprint
from aiokv.cache.tiers.disk import DiskTier
from aiokv.cache.tiers.disk_io import ALIGN, TEMP_PREFIX, BlockFiles, probe_direct
from aiokv.errors import InvalidSpec, TierError, UsageError

pytestmark = pytest.mark.anyio

BLOCK = 3 * ALIGN + 123  # not a multiple of the alignment: direct I/O needs the bounce path
FP = layout_fingerprint(block_bytes=BLOCK, num_layers=4, block_size=16)
OTHER_FP = layout_fingerprint(block_bytes=BLOCK, num_layers=5, block_size=16)


def keys_of(n: int, start: int = 0) -> list[bytes]:
    return [f"req-{i}".encode() for i in range(start, start + n)]


def payloads(n: int, size: int = BLOCK) -> list[memoryview]:
    return [memoryview(os.urandom(size)) for _ in range(n)]


def buffers(n: int, size: int = BLOCK) -> list[memoryview]:
    # Offset by one byte: never aligned, so direct reads go through the bounce buffer.
    return [memoryview(bytearray(size + 1))[1:] for _ in range(n)]


async def opened(path: Path, fp: bytes = FP, **kwargs: object) -> DiskTier:
    kwargs.setdefault("capacity_bytes", 64 * BLOCK)
    tier = DiskTier(path, **kwargs)  # type: ignore[arg-type]
    await tier.open(fp)
    return tier


def block_files(tier: DiskTier) -> list[str]:
    return sorted(n for n in os.listdir(tier.directory) if n.endswith(".kv"))


def temp_files(tier: DiskTier) -> list[str]:
    return [n for n in os.listdir(tier.directory) if n.startswith(TEMP_PREFIX)]


@pytest.fixture(params=[None, False], ids=["probed", "buffered"])
def direct(request: pytest.FixtureRequest) -> bool | None:
    """None: direct I/O where the filesystem takes it (ext4, recent tmpfs); False: never."""
    return request.param


@pytest.mark.usefixtures("disk_reader")
async def test_round_trip_is_byte_exact(tmp_path: Path, direct: bool | None) -> None:
    tier = await opened(tmp_path, direct=direct, io_threads=3)
    assert tier.direct == (direct is None and probe_direct(tier.directory))
    keys, data = keys_of(7), payloads(7)
    assert await tier.write(keys, data) == [True] * 7
    assert all(tier.holds(k) for k in keys) and not tier.holds(b"absent")
    out = buffers(8)
    assert await tier.read([*keys[::-1], b"absent"], out) == [True] * 7 + [False]
    for got, want in zip(out, data[::-1]):
        assert bytes(got) == bytes(want)
    stats = tier.statistics()
    assert (stats.blocks, stats.bytes_held, stats.writes, stats.write_bytes) == (7, 7 * BLOCK, 7, 7 * BLOCK)
    assert (stats.reads, stats.read_hits, stats.read_bytes) == (8, 7, 7 * BLOCK)
    assert (stats.errors, stats.corrupt, stats.evictions) == (0, 0, 0)
    assert not temp_files(tier)
    await tier.aclose()


@pytest.mark.usefixtures("disk_reader")
async def test_aligned_buffers_round_trip(tmp_path: Path, direct: bool | None) -> None:
    """Page-aligned, whole-page buffers (a pinned host pool's chunks) take the zero-copy path."""
    size = 4 * ALIGN
    tier = await opened(tmp_path, layout_fingerprint(block_bytes=size), direct=direct,
                        capacity_bytes=8 * size)
    # Not closed at the end: a finished I/O thread may still hold its last arguments.
    src = memoryview(mmap.mmap(-1, 6 * size))
    src[: 3 * size] = os.urandom(3 * size)
    keys = keys_of(3)
    assert await tier.write(keys, [src[i * size:(i + 1) * size] for i in range(3)]) == [True] * 3
    out = [src[(3 + i) * size:(4 + i) * size] for i in range(3)]
    assert await tier.read(keys, out) == [True] * 3
    assert bytes(src[3 * size:]) == bytes(src[: 3 * size])


async def test_a_new_tier_on_the_same_directory_finds_the_blocks(tmp_path: Path) -> None:
    first = await opened(tmp_path, fsync=True)
    keys, data = keys_of(5), payloads(5)
    assert await first.write(keys, data) == [True] * 5
    await first.aclose()
    with pytest.raises(UsageError):
        first.holds(keys[0])

    second = await opened(tmp_path)
    assert [second.holds(k) for k in keys] == [True] * 5
    assert second.statistics().blocks == 5 and second.block_bytes == BLOCK
    out = buffers(5)
    assert await second.read(keys, out) == [True] * 5
    assert [bytes(o) for o in out] == [bytes(d) for d in data]


async def test_one_tier_per_directory_at_a_time(tmp_path: Path) -> None:
    first = await opened(tmp_path)
    await first.write(keys_of(1), payloads(1))
    with pytest.raises(UsageError, match="another DiskTier"):
        await opened(tmp_path)
    await first.aclose()
    second = await opened(tmp_path)
    assert second.holds(keys_of(1)[0])


async def test_an_unusable_directory_or_a_cancelled_open(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(TierError):
        await opened(blocker)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await opened(tmp_path)
    assert scope.cancelled_caught
    tier = await opened(tmp_path)  # nothing left locked by the cancelled open
    assert await tier.write(keys_of(1), payloads(1)) == [True]


async def test_direct_true_where_the_filesystem_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokv.cache.tiers.disk_direct as disk_direct

    monkeypatch.setattr(disk_direct, "probe_direct", lambda directory: False)  # as tmpfs < 6.6 says
    with pytest.raises(TierError, match="O_DIRECT"):
        await opened(tmp_path, direct=True)
    tier = await opened(tmp_path)  # the default falls back, and the lock was released
    assert not tier.direct
    assert await tier.write(keys_of(1), payloads(1)) == [True]


async def test_another_layout_never_reads_these_blocks(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    keys = keys_of(3)
    await tier.write(keys, payloads(3))
    other = await opened(tmp_path, OTHER_FP)
    assert other.directory != tier.directory
    assert [other.holds(k) for k in keys] == [False] * 3
    assert await other.read(keys, buffers(3)) == [False] * 3
    # A file copied into the other layout's directory under the right name is still not
    # a block of that layout: its header names the first layout.
    name = os.path.basename(BlockFiles(tier.directory, FP, direct=False, fsync=False).path(keys[0]))
    copied = Path(other.directory, name)
    copied.write_bytes(Path(tier.directory, name).read_bytes())
    await other.aclose()
    reopened = await opened(tmp_path, OTHER_FP)
    assert not reopened.holds(keys[0])
    assert reopened.statistics().corrupt == 1
    assert not copied.exists()


@pytest.mark.usefixtures("disk_reader")
async def test_a_truncated_file_is_a_miss_and_is_dropped(tmp_path: Path, direct: bool | None) -> None:
    tier = await opened(tmp_path, direct=direct)
    keys, data = keys_of(3), payloads(3)
    await tier.write(keys, data)
    victim = tier._opened().path(keys[1])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - ALIGN - 100)
    out = buffers(3)
    assert await tier.read(keys, out) == [True, False, True]
    assert bytes(out[0]) == bytes(data[0]) and bytes(out[2]) == bytes(data[2])
    assert not tier.holds(keys[1]) and not os.path.exists(victim)
    stats = tier.statistics()
    assert (stats.corrupt, stats.blocks, stats.read_hits) == (1, 2, 2)


@pytest.mark.usefixtures("disk_reader")
async def test_a_flipped_byte_is_a_miss_and_is_dropped(tmp_path: Path, direct: bool | None) -> None:
    tier = await opened(tmp_path, direct=direct)
    keys, data = keys_of(2), payloads(2)
    await tier.write(keys, data)
    victim = tier._opened().path(keys[0])
    await tier.aclose()
    raw = bytearray(Path(victim).read_bytes())
    raw[ALIGN + 1000] ^= 0x40  # in the payload: the header and length still look whole
    Path(victim).write_bytes(raw)

    again = await opened(tmp_path, direct=direct)
    assert again.holds(keys[0])  # the scan checks headers and lengths, reads check the crc
    out = buffers(2)
    assert await again.read(keys, out) == [False, True]
    assert bytes(out[1]) == bytes(data[1])
    assert not again.holds(keys[0]) and not os.path.exists(victim)
    assert again.statistics().corrupt == 1


async def test_open_drops_temp_files_and_files_that_do_not_verify(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    keys, data = keys_of(3), payloads(3)
    await tier.write(keys, data)
    directory = Path(tier.directory)
    # What a crash mid-write leaves: a temporary file holding part of a block.
    (directory / f"{TEMP_PREFIX}0123456789abcdef").write_bytes(os.urandom(ALIGN + 10))
    # A block file whose header is garbage, and one cut short inside its payload.
    (directory / ("ab" * 20 + ".kv")).write_bytes(os.urandom(5 * ALIGN))
    cut = tier._opened().path(keys[2])
    with open(cut, "r+b") as f:
        f.truncate(2 * ALIGN)
    await tier.aclose()

    again = await opened(tmp_path)
    assert again.temp_files_removed == 1
    assert [again.holds(k) for k in keys] == [True, True, False]
    assert again.statistics().corrupt == 2
    assert len(block_files(again)) == 2
    out = buffers(2)
    assert await again.read(keys[:2], out) == [True, True]
    assert [bytes(o) for o in out] == [bytes(d) for d in data[:2]]


async def test_long_keys_survive_a_reopen(tmp_path: Path, direct: bool | None) -> None:
    """Keys of any length, a 1 MiB one too, share a batch with short ones: none is refused,
    each reads back its own bytes, and a reopened tier finds them all."""
    keys = [b"short", os.urandom(5000), os.urandom(3 * ALIGN), os.urandom((1 << 16) + 1),
            bytes(1 << 20), b"x" * 1024, b"x" * 1025]
    data = payloads(len(keys))
    tier = await opened(tmp_path, direct=direct)
    assert await tier.write(keys, data) == [True] * len(keys)
    await tier.aclose()
    again = await opened(tmp_path, direct=direct)
    assert [again.holds(k) for k in keys] == [True] * len(keys)
    out = buffers(len(keys))
    assert await again.read(keys[::-1], out) == [True] * len(keys)
    assert [bytes(o) for o in out] == [bytes(d) for d in data[::-1]]
    assert await again.exists([bytes(1 << 20), bytes((1 << 20) - 1)]) == [True, False]
    assert again.statistics().corrupt == 0


async def test_a_short_key_that_looks_like_a_digest_is_not_a_long_keys_block(tmp_path: Path) -> None:
    from aiokv.cache.tiers import codec

    long_key = os.urandom(1 << 12)
    tier = await opened(tmp_path)
    assert await tier.write([long_key], payloads(1)) == [True]
    forged = codec.stored_key(long_key)  # what the tier names the long key by
    assert len(forged) < 100 and not tier.holds(forged)
    assert await tier.read([forged], buffers(1)) == [False]


async def test_capacity_counts_payload_bytes_and_evicts_by_policy(tmp_path: Path) -> None:
    n = 4
    # Headers and padding take more than BLOCK - 1 bytes per file, yet n blocks fit.
    tier = await opened(tmp_path, capacity_bytes=n * BLOCK + BLOCK - 1, policy="lru")
    keys, data = keys_of(n + 1), payloads(n + 1)
    assert await tier.write(keys[:n], data[:n]) == [True] * n
    assert tier.statistics().bytes_held == n * BLOCK
    assert await tier.read([keys[0]], buffers(1)) == [True]  # keys[1] is now least recent
    assert await tier.write([keys[n]], [data[n]]) == [True]
    assert [tier.holds(k) for k in keys] == [True, False, True, True, True]
    assert len(block_files(tier)) == n
    stats = tier.statistics()
    assert (stats.blocks, stats.bytes_held, stats.evictions) == (n, n * BLOCK, 1)
    # A key already held is not written again; it only counts as used.
    assert await tier.write([keys[2]], [data[2]]) == [True]
    assert tier.statistics().writes == n + 1
    # More new keys than the tier holds: the head of the call is stored, the tail refused.
    more, more_data = keys_of(n + 2, 100), payloads(n + 2)
    assert await tier.write(more, more_data) == [True] * n + [False, False]
    out = buffers(n)
    assert await tier.read(more[:n], out) == [True] * n
    assert [bytes(o) for o in out] == [bytes(d) for d in more_data[:n]]
    assert tier.statistics().errors == 0


@pytest.mark.parametrize("policy", available_policies())
async def test_every_registered_policy_bounds_the_tier(tmp_path: Path, policy: str) -> None:
    tier = await opened(tmp_path, capacity_bytes=3 * BLOCK, policy=policy)
    keys, data = keys_of(8), payloads(8)
    for i in range(0, 8, 2):
        assert await tier.write(keys[i:i + 2], data[i:i + 2]) == [True, True]
    held = [i for i, k in enumerate(keys) if tier.holds(k)]
    assert len(held) == 3 and len(block_files(tier)) == 3
    assert tier.statistics().evictions == 5
    out = buffers(3)
    assert await tier.read([keys[i] for i in held], out) == [True] * 3
    assert [bytes(o) for o in out] == [bytes(data[i]) for i in held]


@pytest.mark.usefixtures("disk_reader")
async def test_concurrent_reads_writes_and_evictions_stay_consistent(tmp_path: Path) -> None:
    """Many tasks write, read and evict over a small tier at once: every hit has its key's
    bytes, and in the end the index, the policy, the counters and the files agree."""
    import random

    size = 2 * ALIGN + 77
    tier = await opened(tmp_path, layout_fingerprint(block_bytes=size), capacity_bytes=6 * size,
                        io_threads=3)
    universe = keys_of(20)
    value = {k: os.urandom(size) for k in universe}  # one value per key, as the contract says
    wrong: list[bytes] = []

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(25):
            keys = rng.sample(universe, rng.randint(1, 4))
            if rng.random() < 0.5:
                await tier.write(keys, [memoryview(value[k]) for k in keys])
            else:
                out = buffers(len(keys), size)
                for key, view, hit in zip(keys, out, await tier.read(keys, out)):
                    if hit and bytes(view) != value[key]:
                        wrong.append(key)

    async with anyio.create_task_group() as tg:
        for seed in range(6):
            tg.start_soon(worker, seed)
    assert not wrong
    held = [k for k in universe if tier.holds(k)]
    stats = tier.statistics()
    assert len(held) == stats.blocks <= 6 and stats.errors == 0 and stats.corrupt == 0
    assert tier._index.policy is not None and len(tier._index.policy) == len(held)
    names = {os.path.basename(tier._opened().path(k)) for k in held}
    assert set(block_files(tier)) == names and not temp_files(tier)
    assert not tier._index.pins and not tier._index.pending and not tier._index.removing
    assert stats.writes - stats.evictions == len(held)


async def test_eviction_order_is_the_order_writes_were_planned_not_landed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that lands late (a slow file) is as old as when it was called, so which key
    a later write evicts never depends on how fast the disk was."""
    tier = await opened(tmp_path, capacity_bytes=2 * BLOCK, policy="lru", io_threads=2)
    first, second, third = keys_of(3)
    gate = threading.Event()
    real = BlockFiles.write_one

    def write_one(files: BlockFiles, key: bytes, payload: memoryview) -> bool:
        if key == first:
            gate.wait(10)  # the first call's file lands after the second call's
        return real(files, key, payload)

    monkeypatch.setattr(BlockFiles, "write_one", write_one)
    results: list[list[bool]] = []

    async def write(keys: list[bytes]) -> None:
        results.append(await tier.write(keys, payloads(len(keys))))

    async with anyio.create_task_group() as tg:
        tg.start_soon(write, [first])
        await anyio.wait_all_tasks_blocked()
        await write([second])  # lands first
        gate.set()
    assert results == [[True], [True]]
    assert await tier.write([third], payloads(1)) == [True]
    assert [tier.holds(k) for k in (first, second, third)] == [False, True, True]


async def test_reopening_with_less_capacity_keeps_the_newest(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    keys = keys_of(5)
    for i, key in enumerate(keys):
        await tier.write([key], payloads(1))
        os.utime(tier._opened().path(key), ns=(10**18 + i, 10**18 + i))
    await tier.aclose()
    small = await opened(tmp_path, capacity_bytes=2 * BLOCK)
    assert [small.holds(k) for k in keys] == [False, False, False, True, True]
    assert len(block_files(small)) == 2 and small.statistics().evictions == 3


async def test_duplicate_keys_in_one_write(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    key = keys_of(1)[0]
    first, second = payloads(2)
    assert await tier.write([key, key], [first, second]) == [True, True]
    out = buffers(1)
    assert await tier.read([key], out) == [True]
    assert bytes(out[0]) == bytes(first)
    assert tier.statistics().writes == 1


@pytest.mark.usefixtures("disk_reader")
async def test_a_read_error_is_a_miss(tmp_path: Path) -> None:
    tier = await opened(tmp_path)
    keys, data = keys_of(2), payloads(2)
    await tier.write(keys, data)
    path = tier._opened().path(keys[0])
    os.unlink(path)
    os.mkdir(path)  # reading a directory fails with an OSError, not with data
    out = buffers(2)
    assert await tier.read(keys, out) == [False, True]
    assert bytes(out[1]) == bytes(data[1])
    assert tier.statistics().errors == 1
    os.rmdir(path)
    assert await tier.read(keys[:1], out[:1]) == [False]  # now absent: dropped
    assert not tier.holds(keys[0]) and tier.statistics().errors == 2


async def test_a_full_disk_refuses_writes_and_keeps_earlier_blocks(
        small_disk: Path, direct: bool | None, caplog: pytest.LogCaptureFixture) -> None:
    size = 60 * 1024
    tier = await opened(small_disk, layout_fingerprint(block_bytes=size), direct=direct,
                        capacity_bytes=100 * size)
    keys, data = keys_of(30), payloads(30, size)
    stored: list[bool] = []
    with caplog.at_level("WARNING", logger="aiokv"):
        for i in range(0, 30, 3):
            stored += await tier.write(keys[i:i + 3], data[i:i + 3])
    assert True in stored and False in stored  # ~16 blocks fit in 1 MiB
    failing = [r.getMessage() for r in caplog.records if "failing" in r.getMessage()]
    assert len(failing) == 1 and "No space left" in failing[0] and str(small_disk) in failing[0]
    held = [k for k, ok in zip(keys, stored) if ok]
    assert [tier.holds(k) for k in keys] == stored
    assert tier.statistics().errors == stored.count(False)
    assert not temp_files(tier) and len(block_files(tier)) == len(held)
    out = buffers(len(held), size)
    assert await tier.read(held, out) == [True] * len(held)
    want = [bytes(d) for d, ok in zip(data, stored) if ok]
    assert [bytes(o) for o in out] == want
    await tier.aclose()


async def test_io_runs_on_worker_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, set[int]] = {"read": set(), "write": set(), "list": set(), "check": set()}

    def spy(kind: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen[kind].add(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapper

    for kind, name in (("read", "read_many"), ("write", "write_one"), ("list", "list_blocks"),
                       ("check", "check_blocks")):
        monkeypatch.setattr(BlockFiles, name, spy(kind, getattr(BlockFiles, name)))
    loop_thread = threading.get_ident()
    tier = await opened(tmp_path, io_threads=2)
    keys = keys_of(6)
    assert await tier.write(keys, payloads(6)) == [True] * 6
    await tier.aclose()
    again = await opened(tmp_path, io_threads=2)  # the scan checks real files
    assert await again.read(keys, buffers(6)) == [True] * 6
    assert all(seen.values()), seen
    assert loop_thread not in set().union(*seen.values())


@pytest.mark.usefixtures("disk_reader")
async def test_a_cancelled_read_or_write_leaves_nothing_behind(tmp_path: Path) -> None:
    """Threads are not abandoned (a read fills the caller's buffers), so a cancelled call
    returns or raises only after its I/O ended; either way no pin, reservation or temporary
    file is left, and what was written is held whole."""
    tier = await opened(tmp_path, simulated_latency=0.1, io_threads=2)
    keys, data = keys_of(6), payloads(6)
    assert await tier.write(keys[:2], data[:2]) == [True, True]
    with anyio.move_on_after(0.03):
        await tier.read(keys[:2], buffers(2))
    assert not tier._index.pins
    with anyio.move_on_after(0.03):
        await tier.write(keys[2:5], data[2:5])
    assert not tier._index.pending and not tier._index.removing
    held = [tier.holds(k) for k in keys]
    assert held[:2] == [True, True] and held[5] is False
    out = buffers(6)
    assert await tier.read(keys, out) == held
    assert [bytes(o) for o, ok in zip(out, held) if ok] == [bytes(d) for d, ok in zip(data, held) if ok]
    assert not temp_files(tier)
    assert tier.statistics().writes == sum(held)


async def test_misuse_raises(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec):
        DiskTier(tmp_path, capacity_bytes=0)
    with pytest.raises(InvalidSpec):
        DiskTier(tmp_path, capacity_bytes=BLOCK, io_threads=0)
    with pytest.raises(InvalidSpec):
        DiskTier(tmp_path, capacity_bytes=BLOCK, simulated_latency=-1)
    assert DiskTier(tmp_path, capacity_bytes=BLOCK, write_through=True).write_through
    tier = DiskTier(tmp_path, capacity_bytes=8 * BLOCK)
    with pytest.raises(UsageError):
        await tier.read(keys_of(1), buffers(1))
    with pytest.raises(InvalidSpec):
        await tier.open(b"short")
    await tier.open(FP)
    with pytest.raises(UsageError):
        await tier.open(FP)
    with pytest.raises(InvalidSpec):
        await tier.write(keys_of(2), payloads(1))
    with pytest.raises(InvalidSpec):
        await tier.write(["text"], payloads(1))  # type: ignore[list-item]
    await tier.write(keys_of(1), payloads(1))
    with pytest.raises(InvalidSpec):
        await tier.write(keys_of(1, 5), payloads(1, BLOCK + 1))
    with pytest.raises(InvalidSpec):
        await tier.read(keys_of(1), [memoryview(bytes(BLOCK))])  # read-only
    with pytest.raises(InvalidSpec):
        await tier.read(keys_of(1), buffers(1, BLOCK - 1))
    await tier.aclose()
    with pytest.raises(UsageError):
        await tier.write(keys_of(1), payloads(1))


async def test_a_buffer_not_in_c_order_is_refused_as_misuse(tmp_path: Path) -> None:
    """A Fortran-ordered array is contiguous but cannot be read as flat bytes: InvalidSpec,
    as the Redis tier says, not the TypeError of a failed cast."""
    import numpy as np

    side = int(BLOCK ** 0.5)
    tier = await opened(tmp_path, layout_fingerprint(block_bytes=side * side), capacity_bytes=4 * side * side)
    fortran = np.zeros((side, side), dtype=np.uint8, order="F")
    with pytest.raises(InvalidSpec, match="contiguous"):
        await tier.write(keys_of(1), [memoryview(fortran)])
    with pytest.raises(InvalidSpec, match="contiguous"):
        await tier.read(keys_of(1), [memoryview(fortran)])
    await tier.aclose()


@pytest.mark.parametrize("bad", [True, False, 1.5, "4096", None, 0, -BLOCK])
def test_capacity_and_threads_take_the_shared_integer_check(tmp_path: Path, bad: object) -> None:
    """The same rule as every tier's (and the worker's counts): an int, never a bool."""
    with pytest.raises(InvalidSpec, match="capacity_bytes"):
        DiskTier(tmp_path, capacity_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidSpec, match="io_threads"):
        DiskTier(tmp_path, capacity_bytes=BLOCK, io_threads=bad)  # type: ignore[arg-type]


def test_numpy_integers_are_counts(tmp_path: Path) -> None:
    import numpy as np

    tier = DiskTier(tmp_path, capacity_bytes=np.int64(8 * BLOCK), io_threads=np.int32(2))  # type: ignore[arg-type]
    assert type(tier.capacity_bytes) is int and tier.capacity_bytes == 8 * BLOCK
    assert type(tier.io_threads) is int and tier.io_threads == 2


@pytest.mark.parametrize("path", ["", b""])
def test_an_empty_path_is_refused_rather_than_the_current_directory(
        tmp_path: Path, path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidSpec, match="path"):
        DiskTier(path, capacity_bytes=8 * BLOCK)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


async def test_a_capacity_below_one_block_is_refused(tmp_path: Path) -> None:
    """Known at construction through the cache (check_block_bytes), else at open (blocks
    found on disk), else at the first write: never a tier that silently stores nothing."""
    small = DiskTier(tmp_path / "a", capacity_bytes=BLOCK - 1)
    with pytest.raises(InvalidSpec, match=rf"capacity_bytes={BLOCK - 1}.*{BLOCK}-byte block"):
        small.check_block_bytes(BLOCK)
    DiskTier(tmp_path / "a", capacity_bytes=BLOCK).check_block_bytes(BLOCK)

    unknown = await opened(tmp_path / "b", capacity_bytes=BLOCK - 1)
    with pytest.raises(InvalidSpec, match="capacity_bytes"):
        await unknown.write(keys_of(1), payloads(1))
    assert unknown.statistics().writes == 0 and not block_files(unknown)
    await unknown.aclose()

    full = await opened(tmp_path / "c")
    await full.write(keys_of(2), payloads(2))
    await full.aclose()
    with pytest.raises(InvalidSpec, match="capacity_bytes"):
        await opened(tmp_path / "c", capacity_bytes=BLOCK // 2)
    again = await opened(tmp_path / "c")  # the refused open left nothing locked, nothing removed
    assert again.statistics().blocks == 2


async def test_the_cache_refuses_a_disk_tier_too_small_for_one_block(tmp_path: Path) -> None:
    from aiokv import AsyncOffloadingWorker, OffloadCache
    from tests.conftest import make_layers

    kv = make_layers(num_layers=2, num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as worker:
        block_bytes = sum(worker.host_layout.page_sizes[0])
        with pytest.raises(InvalidSpec, match="capacity_bytes"):
            OffloadCache(worker, tiers=[DiskTier(tmp_path, capacity_bytes=block_bytes - 1)],
                         staging_chunks=2)
        assert os.listdir(tmp_path) == []


def fill_up(directory: Path) -> Path:
    """Write one file until the filesystem is full; it frees the room when removed."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = os.urandom(64 << 10)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:  # what is left is smaller than a chunk
            while True:
                f.write(chunk[:ALIGN])
        except OSError:
            pass
    return filler


async def test_a_full_disk_at_open_does_not_turn_direct_io_off_for_life(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The probe cannot write its page on a full disk: that says nothing about O_DIRECT.
    The tier starts buffered, asks again at each write, and decides once there is room."""
    if not probe_direct(str(small_disk)):
        pytest.skip("this tmpfs refuses O_DIRECT (Linux < 6.6)")
    assert probe_direct(str(small_disk)) is True
    size = 2 * ALIGN
    filler = fill_up(small_disk)
    assert probe_direct(str(small_disk)) is None  # undecided, not refused
    with caplog.at_level("WARNING", logger="aiokv"):
        tier = await opened(small_disk, layout_fingerprint(block_bytes=size), capacity_bytes=8 * size)
    assert not tier.direct
    assert "cannot tell whether O_DIRECT works" in caplog.text
    keys, data = keys_of(4), payloads(4, size)
    assert await tier.write(keys[:1], data[:1]) == [False]  # still full
    assert not tier.direct
    filler.unlink()
    assert await tier.write(keys, data) == [True] * 4
    assert tier.direct
    out = buffers(4, size)
    assert await tier.read(keys, out) == [True] * 4
    assert [bytes(o) for o in out] == [bytes(d) for d in data]
    await tier.aclose()


async def test_direct_true_on_a_full_disk_is_taken_at_its_word(small_disk: Path) -> None:
    if not probe_direct(str(small_disk)):
        pytest.skip("this tmpfs refuses O_DIRECT (Linux < 6.6)")
    size = 2 * ALIGN
    filler = fill_up(small_disk)
    tier = await opened(small_disk, layout_fingerprint(block_bytes=size), direct=True,
                        capacity_bytes=8 * size)
    assert tier.direct
    filler.unlink()
    keys, data = keys_of(2), payloads(2, size)
    assert await tier.write(keys, data) == [True, True]
    out = buffers(2, size)
    assert await tier.read(keys, out) == [True, True]
    assert [bytes(o) for o in out] == [bytes(d) for d in data]
    await tier.aclose()


async def test_a_read_only_filesystem_fails_open_with_tier_error(small_disk: Path) -> None:
    """Raised by the tier itself, typed: a caller's ``except TierError`` sees it."""
    import subprocess

    existing = await opened(small_disk)  # a layout directory that exists already
    await existing.write(keys_of(1), payloads(1))
    await existing.aclose()
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.decode().strip()}")
    try:
        for fp in (FP, OTHER_FP):  # a layout seen before, and a new one
            with pytest.raises(TierError, match="Read-only file system") as caught:
                await opened(small_disk, fp)
            assert str(small_disk) in str(caught.value)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], capture_output=True)
    again = await opened(small_disk)  # nothing was left locked
    assert again.holds(keys_of(1)[0])
