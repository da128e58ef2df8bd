"""The host chunks with tiers below them, as vLLM's manager drives them, without vLLM: real
shared pools (``shared_pool``), the tiers' thread (``tier_io``) and real tiers (a directory,
a redis-server on loopback). Every block read back up is compared byte for byte with what
was stored; failures, resets and closes are driven on purpose."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import pytest

from aiokv.backends.shared_file import SharedFile
from aiokv.cache.tiers import DiskTier
from aiokv.cache.tiers.base import Tier
from aiokv.integrations.vllm.shared_pool import PoolView, attach, pool_file, publish
from aiokv.integrations.vllm.tier_io import TierIO
from aiokv.integrations.vllm.tiered_chunks import TieredChunks, Where
from tests.redis_server import RedisServer, need_redis, running

pytestmark = pytest.mark.timeout(60)

CHUNK = 512
# Group 0: two pages kept in the chunk in reverse order (not the layout's), group 1 one
# smaller page: values are padded to the widest block and pages rearranged both ways.
SIZES = [[96, 160], [64]]
OFFSETS = [[160, 0], [0]]


def group_of(key: Any) -> int:
    return int(key[1]) % 2


class Rig:
    """A pool of ``num_chunks`` per rank, published and mapped as vLLM's processes would,
    the tiers' thread over ``tiers``, and the bookkeeping; ``store`` plays the worker."""

    def __init__(self, root: Path, tiers: Sequence[Tier], *, num_chunks: int = 8, spare: int = 2,
                 world: int = 1, engine: str = "engine") -> None:
        self.files = []
        for rank in range(world):
            path = pool_file(engine, rank)
            self.files.append(SharedFile(path, num_chunks * CHUNK))
            publish(path, rank=rank, num_chunks=num_chunks, chunk_bytes=CHUNK, blocks_per_chunk=1,
                    page_sizes=SIZES, page_offsets=OFFSETS)
        view = attach(engine, world, num_chunks)
        assert view is not None
        self.view: PoolView = view
        self.io = TierIO(tiers, drain_timeout=5.0)
        self.io.start(view, b"f" * 16)
        assert self.io.wait_ready(10)
        self.host = TieredChunks(num_chunks, policy="lru", admission=None, io=self.io, group_of=group_of,
                                 spare=spare)
        self.written: dict[tuple[Any, int], bytes] = {}
        self.rng = np.random.default_rng(7)

    def store(self, keys: Sequence[Any]) -> list[Any]:
        """Offer ``keys``; write fresh random bytes for each stored one (every rank); the
        keys stored."""
        plan = self.host.prepare_store(list(keys))
        assert plan is not None
        for key, chunk in zip(plan.keys_to_store, plan.chunk_ids):
            for rank, pool in enumerate(self.view.ranks):
                size = self.view.payload(rank, group_of(key))
                row = self.rng.integers(0, 256, size, dtype=np.uint8)
                pool.scatter(group_of(key), chunk, row)
                self.written[(key, rank)] = row.tobytes()
        self.host.complete_store(plan.keys_to_store, True)
        return list(plan.keys_to_store)

    def read(self, key: Any) -> None:
        """Load ``key`` from its chunk and compare it with what was stored, on every rank."""
        [chunk] = self.host.prepare_load([key])
        try:
            for rank, pool in enumerate(self.view.ranks):
                row = np.zeros(self.view.block_bytes, dtype=np.uint8)
                pool.gather(group_of(key), chunk, row)
                size = self.view.payload(rank, group_of(key))
                assert row[:size].tobytes() == self.written[(key, rank)], (key, rank)
        finally:
            self.host.chunks.complete_load([key])

    def overflow(self) -> list[Any]:
        """Store eight keys where six fit: the two the host evicts go down to the first tier;
        once they are written there, the keys the host no longer holds."""
        self.store(keys(6))
        self.store(keys(2, 6))
        self.until(lambda: self.host.counts[0].demoted == 2)
        return [k for k in keys(8) if self.host.chunks.lookup(k).value == "miss"]

    def spy(self) -> list[str]:
        """The kind of every operation handed to the tiers' thread from now on."""
        asked: list[str] = []
        submit = self.io.submit
        self.io.submit = lambda ops: (asked.extend(op.kind for op in ops), submit(ops))  # type: ignore[method-assign]
        return asked

    def until(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.002)
            self.host.poll()

    def settle(self, key: Any) -> Where:
        """Look ``key`` up until it is no longer on its way (what vLLM's next steps do)."""
        answer = self.host.lookup(key)
        deadline = time.monotonic() + 10
        while answer in (Where.HIT_PENDING, Where.RETRY):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.002)
            answer = self.host.lookup(key)
        return answer

    def close(self) -> None:
        self.io.close()
        for f in self.files:
            f.close()


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AIOKV_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    return tmp_path


