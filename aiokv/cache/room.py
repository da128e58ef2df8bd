"""Room for blocks on their way down to one tier: backpressure, not drops.

A copy down takes room before its bytes are copied off the host pool and gives it back
once the tier has answered its write. Room is taken in parts of at most ``step`` blocks
(a quarter of the room), first come, first served, so a large offer goes down in turns
beside small ones instead of waiting for the queue to empty. An offer that finds the room
taken waits its turn: the producer slows to the pace of the tier, and nothing is dropped
while the tier writes.

A tier that frees no room for ``wait`` seconds while an offer is first in line has stalled
(a dead server, a disk that stopped answering). From then on, and for every offer waiting
at that moment, what does not fit is dropped at once, counted by the caller, until half
the room is free again; so a stalled tier costs the cache one ``wait``, not one per offer
(docs/tiers.md, "Write-behind").
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import anyio

__all__ = ["WriteRoom"]


@dataclass(eq=False)
class _Waiter:
    n: int
    patient: bool = False  # waits as long as it takes, a stall included
    granted: int = -1  # blocks granted; -1 while waiting
    event: anyio.Event = field(default_factory=anyio.Event)


class WriteRoom:
    """Room for ``limit`` blocks on their way down to one tier, handed out in turn.

    Args:
        limit: blocks that may be reserved, being copied or being written at once.
        wait: seconds the first offer in line waits for room before the tier counts as
            stalled (``math.inf``: never).
    """

    def __init__(self, limit: int, wait: float) -> None:
        self.limit = max(1, int(limit))
        self.wait = float(wait)
        self.step = max(1, self.limit // 4)
        """The most blocks one part takes: callers split larger copies into parts."""
        self.pending = 0
        self.stalled = False
        self.closed = False
        self.waits = 0  # parts that had to wait their turn
        self.waited = 0.0  # seconds they waited, all together
        self._line: deque[_Waiter] = deque()
        self._progress = time.monotonic()  # when room last came back (or the line began)

    def fits(self, n: int) -> bool:
        """Whether ``n`` more blocks fit now (when nothing is on its way, any part does)."""
        return self.pending == 0 or self.pending + n <= self.limit

    async def take(self, n: int, *, patient: bool = False) -> int:
        """Room for ``n`` blocks (at most ``step``): at once if it fits and nobody waits,
        else in turn. Returns ``n``, or, once the tier has stalled, what fits (maybe 0).
        ``patient`` waits as long as it takes (a caller with its own bound). Cancellable:
        nothing is held then."""
        n = min(int(n), self.step)
        if n <= 0 or self.closed:
            return 0
        if self.stalled and self.pending <= self.limit // 2:
            self.stalled = False
        if not self._line and self.fits(n):
            self.pending += n
            return n
        if self.stalled and not patient:
            return self._what_fits(n)
        waiter = _Waiter(n, patient)
        if not self._line:
            self._progress = time.monotonic()
        self._line.append(waiter)
        began = time.monotonic()
        try:
            while waiter.granted < 0:
                if patient or math.isinf(self.wait):
                    await waiter.event.wait()
                    continue
                # The clock runs while this waiter is first in line and no room comes back.
                left = self.wait - (time.monotonic() - self._progress) if self._line[0] is waiter \
                    else self.wait
                with anyio.move_on_after(max(0.0, left)):
                    await waiter.event.wait()
                if waiter.granted < 0 and self._line and self._line[0] is waiter \
                        and time.monotonic() - self._progress >= self.wait:
                    self._stall()
        except BaseException:
            if waiter.granted > 0:  # granted as it was cancelled: give it back
                self.give(waiter.granted)
            elif waiter in self._line:
                self._line.remove(waiter)
                self._grant()
            raise
        finally:
            self.waits += 1
            self.waited += time.monotonic() - began
        return waiter.granted

    def give(self, n: int) -> None:
        """Room reserved and not used, or used by blocks the tier has now answered for."""
        if n > 0:
            self.pending -= n
            self._progress = time.monotonic()
            self._grant()

    def close(self) -> None:
        """Take no more: every waiter leaves with what it has (nothing)."""
        self.closed = True
        for waiter in self._line:
            waiter.granted = 0
            waiter.event.set()
        self._line.clear()

    # -- internals ------------------------------------------------------------------------

    def _what_fits(self, n: int) -> int:
        got = min(n, max(0, self.limit - self.pending))
        self.pending += got
        return got

    def _grant(self) -> None:
        """Hand room to the waiters in line, in order, while the first one fits."""
        while self._line and self.fits(self._line[0].n):
            waiter = self._line.popleft()
            self.pending += waiter.n
            waiter.granted = waiter.n
            waiter.event.set()
            self._progress = time.monotonic()

    def _stall(self) -> None:
        """The first in line waited ``wait`` seconds with no room coming back: every waiter
        takes what fits now and leaves, and later offers do so at once until half the room
        is free. Patient waiters stay in line, in their order, for room as it comes back."""
        self.stalled = True
        line, self._line = self._line, deque()
        for waiter in line:
            if waiter.patient:
                self._line.append(waiter)
            else:
                waiter.granted = self._what_fits(waiter.n)
                waiter.event.set()
