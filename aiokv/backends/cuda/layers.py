"""Layerwise jobs on a CUDA lane: one event per layer, recorded on the lane's main stream
behind that layer's copies.

A load's submit enqueues its first layers itself (``head_layers``: always some 100 us of
estimated driver time and at least layer 0, more until about 5 ms of copies are queued)
behind the wait on its dependency and the job's start: one native call where the lane has
the helper. The rest go from the lane's issuer thread a layer at a time, each marked
enqueued as soon as its event's record is, and the job's end behind the last. So the
forward pass starts while later layers are still being handed to the device. A layer is a
few driver operations (``layer_ops``: pitched runs and one batched call, or 2-D copies
through a device slot), never thousands of descriptors. A store is enqueued a layer at a
time as the forward pass pushes it: each push is one call of its own (the wait on the
producer, the layer's copies, its event), and the job's end is recorded behind the last
layer. A store's layer events are timing pairs bracketing the layer's copies, so its
``transfer_time`` sums the copies and leaves out the time the stream waited for the
forward between pushes.

Copies go on the lane's main stream whatever the lane's strategy: the staged strategy
gathers a job across layers and the kernel strategy moves pages with torch ops, neither of
which marks one layer's end; one stream keeps the layers in order, so layer 0 lands first
(docs/layerwise.md, "On CUDA").

A wait on an event never recorded passes at once in CUDA, so nothing here waits on,
queries or arms a layer's event before its record is enqueued (``_recorded``): a gate on a
layer still with the issuer thread blocks until it is issued; the core never gates a store
layer not pushed.

With ``layer_stalls`` the layers' events are timing events, a gate marks the consumer's
arrival on its stream (before it blocks for an issue) and its going on, and ``timeline()``
gives the job's ``LayerTimeline`` in device time (``layer_clock``).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any

from ...doorbell import Doorbell
from ...layer_plan import LayerPlan
from ...layer_timeline import LayerTimeline
from ..base import LayerRun, StallMeter
from .completion import CudaCompletion
from .driver import Driver, JobEvents
from .layer_clock import Held, read_gate
from .layer_copies import Dependency, LayerLane, head_layers, layer_bytes, layer_ops
from .layer_pushes import StorePushes

__all__ = ["CudaLayerRun", "LayerLane"]

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


class CudaLayerRun(StorePushes, LayerRun):
    """One layerwise job's events on a lane (see the module doc)."""

    def __init__(self, lane: LayerLane, plan: LayerPlan, store: bool) -> None:
        drv = lane.driver
        self._lane = lane
        self._drv: Driver = drv
        self._store = store
        self.measures_gates = lane.measure_stalls
        self.num_layers = n = plan.num_layers
        self._ops = layer_ops(lane, plan)  # host work, before anything is taken
        self._head = n if store else head_layers(self._ops, layer_bytes(plan))
        self._held = Held(drv) if lane.measure_stalls else None
        self._events: list[Any] = []
        # A store's layers: a timing pair each, its stop being the layer's event (the first
        # pushed layer's copies start at the job's start instead).
        self._spans: list[JobEvents] = []
        self._first: int | None = None
        self._job: JobEvents | None = None
        take = drv.take_timing_event if self._held is not None else drv.take_sync_event
        try:
            if store:
                self._spans = [drv.take_job_events() for _ in range(n)]
                self._events = [span.stop for span in self._spans]
            else:
                self._events = [take() for _ in range(n)]
            if self._held is not None:
                self._held.origin = drv.take_timing_event()
            self._job = drv.take_job_events()
        except BaseException:
            self.give_back()
            raise
        if self._held is not None:  # the timing events outlive the job until read
            weakref.finalize(self, self._held.release)
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
        self._submitted = time.perf_counter()
        self._issued_at: list[float | None] = [None] * n  # host seconds after the submit
        self._blocked = [0.0] * n
        self._meter: StallMeter | None = None
        self._timeline: LayerTimeline | None = None
        later = store or lane.issuer is not None or self._head < n
        self.completion: _RunEnd = _RunEnd(self, drv, self._job, None, lane.bell_stream,
                                           issued_later=later, waiter=lane.waiter)

    @property
    def head(self) -> int:
        """Layers a load's submit enqueues itself; the rest go from the issuer thread."""
        return self._head

    def layer_descriptors(self, layer: int) -> int:
        """Driver operations (descriptors and pitched ops) of layer ``layer``'s copies."""
        return self._ops.descriptors(layer)

    # -- enqueueing ---------------------------------------------------------------------

    def give_back(self) -> None:
        """Nothing of the job was enqueued: its events go back."""
        drv = self._drv
        if self._spans:
            self._give_spans()
        else:
            for event in self._events:
                (drv.give_timing_event if self._held is not None else drv.give_sync_event)(event)
        if self._job is not None:
            drv.give_job_events(self._job)
        if self._held is not None:
            self._held.release()
        self._events, self._job = [], None

    def _emit(self, target: Any, layer: int) -> None:
        """Layer ``layer``'s copies and its event's record on the main stream, through
        ``target`` (the driver, or the lane's recorder while a program is open)."""
        ops, main = self._ops, self._lane.stream
        if ops.staged is not None:
            self._lane.layer_staging.emit(target, ops.staged, layer, main, self._lane.direction.to_host)
            target.record(self._events[layer], main)
            return
        lo, hi = int(ops.pbounds[layer]), int(ops.pbounds[layer + 1])
        if hi > lo and ops.packed is not None:
            target.memcpy_pitched(ops.packed[lo:hi], main)
        lo, hi = int(ops.bounds[layer]), int(ops.bounds[layer + 1])
        if hi > lo:
            target.memcpy_batch(ops.dst[lo:hi], ops.src[lo:hi], ops.sizes[lo:hi], main,
                                to_host=self._lane.direction.to_host)
        target.record(self._events[layer], main)

    def _mark(self, layers: range | list[int]) -> None:
        """These layers' records are enqueued: gates and waits on them may go ahead."""
        now = time.perf_counter() - self._submitted
        with self._changed:
            for i in layers:
                self._recorded[i] = 1
                self._issued_at[i] = now
            self._changed.notify_all()

    def issue_load(self, dep: Dependency | None, on_issuer: bool) -> None:
        """Enqueue the first layers as one native call where the lane has the helper, then
        the rest a layer at a time from the issuer thread: handed to it from the caller's
        thread, or right here on it (a job queued behind other work), so each layer is
        marked as it is enqueued rather than once the whole job is. Raises (nothing
        enqueued, or a sticky error) on the caller's thread; otherwise a failure is the
        job's and the layers whose records were not reached."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        ev, main, rec = self._job, lane.stream, lane.recorder
        count = self._head
        last = count == self.num_layers
        error: BaseException | None = None
        recorded: list[int] = []
        rows: list[int] = []
        enqueuing = False
        started = time.perf_counter()
        try:
            drv.ensure_context()
            drv.check_usable()
            target: Any = drv if rec is None else rec
            if rec is not None:
                rec.open()
            enqueuing = rec is None
            try:
                if dep is not None:
                    dep.resolve(target)
                    target.stream_wait(main, dep.event)
                target.record(ev.start, main)
                if self._held is not None:
                    target.record(self._held.origin, main)
                for layer in range(count):
                    self._emit(target, layer)
                    if rec is None:
                        recorded.append(layer)
                        if on_issuer:
                            self._mark([layer])
                    elif rec.program is not None:
                        rows.append(len(rec.program) - 1)
                if last:
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
                recorded = list(range(count))
        except BaseException as exc:
            if rec is not None and rec.failed_row is not None:
                recorded = [i for i, row in enumerate(rows) if row < rec.failed_row]
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
        self._mark(recorded)
        lane.last_started_at = started
        if error is not None or last:
            self._settle_issue(started, error)
            return
        if on_issuer:  # in the lane's order already: nothing queued after it may go first
            self._issue_tail(count, started)
            return
        tail = functools.partial(self._issue_tail, count, started)
        try:
            lane.layer_issuer().run(tail, defer=True)
        except Exception:  # no thread to hand them to (closed, or none could start): here then
            tail()

    def _issue_tail(self, first: int, started: float) -> None:
        """On the issuer thread: layers ``first..`` one call each, each marked as it is
        enqueued, then the job's end. A failure fails the layers not reached."""
        lane, drv, rec = self._lane, self._drv, self._lane.recorder
        assert self._job is not None
        error: BaseException | None = None
        try:
            drv.ensure_context()
            last = self.num_layers - 1
            for layer in range(first, self.num_layers):
                drv.check_usable()
                target: Any = drv if rec is None else rec
                if rec is not None:
                    rec.open()
                try:
                    self._emit(target, layer)
                    if layer == last:
                        target.record(self._job.stop, lane.stream)
                except BaseException:
                    if rec is not None:
                        rec.abort()
                    raise
                if rec is not None:
                    rec.commit()
                self._mark([layer])
        except BaseException as exc:  # on the issuer thread: the job's failure, never raised
            error = exc
            self._end_behind(self._job)
        self._settle_issue(started, error)

    def _settle_issue(self, started: float, error: BaseException | None) -> None:
        """The load's enqueue is over: layers not recorded fail with ``error``."""
        with self._changed:
            if error is not None:
                for i in range(self.num_layers):
                    if not self._recorded[i]:
                        self._errors[i] = error
            self._issued = True
            self._changed.notify_all()
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

    # -- waiting ------------------------------------------------------------------------

    def _ended(self, landed: bool, timed: bool = False) -> None:
        """The job's end was seen (``landed``: its event completed, so every layer recorded
        before it did too): every layer is final; their events go back (a measured run's
        once its timeline is read)."""
        with self._changed:
            self._landed = self._landed or landed
            self._over = True
            events, self._events = self._events, []
            self._changed.notify_all()
        if self._drv.broken is not None or self.abandoned is not None:
            return  # copies may still run: nothing goes back to the pools
        if self._spans:  # a store's layer events are its timing pairs' (``copy_time``)
            if self._held is not None:
                self._held.keep([], landed=False, recorded=b"")
            if not timed:
                self._give_spans()  # no time to read (a timed store's: ``copy_time``)
            return
        if self._held is not None:
            self._held.keep(events, landed, bytes(self._recorded))
            return
        for event in events:
            self._drv.give_sync_event(event)

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
        drv = self._drv
        pair = self._arrive(consumer, meter) if self.measures_gates else None
        if not self._recorded[layer] and (not self._store or self._pushed[layer]):
            began = time.perf_counter()
            self._wait_recorded(layer, None)  # its enqueue is still with the issuer thread
            self._blocked[layer] += time.perf_counter() - began
        if ((self.abandoned is not None and not self._seen[layer]) or self._errors[layer] is not None
                or not self._recorded[layer]):
            self._forget(pair)
            return False
        with self._lock:
            try:
                drv.ensure_context()
                done = bool(self._seen[layer] or self._over)
                if not done and drv.query(self._events[layer]):
                    self._seen[layer] = done = True
                if not done:
                    drv.stream_wait(consumer, self._events[layer])
                if pair is not None:
                    drv.record(pair.stop, consumer)
                    self._meter = meter
                    meter.later(functools.partial(read_gate, self, layer, pair),
                                functools.partial(self._held_drop, pair))
                    pair = None
            except Exception:
                self._forget(pair)
                return False  # the consumer cannot be ordered after the layer: recompute
        return self.error(layer) is None if done else True

    def _arrive(self, consumer: Any, meter: StallMeter) -> JobEvents | None:
        """A measured gate's first mark: the consumer's stream reached the gate (before
        the gate may block for the layer's issue, so a wait there counts in its stall)."""
        drv = self._drv
        try:
            drv.ensure_context()
            pair = drv.take_job_events()
        except Exception:
            return None
        try:
            drv.record(pair.start, consumer)
        except Exception:
            drv.give_job_events(pair)
            return None
        if self._held is not None:
            self._held.open_gate()
        return pair

    def _forget(self, pair: JobEvents | None) -> None:
        if pair is not None:
            self._held_drop(pair)

    def _held_drop(self, pair: JobEvents) -> None:
        if self._drv.broken is None:
            self._drv.give_job_events(pair)
        if self._held is not None:
            self._held.close_gate()

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

    # -- the timeline ---------------------------------------------------------------------

    def timeline(self) -> LayerTimeline | None:
        held = self._held
        if self._timeline is not None or held is None:
            return self._timeline
        if not self.completion.query():
            return None
        if self._meter is not None:
            self._meter.collect()
        done = held.copy_done(self.num_layers)
        if done is None:
            return None  # a gate's second mark has not run on its stream yet
        self._timeline = LayerTimeline(
            clock="device", copy_done=tuple(done), reached=tuple(held.reached(self.num_layers)),
            started=tuple(held.started(self.num_layers)), issued=tuple(self._issued_at),
            blocked=tuple(self._blocked))
        held.release()
        return self._timeline
