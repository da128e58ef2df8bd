"""A layerwise store's pushes on a CUDA lane, mixed into ``layers.CudaLayerRun``.

A store is enqueued a layer at a time as the forward pass pushes it: each push is one call
of its own (the wait on the producer, the layer's copies, its event), on the lane's issuer
thread where it has one, and the job's end is recorded behind the last layer. Each layer's
event is the stop of a timing pair whose start is recorded before its copies, so the
store's ``transfer_time`` sums its copies and leaves out the time the stream waited for the
forward between pushes (``copy_time``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...errors import WorkerClosed
from .driver import Driver, JobEvents
from .layer_clock import Held
from .layer_copies import Dependency, LayerLane

__all__ = ["StorePushes"]


class StorePushes:
    """The store half of a layerwise run (the state is the run's)."""

    _lane: LayerLane
    _drv: Driver
    _job: JobEvents | None
    _held: Held | None
    _spans: list[JobEvents]
    _first: int | None
    _has_start: bool
    _finished: bool
    _store: bool
    _pushed: bytearray
    _errors: list[BaseException | None]
    _lock: threading.Lock
    _changed: threading.Condition
    num_layers: int
    completion: Any

    def _emit(self, target: Any, layer: int) -> None:
        raise NotImplementedError

    def _mark(self, layers: range | list[int]) -> None:
        raise NotImplementedError

    def _end_behind(self, ev: JobEvents) -> None:
        raise NotImplementedError

    def push(self, layer: int, dependency: Any) -> bool:
        issuer = self._lane.issuer
        dep: Dependency | None = dependency
        self._pushed[layer] = 1
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

    def _issue_push(self, layer: int, dep: Dependency | None) -> bool:
        """One layer of a store: the wait on its producer, its copies, its event; one
        native call where the lane has the helper."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        main, rec = lane.stream, lane.recorder
        try:
            drv.ensure_context()
            drv.check_usable()
            target: Any = drv if rec is None else rec
            if rec is not None:
                rec.open()
            try:
                if dep is not None:
                    dep.resolve(target)
                    target.stream_wait(main, dep.event)
                if not self._has_start:
                    target.record(self._job.start, main)  # also this layer's start
                    if self._held is not None:
                        target.record(self._held.origin, main)
                else:
                    target.record(self._spans[layer].start, main)
                self._emit(target, layer)
            except BaseException:
                if rec is not None:
                    rec.abort()
                raise
            if rec is not None:
                rec.commit()
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
                # Not "not recorded": a push still queued on the issuer thread is recorded
                # after this, and before the end ``_end_store`` records behind it.
                if not self._pushed[i] and self._errors[i] is None:
                    self._errors[i] = error or WorkerClosed("the store ended before this layer was pushed")
            self._changed.notify_all()
        issuer = self._lane.issuer
        if issuer is None:
            self._end_store()
        else:
            issuer.run(self._end_store, defer=False)

    def _end_store(self) -> None:
        """Record the store's end behind its pushed layers; it fails if any layer did."""
        assert self._job is not None
        try:
            self._drv.ensure_context()
        except Exception:
            pass
        self._end_behind(self._job)
        error = next((e for e in self._errors if e is not None), None)
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