@pytest.fixture
def rig(shm: Path) -> Iterator[Rig]:
    made = Rig(shm, [DiskTier(shm / "disk", capacity_bytes=64 * 512)])
    yield made
    made.close()


def keys(n: int, start: int = 0) -> list[tuple[str, int]]:
    return [("k", i) for i in range(start, start + n)]


def test_an_evicted_block_comes_back_from_disk_byte_exact(rig: Rig) -> None:
    """Six slots (two of the eight chunks spare): eight keys evict two, which go to disk
    and come back up, every byte as stored, through a lookup that never waits."""
    assert rig.store(keys(6)) == keys(6)
    assert rig.store(keys(2, 6)) == keys(2, 6)
    evicted = [k for k in keys(8) if rig.host.chunks.lookup(k).value == "miss"]
    assert len(evicted) == 2
    rig.until(lambda: rig.host.counts[0].demoted == 2)
    assert rig.host.spare_free == 2, "a chunk on its way down came back when its write ended"
    for key in evicted:
        assert rig.host.lookup(key) is Where.HIT_PENDING
    for key in evicted:
        assert rig.settle(key) is Where.HIT
        rig.read(key)
    counts = rig.host.counts[0]
    assert (counts.found, counts.promoted, counts.promote_failed) == (2, 2, 0)
    assert counts.read_bytes == sum(rig.view.payload(0, group_of(k)) for k in evicted)
    # What came up evicted others, which went down in turn; the rest still read as stored.
    rig.until(lambda: not rig.host.busy)
    for key in keys(8):
        assert rig.settle(key) is Where.HIT
        rig.read(key)
    rig.host.chunks.check_invariants()


