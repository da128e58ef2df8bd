"""``TransferFuture``: an awaitable result that any number of tasks may await.

Awaiting works under asyncio, uvloop and trio: each waiter waits on an event of its own
task's loop (``aiokv.loops``), on the thread of the loop that submitted the job (its events
are set from there; another thread gets a ``UsageError`` rather than a wait that never
ends).
Cancelling an awaiting task removes only that waiter; the copy goes on and the job is
still completed and reported.

On asyncio a waiter is a bare loop future, so the resolve that wakes it is one
``call_soon``, with no ``asyncio.Event`` in between.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any

import anyio

from .errors import TransferFailed, UsageError
from .loops import LoopEvent, loop_event, loop_library, loop_yield
from .specs import TransferResult

__all__ = ["TransferFuture"]

_log = logging.getLogger("aiokv")


class TransferFuture:
    """The outcome of one submitted job.

    ``await fut`` returns the ``TransferResult`` or raises ``TransferFailed``.
    """

    __slots__ = ("_callbacks", "_cause", "_result", "_thread", "_waiters", "job_id")

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self._thread = threading.get_ident()  # the submitting loop's, which resolves it
        self._result: TransferResult | None = None
        self._cause: BaseException | None = None
        self._waiters: list[LoopEvent | asyncio.Future[None]] = []
        self._callbacks: list[Callable[[TransferFuture], Any]] = []

    def done(self) -> bool:
        """True once the copy is over (successfully or not). Never yields."""
        return self._result is not None

    def result(self) -> TransferResult:
        """The result of a done future; raises ``TransferFailed`` if the copy failed, with
        what failed it as ``__cause__``, and ``UsageError`` if it is not done yet."""
        result = self._result
        if result is None:
            raise UsageError(f"job {self.job_id} is still in flight; await the future instead")
        if not result.success:
            # A new exception per call: one object raised again by every await would grow
            # its traceback each time and be shared by concurrent awaiters.
            cause = self._cause
            raise TransferFailed(result, repr(cause) if cause is not None else "") from cause
        return result

    def add_done_callback(self, fn: Callable[[TransferFuture], Any]) -> None:
        """Call ``fn(future)`` on the event loop once done (at once if already done)."""
        if self.done():
            fn(self)
        else:
            self._callbacks.append(fn)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._wait().__await__()

    async def _wait(self) -> TransferResult:
        if self._result is None:
            if threading.get_ident() != self._thread:
                raise UsageError(
                    f"job {self.job_id}'s future was awaited on another thread than the event "
                    "loop that submitted it, which could not wake it; await it on that loop "
                    "(e.g. asyncio.run_coroutine_threadsafe), or use SyncOffloadingWorker"
                )
        if self._result is not None:
            # A done future still yields once (the loop's own yield: asyncio.sleep(0) costs
            # a third of anyio's checkpoint), so a loop of awaits stays cancellable.
            await loop_yield()()
            return self.result()
        if loop_library() == "asyncio":
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if self._result is None:
                    self._waiters.remove(waiter)
            return self.result()
        event = loop_event()
        self._waiters.append(event)
        try:
            await event.wait()
        finally:
            if self._result is None:
                self._waiters.remove(event)
        return self.result()

    def _resolve(self, result: TransferResult, cause: BaseException | None = None) -> None:
        """Called by the poller on the loop thread; ``cause`` is why a failed job failed."""
        self._cause = cause
        self._result = result
        for waiter in self._waiters:
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():  # a cancelled waiter is removed by its task later
                    waiter.set_result(None)
            else:
                waiter.set()
        self._waiters.clear()
        callbacks, self._callbacks = self._callbacks, []
        escaped: BaseException | None = None
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:  # a user's callback must not cost other jobs their results
                _log_callback_error(self.job_id, exc)
            except BaseException as exc:
                if _is_cancellation(exc):
                    # Nobody cancelled the poller that runs this: e.g. the callback read a
                    # cancelled asyncio future. Raised on, it would read as a cancellation.
                    _log_callback_error(self.job_id, exc)
                else:
                    escaped = escaped or exc  # KeyboardInterrupt and such: after every callback
        if escaped is not None:
            raise escaped

    def __repr__(self) -> str:
        result = self._result
        state = "pending" if result is None else ("done" if result.success else "failed")
        return f"<TransferFuture job={self.job_id} {state}>"


def _log_callback_error(job_id: int, exc: BaseException) -> None:
    """Log a done callback's error; a logging handler or filter that raises must not cost
    the future's other callbacks, or the poller that runs them, anything either."""
    try:
        _log.error("done callback of job %s raised %r", job_id, exc, exc_info=exc)
    except Exception:
        pass


def _is_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is an event loop's cancellation (asyncio's, or the running loop's)."""
    if isinstance(exc, asyncio.CancelledError):
        return True
    try:
        return isinstance(exc, anyio.get_cancelled_exc_class())
    except Exception:  # no async library running here
        return False
