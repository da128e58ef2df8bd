"""A layerwise store's pushes on a CUDA lane, mixed into ``layers.CudaLayerRun``.

A store is enqueued a layer at a time as the forward pass pushes it, on the forward's
thread, between two of its layers: so a push must cost that thread next to nothing. It
records the copy's dependency on the caller's stream there and then (the stream as it
stands now: DESIGN.md section 1), and, on the native path, hands the layer's program (the
wait on that dependency, the layer's start, its copies, its event) to the lane's native
issuer without waiting for it: no driver call of the copies and no GIL hand-over on the
forward's thread. On the Python path the push makes those calls itself (or queues them on
the lane's Python issuer thread, with ``issue_thread``). The job's end is recorded behind
the last layer. Each layer's event is the stop of a timing pair whose start is recorded
before its copies, so the store's ``transfer_time`` sums its copies and leaves out the
time the stream waited for the forward between pushes (``copy_time``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import WorkerClosed
from .driver import Driver, JobEvents
from .layer_clock import Held
from .layer_copies import Dependency, LayerLane
from .layer_program import Rows

__all__ = ["StorePushes"]


class StorePushes:
    """The store half of a layerwise run (the state is the run's)."""

    _lane: LayerLane
    _drv: Driver
    _native: bool
    _job: JobEvents | None
    _held: Held | None
    _spans: list[JobEvents]
    _first: int | None
    _has_start: bool
    _finished: bool
    _store: bool
    _pushed: bytearray
    _errors: list[BaseException | None]
    _deps: list[Any]
    _lock: threading.Lock
    _changed: threading.Condition
    num_layers: int
    completion: Any

    # The run's own (``layers``, ``layer_issue``).
    _emit: Callable[[Any, int], None]
    _layer_rows: Callable[..., None]
    _mark: Callable[[range | list[int]], None]
    _attach: Callable[[list[int], Any, list[int]], None]
    _end_behind: Callable[[JobEvents], None]

    def push(self, layer: int, dependency: Any) -> bool:
        dep: Dependency | None = dependency
        self._pushed[layer] = 1
        if self._native:
            return self._submit_push(layer, dep)
        issuer = self._lane.issuer
        if issuer is None:
            return self._issue_push(layer, dep)
        try:
            if dep is not None and dep.pending:
                self._drv.ensure_context()
                dep.resolve(self._drv)  # on the caller's thread: its stream as it stands now
        except Exception as exc:
            return self._push_failed(layer, exc, dep)

        def issue() -> None:
            self._issue_push(layer, dep)  # a failure is the layer's (``_push_failed``)

        issuer.run(issue, defer=False)
        return True

    def _start_row(self, rows: Rows, layer: int, main: int) -> None:
        """The layer's start: the job's (and the timeline's origin) for the first push,
        else the layer's own timing pair's."""
        assert self._job is not None
        if not self._has_start:
            rows.record(int(self._job.start), main)  # also this layer's start
            if self._held is not None:
                rows.record(int(self._held.origin), main)
            self._first, self._has_start = layer, True
        else:
            rows.record(int(self._spans[layer].start), main)

    def _submit_push(self, layer: int, dep: Dependency | None) -> bool:
        """The native path: the dependency recorded on the caller's stream now, the layer's
        program handed to the lane's issuer; never waits (module doc)."""
        lane, drv = self._lane, self._drv
        rec, native = lane.recorder, lane.native
        assert rec is not None and native is not None
        main = int(lane.stream)
        first = not self._has_start
        try:
            drv.check_usable()
            if dep is not None and dep.pending:
                drv.ensure_context()
                dep.resolve(drv)
            rows = Rows()
            if dep is not None:
                rows.wait(main, int(dep.event))
            self._start_row(rows, layer, main)
            self._layer_rows(rows, [layer], sliced=True)
            ticket = native.submit(rows.words(), tuple(rows.buffers), rec.main, rec.rescue, 0, False,
                                   self._held is not None)
        except BaseException as exc:
            if first:
                self._first, self._has_start = None, False
            self._push_failed(layer, exc, dep)
            if not isinstance(exc, Exception):
                raise
            return False
        if dep is not None:
            self._deps.append(dep.event)  # back once the job ended: its wait was issued by then
        self._attach([layer], ticket, [rows.records[layer] + 1])
        lane.last_started_at = time.perf_counter()
        return True

    def _issue_push(self, layer: int, dep: Dependency | None) -> bool:
        """The Python path: one layer of a store, the wait on its producer, its copies,
        its event."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        main = lane.stream
        try:
            drv.ensure_context()
            drv.check_usable()
            if dep is not None:
                dep.resolve(drv)
                drv.stream_wait(main, dep.event)
            if not self._has_start:
                drv.record(self._job.start, main)  # also this layer's start
                if self._held is not None:
                    drv.record(self._held.origin, main)
            else:
                drv.record(self._spans[layer].start, main)
            self._emit(drv, layer)
        except BaseException as exc:
            self._push_failed(layer, exc, dep)
            if not isinstance(exc, Exception):
                raise
            return False
        if dep is not None:
            drv.give_sync_event(dep.event)
        with self._changed:
            if not self._has_start:
                self._first = layer
            self._has_start = True
        self._mark([layer])
        lane.last_started_at = time.perf_counter()
        return True

    def fail(self, layer: int, error: BaseException) -> None:
        self._pushed[layer] = 1
        self._push_failed(layer, error, None)

    def _push_failed(self, layer: int, exc: BaseException, dep: Dependency | None) -> bool:
        if dep is not None and self._drv.broken is None:
            self._drv.give_sync_event(dep.event)
        with self._changed:
            self._errors[layer] = exc
            self._changed.notify_all()
        return False

    def finish(self, error: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        with self._changed:
            for i in range(self.num_layers):
                # Not "not recorded": a push still queued on an issuer is recorded after
                # this, and before the end ``_end_store`` records behind it.
                if not self._pushed[i] and self._errors[i] is None:
                    self._errors[i] = error or WorkerClosed("the store ended before this layer was pushed")
            self._changed.notify_all()
        issuer = self._lane.issuer
        if issuer is None:
            self._end_store()
        else:
            issuer.run(self._end_store, defer=False)

    def _end_store(self) -> None:
        """Record the store's end behind its pushed layers; it fails if any layer did (a
        push whose program fails on the native issuer is found once the job ends)."""
        assert self._job is not None
        error = next((e for e in self._errors if e is not None), None)
        lane = self._lane
        if self._native:
            rec, native = lane.recorder, lane.native
            assert rec is not None and native is not None
            main = int(lane.stream)
            rows = Rows()
            rows.record(int(self._job.stop), main)
            try:
                ticket = native.submit(rows.words(), (), rec.main, rec.rescue, int(self._job.stop), False)
            except Exception as exc:  # the lane closed: its issuer ran or cancelled the pushes
                error = error or exc
            else:
                lane.last_ticket = ticket
                self.completion.attach(ticket, time.perf_counter(), error)
                return
        try:
            self._drv.ensure_context()
        except Exception:
            pass
        self._end_behind(self._job)
        self.completion.mark_issued(time.perf_counter(), error)

    def copy_time(self, drv: Driver, job: JobEvents) -> float | None:
        """Seconds the copies took on the device (the job landed): a load's from its start
        to its end; a store's summed over its layers, each from its start to its event, so
        the time the stream waited for the forward between pushes is not counted."""
        if not self._store:
            return drv.elapsed(job.start, job.stop)
        spans = self._spans
        if not spans:
            return None  # given back already: the time is lost, never misreported
        try:
            total = 0.0
            for layer, span in enumerate(spans):
                seconds = drv.elapsed(job.start if layer == self._first else span.start, span.stop)
                if seconds is None:
                    return None
                total += seconds
            return total
        finally:
            if drv.broken is None:
                self._give_spans()

    def _give_spans(self) -> None:
        with self._lock:
            spans, self._spans = self._spans, []
        for span in spans:
            self._drv.give_job_events(span)
