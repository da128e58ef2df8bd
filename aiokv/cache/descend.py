"""Copies down: blocks the host evicts (demotions), stores (write-through) or turns away
(spills), copied off the host pool into rows and handed to the tiers' writers.

Every copy takes room in its tier's write queue first (``room.WriteRoom``), in parts of at
most ``room.step`` blocks, each waiting its turn: an offer the tier cannot take yet waits
instead of dropping blocks, so the cache slows to the tier's pace (backpressure). Only a
tier that stalls has blocks dropped, counted. A wait is cancellable: what was not copied
when it is cancelled is dropped (counted); a copy that has started runs to its end.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial

import anyio

from ..errors import InvalidSpec, UsageError
from ..future import TransferFuture
from .cascade import Cascade
from .links import Batch, Hold, TierLink
from .manager import ChunkManager
from .protocol import result_or_none

__all__ = ["StoreFn", "Ticket", "demote", "first_spill", "spill", "spill_wanted", "ticket"]

StoreFn = Callable[[list[int], list[int]], TransferFuture]
"""Submits a store of GPU blocks into host chunks (absolute ids)."""


async def demote(cascade: Cascade, keys: Sequence[Hashable], chunks: Sequence[int]) -> None:
    """Copy blocks the host evicted (absolute ``chunks``) off the pool and queue them for
    the demotion tier, part by part as room comes; the caller reuses the chunks once this
    returns. Cancelled while waiting for room, the blocks not copied yet are dropped."""
    link = cascade.demote_to
    if link is None or not keys:
        return
    # A block the tier holds goes too: its write is a touch there (no I/O for a local
    # tier), so the tier orders blocks by when the host let them go, as a victim cache. One
    # still on its way there is touched now, as its write would if it had landed already:
    # how fast writes land must not decide what the tier keeps.
    todo: list[tuple[bytes, int]] = []
    again: list[bytes] = []
    for k, c in zip(keys, chunks):
        tk = cascade.tier_key(k)
        if tk in link.inflight:
            again.append(tk)
        else:
            todo.append((tk, c))
    if again and not link.tier.remote:
        try:
            link.tier.touch(again)
        except (UsageError, InvalidSpec):
            raise
        except Exception:  # a tier that broke its contract: no touch, nothing lost
            pass
    # Waiting their turn for room, the blocks are still on their way down: lookups count
    # them and restores copy them out of their host chunks (``Hold``), which the store that
    # evicted them overwrites only once this returns.
    hold = Hold()
    link.hold(hold, todo)
    try:
        while todo:
            want = min(len(todo), link.room.step)
            got = await link.take_room(want)
            head, todo = todo[:want], todo[want:]
            part = head[:got]
            link.unhold(hold, [tk for tk, _ in head])
            link.drop(want - got)
            if part:
                batch = Batch([tk for tk, _ in part], "demote")
                link.expect(batch)
                with anyio.CancelScope(shield=True):  # the chunks are reused once we return
                    await cascade.land(link, batch, [c for _, c in part])
    finally:
        link.unhold(hold, [tk for tk, _ in todo])
        link.drop(len(todo))
        with anyio.CancelScope(shield=True):  # a restore still copying out of the chunks
            await hold.quiet()


def spill_wanted(cascade: Cascade, mgr: ChunkManager, keys: Sequence[Hashable]) -> list[Hashable]:
    """Offered keys the host turned away that the demotion tier should get."""
    link = cascade.demote_to
    if link is None:
        return []
    return [k for k in keys if k not in mgr and cascade.wants(link, k)]


async def first_spill(cascade: Cascade, spill: list[Hashable]) -> list[int]:
    """Staging chunks, with room taken for them, for the first of ``spill``: they ride along
    with the offer's own store (the rest go in rounds, ``spill``)."""
    link = cascade.demote_to
    staging = cascade.staging
    want = min(len(spill), staging.available, link.room.step) if link is not None else 0
    if link is None or want <= 0:
        return []
    got = await link.take_room(want)
    chunks = staging.take(got)  # a restore may have taken some meanwhile
    link.give_room(got - len(chunks))
    return chunks


def ticket(cascade: Cascade, keys: list[Hashable], chunks: list[int], spill: list[Hashable],
           spill_chunks: list[int]) -> Ticket:
    """What one store job hands down once it lands: its stored ``keys`` (in absolute host
    ``chunks``) for each write-through tier, and its ``spill`` keys (in staging
    ``spill_chunks``, room for them taken already) for the demotion tier."""
    through: list[tuple[TierLink, list[bytes]]] = []
    for link in cascade.through:
        wanted = [tk for k in keys if cascade.wants_key(link, tk := cascade.tier_key(k))]
        if wanted:
            through.append((link, wanted))
    down = None
    if spill and cascade.demote_to is not None:
        down = (cascade.demote_to, Batch([cascade.tier_key(k) for k in spill], "demote"))
    return Ticket(cascade, keys, chunks, through, down, spill_chunks)


