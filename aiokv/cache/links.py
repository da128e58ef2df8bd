"""One lower tier as the cache drives it: its write calls, the blocks on their way down,
and its counters.

A block goes down as a copy of its bytes (a row). From the moment its copy starts until the
tier has answered its write, the row is listed in ``inflight``; an evicted block waiting
its turn for room before that is listed in ``waiting``, in its host chunk (``Hold``).
Lookups count both and restores read them from memory, so a block is never in neither
place and a restore never waits for room or for a write. Each batch's ``write`` call
starts as soon as its rows are copied (the tier bounds its own I/O), so the tier makes room
for it then, in the order the cache decided, and how fast the writes land never changes
what the cache finds.

Room for blocks on their way down is bounded (``queue_bytes``) and taken before a copy
starts, in turns (``room.WriteRoom``): an offer that finds it taken waits, so the cache
slows to the pace of the tier instead of dropping blocks; only a tier that stalls (frees
no room for ``queue_wait`` seconds) has blocks dropped, counted and logged at most once a
minute (docs/tiers.md, "Write-behind").
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.abc
import numpy as np

from .records import TierCacheStats
from .room import WriteRoom
from .tiers.base import Tier

__all__ = ["Batch", "Hold", "TierLink"]

_log = logging.getLogger("aiokv")

LOG_EVERY = 60.0
"""Seconds between two log lines about one tier's drops."""
RETRIES = 2
"""Times a key refused while other write calls ran is tried again after them."""


@dataclass(eq=False)
class Batch:
    """Blocks on their way to one tier: their tier keys and, once copied, their rows
    (``(n, block_bytes)`` uint8 in portable page order)."""

    keys: list[bytes]
    kind: Literal["demote", "through", "persist"]
    rows: np.ndarray | None = None
    landed: anyio.Event = field(default_factory=anyio.Event)  # copied (or abandoned)
    written: anyio.Event = field(default_factory=anyio.Event)  # the tier answered (or dropped)

    def row(self, i: int) -> np.ndarray | None:
        return None if self.rows is None else self.rows[i]


class Hold:
    """Blocks the host evicted that wait their turn for room, still in their host chunks:
    their offer stores into those chunks only once they are copied off or dropped, and
    after every restore copying them out of there has finished (``readers``)."""

    def __init__(self) -> None:
        self.readers = 0
        self._idle: anyio.Event | None = None

    def enter(self) -> None:
        self.readers += 1

    def leave(self) -> None:
        self.readers -= 1
        if not self.readers and self._idle is not None:
            self._idle.set()

    async def quiet(self) -> None:
        """Return once no restore copies out of the held chunks."""
        while self.readers:
            self._idle = anyio.Event()
            await self._idle.wait()


