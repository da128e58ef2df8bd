"""One lower tier as the cache drives it: its write calls, the blocks on their way down,
and its counters.

A block goes down as a copy of its bytes (a row). From the moment its copy starts until the
tier has answered its write, the row is listed in ``inflight``: lookups count it and
restores read it from memory, so a block is never in neither place and a restore never
waits for a write. Each batch's ``write`` call starts as soon as its rows are copied (the
tier bounds its own I/O), so the tier makes room for it then, in the order the cache
decided, and how fast the writes land never changes what the cache finds.

Room for blocks on their way down is bounded (``queue_bytes``) and reserved before a copy
starts; an offer that finds it taken waits its turn, up to ``queue_wait`` seconds. A tier
still full after such a wait is falling behind: from then on what does not fit is dropped
at once (counted, and logged at most once a minute) until half its room is free again
(docs/tiers.md, "Write-behind").
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.abc
import numpy as np

from .records import TierCacheStats
from .tiers.base import Tier

__all__ = ["Batch", "Room", "TierLink"]

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


@dataclass(eq=False)
class TierLink:
    """One tier, its room for blocks on their way down, and what the cache counted for it."""

    tier: Tier
    limit_blocks: int
    queue_wait: float = 1.0
    inflight: dict[bytes, tuple[Batch, int]] = field(default_factory=dict)
    writes: dict[Batch, anyio.CancelScope] = field(default_factory=dict)  # write calls running
    pending: int = 0  # blocks reserved, being copied or being written
    behind: bool = False  # a wait for room timed out: drop at once until half empty
    tg: anyio.abc.TaskGroup | None = None  # runs the write calls while the cache is open
    _calling: set[Batch] = field(default_factory=set)  # batches whose write call runs now
    _calls: int = 0  # write calls started
    room: anyio.Event = field(default_factory=anyio.Event)
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

    def stats(self) -> TierCacheStats:
        return TierCacheStats(
            name=self.tier.name, hits=self.hits, restored_keys=self.restored_keys,
            restored_bytes=self.restored_bytes, demoted=self.demoted,
            write_throughs=self.write_throughs, demotions_dropped=self.dropped,
            read_misses=self.read_misses, queued_blocks=self.pending, persisted=self.persisted,
            tier=self.tier.statistics(),
        )

    # -- room ----------------------------------------------------------------------------

    def fits(self, n: int) -> bool:
        """Whether ``n`` more blocks fit (when nothing is on its way, any one offer does)."""
        return self.pending == 0 or self.pending + n <= self.limit_blocks

    async def reserve(self, n: int, *, patient: bool = False) -> int:
        """Reserve room for ``n`` blocks, waiting up to ``queue_wait`` seconds for it unless
        the tier is behind (``patient``: as long as it takes, for a caller with its own
        bound); how many were reserved (``n``, or what fits when the wait ran out).
        Cancellable: nothing is reserved then."""
        if n <= 0:
            return 0
        if self.behind and self.pending <= self.limit_blocks // 2:
            self.behind = False
        if patient or not (self.behind or self.fits(n)):
            with anyio.move_on_after(math.inf if patient else self.queue_wait):
                while not self.fits(n):
                    if self.room.is_set():
                        self.room = anyio.Event()
                    await self.room.wait()
            self.behind = not patient and not self.fits(n)
        got = n if self.fits(n) else max(0, min(n, self.limit_blocks - self.pending))
        self.pending += got
        return got

    def unreserve(self, n: int) -> None:
        """Give back room reserved and not used (or used by a batch now written)."""
        if n > 0:
            self.pending -= n
            self.room.set()

    def drop(self, n: int) -> None:
        """Count ``n`` blocks that will not reach this tier; log now and then."""
        if n <= 0:
            return
        self.dropped += n
        self._unlogged += n
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            _log.warning(
                "aiokv: %d blocks for the %s tier were dropped (%d so far): it stayed full of "
                "blocks on their way down (it cannot keep up), refused them, or the cache "
                "closed first; see docs/tiers.md, Write-behind",
                self._unlogged, self.tier.name, self.dropped)
            self._unlogged, self._logged_at = 0, now

    # -- blocks on their way down --------------------------------------------------------

    def expect(self, batch: Batch) -> None:
        """List ``batch``'s keys as on their way here (their copy is starting); room for
        them was reserved."""
        for i, key in enumerate(batch.keys):
            self.inflight[key] = (batch, i)

    def push(self, batch: Batch, rows: np.ndarray) -> None:
        """The batch's bytes landed: start its write (or drop it once closed)."""
        batch.rows = rows
        batch.landed.set()
        if self.tg is None:
            self.abandon(batch)
            return
        scope = self.writes[batch] = anyio.CancelScope(shield=True)  # stop() cancels it
        self.tg.start_soon(self._write, batch, scope)

    def abandon(self, batch: Batch, *, dropped: bool = True) -> None:
        """The batch will not be written (its copy failed, or the cache closed; a store
        that never landed is no drop)."""
        batch.landed.set()
        batch.written.set()
        self._forget(batch)
        if dropped:
            self.drop(len(batch.keys))
        self.unreserve(len(batch.keys))

    def find(self, key: bytes) -> tuple[Batch, int] | None:
        return self.inflight.get(key)

    def _forget(self, batch: Batch) -> None:
        for key in batch.keys:
            if (entry := self.inflight.get(key)) is not None and entry[0] is batch:
                del self.inflight[key]

    async def _write(self, batch: Batch, scope: anyio.CancelScope) -> None:
        """One batch's write call. Keys the tier refuses while other calls run (it may be
        removing the same key's old file for one of them) are tried again when those are
        over, so calls touching one key do not cost a block."""
        ok: int | None = None
        try:
            with scope:
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
        self.unreserve(len(batch.keys))
        batch.written.set()

    def stop(self) -> None:
        """Stop the write calls (each then counts what it did not write) and take no more."""
        self.tg = None
        for scope in self.writes.values():
            scope.cancel()


class Room:
    """Room one offer reserved in the write queues, taken as its copies are decided."""

    def __init__(self) -> None:
        self.held: dict[TierLink, int] = {}

    def left(self, link: TierLink | None) -> int:
        return self.held.get(link, 0) if link is not None else 0

    def take(self, link: TierLink, n: int) -> int:
        """Up to ``n`` of the room held in ``link``; the rest of ``n`` is dropped, counted."""
        got = min(n, self.held.get(link, 0))
        if got:
            self.held[link] -= got
        link.drop(n - got)
        return got

    def release(self) -> None:
        for link, n in self.held.items():
            link.unreserve(n)
        self.held.clear()