async def spill(cascade: Cascade, keys: list[Hashable], blocks: list[int], store: StoreFn) -> int:
    """Spill ``keys`` (in GPU ``blocks``) to the demotion tier in rounds through the staging
    chunks, each round taking its turn for room and then for free chunks (after the
    restores that started before it); how many were copied. Blocks not reached
    (cancelled, a stalled tier) are dropped and counted."""
    link = cascade.demote_to
    done = 0
    todo = list(zip(keys, blocks))
    try:
        while todo and link is not None:
            want = min(len(todo), link.room.step, cascade.staging.total)
            got = await link.take_room(want)
            if got < want:  # the tier stalled: what did not fit goes no further
                link.drop(want - got)
                del todo[got:want]
            if not got:
                continue
            try:
                # In line by when it started among the restores (a ticket): behind every
                # restore, it would wait as long as restores keep coming, holding its room.
                chunks = await cascade.staging.take_some(got, cascade.ticket())
            except BaseException:
                link.give_room(got)
                raise
            link.give_room(got - len(chunks))
            part, todo = todo[: len(chunks)], todo[len(chunks):]
            down = Batch([cascade.tier_key(k) for k, _ in part], "demote")
            rider = Ticket(cascade, [], [], [], (link, down), chunks)
            try:
                future = store([b for _, b in part], chunks)
            except BaseException:
                rider.failed()
                raise
            event = anyio.Event()
            future.add_done_callback(partial(rider.settle, mgr=None, done=event))
            await event.wait()
            done += len(part)
    finally:
        if link is not None:
            link.drop(len(todo))
    return done


class Ticket:
    """The copies down that one store job decided, from its submit to their queueing."""

    def __init__(self, cascade: Cascade, keys: list[Hashable], chunks: list[int],
                 through: list[tuple[TierLink, list[bytes]]], down: tuple[TierLink, Batch] | None,
                 staging: list[int]) -> None:
        self._cascade = cascade
        self._at = dict(zip(keys, chunks))
        self._keys = keys
        self._through = through
        self._down = down
        self._staging = staging

    def failed(self) -> None:
        """The store did not land (refused or failed): nothing goes down."""
        if self._down is not None:
            link, batch = self._down
            link.abandon(batch, dropped=False)
        self._cascade.staging.give(self._staging)

    def settle(self, future: TransferFuture, mgr: ChunkManager | None, done: anyio.Event) -> None:
        """The store's done callback: copy what landed off the pool in the cascade's task
        group (write-through keys pinned meanwhile, each part taking its turn for room);
        ``done`` is set once everything is queued."""
        if result_or_none(future) is None:
            self.failed()
            done.set()
            return
        cascade = self._cascade
        if self._down is not None:
            link, batch = self._down
            link.expect(batch)
        pinned = self._keys if self._through and mgr is not None else []
        if mgr is not None:
            mgr.prepare_load(pinned, touch=False)  # a copy to a tier is no reuse
        tks = {cascade.tier_key(k): self._at[k] for k in self._keys}
        through = [(link, list(wanted)) for link, wanted in self._through]

        async def copy() -> None:
            try:
                if self._down is not None:
                    link, batch = self._down
                    self._down = None
                    await cascade.land(link, batch, self._staging)
                cascade.staging.give(self._staging)  # before any wait for room below
                self._staging = []
                while through:
                    link, wanted = through[0]
                    want = min(len(wanted), link.room.step)
                    got = await link.take_room(want)
                    part = wanted[:got]
                    link.drop(want - got)
                    del wanted[:want]
                    if not wanted:
                        through.pop(0)
                    if part:
                        batch = Batch(part, "through")
                        link.expect(batch)
                        await cascade.land(link, batch, [tks[tk] for tk in part])
            finally:
                if self._down is not None:  # not reached: the cascade stopped first
                    self._down[0].abandon(self._down[1])
                for link, wanted in through:
                    link.drop(len(wanted))
                if mgr is not None:
                    mgr.complete_load(pinned)
                cascade.staging.give(self._staging)

        if not cascade.start(copy, done):  # stopped meanwhile: the copies down are dropped
            if mgr is not None:
                mgr.complete_load(pinned)
            if self._down is not None:
                self._down[0].abandon(self._down[1])
            for link, wanted in through:
                link.drop(len(wanted))
            cascade.staging.give(self._staging)
            done.set()