class Gated(DiskTier):
    """A disk tier whose reads and writes start only once the test opens ``gate``, so a
    test sees them in flight however slow the machine is (never by a guessed delay)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate = threading.Event()

    async def _wait(self) -> None:
        if not self.gate.is_set():
            await anyio.to_thread.run_sync(self.gate.wait, abandon_on_cancel=True)

    async def read(self, keys, out):  # type: ignore[no-untyped-def]
        await self._wait()
        return await super().read(keys, out)

    async def write(self, keys, values):  # type: ignore[no-untyped-def]
        await self._wait()
        return await super().write(keys, values)


def test_a_block_on_its_way_down_is_retried_not_lost(shm: Path) -> None:
    """While its write is in flight an evicted key answers RETRY (its chunk still holds it
    and no store may take that chunk); once written it comes up from disk."""
    tier = Gated(shm / "disk", capacity_bytes=64 * 512)
    rig = Rig(shm, [tier])
    try:
        rig.store(keys(6))
        rig.store(keys(1, 6))
        [evicted] = [k for k in keys(7) if rig.host.chunks.lookup(k).value == "miss"]
        assert rig.host.lookup(evicted) is Where.RETRY
        assert rig.host.spare_free == 1
        tier.gate.set()
        assert rig.settle(evicted) is Where.HIT
        rig.read(evicted)
    finally:
        tier.gate.set()
        rig.close()


def test_with_no_spare_chunk_an_eviction_is_dropped_and_counted(shm: Path) -> None:
    rig = Rig(shm, [DiskTier(shm / "disk", capacity_bytes=64 * 512, simulated_latency=0.5)], spare=1)
    try:
        rig.store(keys(7))
        rig.store(keys(2, 7))  # two evictions, one spare chunk: one goes down, one is dropped
        assert rig.host.counts[0].dropped == 1
        rig.until(lambda: rig.host.counts[0].demoted == 1)
        rig.host.chunks.check_invariants()
    finally:
        rig.close()


class FailingReads(DiskTier):
    """A disk tier whose reads fail half way once ``broken`` is set: the bytes have landed
    in the chunk, then the call raises (the worst case for the chunk it filled)."""

    broken = False

    async def read(self, keys, out):  # type: ignore[no-untyped-def]
        got = await super().read(keys, out)
        if self.broken:
            raise OSError("the disk went away")
        return got


def test_a_tier_failing_mid_promotion_is_a_miss_and_frees_the_chunk(shm: Path) -> None:
    tier = FailingReads(shm / "disk", capacity_bytes=64 * 512, simulated_latency=0.2)
    rig = Rig(shm, [tier])
    try:
        rig.store(keys(6))
        rig.store(keys(2, 6))
        evicted = [k for k in keys(8) if rig.host.chunks.lookup(k).value == "miss"]
        rig.until(lambda: rig.host.counts[0].demoted == 2)
        tier.broken = True
        assert rig.host.lookup(evicted[0]) is Where.HIT_PENDING
        assert rig.settle(evicted[0]) is Where.MISS
        counts = rig.host.counts[0]
        assert (counts.promoted, counts.promote_failed) == (0, 1)
        assert rig.host.lookup(evicted[0]) is Where.MISS, "not asked again at once"
        stats = rig.host.chunks.stats()
        # Its slot was made by evicting one more block; the failed read freed it again.
        assert (stats.keys, stats.chunks_free, stats.pending_keys) == (5, 1, 0)
        events = [e for e in rig.host.events if not e.stored]
        assert [e.keys for e in events] == [(evicted[0],)]
        rig.host.chunks.check_invariants()
    finally:
        rig.close()


def test_a_reset_keeps_chunks_a_read_still_fills_out_of_use(shm: Path) -> None:
    tier = Gated(shm / "disk", capacity_bytes=64 * 512)
    tier.gate.set()
    rig = Rig(shm, [tier])
    try:
        evicted = rig.overflow()
        tier.gate.clear()  # the read below stays in flight until the gate opens
        assert rig.host.lookup(evicted[0]) is Where.HIT_PENDING
        reading = rig.host._pending  # the op in flight
        [busy] = [op.chunk for op in reading.values() if op.kind == "promote"]
        rig.host.reset()
        plan = rig.host.prepare_store(keys(5, 100))
        assert plan is not None and busy not in plan.chunk_ids, "a chunk still being filled was handed out"
        assert rig.host.prepare_store(keys(1, 200)) is None, "the sixth slot is fenced"
        tier.gate.set()
        rig.until(lambda: not rig.host.busy)
        assert rig.host.chunks.lookup(evicted[0]).value == "miss", "a read from before the reset is no hit"
        plan = rig.host.prepare_store(keys(1, 200))
        assert plan is not None and plan.chunk_ids == [busy]
        rig.host.chunks.check_invariants()
    finally:
        tier.gate.set()
        rig.close()


def test_after_a_reset_nothing_is_read_up_until_the_workers_flushed(rig: Rig) -> None:
    """vLLM's reset frees every chunk while a worker's copy from before it may still write
    one (vLLM says when they have all ended: on_reset_flushed). A block read up into a
    freed chunk meanwhile would be overwritten by that late copy and then served as the
    key's bytes, so until then a key the host lacks is a miss and no read starts."""
    evicted = rig.overflow()
    asked = rig.spy()
    rig.host.reset()
    for key in evicted:
        assert rig.host.lookup(key) is Where.MISS, "read up before the reset's copies ended"
    assert "promote" not in asked and rig.host.promoting == 0
    rig.host.reset_flushed()
    assert rig.host.lookup(evicted[0]) is Where.HIT_PENDING
    assert rig.settle(evicted[0]) is Where.HIT
    rig.read(evicted[0])
    rig.host.chunks.check_invariants()


def test_two_ranks_each_get_their_own_block_and_a_hit_needs_both(shm: Path) -> None:
    rig = Rig(shm, [DiskTier(shm / "disk", capacity_bytes=64 * 512)], world=2)
    try:
        evicted = rig.overflow()
        assert rig.settle(evicted[0]) is Where.HIT
        rig.read(evicted[0])
        # Rank 1's block of the other key is lost: the key is a miss, never half a hit.
        tier = rig.io.tiers[0]
        assert isinstance(tier, DiskTier)
        for name in Path(tier.directory).iterdir():
            name.unlink()
        assert rig.settle(evicted[1]) is Where.MISS
    finally:
        rig.close()


def test_write_through_pins_until_written_and_serves_after_eviction(shm: Path) -> None:
    tier = DiskTier(shm / "disk", capacity_bytes=64 * 512, write_through=True)
    rig = Rig(shm, [tier])
    try:
        rig.store(keys(3))
        assert rig.host.chunks.stats().pinned_keys == 3
        rig.until(lambda: rig.host.counts[0].written_through == 3)
        assert rig.host.chunks.stats().pinned_keys == 0
        rig.store(keys(6, 3))  # three of the first keys evicted: the tier already has them
        for key in keys(3):
            if rig.host.chunks.lookup(key).value == "miss":
                assert rig.settle(key) is Where.HIT
                rig.read(key)
    finally:
        rig.close()


