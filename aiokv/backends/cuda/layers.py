"""Layerwise jobs on a CUDA lane: one event per layer, recorded on the lane's main stream
behind that layer's copies.

A load's submit enqueues only its first layers (as many as fit ``INLINE_ISSUE_US`` of
estimated driver time, at least one) behind the wait on its dependency and the job's
start: one native call where the lane has the helper. The rest go from the lane's issuer
thread a layer at a time, each marked enqueued as soon as its event's record is, and the
job's end behind the last. So the submit returns within about one layer's enqueue and the
forward pass starts while later layers are still being handed to the device. A layer is
a few driver operations (``layer_ops``: pitched runs and one batched call), never
thousands of descriptors. A store is enqueued a layer at a time as the forward pass pushes
it: each push is one call of its own (the wait on the producer, the layer's copies, its
event), and the job's end is recorded behind the last layer.

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
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ...doorbell import Doorbell
from ...errors import WorkerClosed
from ...layer_plan import LayerPlan
from ...layer_timeline import LayerTimeline
from ...specs import Direction
from ..base import LayerRun, StallMeter
from .completion import CudaCompletion
from .driver import Driver, JobEvents
from .issuer import Issuer
from .layer_clock import Held, read_gate
from .layer_ops import US_PER_CALL, LayerOps, fold_layers, prefer_staged, worth_staging
from .layer_staging import LayerStaging, TorchSlot
from .pieces import PieceKernel
from .program import Recorder
from .strategy import CopyContext

__all__ = ["INLINE_ISSUE_US", "CudaLayerRun", "LayerLane", "head_layers", "layer_ops"]

# A load's submit enqueues its first layers itself, the rest go from the lane's issuer
# thread. It always spends this much estimated driver time (host microseconds), and at least
# layer 0, so the forward pass never waits on a thread hand-off for its first layer; and it
# goes on, up to INLINE_MAX_US, until the layers enqueued keep the copy engine busy for
# INLINE_COVER_S at INLINE_COVER_GBPS: the issuer thread must take the GIL from the forward
# pass's thread first, which can take a switch interval (docs/layerwise.md, "Loads").
INLINE_ISSUE_US = 100.0
INLINE_MAX_US = 400.0
INLINE_COVER_S = 5e-3
INLINE_COVER_GBPS = 50.0

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
    layer_staging: Any  # a ``LayerStaging``, made on first use by ``layer_ops``

    @property
    def driver(self) -> Driver: ...
    @property
    def recorder(self) -> Recorder | None: ...
    @property
    def issuer(self) -> Issuer | None: ...
    @property
    def context(self) -> CopyContext: ...
    def layer_issuer(self) -> Issuer: ...


def layer_ops(lane: LayerLane, plan: LayerPlan) -> LayerOps:
    """The plan's copies in the lane's direction: folded into pitched runs straight to the
    pages where the driver has 2-D batches (``layer_ops.fold_layers``), or through the
    lane's device slot where those would be many (``layer_staging``, ``prefer_staged``)."""
    ctx = lane.context
    drv = ctx.driver
    pitched = bool(getattr(drv, "pitched_copies", False))
    ops = fold_layers(plan, plan.bounds, ctx.device_base, ctx.host_base, to_host=ctx.to_host,
                      max_pitch=int(getattr(drv, "max_pitch", 0)) if pitched else 0)
    if not pitched:
        return ops
    ops = ops.with_packed(drv.pitched_ops)
    staging = _staging(lane, plan) if worth_staging(ops) else None
    if staging is not None:
        staged = staging.plan(plan, lane.stream, drv.pitched_ops, ctx.to_host)
        if staged is not None and prefer_staged(ops, staged):
            return ops.with_staged(staged)
    return ops


