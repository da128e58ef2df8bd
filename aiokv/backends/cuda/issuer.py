"""One thread per lane that makes a long job's driver calls after ``submit`` has returned.

Why: the driver spends host time on every DMA descriptor and every staged slice, so
issuing a job of small pages takes much of the submitting thread's time
(docs/performance.md, "Issue thread"). Planning is what submit must do itself (it validates, and
raises before anything is enqueued); the calls that only hand the plan to the device can
run here, in submission order, while the caller goes back to its event loop or step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ...errors import WorkerClosed

__all__ = ["Issuer"]

_log = logging.getLogger("aiokv")


class Issuer:
    """Runs a lane's issue work in order: on the caller's thread when nothing is queued
    and the caller does not ask to defer, else on the issuer's own thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._work: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = False  # someone (either thread) is running work now
        self._closed = False
        self._thread: threading.Thread | None = None  # started on the first deferral

    def run(self, work: Callable[[], None], defer: bool) -> bool:
        """Run ``work`` now when ``defer`` is False and nothing is queued or running (its
        errors propagate); otherwise queue it behind the rest. True if it ran here.

        Queued work must handle its own errors: the thread logs and drops what escapes.
        """
        with self._cond:
            if self._closed:
                raise WorkerClosed(f"{self.name} is closed; create a new worker to transfer more")
            if defer or self._busy or self._work:
                if self._thread is None:
                    thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    thread.start()  # may raise: then nothing was queued
                    self._thread = thread
                self._work.append(work)
                self._cond.notify_all()
                return False
            self._busy = True
        try:
            work()
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy and not self._work, timeout)

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._busy and not self._work

    def on_own_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def stop(self) -> None:
        """Let the thread end once what is queued has run, without waiting for it (a
        dropped worker's lane: nothing may block in a finalizer)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._busy and (bool(self._work) or self._closed))
                if not self._work:
                    return  # closed and drained
                work = self._work.popleft()
                self._busy = True
            try:
                work()
            except BaseException:  # work reports its own failures; never lose the thread
                _log.exception("%s: issue work raised", self.name)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