def test_a_remote_tier_is_asked_once_then_read_up(shm: Path) -> None:
    need_redis()
    from aiokv.cache.tiers import RedisTier

    with running(RedisServer(shm / "redis")) as server:
        rig = Rig(shm, [RedisTier(server.url, namespace="t", timeout=2.0)])
        try:
            evicted = rig.overflow()
            asked = rig.spy()
            assert rig.host.lookup(evicted[0]) is Where.RETRY
            assert rig.host.lookup(evicted[0]) in (Where.RETRY, Where.HIT_PENDING)
            assert rig.settle(evicted[0]) is Where.HIT
            assert [k for k in asked if k != "write"] == ["locate", "promote"], "one question, one read"
            rig.read(evicted[0])
            never = ("k", 999)
            assert rig.host.lookup(never) is Where.RETRY
            assert rig.settle(never) is Where.MISS
            assert rig.host.lookup(never) is Where.MISS, "an absence is remembered"
        finally:
            rig.close()


def test_a_tier_that_cannot_open_is_left_out_and_the_host_still_serves(shm: Path) -> None:
    class Broken(DiskTier):
        async def open(self, fingerprint: bytes) -> None:
            raise OSError("no such device")

    rig = Rig(shm, [Broken(shm / "disk", capacity_bytes=64 * 512)])
    try:
        assert rig.io.disabled == {0} and "no such device" in rig.io.errors[0]
        rig.store(keys(6))
        rig.store(keys(2, 6))
        assert rig.host.counts[0].dropped == 2
        assert rig.settle(keys(1)[0]) is Where.MISS
        rig.read(keys(1, 7)[0])
    finally:
        rig.close()


def test_close_answers_everything_in_flight_within_its_bound(shm: Path) -> None:
    rig = Rig(shm, [DiskTier(shm / "disk", capacity_bytes=64 * 512, simulated_latency=0.5)])
    rig.io.drain_timeout = 0.1
    rig.store(keys(6))
    rig.store(keys(2, 6))
    started = time.monotonic()
    rig.close()
    assert time.monotonic() - started < 3
    rig.host.poll()
    assert not rig.host.busy and not rig.io.ready
    assert rig.host.spare_free == 2


def test_a_batch_that_raises_fails_its_blocks_and_the_tiers_serve_on(rig: Rig, monkeypatch) -> None:
    """Anything a batch raises outside the tier's own call (here rearranging a block's
    pages into its chunk) fails that batch's blocks, each a miss; the tiers' thread serves
    the next one (it did not: the first such error took every tier off until restart)."""
    from aiokv.integrations.vllm.shared_pool import RankPool

    evicted = rig.overflow()
    real = RankPool.scatter
    calls = [0]

    def scatter_once_broken(self: RankPool, group: int, chunk: int, row: np.ndarray) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected: a bug while placing pages")
        real(self, group, chunk, row)

    monkeypatch.setattr(RankPool, "scatter", scatter_once_broken)
    assert rig.settle(evicted[0]) is Where.MISS
    assert rig.host.counts[0].promote_failed == 1 and rig.io.ready
    assert rig.settle(evicted[1]) is Where.HIT
    rig.read(evicted[1])
    rig.host.chunks.check_invariants()


def test_work_handed_over_once_the_thread_has_ended_is_answered(shm: Path) -> None:
    """The thread can end between a lookup seeing the tiers ready and its read being
    handed over; that read is answered (failed) at once, never left in flight, which
    would keep vLLM stepping (has_pending_work) and its slot pending for ever."""
    rig = Rig(shm, [DiskTier(shm / "disk", capacity_bytes=64 * 512)])
    evicted = rig.overflow()
    close_first = rig.io.submit

    def submit_after_the_end(ops: Any) -> None:
        rig.io.close()
        close_first(ops)

    rig.io.submit = submit_after_the_end  # type: ignore[method-assign]
    assert rig.host.lookup(evicted[0]) is Where.HIT_PENDING  # ready when it looked
    rig.until(lambda: not rig.host.busy, timeout=5)
    assert rig.host.promoting == 0 and rig.host.counts[0].promote_failed == 1
    assert rig.host.chunks.stats().pending_keys == 0
    rig.host.chunks.check_invariants()
    rig.close()


