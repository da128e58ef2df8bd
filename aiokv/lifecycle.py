"""Who opened a worker and whether it still takes work: the one way both faces open and
close the core (in the manner of httpx's client states).

A worker is opened once, by one face: the async face on entering ``async with``, the sync
adapter when it wraps the worker. Closing passes through ``CLOSING`` (no new work, jobs in
flight drain) to ``CLOSED`` (host memory freed or, for copies that never ended, kept).
"""

from __future__ import annotations

import enum
import threading

from .errors import UsageError, WorkerClosed

__all__ = ["Face", "Lifecycle", "State"]


class State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Face(enum.Enum):
    """The two ways to drive a worker; the value is the class a user holds."""

    ASYNC = "AsyncOffloadingWorker"
    SYNC = "SyncOffloadingWorker"


_HOW_TO_CLOSE = {Face.ASYNC: "aclose() (or leave `async with`)", Face.SYNC: "shutdown()"}


class Lifecycle:
    """The state of one worker, shared by its faces; holds no reference to the core."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = State.NEW
        self.owner: Face | None = None
        # Set once the core let go of its lanes and host memory: what a second closer waits for.
        self.closed = threading.Event()

    def open(self, face: Face) -> None:
        """Open for ``face``; raises ``UsageError`` if open already (by either face) and
        ``WorkerClosed`` if closed."""
        with self._lock:
            if self.state is State.NEW:
                self.state, self.owner = State.OPEN, face
                return
            raise self.refusal(face, entering=True)

    def check_open(self, face: Face) -> None:
        """Raise unless the worker is open and owned by ``face`` (cheap: on every submit)."""
        if self.state is not State.OPEN or self.owner is not face:
            raise self.refusal(face)

    def begin_close(self, face: Face) -> State:
        """Stop taking work and return the state before: ``NEW`` (nothing ever ran: close at
        once), ``OPEN`` (this caller drains), ``CLOSING`` or ``CLOSED`` (another caller has
        it). Raises ``UsageError`` if the other face owns the worker."""
        with self._lock:
            before = self.state
            if before is State.OPEN and self.owner is not face:
                assert self.owner is not None
                raise UsageError(
                    f"a {self.owner.value} owns this worker: call its {_HOW_TO_CLOSE[self.owner]} instead"
                )
            if before in (State.NEW, State.OPEN):
                self.state = State.CLOSING
                self.owner = self.owner or face
            return before

    def finish_close(self) -> None:
        self.state = State.CLOSED
        self.closed.set()

    def refusal(self, face: Face, *, entering: bool = False) -> UsageError:
        """Why ``face`` may not use (or, ``entering``, open) the worker now."""
        if self.state in (State.CLOSING, State.CLOSED):
            return WorkerClosed("this worker is closed; create a new one to transfer more")
        if self.state is State.NEW:
            return WorkerClosed("the worker is not open yet: use `async with worker:` before submitting")
        if self.owner is face:
            if face is Face.SYNC:
                return UsageError("this worker is already owned by another SyncOffloadingWorker; "
                                  "give each adapter its own AsyncOffloadingWorker")
            return UsageError("this worker is already open; enter it once" if entering else
                              "this worker is open already")
        if face is Face.SYNC:
            return UsageError("this worker is open on an event loop (an AsyncOffloadingWorker owns "
                              "it); give the sync adapter a fresh AsyncOffloadingWorker")
        return UsageError("a SyncOffloadingWorker owns this worker: submit through it and close it "
                          "with its shutdown()")
