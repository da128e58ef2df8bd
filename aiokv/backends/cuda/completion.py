"""The end of one CUDA job: its completion event, polled, waited on, or rung on a doorbell.

A job's timing pair comes from the driver's pool and goes back once the job is observed
done and its device time read (``settle``), or once the last thread blocked on it is out.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...doorbell import Doorbell
from ..base import Completion
from .driver import Driver, JobEvents

__all__ = ["CudaCompletion"]


class CudaCompletion(Completion):
    """The completion event of one job; its events go back to the pool once observed."""

    __slots__ = (
        "_bell_stream", "_bells", "_done", "_driver", "_elapsed", "_error", "_events", "_issued",
        "_lock", "_orphan", "_started", "_unsettled", "_waiter", "_waiting",
    )

    def __init__(
        self, driver: Driver, events: JobEvents, error: BaseException | None = None,
        bell_stream: Any = None, started: float | None = None, issued_later: bool = False,
        waiter: Any = None,
    ) -> None:
        """``issued_later``: the lane has an issuer thread, so the job counts as not yet
        enqueued until ``mark_issued`` (whichever thread ends up enqueueing it).
        ``waiter``: the lane's native waiter thread, which rings doorbells (else the
        driver's host functions do)."""
        self._waiter = waiter
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

    def _pending_issue(self) -> bool:
        issued = self._issued
        return issued is not None and not issued.is_set()

    def query(self) -> bool:
        if self._done:
            return True
        drv = self._driver
        if drv.broken is not None:
            self._finish(drv.broken)
            return True
        if self._pending_issue():
            return False
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
