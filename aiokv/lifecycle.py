"""Whether a worker takes work: the one way both faces open and close the core (in the
manner of httpx's client states).

Each core belongs to exactly one face from birth, so the states are all there is: ``NEW``
(built, not open: the async face opens on entering ``async with``, the sync face when it is
built), ``OPEN`` (takes work), ``CLOSING`` (no new work; jobs in flight drain) and
``CLOSED`` (host memory freed or, for copies that never ended, kept).
"""

from __future__ import annotations

import enum
import threading

from .errors import UsageError, WorkerClosed

__all__ = ["Lifecycle", "State"]


class State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Lifecycle:
    """The state of one worker; holds no reference to the core. Any thread may close it:
    exactly one closer drains, the others are told the state it found."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = State.NEW
        # Set once the core let go of its lanes and host memory: what a second closer waits for.
        self.closed = threading.Event()

    def open(self) -> None:
        """``NEW`` -> ``OPEN``; raises ``UsageError`` if open already, ``WorkerClosed`` if
        closing or closed."""
        with self._lock:
            if self.state is State.NEW:
                self.state = State.OPEN
                return
            raise self.refusal(entering=True)

    def check_open(self) -> None:
        """Raise unless the worker takes work (cheap: on every submit)."""
        if self.state is not State.OPEN:
            raise self.refusal()

    def begin_close(self) -> State:
        """Stop taking work and return the state before: ``NEW`` (nothing ever ran: close at
        once), ``OPEN`` (this caller drains), ``CLOSING`` or ``CLOSED`` (another caller has
        it, or had it)."""
        with self._lock:
            before = self.state
            if before in (State.NEW, State.OPEN):
                self.state = State.CLOSING
            return before

    def finish_close(self) -> None:
        self.state = State.CLOSED
        self.closed.set()

    def refusal(self, *, entering: bool = False) -> UsageError:
        """Why the worker may not be used (or, ``entering``, opened) now."""
        state = self.state
        if state is State.CLOSING:
            return WorkerClosed("this worker is closed (its jobs in flight are draining); "
                                "create a new one to transfer more")
        if state is State.CLOSED:
            return WorkerClosed("this worker is closed; create a new one to transfer more")
        if state is State.NEW:
            return WorkerClosed("the worker is not open yet: use `async with worker:` before submitting")
        return UsageError("this worker is already open; enter it once" if entering else
                          "this worker is open")
