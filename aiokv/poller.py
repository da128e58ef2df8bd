"""Wakes futures when their copies finish, from one task on the event loop.

Completion is polled (an event query costs under a microsecond), adaptively: after a
submit or a completion the poller only yields to the loop for ``spin_seconds``, which
gives wake-ups of tens of microseconds; after that it sleeps ``poll_interval`` between
queries (asyncio rounds sleeps under a millisecond up to ~1.1 ms and uvloop down to a
busy spin, so shorter sleeps buy nothing). When the observed transfer rate predicts that
the head job needs longer, it sleeps until a spin window before the predicted end instead,
and when the job should end within one sleep it keeps spinning, so long transfers are
noticed within microseconds at little CPU cost. With nothing in
flight it sleeps on an event that submits set.

Given a ``watch`` hook (the worker's, with ``WorkerOptions.wait_threads``), the poller
does not guess after the spin: the hook starts a thread per head job that blocks in the
driver until the job ends (no CPU) and then wakes the poller, which sleeps meanwhile
(polling every 10 ms as a backstop). On the H200 that woke long jobs later than the
predictive poller, so it is opt-in.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

__all__ = ["Poller"]

_MAX_NAP = 0.01


class Poller:
    """Calls ``poll()`` (which returns how many jobs finished) while ``pending()`` > 0."""

    def __init__(
        self,
        poll: Callable[[], int],
        pending: Callable[[], int],
        *,
        expected_wait: Callable[[], float | None] = lambda: None,
        watch: Callable[[], None] | None = None,
        spin_seconds: float,
        poll_interval: float,
    ) -> None:
        self._poll = poll
        self._pending = pending
        self._expected_wait = expected_wait
        self._watch = watch
        self._spin = spin_seconds
        self._interval = poll_interval
        self._wake = anyio.Event()
        self._active_since = time.perf_counter()
        self.polls = 0
        self.sleeps = 0

    def wake(self) -> None:
        """Note new work. Call on the loop thread (submits do)."""
        self._active_since = time.perf_counter()
        if not self._wake.is_set():
            self._wake.set()

    def _finishing_soon(self) -> bool:
        """The head job should end within one sleep (or is only just overdue)."""
        eta = self._expected_wait()
        return eta is not None and -self._spin < eta <= self._spin + self._interval

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            if self._wake.is_set():
                self._wake = anyio.Event()
            if not self._pending():
                await self._wake.wait()
                continue
            self.polls += 1
            if self._poll():
                self._active_since = time.perf_counter()
                await anyio.lowlevel.checkpoint()
            elif time.perf_counter() - self._active_since < self._spin:
                await anyio.lowlevel.checkpoint()
            elif self._watch is not None:
                # Threads blocked in the driver on each head job wake us when it ends.
                self.sleeps += 1
                self._watch()
                with anyio.move_on_after(_MAX_NAP):
                    await self._wake.wait()
            elif self._finishing_soon():
                # A nap cannot be shorter than ~1 ms on asyncio: spin through the last stretch.
                await anyio.lowlevel.checkpoint()
            else:
                self.sleeps += 1
                eta = self._expected_wait()
                early = eta is not None and eta > self._spin + self._interval
                # Capped, so a stale rate estimate costs at most a few milliseconds of delay.
                nap = min(eta - self._spin, _MAX_NAP) if early and eta is not None else self._interval
                with anyio.move_on_after(nap):
                    await self._wake.wait()  # a submit cuts the sleep short
                if early:
                    self._active_since = time.perf_counter()  # spin around the predicted end
