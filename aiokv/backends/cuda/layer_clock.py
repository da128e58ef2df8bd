"""Device timestamps of one measured layerwise job (``WorkerOptions(layer_stalls=True)``).

Every time is a timing event's distance from the job's ``origin``, an event recorded on the
lane's stream just before layer 0's copies: each layer's event (its copies' end), and per
gate two marks on the consumer's stream (it reached the gate; it went on). The events are
read only once they completed, and the origin lives until the timeline is read or the job's
handle is dropped, so a gate read after the job's end is still placed on the same clock.
"""

from __future__ import annotations

import threading
from typing import Any

from .driver import JobEvents

__all__ = ["Held", "read_gate"]


class Held:
    """A measured run's timing events past its end: the origin, the layers' events, and
    what gates reported; given back to the driver's pools once (``release``)."""

    def __init__(self, driver: Any) -> None:
        self._drv = driver
        self._lock = threading.Lock()
        self.origin: Any = None
        self._events: list[Any] = []
        self._recorded: bytes = b""  # per layer, whether this job recorded its event
        self._kept = False  # the job's end handed its layer events over (``keep``)
        self._landed = False
        self._gates_open = 0  # gates whose marks are not read yet
        self._copy_done: list[float | None] | None = None
        self._reached: dict[int, float | None] = {}
        self._started: dict[int, float | None] = {}

    def keep(self, events: list[Any], landed: bool, recorded: bytes) -> None:
        """The job ended: its layer events are kept for ``copy_done`` where it landed (else
        no time of theirs can be read, and they go back now). ``recorded[i]``: layer ``i``'s
        event was recorded by this job; one that was not (a load that failed part way)
        holds another job's time, or none, and is never read."""
        with self._lock:
            self._kept = True
            if landed and self.origin is not None:
                self._events, self._landed, self._recorded = events, True, recorded
                return
        self._give(events)

    def open_gate(self) -> None:
        with self._lock:
            self._gates_open += 1

    def close_gate(self) -> None:
        with self._lock:
            self._gates_open -= 1

    def note_gate(self, layer: int, pair: JobEvents) -> None:
        """A gate's marks ran: where its consumer arrived and went on (first gate wins)."""
        with self._lock:
            origin = self.origin
            if origin is None or layer in self._started:
                return
            self._reached[layer] = self._drv.elapsed(origin, pair.start)
            self._started[layer] = self._drv.elapsed(origin, pair.stop)

    def copy_done(self, layers: int) -> list[float | None] | None:
        """Each layer's end from the origin (None where unknown), or None while a gate's
        marks are still to run or the job's end has not handed its events over (``keep``:
        read before that, the answer would stay without copy ends)."""
        with self._lock:
            if self._gates_open > 0 or not self._kept:
                return None
            if self._copy_done is None:
                origin = self.origin
                if self._landed and origin is not None and len(self._events) == layers:
                    marks = self._recorded
                    self._copy_done = [self._drv.elapsed(origin, ev) if marks[i] else None
                                       for i, ev in enumerate(self._events)]
                else:
                    self._copy_done = [None] * layers
            return list(self._copy_done)

    def reached(self, layers: int) -> list[float | None]:
        with self._lock:
            return [self._reached.get(i) for i in range(layers)]

    def started(self, layers: int) -> list[float | None]:
        with self._lock:
            return [self._started.get(i) for i in range(layers)]

    def release(self) -> None:
        """Give the origin and the kept layer events back (idempotent)."""
        with self._lock:
            origin, events = self.origin, self._events
            self.origin, self._events = None, []
        self._give(events + ([origin] if origin is not None else []))

    def _give(self, events: list[Any]) -> None:
        drv = self._drv
        if drv.broken is None:
            for event in events:
                drv.give_timing_event(event)


def read_gate(run: Any, layer: int, pair: JobEvents) -> tuple[bool, float | None]:
    """A measured gate's stall, once its second mark ran: device time between its two
    marks (``StallMeter.later``); also places them on the job's timeline."""
    drv = run._drv
    drv.ensure_context()
    if not drv.query(pair.stop):
        return False, None
    if run._held is not None:
        run._held.note_gate(layer, pair)
    return True, drv.elapsed(pair.start, pair.stop)
