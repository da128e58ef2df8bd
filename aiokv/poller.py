"""Wakes futures when their copies finish, from one task on the event loop.

Completion is polled (an event query costs under a microsecond), adaptively. When the
observed transfer rate predicts that the oldest job needs longer, the poller naps at once,
until a lead (``spin_seconds`` plus how late its naps have been ending) before the
predicted end, then spins through it, so a job that ends on time is noticed within tens
of microseconds at little CPU cost. Without a prediction it only yields to the loop for
``spin_seconds`` after a submit or a completion, then naps.

Event loops time naps to the millisecond (asyncio rounds every timeout up to the next whole
one), so a nap aimed just before a predicted end often overshot it, and a job that ended
early, or late after the spin gave up, waited milliseconds to be noticed. With a ``bell``
(``aiokv.doorbell``) the poller first asks every head job to ring it when it ends
(``arm``) and naps on the bell's file descriptor instead: the nap ends when the job ends or
when the bell's precise alarm (set to the lead before the predicted end) goes off,
and the loop's timer (``max_nap``, 10 ms) is only a backstop. Submits end the nap too.
On asyncio (and uvloop) the bell stays registered with the loop for the poller's life; on
trio it is watched only while napping. Where a head job cannot ring, naps fall back to
``poll_interval``. With nothing in flight the poller sleeps on an event that submits set.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from .doorbell import Doorbell
from .handler import Job
from .loops import loop_event, loop_library, loop_yield
from .specs import Direction

__all__ = ["CompletionForecast", "Poller", "PollerStatistics"]

_MAX_NAP = 0.01
# The shortest nap worth taking on the bell's alarm.
_MIN_ALARM_NAP = 100e-6
# How late a nap is assumed to end before any was measured; a later one is a stalled loop.
_INITIAL_LATENESS = 100e-6
_MAX_LATENESS = 2e-3
# How late a job may run past its predicted end and still be spun for (see expected_wait).
_SLACK_SHARE = 0.25
_MAX_SLACK = 2e-3
# Jobs of at least this many bytes teach the rate (small ones are dominated by overheads).
_MIN_RATE_BYTES = 1 << 20
# Detection windows kept for ``PollerStatistics``.
_WINDOWS_KEPT = 4096


@dataclass(frozen=True)
class PollerStatistics:
    """What the async face's poller did, for the benchmark and for tuning.

    ``detect_windows`` holds, per finished job (most recent last, the last 4096), the
    seconds from the last poll that saw its direction's head job not done (or the job's
    launch, if later) to the poll that found it done: an upper bound on how late its end
    was noticed. ``polls`` counts completion polls, ``naps`` the naps between them.
    """

    polls: int
    naps: int
    detect_windows: tuple[float, ...]


class CompletionForecast:
    """Predicts when each direction's oldest job ends from the rate of earlier large jobs,
    so the poller naps through a long copy and spins around its end. Fed by the async face
    with every job it pops (``saw``) and, once their device times are read, ``learn``."""

    def __init__(self) -> None:
        # Observed bytes/s of large jobs per direction (EWMA).
        self._rate: dict[Direction, float] = {}
        # When the last job of each direction was seen done: the next cannot start sooner.
        self._last_done: dict[Direction, float] = {}
        self._to_learn: list[tuple[Job, float]] = []
        self.detect_windows: deque[float] = deque(maxlen=_WINDOWS_KEPT)

    @property
    def has_rate(self) -> bool:
        """Whether any direction's rate is known (else nothing can be predicted)."""
        return bool(self._rate)

    def saw(self, done: Iterable[Job]) -> None:
        """Note jobs just popped (in submission order per direction)."""
        for job in done:
            self.detect_windows.append(job.noticed_at - job.running_seen_at)
            d = job.direction
            if job.error is None and job.nbytes >= _MIN_RATE_BYTES and job.teaches_rate:
                # Host-clock span from when it could start to when it was seen done: the
                # rate's measure where the device time is unknown.
                span = job.noticed_at - max(job.started_at, self._last_done.get(d, 0.0))
                self._to_learn.append((job, span))
            self._last_done[d] = job.noticed_at

    def learn(self) -> None:
        """Learn the rate from the jobs seen since; call once their device times are read
        (after the tasks they woke ran)."""
        if not self._to_learn:
            return
        jobs, self._to_learn = self._to_learn, []
        for job, span in jobs:
            elapsed = job.completion.elapsed
            if elapsed is None:
                elapsed = span
            if elapsed > 0:
                rate = job.nbytes / elapsed
                old = self._rate.get(job.direction)
                self._rate[job.direction] = rate if old is None else 0.8 * old + 0.2 * rate

    def expected_wait(self, heads: Iterable[Job], now: float | None = None) -> float | None:
        """Seconds until the soonest of ``heads`` (each direction's oldest job) should end;
        None when no rate is known.

        A job a little late (under a quarter of its predicted time, at most 2 ms) reads as
        due now (0.0), so the poller keeps spinning for it instead of taking a timer nap;
        later than that, the prediction is stale and the true (negative) value is returned.
        """
        if now is None:
            now = time.perf_counter()
        soonest: float | None = None
        for head in heads:
            rate = self._rate.get(head.direction)
            if rate is None:
                continue
            span = head.nbytes / rate
            eta = max(head.started_at, self._last_done.get(head.direction, 0.0)) + span - now
            if -min(_MAX_SLACK, _SLACK_SHARE * span) < eta < 0:
                eta = 0.0
            if soonest is None or eta < soonest:
                soonest = eta
        return soonest


