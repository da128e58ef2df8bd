"""Wakes futures when their copies finish, from one task on the event loop.

Completion is polled (an event query costs under a microsecond), adaptively: after a
submit or a completion the poller only yields to the loop for ``spin_seconds``, which
gives wake-ups of tens of microseconds. After that it naps. When the observed transfer
rate predicts that the head job needs longer, the nap ends a spin window before the
predicted end, and when the job should end within one nap it keeps spinning, so a job that
ends on time is noticed within microseconds at little CPU cost.

A nap on a timer cannot end sooner than it was set for (asyncio rounds anything under a
millisecond up to ~1.1 ms), so a job that ends early, or late after the spin gave up, used
to wait milliseconds to be noticed. With a ``bell`` the poller first asks every head job to
ring it when it ends (``arm``) and naps on the bell's file descriptor instead: the nap ends
as the job ends, and the timer (``max_nap``, 10 ms) is only a backstop. Submits ring it
too. Where a head job cannot ring, naps fall back to ``poll_interval``. With nothing in
flight the poller sleeps on an event that submits set.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.lowlevel

from .doorbell import Doorbell

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
        bell: Doorbell | None = None,
        arm: Callable[[], bool] | None = None,
        spin_seconds: float,
        poll_interval: float,
        max_nap: float = _MAX_NAP,
    ) -> None:
        self._poll = poll
        self._pending = pending
        self._expected_wait = expected_wait
        self._spin = spin_seconds
        self._interval = poll_interval
        self._bell = bell
        self._arm = arm
        self._max_nap = max_nap
        self._napping = False
        self._wake = anyio.Event()
        self._active_since = time.perf_counter()
        self.polls = 0
        self.sleeps = 0

    def wake(self) -> None:
        """Note new work. Call on the loop thread (submits do)."""
        self._active_since = time.perf_counter()
        if not self._wake.is_set():
            self._wake.set()
        if self._napping and self._bell is not None:
            self._bell.ring()  # the nap waits on the bell, not on the event

    def _finishing_soon(self) -> bool:
        """The head job should end within one sleep (or is only just overdue)."""
        eta = self._expected_wait()
        return eta is not None and -self._spin < eta <= self._spin + self._interval

    async def _nap(self, timer: float, rung: float) -> None:
        """Sleep ``timer`` seconds, or up to ``rung`` when every head job will ring the
        bell as it ends; a submit cuts either short."""
        bell, arm = self._bell, self._arm
        if bell is None or arm is None:
            with anyio.move_on_after(timer):
                await self._wake.wait()
            return
        bell.drain()  # rings of jobs already seen done
        armed = arm()
        self._napping = True
        try:
            with anyio.move_on_after(rung if armed else timer):
                await anyio.wait_readable(bell.fileno())
        finally:
            self._napping = False

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
            elif self._finishing_soon():
                # A nap cannot be shorter than ~1 ms on asyncio: spin through the last stretch.
                await anyio.lowlevel.checkpoint()
            else:
                self.sleeps += 1
                eta = self._expected_wait()
                if eta is not None and eta > self._spin + self._interval:
                    # Capped, so a stale rate estimate costs at most a few milliseconds.
                    nap = min(eta - self._spin, self._max_nap)
                    await self._nap(nap, nap)
                    self._active_since = time.perf_counter()  # spin around the predicted end
                else:
                    await self._nap(self._interval, self._max_nap)