class EveryKeyOnDisk:
    """A stand-in for the tiers' thread whose one local tier holds every key and never
    answers: the bookkeeping of reads up alone."""

    def __init__(self) -> None:
        self.tiers = [type("T", (), {"remote": False, "write_through": False, "name": "disk"})()]
        self.ready, self.in_flight = True, 0

    def usable(self, index: int) -> bool:
        return True

    def holds(self, key: Any) -> int:
        return 0

    def submit(self, ops: Any) -> None:
        pass

    def results(self) -> list[Any]:
        return []


def test_a_read_up_never_evicts_what_the_same_request_found_before_it() -> None:
    """A prefix longer than the host: its tail's reads up take the chunks of other keys,
    never of the request's own head (which would then be read up again, for ever), and
    end as a miss where nothing else is left to evict."""
    host = TieredChunks(10, policy="lru", admission=None, io=EveryKeyOnDisk(), group_of=group_of,  # type: ignore[arg-type]
                        spare=2)
    others = keys(3, 100)
    host.chunks.prepare_store(others)
    host.chunks.complete_store(others, True)
    head = keys(5)
    host.chunks.prepare_store(head)
    host.chunks.complete_store(head, True)  # the host's eight slots: three others, then the head
    found = set(head)
    for key in keys(3, 5):  # the tail: each read up evicts one of the others
        assert host.lookup(key, found) is Where.HIT_PENDING
        found.add(key)
    assert all(host.chunks.lookup(k).value == "hit" for k in head)
    assert all(host.chunks.lookup(k).value == "miss" for k in others)
    assert host.lookup(("k", 8), found) is Where.MISS, "nothing left but the request's own keys"
    host.chunks.check_invariants()


def test_a_read_up_costs_the_same_however_long_the_prefix_before_it(monkeypatch) -> None:
    """vLLM looks up a whole prompt under its scheduler lock; each key a tier holds starts
    a read up that must not evict the keys the same request found before it. Handing
    that whole prefix to the store plan each time made a prompt of n such keys cost
    O(n^2) (8000 keys from disk after a restart: about 8 s in one step on this project's
    CPU VM). Each read up's plan now offers its one key, the prefix kept by reference."""
    from aiokv.cache import ChunkManager

    offered: list[int] = []
    real = ChunkManager.prepare_store

    def spy(self: ChunkManager, keys: Any, **kw: Any) -> Any:
        keys = list(keys)
        offered.append(len(keys))
        return real(self, keys, **kw)

    monkeypatch.setattr(ChunkManager, "prepare_store", spy)
    host = TieredChunks(40, policy="lru", admission=None, io=EveryKeyOnDisk(), group_of=group_of,  # type: ignore[arg-type]
                        spare=4)
    found: set[Any] = set()
    for key in keys(30):
        assert host.lookup(key, found) in (Where.HIT_PENDING, Where.RETRY)
        found.add(key)
    assert host.promoting == 18  # half the host's slots read up at once
    assert offered == [1] * 18, offered


def test_remote_answers_no_read_followed_are_not_kept_for_ever(monkeypatch) -> None:
    """A key a remote tier holds is remembered until its read starts; vLLM stops a
    prefix's lookups at its first miss (and requests end), so many such answers are never
    followed by a read. They are kept up to a bound, oldest forgotten first (asked again
    if ever wanted), not for the server's life."""
    import aiokv.integrations.vllm.tiered_chunks as tiered_chunks
    from aiokv.integrations.vllm.tier_io import Done

    class RemoteHoldsAll(EveryKeyOnDisk):
        def __init__(self) -> None:
            super().__init__()
            self.tiers = [type("T", (), {"remote": True, "write_through": False, "name": "redis"})()]
            self.answers: list[Done] = []

        def holds(self, key: Any) -> int:
            return -1

        def submit(self, ops: Any) -> None:
            self.answers.extend(Done(op, True, 0) for op in ops if op.kind == "locate")

        def results(self) -> list[Done]:
            out, self.answers = self.answers, []
            return out

    monkeypatch.setattr(tiered_chunks, "_LOCATED_LIMIT", 64, raising=False)
    host = TieredChunks(8, policy="lru", admission=None, io=RemoteHoldsAll(), group_of=group_of,  # type: ignore[arg-type]
                        spare=2)
    for key in keys(1000):
        assert host.lookup(key) is Where.RETRY  # located, never looked up again
    host.poll()
    assert len(host._located) <= 64
    assert host.lookup(("k", 999)) is Where.HIT_PENDING, "the newest answers are kept"