class _BellNaps:
    """Naps on the bell through anyio: the loop watches its descriptor only while napping."""

    def __init__(self, bell: Doorbell) -> None:
        self._bell = bell

    def stop(self) -> None:
        pass

    async def nap(self, limit: float) -> None:
        with anyio.move_on_after(limit):
            await anyio.wait_readable(self._bell.fileno())

    def end_nap(self) -> None:
        self._bell.ring()


class _ReaderNaps:
    """asyncio: the bell stays registered with the loop for the poller's life, and its
    callback drains it and ends the nap in progress. That spares each nap the loop's
    register / unregister and anyio's wrappers, which cost about a third more CPU time per
    nap on asyncio and uvloop alike (docs/performance.md, "Doorbell"). A ring that lands
    while the poller spins is drained there; a poll always follows, so none is lost."""

    def __init__(self, bell: Doorbell, loop: asyncio.AbstractEventLoop) -> None:
        self._bell = bell
        self._loop = loop
        self._fd = bell.fileno()  # kept: a closed epoll object no longer says its number
        self._napping: asyncio.Future[None] | None = None

    def start(self) -> None:
        """Raises ``NotImplementedError`` on a loop that cannot watch descriptors."""
        self._loop.add_reader(self._fd, self._rung)

    def stop(self) -> None:
        self._loop.remove_reader(self._fd)

    def _rung(self) -> None:
        self._bell.drain()
        self.end_nap()

    def end_nap(self) -> None:
        napping = self._napping
        if napping is not None and not napping.done():
            napping.set_result(None)

    async def nap(self, limit: float) -> None:
        napping = self._napping = self._loop.create_future()
        backstop = self._loop.call_later(limit, self.end_nap)
        try:
            await napping
        finally:
            backstop.cancel()
            self._napping = None


