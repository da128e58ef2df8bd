"""Staging chunks, and the one rule for where a copy off the host pool runs.

Blocks move between the host pool and the tiers as copies: evicted, stored or spilled
blocks are copied off their chunks into rows, and blocks read back (or still on their way
down) are put into staging chunks for their load to the GPU. Small copies run on the event
loop, where a thread hop would cost more than the copy; larger ones on a worker thread, so
moving many large blocks never stalls the loop (docs/tiers.md, "Copies off the host pool").
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio
import anyio.to_thread

__all__ = ["INLINE_COPY_BYTES", "Staging", "off_loop"]

T = TypeVar("T")

INLINE_COPY_BYTES = 256 << 10
"""Bytes a copy may move on the loop thread; larger copies go to a worker thread (a hop
there costs the loop about as much as copying this much, fresh pages included)."""


async def off_loop(nbytes: int, fn: Callable[..., T], *args: object) -> T:
    """Run the copy ``fn(*args)`` of ``nbytes`` on the loop thread if it is small, else on a
    worker thread (which runs to its end even if the caller is cancelled meanwhile: the
    memory it touches must not be handed on while it runs)."""
    if nbytes <= INLINE_COPY_BYTES:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


class Staging:
    """The staging chunks of one cache (the host bookkeeping never hands them out): taken by
    a restore batch or a spill, given back when its copy is over. A waiter of a lower rank
    takes freed chunks first (a ticket: the earliest restore's batches read first, and a
    spill round goes after the restores that started before it), unranked ones after
    them, each in arrival order."""

    def __init__(self, chunks: range) -> None:
        self.total = len(chunks)
        self._free: list[int] = list(chunks)
        self._freed = anyio.Event()
        self._waiting: list[tuple[float, int]] = []  # (rank, arrival), the first first
        self._seq = itertools.count()

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free chunks, at once (maybe none: none while a waiter is in line,
        which came first)."""
        if self._waiting:
            return []
        return self._take(n)

    def _take(self, n: int) -> list[int]:
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    async def take_some(self, n: int, rank: int | None = None) -> list[int]:
        """Between one and ``n`` chunks, waiting until one is free and no waiter before
        it (by ``rank``, then arrival) is left (cancellable)."""
        me = (math.inf if rank is None else rank, next(self._seq))
        bisect.insort(self._waiting, me)
        try:
            while not self._free or self._waiting[0] != me:
                if self._freed.is_set():
                    self._freed = anyio.Event()
                await self._freed.wait()
        finally:
            self._waiting.remove(me)
            if self._free and self._waiting:
                self._freed.set()  # the next waiter may take what is left
        return self._take(n)

    def give(self, chunks: Sequence[int]) -> None:
        if chunks:
            self._free.extend(chunks)
            self._freed.set()
