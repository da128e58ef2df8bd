"""One lower tier as the cache drives it: its write queue, its writer, the blocks on their
way down, and its counters.

A block goes down as a copy of its bytes (a row). From the moment its copy starts until the
tier has answered its write, the row is listed in ``inflight``: lookups count it and
restores read it from memory, so a block is never in neither place and a restore never
waits for the writer. Room in the queue is reserved before a copy starts; an offer that
finds the queue full waits its turn, up to ``queue_wait`` seconds. A tier still full after
such a wait is falling behind: from then on what does not fit is dropped at once (counted,
and logged at most once a minute) until its queue is half empty (docs/tiers.md,
"Write-behind").
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import anyio
import numpy as np

from .records import TierCacheStats
from .tiers.base import Tier

__all__ = ["Batch", "Room", "TierLink"]

_log = logging.getLogger("aiokv")

LOG_EVERY = 60.0
"""Seconds between two log lines about one tier's drops."""


@dataclass(eq=False)
class Batch:
    """Blocks on their way to one tier: their tier keys and, once copied, their rows
    (``(n, block_bytes)`` uint8 in portable page order)."""

    keys: list[bytes]
    kind: Literal["demote", "through", "persist"]
    rows: np.ndarray | None = None
    landed: anyio.Event = field(default_factory=anyio.Event)

    def row(self, i: int) -> np.ndarray | None:
        return None if self.rows is None else self.rows[i]


@dataclass(eq=False)
class TierLink:
    """One tier, its queue (bounded in blocks) and what the cache counted for it."""

    tier: Tier
    limit_blocks: int
    queue_wait: float = 1.0
    queue: deque[Batch] = field(default_factory=deque)
    inflight: dict[bytes, tuple[Batch, int]] = field(default_factory=dict)
    pending: int = 0  # blocks reserved, being copied, queued or being written
    behind: bool = False  # a wait for room timed out: drop at once until half empty
    writing: bool = False
    wake: anyio.Event = field(default_factory=anyio.Event)
    room: anyio.Event = field(default_factory=anyio.Event)
    queued_batches: int = 0
    done_batches: int = 0
    progress: anyio.Event = field(default_factory=anyio.Event)
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

    # -- room in the queue ---------------------------------------------------------------

    def fits(self, n: int) -> bool:
        """Whether ``n`` more blocks fit (an empty queue takes any one offer)."""
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
        """Give back room reserved and not used."""
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
                "aiokv: %d blocks for the %s tier were dropped (%d so far): its write queue "
                "stayed full (the tier cannot keep up) or it refused them; see docs/tiers.md, "
                "Write-behind", self._unlogged, self.tier.name, self.dropped)
            self._unlogged, self._logged_at = 0, now

    # -- blocks on their way down --------------------------------------------------------

    def expect(self, batch: Batch) -> None:
        """List ``batch``'s keys as on their way here (their copy is starting); room for
        them was reserved."""
        for i, key in enumerate(batch.keys):
            self.inflight[key] = (batch, i)

    def push(self, batch: Batch, rows: np.ndarray) -> None:
        """The batch's bytes landed: hand it to the writer (or drop it once closed)."""
        batch.rows = rows
        batch.landed.set()
        if not self.writing:
            self.abandon(batch)
            return
        self.queue.append(batch)
        self.queued_batches += 1
        self.wake.set()

    def abandon(self, batch: Batch, *, dropped: bool = True) -> None:
        """The batch will not be written (its copy failed, or the cache closed; a store
        that never landed is no drop)."""
        batch.landed.set()
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

    # -- the writer ----------------------------------------------------------------------

    async def run_writer(self, scope: anyio.CancelScope) -> None:
        """Write queued batches in order until ``scope`` is cancelled (by the cascade: it is
        shielded, so a cancelled owner still drains within its bound)."""
        with scope:
            while True:
                if not self.queue:
                    await self.wake.wait()
                    self.wake = anyio.Event()
                    continue
                batch = self.queue[0]
                ok = 0
                try:
                    assert batch.rows is not None
                    done = await self.tier.write(batch.keys, [memoryview(r) for r in batch.rows])
                    ok = sum(1 for d in done if d)
                except Exception:  # a tier that broke its contract: its blocks are dropped
                    ok = 0
                finally:
                    self.queue.popleft()
                    self._written(batch, ok)

    def _written(self, batch: Batch, ok: int) -> None:
        n = len(batch.keys)
        if batch.kind == "through":
            self.write_throughs += ok
        elif batch.kind == "persist":
            self.persisted += ok
        else:
            self.demoted += ok
        self.drop(n - ok)
        self._forget(batch)  # after the write: the tier holds them now, or they are gone
        self.pending -= n
        self.done_batches += 1
        self.room.set()
        progress, self.progress = self.progress, anyio.Event()
        progress.set()

    def stop(self) -> None:
        """Drop what is still queued (the writer was stopped)."""
        self.writing = False
        while self.queue:
            batch = self.queue.popleft()
            self._forget(batch)
            self.drop(len(batch.keys))
            self.pending -= len(batch.keys)
            self.done_batches += 1
        self.room.set()
        self.progress.set()

    async def written(self, target: int) -> None:
        """Until ``target`` batches were written or dropped (or the writer stopped)."""
        while self.writing and self.done_batches < target:
            await self.progress.wait()


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