def _staging(lane: LayerLane, plan: LayerPlan) -> LayerStaging | None:
    """The lane's device slot for staged layers, made on first use (None: no staging)."""
    staging = lane.layer_staging
    if staging is None:
        ctx = lane.context
        slot = int(getattr(ctx, "staging_bytes", 0)) // 2
        if slot <= 0:
            return None
        kernel: list[Any] = []

        def make_kernel() -> Any:
            # On the driver itself: the table's upload runs on the submitting thread, while
            # the issuer thread may hold the lane's recorder; launches go through the
            # recorder as the layer is enqueued (``LayerStaging.emit``).
            kernel.append(PieceKernel(lane.driver, ctx.device))
            return kernel[0]

        staging = lane.layer_staging = LayerStaging(
            ctx.layout, plan.layer_map, ctx.device_base, ctx.host_base, slot, make_kernel,
            TorchSlot(ctx.device, lambda stream: kernel[0].torch_stream(stream)))
    return staging if staging.shape is not None else None


def head_layers(ops: LayerOps, layer_bytes: Sequence[int]) -> int:
    """How many layers, from layer 0, a load's submit enqueues itself (see
    ``INLINE_ISSUE_US``): at least one."""
    spent = 2 * US_PER_CALL  # the job's start, and the wait on its dependency
    covered = 0.0  # seconds of copies enqueued so far, at INLINE_COVER_GBPS
    for layer in range(ops.num_layers):
        spent += ops.cost_us(layer)
        if spent > INLINE_ISSUE_US and (spent > INLINE_MAX_US or covered >= INLINE_COVER_S):
            return max(1, layer)
        covered += layer_bytes[layer] / (INLINE_COVER_GBPS * 1e9)
    return ops.num_layers


def _layer_bytes(plan: LayerPlan) -> list[int]:
    total = np.concatenate(([0], np.cumsum(plan.nbytes, dtype=np.int64)))
    cuts = np.asarray(plan.bounds, dtype=np.int64)
    return (total[cuts[1:]] - total[cuts[:-1]]).tolist()


class _RunEnd(CudaCompletion):
    """A layerwise job's end: once seen, every layer is final and its events go back."""

    __slots__ = ("_run",)

    def __init__(self, run: CudaLayerRun, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run = run

    def _finish(self, error: BaseException | None) -> None:
        super()._finish(error)
        self._run._ended(landed=error is None)


class CudaLayerRun(LayerRun):
    """One layerwise job's events on a lane (see the module doc)."""

    def __init__(self, lane: LayerLane, plan: LayerPlan, store: bool) -> None:
        drv = lane.driver
        self._lane = lane
        self._drv: Driver = drv
        self._store = store
        self.measures_gates = lane.measure_stalls
        self.num_layers = n = plan.num_layers
        self._ops = layer_ops(lane, plan)  # host work, before anything is taken
        self._head = n if store else head_layers(self._ops, _layer_bytes(plan))
        self._held = Held(drv) if lane.measure_stalls else None
        self._events: list[Any] = []
        self._job: JobEvents | None = None
        take = drv.take_timing_event if self._held is not None else drv.take_sync_event
        try:
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
        """Enqueue the first layers (all of them on the issuer thread) as one native call
        where the lane has the helper, and hand the rest to the issuer thread. Raises
        (nothing enqueued, or a sticky error) on the caller's thread; otherwise a failure is
        the job's and the layers whose records were not reached."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        ev, main, rec = self._job, lane.stream, lane.recorder
        count = self.num_layers if on_issuer else self._head
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
                    target.record(self._job.start, main)
                    if self._held is not None:
                        target.record(self._held.origin, main)
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

    # -- waiting ------------------------------------------------------------------------

    def _ended(self, landed: bool) -> None:
        """The job's end was seen (``landed``: its event completed, so every layer recorded
        before it did too): every layer is final; their events go back (a measured run's
        once its timeline is read)."""
        with self._changed:
            self._landed = self._landed or landed
            self._over = True
            events, self._events = self._events, []
            self._changed.notify_all()
        if self._held is not None:
            self._held.keep(events, landed and self.abandoned is None)
        elif self._drv.broken is None and self.abandoned is None:
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
