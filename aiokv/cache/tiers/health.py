"""One log line when a tier starts failing, with the reason, and one when it works again.

Tiers never raise for I/O trouble (a failure is a miss or a dropped write, counted in
``statistics().errors``), so without a log a wrong password or a full disk would be
silent. While a tier keeps failing, a reminder is logged at most once per ``interval``.
Reasons never carry secrets: callers pass exceptions whose text names no password.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["FailureLog"]

_log = logging.getLogger("aiokv")


class FailureLog:
    """Whether one tier is failing, logged on each change and at most once per
    ``interval`` seconds while it lasts. Safe to call from worker threads."""

    def __init__(self, tier: str, *, interval: float = 60.0) -> None:
        self.tier = tier
        self.interval = interval
        self.failing = False
        self.last_error: str | None = None
        self._since_logged = 0
        self._next_log = 0.0
        self._lock = threading.Lock()

    def failed(self, error: object) -> None:
        """A call of the tier failed (an exception, or a per-command error reply)."""
        reason = _reason(error)
        now = time.monotonic()
        with self._lock:
            self.last_error = reason
            if not self.failing:
                self.failing = True
                self._since_logged = 0
                self._next_log = now + self.interval
                _log.warning("%s is failing: %s (each failure is a miss or a dropped write, "
                             "counted in statistics().errors)", self.tier, reason)
                return
            self._since_logged += 1
            if now >= self._next_log:
                _log.warning("%s is still failing: %d more failures in the last %.0f s; "
                             "latest: %s", self.tier, self._since_logged, self.interval, reason)
                self._since_logged = 0
                self._next_log = now + self.interval

    def succeeded(self) -> None:
        """A call of the tier went through without an error."""
        with self._lock:
            if not self.failing:
                return
            self.failing = False
        _log.info("%s works again", self.tier)


def _reason(error: object) -> str:
    if isinstance(error, BaseException):
        text = str(error) or type(error).__name__
        return f"{type(error).__name__}: {text}"
    return str(error)
