"""The end of one CUDA job: its completion event, polled, waited on, or rung on a doorbell.

A job's timing pair comes from the driver's pool and goes back once the job is observed
done and its device time read (``settle``), or once the last thread blocked on it is out.
On the native path the job is a program its lane's issuer thread runs after ``submit``
returned (a ``Ticket``): until the ticket is issued the job is not done, waits block on
the ticket, and doorbells are armed by the issuer thread once it has issued the program.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...doorbell import Doorbell
from ...errors import WorkerClosed
from ..base import Completion
from .driver import Driver, JobEvents

__all__ = ["CudaCompletion"]


class CudaCompletion(Completion):
    """The completion event of one job; its events go back to the pool once observed."""

    __slots__ = (
        "_bell_stream", "_bells", "_dependency", "_done", "_driver", "_elapsed", "_error", "_events",
        "_issued", "_lock", "_orphan", "_recorder", "_started", "_stream", "_ticket", "_unsettled",
        "_waiter", "_waiting",
    )

    def __init__(
        self, driver: Driver, events: JobEvents, error: BaseException | None = None,
        bell_stream: Any = None, started: float | None = None, issued_later: bool = False,
        waiter: Any = None, ticket: Any = None, recorder: Any = None, dependency: Any = None,
        stream: Any = None,
    ) -> None:
        """``issued_later``: the lane has a Python issuer thread, so the job counts as not
        yet enqueued until ``mark_issued`` (whichever thread ends up enqueueing it).
        ``waiter``: the lane's native waiter thread, which rings doorbells (else the
        driver's host functions do). ``ticket``: the native path's program, not done before
        it is issued; ``recorder`` turns its failure into the job's error; ``dependency`` is
        the pooled event its program waits on (given back once the job is over);
        ``stream``: the lane's main stream (waited out if a failure's end went unrecorded)."""
        self._waiter = waiter
        self._ticket = ticket
        self._recorder = recorder
        self._dependency = dependency
        self._stream = stream
        self._driver = driver
        self._started = started
        self._bell_stream = bell_stream
        self._events: JobEvents | None = events
        self._done = False
        self._error = error
        self._elapsed: float | None = None
        # A finished job's timing pair, until ``settle`` reads it and pools it (off the
        # wake-up path: the read and the return cost several microseconds per job).
        self._unsettled: JobEvents | None = None
        self._lock = threading.Lock()
        # Threads inside cuEventSynchronize on our events: those go back to the pool only
        # once the last one is out, or a new job could re-record an event being waited on.
        self._waiting = 0
        self._orphan: JobEvents | None = None
        # Unset while the lane's issuer has yet to enqueue the job (None: enqueued at launch);
        # doorbells asked for meanwhile are armed once it has.
        self._issued: threading.Event | None = threading.Event() if issued_later else None
        self._bells: list[Doorbell] = []

    def mark_issued(self, started: float, error: BaseException | None) -> None:
        """Called by the lane once every copy is enqueued (or the enqueue failed): when
        they were handed over (``started_at``), and the failure the job then reports."""
        with self._lock:
            self._started = started
            if error is not None and self._error is None:
                self._error = error  # reported once the enqueued part is over
            bells, self._bells = self._bells, []
            if self._issued is not None:
                self._issued.set()
        for bell in bells:
            if not self.ring_when_done(bell):
                bell.ring()  # cannot arm it: wake the waiter now, it falls back to polling

    def attach(self, ticket: Any, started: float, error: BaseException | None) -> None:
        """The job reached the native issuer after the completion was made, as ``ticket``
        (a layerwise load's one program, a store's end), or never did (None: it fails with
        ``error``)."""
        with self._lock:
            self._ticket = ticket
        self.mark_issued(started, error)

    def _pending_issue(self) -> bool:
        if self._ticket is not None:
            return self._ticket_pending()
        issued = self._issued
        return issued is not None and not issued.is_set()

    def _ticket_pending(self) -> bool:
        """Whether the issuer has yet to issue the job's program; once it has, take its
        result (the job's error, when it started) and forget the ticket."""
        ticket = self._ticket
        if ticket is None:
            return False
        result = ticket.result()
        if result is None:
            return True
        self._ticket = None
        self._started = ticket.started_at
        error = self._recorder.error_of(result) if result[1] else None
        if error is not None:
            if self._error is None:
                self._error = error
            if not result[3] and self._driver.broken is None and not isinstance(error, WorkerClosed):
                # Nothing recorded the end behind what the program enqueued: wait that out.
                try:
                    self._driver.stream_synchronize(self._stream)
                except Exception:
                    pass  # a broken context fails every job anyway
        return False

    def query(self) -> bool:
        if self._done:
            return True
        drv = self._driver
        if drv.broken is not None:
            self._finish(drv.broken)
            return True
        if self._pending_issue():
            return False
        if drv.broken is not None:  # the program's own failure may have been the sticky one
            self._finish(drv.broken)
            return True
        events = self._events
        if events is None:
            return self._done
        try:
            drv.ensure_context()
            if not drv.query(events.done):
                return False
        except Exception as exc:
            if drv.broken is None:
                self._wait_out(events)
            self._finish(exc)
            return True
        self._finish(None)
        return True

    def _wait_out(self, events: JobEvents) -> None:
        """A query that failed without breaking the context says nothing of the copies:
        block until they are over before the job is reported failed, or its memory could
        be reused (a cache's chunks, the GPU blocks) while they still run."""
        try:
            self._driver.synchronize(events.done)
            return
        except Exception:
            pass
        if self._bell_stream is not None:
            try:
                self._driver.stream_synchronize(self._bell_stream)
            except Exception:
                pass  # a context that fails this too fails every job anyway

    def wait(self, timeout: float | None = None) -> bool:
        if self.query():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._issued is not None and not self._issued.wait(timeout):
            return self.query()
        ticket = self._ticket  # (set by then, for a job planned after its submit)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if ticket is not None and not ticket.wait(left):
            return self.query()
        if timeout is None:
            with self._lock:
                events = self._events
                if events is None:
                    return True
                self._waiting += 1
            error: Exception | None = None
            try:
                self._driver.synchronize(events.done)
            except Exception as exc:
                error = exc
            finally:
                with self._lock:
                    self._waiting -= 1
                    orphan = self._orphan if self._waiting == 0 else None
                    if orphan is not None:
                        self._orphan = None
                if orphan is not None:
                    self._driver.give_job_events(orphan)
            if error is not None:
                self._finish(error)
                return True
            return self.query()
        pause = 20e-6
        while not self.query():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def ring_when_done(self, bell: Doorbell) -> bool:
        with self._lock:
            events = self._events
            if events is not None and not self._done:
                if self._bell_stream is None:
                    return False
                ticket = self._ticket
                if ticket is not None and bell.ring_fd() >= 0 and ticket.ring_fd(bell.ring_fd()):
                    return True  # the issuer thread arms it once it issued the program
                if self._pending_issue():
                    if self._waiter is None and not self._driver.can_ring():
                        return False
                    self._bells.append(bell)  # armed by ``mark_issued``
                    return True
                if self._waiter is not None and bell.ring_fd() >= 0:
                    try:  # the waiter thread rings it: no Python, no driver callback thread
                        if self._waiter.watch(events.done, bell.ring_fd()) == 0:
                            return True
                    except Exception:
                        pass  # refused (a dup failed, say): the host function may still do
                try:
                    return self._driver.ring_after(self._bell_stream, events.done, bell)
                except Exception:
                    return False  # the driver refused; a sticky error shows at the next query
        bell.ring()
        return True

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                return
            events, self._events = self._events, None
            if self._error is None:
                self._error = error
            self._done = True
            dependency, self._dependency = self._dependency, None
            if dependency is not None and self._ticket is None and self._driver.broken is None:
                # Its program was issued (its wait on the event enqueued): the event is free.
                self._driver.give_sync_event(dependency)
            if self._error is None:
                self._unsettled = events  # timed and pooled by ``settle``
                return
        self._pool(events)

    def _device_time(self, drv: Driver, events: JobEvents) -> float | None:
        """Seconds the job's copies took on the device (a layerwise store sums its layers)."""
        return drv.elapsed(events.start, events.stop)

    def settle(self) -> None:
        with self._lock:
            events, self._unsettled = self._unsettled, None
            if events is None:
                return
            drv = self._driver
            try:
                drv.ensure_context()  # any thread may read a result's transfer_time
                self._elapsed = self._device_time(drv, events)
            except Exception:
                self._elapsed = None  # the time is lost (a broken device), never the result
        self._pool(events)

    def _pool(self, events: JobEvents | None) -> None:
        """Give the job's events back, or to the last thread still waiting on them."""
        with self._lock:
            if events is not None and self._waiting:
                self._orphan, events = events, None  # the last waiter gives them back
        if events is not None and self._driver.broken is None:
            self._driver.give_job_events(events)