@dataclass(eq=False)
class TierLink:
    """One tier, its room for blocks on their way down, and what the cache counted for it."""

    tier: Tier
    limit_blocks: int
    queue_wait: float = 1.0
    inflight: dict[bytes, tuple[Batch, int]] = field(default_factory=dict)
    waiting: dict[bytes, tuple[Hold, int]] = field(default_factory=dict)  # for room: host chunk
    writes: dict[Batch, anyio.CancelScope] = field(default_factory=dict)  # write calls running
    tg: anyio.abc.TaskGroup | None = None  # runs the write calls while the cache is open
    _calling: set[Batch] = field(default_factory=set)  # batches whose write call runs now
    _order: deque[Batch] = field(default_factory=deque)  # expected, write call not started
    _started: anyio.Event | None = None  # set once the last write call dispatched has begun
    _calls: int = 0  # write calls started
    room: WriteRoom = field(init=False)
    hits: int = 0
    restored_keys: int = 0
    restored_bytes: int = 0
    demoted: int = 0
    write_throughs: int = 0
    dropped: int = 0
    read_misses: int = 0
    persisted: int = 0
    _unlogged: int = 0
    _logged_at: float = -math.inf

    def __post_init__(self) -> None:
        self.room = WriteRoom(self.limit_blocks, self.queue_wait)

    @property
    def pending(self) -> int:
        """Blocks reserved, being copied or being written."""
        return self.room.pending

    def stats(self) -> TierCacheStats:
        return TierCacheStats(
            name=self.tier.name, hits=self.hits, restored_keys=self.restored_keys,
            restored_bytes=self.restored_bytes, demoted=self.demoted,
            write_throughs=self.write_throughs, demotions_dropped=self.dropped,
            read_misses=self.read_misses, queued_blocks=self.pending, persisted=self.persisted,
            tier=self.tier.statistics(), room_waits=self.room.waits,
            room_wait_seconds=self.room.waited,
        )

    # -- room ----------------------------------------------------------------------------

    async def take_room(self, n: int, *, patient: bool = False) -> int:
        """Room for up to ``room.step`` of ``n`` blocks, in turn (``WriteRoom.take``)."""
        return await self.room.take(n, patient=patient)

    def give_room(self, n: int) -> None:
        """Give back room taken and not used (or used by a batch now answered for)."""
        self.room.give(n)

    def drop(self, n: int) -> None:
        """Count ``n`` blocks that will not reach this tier; log now and then."""
        if n <= 0:
            return
        self.dropped += n
        self._unlogged += n
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            _log.warning(
                "aiokv: %d blocks for the %s tier were dropped (%d so far): it stalled (freed "
                "no room for queue_wait seconds), refused them, or the cache closed first; "
                "see docs/tiers.md, Write-behind",
                self._unlogged, self.tier.name, self.dropped)
            self._unlogged, self._logged_at = 0, now

    # -- blocks on their way down --------------------------------------------------------

    def expect(self, batch: Batch) -> None:
        """List ``batch``'s keys as on their way here (their copy is starting); room for
        them was reserved. Write calls start in the order batches are expected."""
        for i, key in enumerate(batch.keys):
            self.inflight[key] = (batch, i)
        self._order.append(batch)

    def push(self, batch: Batch, rows: np.ndarray) -> None:
        """The batch's bytes landed: start its write once the batches expected before it
        have started theirs (or drop it once closed)."""
        batch.rows = rows
        batch.landed.set()
        self._dispatch()

    def abandon(self, batch: Batch, *, dropped: bool = True) -> None:
        """The batch will not be written (its copy failed, or the cache closed; a store
        that never landed is no drop)."""
        self._give_up(batch, dropped=dropped)
        self._dispatch()

    def _give_up(self, batch: Batch, *, dropped: bool) -> None:
        batch.landed.set()
        batch.written.set()
        self._forget(batch)
        if dropped:
            self.drop(len(batch.keys))
        self.give_room(len(batch.keys))

    def _dispatch(self) -> None:
        """Start the write calls of the batches whose bytes have landed, in the order they
        were expected: copies off the pool may end out of order (those on worker threads),
        and a tier orders blocks for eviction when their write starts, so the order the
        cache decided, not the threads' timing, decides what the tier keeps."""
        order = self._order
        while order and order[0].landed.is_set():
            batch = order.popleft()
            if batch.written.is_set():  # abandoned meanwhile
                continue
            if self.tg is None:
                self._give_up(batch, dropped=True)
                continue
            scope = self.writes[batch] = anyio.CancelScope(shield=True)  # stop() cancels it
            before, self._started = self._started, anyio.Event()
            self.tg.start_soon(self._write, batch, scope, before, self._started)

    def find(self, key: bytes) -> tuple[Batch, int] | None:
        return self.inflight.get(key)

    def on_way(self, key: bytes) -> bool:
        """Whether ``key`` is on its way here: copied or being copied, or waiting its turn
        for room in its host chunk."""
        return key in self.inflight or key in self.waiting

    def hold(self, hold: Hold, pairs: list[tuple[bytes, int]]) -> None:
        """List evicted blocks (tier key, absolute host chunk) as waiting for room."""
        for key, chunk in pairs:
            self.waiting[key] = (hold, chunk)

    def unhold(self, hold: Hold, keys: list[bytes]) -> None:
        """The blocks are in flight now, or dropped: no longer waiting in their chunks."""
        for key in keys:
            if (entry := self.waiting.get(key)) is not None and entry[0] is hold:
                del self.waiting[key]

    def _forget(self, batch: Batch) -> None:
        for key in batch.keys:
            if (entry := self.inflight.get(key)) is not None and entry[0] is batch:
                del self.inflight[key]

    async def _write(self, batch: Batch, scope: anyio.CancelScope, before: anyio.Event | None,
                     started: anyio.Event) -> None:
        """One batch's write call. Keys the tier refuses while other calls run (it may be
        removing the same key's old file for one of them) are tried again when those are
        over, so calls touching one key do not cost a block."""
        ok: int | None = None
        try:
            with scope:
                # A tier plans a write (and orders its blocks) before its first await, and
                # tasks may start in any order (trio shuffles them): each call waits for
                # the one dispatched before it to have started.
                if before is not None and not before.is_set():  # no checkpoint otherwise
                    await before.wait()
                started.set()
                rows = batch.rows
                if rows is not None:  # always: a batch is written once its rows landed
                    views = [memoryview(r) for r in rows]
                    done, overlapped = await self._call(batch, batch.keys, views)
                    for _ in range(RETRIES):
                        again = [i for i, d in enumerate(done) if not d]
                        if not (again and overlapped):
                            break
                        # Only calls running now: a batch waiting to retry runs none, so no
                        # two batches ever wait on each other.
                        for other in [b for b in self._calling if b is not batch]:
                            await other.written.wait()
                        retried, overlapped = await self._call(
                            batch, [batch.keys[i] for i in again], [views[i] for i in again])
                        for i, d in zip(again, retried):
                            done[i] = d
                    ok = sum(1 for d in done if d)
        except Exception:  # a tier that broke its contract: its blocks are dropped
            ok = 0
        finally:
            started.set()  # stopped before it began: the calls after it are not held
            self.writes.pop(batch, None)
            self._written(batch, self._landed(batch) if ok is None else ok)

    def _landed(self, batch: Batch) -> int:
        """How many of a stopped batch's blocks the tier holds: a local tier's I/O is never
        abandoned half way, so what it wrote counts as written, not as dropped; a remote
        tier cannot say without a round trip."""
        if self.tier.remote:
            return 0
        try:
            return sum(1 for key in batch.keys if self.tier.holds(key))
        except Exception:  # a tier that broke its contract
            return 0

    async def _call(self, batch: Batch, keys: list[bytes],
                    views: list[memoryview]) -> tuple[list[bool], bool]:
        """One ``write`` call; its answers, and whether another call ran beside it."""
        overlapped = bool(self._calling)
        started = self._calls
        self._calls += 1
        self._calling.add(batch)
        try:
            done = list(await self.tier.write(keys, views))
        finally:
            self._calling.discard(batch)
        return done, overlapped or self._calls != started + 1

    def _written(self, batch: Batch, ok: int) -> None:
        if batch.kind == "through":
            self.write_throughs += ok
        elif batch.kind == "persist":
            self.persisted += ok
        else:
            self.demoted += ok
        self.drop(len(batch.keys) - ok)
        self._forget(batch)  # after the write: the tier holds them now, or they are gone
        self.give_room(len(batch.keys))
        batch.written.set()

    def stop(self) -> None:
        """Stop the write calls (each then counts what it did not write) and take no more."""
        self.tg = None
        self.room.close()
        for scope in self.writes.values():
            scope.cancel()
