"""``TransferFuture``: an awaitable result that any number of tasks may await.

Awaiting is backend-neutral (anyio events), so it works under asyncio, uvloop and trio.
Cancelling an awaiting task removes only that waiter; the copy goes on and the job is
still completed and reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import anyio
import anyio.lowlevel

from .specs import TransferFailed, TransferResult

__all__ = ["TransferFuture"]

_log = logging.getLogger("aiokv")


class TransferFuture:
    """The outcome of one submitted job.

    ``await fut`` returns the ``TransferResult`` or raises ``TransferFailed``.
    """

    __slots__ = ("_callbacks", "_error", "_result", "_waiters", "job_id")

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        self._result: TransferResult | None = None
        self._error: TransferFailed | None = None
        self._waiters: list[anyio.Event] = []
        self._callbacks: list[Callable[[TransferFuture], Any]] = []

    def done(self) -> bool:
        """True once the copy is over (successfully or not). Never yields."""
        return self._result is not None

    def result(self) -> TransferResult:
        """The result of a done future; raises ``TransferFailed`` if the copy failed."""
        if self._result is None:
            raise RuntimeError(f"job {self.job_id} is still in flight; await the future instead")
        if self._error is not None:
            raise self._error
        return self._result

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
            event = anyio.Event()
            self._waiters.append(event)
            try:
                await event.wait()
            finally:
                if self._result is None:
                    self._waiters.remove(event)
        else:
            # A done future still checkpoints, so a loop of awaits stays cancellable.
            await anyio.lowlevel.checkpoint()
        return self.result()

    def _resolve(self, result: TransferResult, reason: str = "") -> None:
        """Called by the poller on the loop thread."""
        if result.success:
            self._result = result
        else:
            self._error = TransferFailed(result, reason)
            self._result = result
        for event in self._waiters:
            event.set()
        self._waiters.clear()
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a user's callback must not cost other jobs their results
                _log.exception("done callback of job %s raised", self.job_id)

    def __repr__(self) -> str:
        state = "pending" if self._result is None else ("failed" if self._error else "done")
        return f"<TransferFuture job={self.job_id} {state}>"
