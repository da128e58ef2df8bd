"""Layerwise jobs on a CUDA lane: one event per layer, recorded on the lane's main stream
behind that layer's copies.

A load is one enqueue, one native call on the native path: the wait on its dependency, the
job's start, then per layer one batched copy and the layer's event (``issue_layers``, which
builds those rows with numpy whatever the number of layers), then the job's end. No host
work sits between two layers. A store is enqueued a layer at a time as the forward pass
pushes it: each push is one call of its own (the wait on the producer, the layer's batched
copy, its event), and the job's end is recorded behind the last layer. A store's layer
events are timing pairs bracketing the layer's copies, so its ``transfer_time`` sums the
copies and leaves out the time the stream waited for the forward between pushes.

Copies go as batched DMA on the lane's main stream whatever the lane's strategy: the staged
strategy gathers a job across layers and the kernel strategy moves pages with torch ops,
neither of which marks one layer's end; one stream keeps the layers in order, so layer 0
lands first (docs/layerwise.md, "On CUDA").

A wait on an event never recorded passes at once in CUDA, so nothing here waits on,
queries or arms a layer's event before its record is enqueued (``_recorded``): a gate on a
load still with the issuer thread blocks until it is issued; the core never gates a store
layer not pushed.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Protocol

import numpy as np

from ...doorbell import Doorbell
from ...errors import WorkerClosed
from ...layer_plan import LayerPlan
from ...specs import Direction
from ..base import LayerRun, StallMeter
from .completion import CudaCompletion
from .driver import Driver, JobEvents
from .issuer import Issuer
from .program import Recorder, issue_layers

__all__ = ["CudaLayerRun", "LayerLane"]

# A captured dependency (``lane.Dependency``: ``event``, ``pending``, ``resolve(driver)``).
Dependency = Any


class LayerLane(Protocol):
    """What a layerwise run uses of its lane (``lane.CudaLane``)."""

    direction: Direction
    stream: Any
    bell_stream: Any
    waiter: Any
    measure_stalls: bool
    last_started_at: float | None

    @property
    def driver(self) -> Driver: ...
    @property
    def recorder(self) -> Recorder | None: ...
    @property
    def issuer(self) -> Issuer | None: ...
    def pointers(self, plan: LayerPlan) -> tuple[Any, Any, Any]: ...


class _RunEnd(CudaCompletion):
    """A layerwise job's end: once seen, every layer is final and its events go back."""

    __slots__ = ("_run",)

    def __init__(self, run: CudaLayerRun, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run = run

    def _finish(self, error: BaseException | None) -> None:
        super()._finish(error)
        # Timed (``settle`` reads the layers' pairs) only once the whole job succeeded.
        self._run._ended(landed=error is None, timed=self._error is None)

    def _device_time(self, drv: Driver, events: JobEvents) -> float | None:
        return self._run.copy_time(drv, events)


class CudaLayerRun(LayerRun):
    """One layerwise job's events on a lane (see the module doc)."""

    def __init__(self, lane: LayerLane, plan: LayerPlan, store: bool) -> None:
        drv = lane.driver
        self._lane = lane
        self._drv: Driver = drv
        self._store = store
        self.measures_gates = lane.measure_stalls
        self.num_layers = n = plan.num_layers
        self._bounds = plan.bounds
        self._pointers = lane.pointers(plan)  # host work, before anything is taken
        self._events: list[Any] = []
        # A store's layers: a timing pair each, its stop being the layer's event (the first
        # pushed layer's copies start at the job's start instead).
        self._spans: list[JobEvents] = []
        self._first: int | None = None
        self._job: JobEvents | None = None
        try:
            if store:
                self._spans = [drv.take_job_events() for _ in range(n)]
                self._events = [span.stop for span in self._spans]
            else:
                self._events = [drv.take_sync_event() for _ in range(n)]
            self._job = drv.take_job_events()
        except BaseException:
            self.give_back()
            raise
        self._recorded = bytearray(n)
        self._pushed = bytearray(n)  # a store layer handed to ``push`` (its record may be to come)
        self._seen = bytearray(n)  # a query found the layer done
        self._errors: list[BaseException | None] = [None] * n
        self._lock = threading.Lock()  # a driver call on a layer event vs their return to the pool
        self._changed = threading.Condition(self._lock)
        self._issued = False  # a load: its enqueue was made (or failed)
        self._has_start = False
        self._finished = False
        self._over = False  # the job's end was seen: layer events back in the pool
        self._landed = False  # ... and its event completed: every recorded layer landed
        self.completion: _RunEnd = _RunEnd(self, drv, self._job, None, lane.bell_stream,
                                           issued_later=store or lane.issuer is not None, waiter=lane.waiter)

    # -- enqueueing ---------------------------------------------------------------------

    def give_back(self) -> None:
        """Nothing of the job was enqueued: its events go back."""
        if self._spans:
            self._give_spans()
        else:
            for event in self._events:
                self._drv.give_sync_event(event)
        if self._job is not None:
            self._drv.give_job_events(self._job)
        self._events, self._job = [], None

    def issue_load(self, dep: Dependency | None, on_issuer: bool) -> None:
        """Enqueue every layer, as one native call where the lane has the helper. Raises
        (nothing enqueued, or a sticky error) on the caller's thread; otherwise a failure
        is the job's and the layers whose records were not reached."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        ev, main, rec = self._job, lane.stream, lane.recorder
        error: BaseException | None = None
        recorded: list[int] = []
        rows: np.ndarray | None = None
        enqueuing = False
        started = time.perf_counter()
        try:
            drv.ensure_context()
            drv.check_usable()
            dst, src, sizes = self._pointers
            target: Any = drv if rec is None else rec
            if rec is not None:
                rec.open()
            enqueuing = rec is None
            try:
                if dep is not None:
                    dep.resolve(target)
                    target.stream_wait(main, dep.event)
                target.record(ev.start, main)
                rows = issue_layers(target, main, dst, src, sizes, self._bounds, self._events,
                                    to_host=lane.direction.to_host, recorded=recorded)
                target.record(ev.stop, main)
            except BaseException:
                if rec is not None:
                    rec.abort()  # enqueues what was recorded, as the Python path would have
                    enqueuing = rec.ran
                raise
            if rec is not None:
                try:
                    rec.commit()
                finally:
                    enqueuing = rec.ran
                recorded = list(range(self.num_layers))
        except BaseException as exc:
            if rec is not None and rows is not None and rec.failed_row is not None:
                recorded = [i for i, row in enumerate(rows.tolist()) if row < rec.failed_row]
            if not on_issuer and (not enqueuing or drv.broken is not None):
                if drv.broken is None:
                    self.give_back()
                if dep is not None:
                    drv.give_sync_event(dep.event)
                if drv.broken is not None and drv.broken is not exc:
                    raise drv.broken from exc
                raise
            if not on_issuer and not isinstance(exc, Exception):
                raise
            error = exc
            self._end_behind(ev)
        if dep is not None:
            drv.give_sync_event(dep.event)
        with self._changed:
            for i in recorded:
                self._recorded[i] = 1
            if error is not None:
                for i in range(self.num_layers):
                    if not self._recorded[i]:
                        self._errors[i] = error
            self._issued = True
            self._changed.notify_all()
        lane.last_started_at = started
        self.completion.mark_issued(started, error)

    def _end_behind(self, ev: JobEvents) -> None:
        """Record the job's end behind what part of it was enqueued (or, where even that
        fails, wait the stream out), so a failure is not reported while copies still run."""
        drv, main = self._drv, self._lane.stream
        if drv.broken is not None:
            return
        try:
            drv.record(ev.stop, main)
        except Exception:
            try:
                drv.stream_synchronize(main)
            except Exception:
                pass  # a broken context fails every job anyway

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
        """One layer of a store: the wait on its producer, its batched copy, its event; one
        native call where the lane has the helper."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        main, rec = lane.stream, lane.recorder
        lo, hi = int(self._bounds[layer]), int(self._bounds[layer + 1])
        dst, src, sizes = self._pointers
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
                else:
                    target.record(self._spans[layer].start, main)
                issue_layers(target, main, dst[lo:hi], src[lo:hi], sizes[lo:hi], [0, hi - lo],
                             [self._events[layer]], to_host=lane.direction.to_host)
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
            self._recorded[layer] = 1
            self._changed.notify_all()
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

    # -- waiting ------------------------------------------------------------------------

    def _ended(self, landed: bool, timed: bool = False) -> None:
        """The job's end was seen (``landed``: its event completed, so every layer recorded
        before it did too): every layer is final; their events go back."""
        with self._changed:
            self._landed = self._landed or landed
            self._over = True
            events, self._events = self._events, []
            self._changed.notify_all()
        if self._drv.broken is None and self.abandoned is None:
            if self._spans:
                if not timed:
                    self._give_spans()  # no time to read (a timed store's: ``copy_time``)
                return
            for event in events:
                self._drv.give_sync_event(event)

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

    def query(self, layer: int) -> bool:
        if self._errors[layer] is not None or self._seen[layer] or self._over:
            return True
        if not self._recorded[layer]:
            return False
        with self._lock:
            if self._over:
                return True
            try:
                self._drv.ensure_context()
                done = self._drv.query(self._events[layer])
            except Exception as exc:
                self._errors[layer] = exc
                return True
        if done:
            self._seen[layer] = 1
        return done

    def error(self, layer: int) -> BaseException | None:
        error = self._errors[layer]
        if error is not None or self._seen[layer]:
            return error
        if self._over:
            return None if self._landed else self.completion.error
        return self.abandoned

    def _wait_recorded(self, layer: int, timeout: float | None) -> bool:
        """Until the layer's record is enqueued, or it can never be (failed, ended)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: bool(self._recorded[layer]) or self._errors[layer] is not None or self._over
                or self.abandoned is not None or (self._issued and not self._store), timeout)

    def enqueued(self, layer: int) -> bool:
        """Whether the layer's record is enqueued. A store layer pushed to a lane whose
        issuer thread still holds the push counts: a gate waits for its record."""
        return bool(self._recorded[layer] or (self._store and self._pushed[layer]))

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait_recorded(layer, timeout):
            return False
        pause = 20e-6
        while not self.query(layer):
            if self.abandoned is not None or (deadline is not None and time.monotonic() >= deadline):
                return False
            if not self._recorded[layer]:  # an issued load whose layer never was
                return True
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def gate(self, layer: int, consumer: Any, meter: StallMeter) -> bool:
        if not self._recorded[layer] and (not self._store or self._pushed[layer]):
            self._wait_recorded(layer, None)  # its enqueue is still with the issuer thread
        if self.abandoned is not None and not self._seen[layer]:
            return False
        if self._errors[layer] is not None or not self._recorded[layer]:
            return False
        drv = self._drv
        with self._lock:
            if self._seen[layer] or self._over:
                if self.measures_gates:
                    meter.add(0.0)
                return self.error(layer) is None
            try:
                drv.ensure_context()
                if drv.query(self._events[layer]):
                    self._seen[layer] = 1
                    if self.measures_gates:
                        meter.add(0.0)
                    return True
                pair = drv.take_job_events() if self._lane.measure_stalls else None
                if pair is not None:
                    drv.record(pair.start, consumer)
                drv.stream_wait(consumer, self._events[layer])
                if pair is not None:
                    drv.record(pair.stop, consumer)
                    meter.later(functools.partial(_read_stall, drv, pair),
                                functools.partial(drv.give_job_events, pair))
            except Exception:
                return False  # the consumer cannot be ordered after the layer: recompute
        return True

    def ring_when_done(self, layer: int, bell: Doorbell) -> bool:
        if not self._recorded[layer]:
            return False
        with self._lock:
            if self._over or self._seen[layer] or self._errors[layer] is not None:
                bell.ring()
                return True
            event = self._events[layer]
            waiter = self._lane.waiter
            try:
                if waiter is not None and bell.ring_fd() >= 0 and waiter.watch(event, bell.ring_fd()) == 0:
                    return True
                return self._drv.ring_after(self._lane.bell_stream, event, bell)
            except Exception:
                return False

    def abandon(self, error: BaseException) -> None:
        with self._changed:
            self.abandoned = error
            self._changed.notify_all()


def _read_stall(drv: Driver, pair: JobEvents) -> tuple[bool, float | None]:
    """A gate's stall: device time between its two events on the consumer's stream."""
    drv.ensure_context()
    if not drv.query(pair.stop):
        return False, None
    return True, drv.elapsed(pair.start, pair.stop)