class Poller:
    """Calls ``poll()`` (which returns how many jobs finished) while ``pending()`` > 0, and
    ``settle()`` after a poll that finished jobs, past one yield to the loop (asyncio and
    uvloop run the tasks it woke first; trio may run them either side)."""

    def __init__(
        self,
        poll: Callable[[], int],
        pending: Callable[[], int],
        *,
        expected_wait: Callable[[], float | None] = lambda: None,
        settle: Callable[[], None] = lambda: None,
        bell: Doorbell | None = None,
        arm: Callable[[], bool] | None = None,
        spin_seconds: float,
        poll_interval: float,
        max_nap: float = _MAX_NAP,
    ) -> None:
        self._poll = poll
        self._pending = pending
        self._expected_wait = expected_wait
        self._settle = settle
        self._yield: Callable[[], Awaitable[None]] = anyio.lowlevel.checkpoint  # run() picks the loop's
        self._spin = spin_seconds
        self._interval = poll_interval
        self._bell = bell
        self._arm = arm
        self._max_nap = max_nap
        # Without the alarm, a nap cannot end sooner than the loop's timer allows ("Doorbell").
        self._shortest_nap = _MIN_ALARM_NAP if bell is not None and bell.has_alarm else poll_interval
        self._napping = False
        self._naps: _BellNaps | _ReaderNaps | None = None  # chosen per run, for its loop
        self._lateness = _INITIAL_LATENESS
        self._wake = loop_event()
        self._active_since = time.perf_counter()
        self.polls = 0
        self.sleeps = 0

    def statistics(self, windows: Iterable[float] = ()) -> PollerStatistics:
        """A snapshot of this poller's counts, with the detection ``windows`` given."""
        return PollerStatistics(self.polls, self.sleeps, tuple(windows))

    def wake(self) -> None:
        """Note new work. Call on the loop thread (submits do)."""
        self._active_since = time.perf_counter()
        if not self._wake.is_set():
            self._wake.set()
        if self._napping and self._naps is not None:
            self._naps.end_nap()  # the nap waits on the bell, not on the event

    def _lead(self) -> float:
        """How long before a predicted end a nap must be set to end, to be spinning then."""
        return self._spin + self._lateness

    def _learn_lateness(self, target: float) -> None:
        """Track how late naps end (how late a sleeping thread wakes depends on the host):
        rises quickly, decays slowly, so the lead covers most naps."""
        late = time.perf_counter() - target
        if late < 0 or late > _MAX_LATENESS:
            return  # a ring or a submit ended it early, or the loop was stalled
        step = 0.25 if late > self._lateness else 0.05
        self._lateness += step * (late - self._lateness)

    async def _nap(self, until: float | None) -> float | None:
        """Nap ``until`` seconds (to the lead before a predicted end) or, with no
        prediction, for as long as the head jobs' rings allow; a submit cuts it short.

        Returns when a timed nap was meant to end (for learning lateness), else None.
        """
        bell, arm, naps = self._bell, self._arm, self._naps
        if bell is None or arm is None or naps is None:
            target = None if until is None else time.perf_counter() + until
            with anyio.move_on_after(self._interval if until is None else until):
                await self._wake.wait()
            return target
        # Rings pending now are of jobs already seen done (the driver's callback thread
        # often rings after a spinning poll saw the end), or of one that ended since the
        # last poll: drain them, or the nap would end at once, and if there were any, look
        # once more, or such a ring would be lost.
        if bell.drain():
            self.polls += 1
            if self._poll():
                self._active_since = time.perf_counter()
                await self._settle_after_yield()
                return None
        armed = arm()
        alarm = until is not None and bell.set_alarm(until)
        target = None if until is None else time.perf_counter() + until
        if alarm:
            limit = self._max_nap  # a backstop: the alarm (or a ring) ends the nap
        elif until is not None:
            limit = until  # no alarm here: the loop's timer it is
        else:
            limit = self._max_nap if armed else self._interval
        # The alarm is left set when a ring ends the nap first: clearing it cost two system
        # calls per nap, and should it go off later, it is drained like a ring.
        self._napping = True
        try:
            await naps.nap(limit)
        finally:
            self._napping = False
        return target

    async def run(self) -> None:
        """Poll until cancelled."""
        checkpoint = self._yield = loop_yield()
        if self._bell is not None and self._arm is not None:
            self._naps = _BellNaps(self._bell)
            if loop_library() == "asyncio":
                reader = _ReaderNaps(self._bell, asyncio.get_running_loop())
                try:
                    reader.start()
                    self._naps = reader
                except NotImplementedError:  # e.g. the proactor loop: anyio's way it is
                    pass
        try:
            await self._spin_and_nap(checkpoint)
        finally:
            self.release_bell()

    def release_bell(self) -> None:
        """Stop watching the bell, which is about to close; later naps are timer naps."""
        if self._naps is not None:
            self._naps.end_nap()
            self._naps.stop()
            self._naps = None

    async def _settle_after_yield(self) -> None:
        """After a poll that finished jobs: let the tasks it woke run, then settle them."""
        await self._yield()
        self._settle()

    async def _spin_and_nap(self, checkpoint: Callable[[], Awaitable[None]]) -> None:
        while True:
            wake = self._wake
            if wake.is_set():
                if isinstance(wake, asyncio.Event):
                    wake.clear()  # asyncio's clears (no new event per turn); anyio's cannot
                else:
                    self._wake = loop_event()
            if not self._pending():
                await self._wake.wait()
                continue
            self.polls += 1
            if self._poll():
                self._active_since = time.perf_counter()
                await self._settle_after_yield()
                continue
            eta = self._expected_wait()
            lead = self._lead()
            if eta is not None and eta > lead + self._shortest_nap:
                # The oldest job needs longer (later jobs end after it): nap until the lead
                # before its predicted end, capped so a stale rate costs a few ms at most.
                self.sleeps += 1
                target = await self._nap(min(eta - lead, self._max_nap))
                if target is not None:
                    self._learn_lateness(target)
                self._active_since = time.perf_counter()  # spin around the predicted end
            elif time.perf_counter() - self._active_since < self._spin or (
                eta is not None and eta > -self._spin
            ):
                await checkpoint()  # just submitted or finished, or due now
            else:
                self.sleeps += 1
                await self._nap(None)  # no prediction, or a stale one
