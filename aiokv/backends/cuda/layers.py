"""Layerwise jobs on a CUDA lane: one event per layer, recorded on the lane's main stream
behind that layer's copies.

On the native path a load's submit hands the whole job to the lane's native issuer
thread as one program, its first layer's rows first (``layer_issue``, ``layer_program``),
and returns: layer ``i`` counts as enqueued once the ticket's ``rows_done`` passes the row
of its record. A store's push is one small program of its own, handed over without
waiting (``layer_pushes``). On the Python path a load's submit enqueues its first layers
itself and the lane's issuer thread the rest, each marked as its record is enqueued; a
push is enqueued on the caller's thread. A layer is a few driver operations
(``layer_ops``: pitched runs and one batched call, or 2-D copies through a device slot),
never thousands of descriptors. A store's layer events are timing pairs bracketing the
layer's copies, so its ``transfer_time`` sums the copies and leaves out the time the
stream waited for the forward between pushes.

Copies go on the lane's main stream whatever the lane's strategy: the staged strategy
gathers a job across layers and the kernel strategy moves pages with torch ops, neither of
which marks one layer's end; one stream keeps the layers in order, so layer 0 lands first
(docs/layerwise.md, "On CUDA").

A wait on an event never recorded passes at once in CUDA, so nothing here waits on,
queries or arms a layer's event before its record is enqueued (``_recorded``, or its
ticket's rows): a gate on a layer not enqueued yet blocks until it is (``wait_rows`` on
the native path); the core never gates a store layer not pushed.

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
from .layer_copies import LayerLane, head_layers, layer_bytes, layer_ops
from .layer_issue import LoadIssue
from .layer_pushes import StorePushes

__all__ = ["ABANDON_POLL_S", "CudaLayerRun", "LayerLane"]

# A gate or wait blocked on a native load's ticket looks this often whether the run was
# abandoned (the worker closed): the ticket's wait cannot be signalled from Python.
ABANDON_POLL_S = 0.05


class _RunEnd(CudaCompletion):
    """A layerwise job's end: once seen, every layer is final and its events go back."""

    __slots__ = ("_run",)

    def __init__(self, run: CudaLayerRun, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._run = run

    def _finish(self, error: BaseException | None) -> None:
        landed = error is None  # the end's event completed: every layer recorded landed
        if error is None:  # a store's push whose program failed on the native issuer
            error = self._run.issue_error()
        super()._finish(error)
        # Timed (``settle`` reads the layers' pairs) only once the whole job succeeded.
        self._run._ended(landed=landed, timed=self._error is None)

    def _device_time(self, drv: Driver, events: JobEvents) -> float | None:
        return self._run.copy_time(drv, events)


class CudaLayerRun(StorePushes, LoadIssue, LayerRun):
    """One layerwise job's events on a lane (see the module doc)."""

    def __init__(self, lane: LayerLane, plan: LayerPlan, store: bool) -> None:
        drv = lane.driver
        self._lane = lane
        self._drv: Driver = drv
        self._store = store
        self._native = lane.native is not None
        self.measures_gates = lane.measure_stalls
        self.num_layers = n = plan.num_layers
        self._ops = layer_ops(lane, plan)  # host work, before anything is taken
        self._head = n if store or self._native else head_layers(self._ops, layer_bytes(plan))
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
            elif self._held is None and hasattr(drv, "take_sync_events"):
                self._events = drv.take_sync_events(n)
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
        # The native path: each layer's program (its ticket) and the rows it must have run
        # for the layer's record to be enqueued; and the dependency events its programs
        # wait on, given back once the job has ended (every program of it was issued).
        self._tickets: list[Any] = [None] * n
        self._need = [0] * n
        self._deps: list[Any] = []
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
        later = store or self._native or lane.issuer is not None or self._head < n
        self.completion: _RunEnd = _RunEnd(self, drv, self._job, None, lane.bell_stream,
                                           issued_later=later, waiter=lane.waiter, recorder=lane.recorder,
                                           stream=lane.stream)

    @property
    def head(self) -> int:
        """Layers a load's submit enqueues itself on the Python path (the rest go from the
        issuer thread); on the native path the whole load is one program."""
        return self._head

    def layer_descriptors(self, layer: int) -> int:
        """Driver operations (descriptors and pitched ops) of layer ``layer``'s copies."""
        return self._ops.descriptors(layer)

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

    def _mark(self, layers: range | list[int]) -> None:
        """These layers' records are enqueued: gates and waits on them may go ahead."""
        now = time.perf_counter() - self._submitted
        with self._changed:
            for i in layers:
                self._recorded[i] = 1
                self._issued_at[i] = now
            self._changed.notify_all()

    # -- the native path's tickets -----------------------------------------------------------

    def _attach(self, layers: list[int], ticket: Any, needs: list[int]) -> None:
        """These layers go with ``ticket``: each is enqueued once it ran ``needs[i]`` rows."""
        with self._changed:
            for layer, need in zip(layers, needs):
                self._tickets[layer], self._need[layer] = ticket, need
            self._changed.notify_all()

    def _is_recorded(self, layer: int) -> bool:
        """Whether the layer's record is enqueued (an atomic read of its ticket's rows)."""
        if self._recorded[layer]:
            return True
        ticket = self._tickets[layer]
        if ticket is not None and ticket.rows_done >= self._need[layer]:
            self._recorded[layer] = 1
            return True
        if ticket is not None and ticket.issued:
            self._sync(layer)
        return False

    def _sync(self, layer: int) -> None:
        """A ticket issued short of the layer's record: the layer failed with its error."""
        ticket = self._tickets[layer]
        result = ticket.result() if ticket is not None else None
        if result is None or self._errors[layer] is not None:
            return
        if int(result[0]) >= self._need[layer]:
            self._recorded[layer] = 1
            return
        rec = self._lane.recorder
        error = rec.error_of(result) if rec is not None else None
        with self._changed:
            self._errors[layer] = error or RuntimeError("the layer's copies were never issued")
            self._changed.notify_all()

    def issue_error(self) -> BaseException | None:
        """The first layer's error from an issued program that stopped short of it."""
        for layer, ticket in enumerate(self._tickets):
            if ticket is not None and not self._recorded[layer] and ticket.issued:
                self._sync(layer)
        return next((self._errors[layer] for layer, ticket in enumerate(self._tickets)
                     if ticket is not None and not self._recorded[layer] and self._errors[layer] is not None),
                    None)

    # -- waiting ------------------------------------------------------------------------

    def _ended(self, landed: bool, timed: bool = False) -> None:
        """The job's end was seen (``landed``: its event completed, so every layer recorded
        before it did too): every layer is final; their events go back (a measured run's
        once its timeline is read), and the dependency events its programs waited on."""
        for layer in range(self.num_layers):  # every program of the job was issued by now
            if self._tickets[layer] is not None:
                self._is_recorded(layer)
        with self._changed:
            self._landed = self._landed or landed
            self._over = True
            events, self._events = self._events, []
            deps, self._deps = self._deps, []
            self._changed.notify_all()
        if self._drv.broken is not None or self.abandoned is not None:
            return  # copies may still run: nothing goes back to the pools
        for event in deps:
            self._drv.give_sync_event(event)
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
        if not self._is_recorded(layer):
            return self._errors[layer] is not None
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
        if self._tickets[layer] is not None and not self._recorded[layer]:
            self._is_recorded(layer)
        error = self._errors[layer]
        if error is not None or self._seen[layer]:
            return error
        if self._over:
            return None if self._landed else self.completion.error
        return self.abandoned

    def _wait_recorded(self, layer: int, timeout: float | None) -> bool:
        """Until the layer's record is enqueued, or it can never be (failed, ended)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            if not self._changed.wait_for(
                    lambda: bool(self._recorded[layer]) or self._tickets[layer] is not None
                    or self._errors[layer] is not None or self._over or self.abandoned is not None
                    or (self._issued and not self._store), timeout):
                return False
            ticket = self._tickets[layer]
        if ticket is None or self._recorded[layer]:
            return True
        while True:
            # In slices: ``abandon`` cannot signal the ticket's wait, and the program may be
            # stuck in a driver call (a hung device) while the worker closes.
            left = ABANDON_POLL_S if deadline is None else min(ABANDON_POLL_S, deadline - time.monotonic())
            if ticket.wait_rows(self._need[layer], max(0.0, left)):  # the GIL released while it waits
                self._recorded[layer] = 1
                return True
            if ticket.issued:  # ended short of the layer: it failed
                self._sync(layer)
                return True
            if self.abandoned is not None:
                return True  # the caller finds the run abandoned, as on the Python path
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def enqueued(self, layer: int) -> bool:
        """Whether the layer's record is enqueued. A store layer pushed to a lane whose
        issuer still holds the push counts: a gate waits for its record."""
        return bool(self._is_recorded(layer) or (self._store and self._pushed[layer]))

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._wait_recorded(layer, timeout):
            return False
        pause = 20e-6
        while not self.query(layer):
            if self.abandoned is not None or (deadline is not None and time.monotonic() >= deadline):
                return False
            if not self._is_recorded(layer):  # an issued load whose layer never was
                return True
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def gate(self, layer: int, consumer: Any, meter: StallMeter) -> bool:
        drv = self._drv
        pair = self._arrive(consumer, meter) if self.measures_gates else None
        if not self._is_recorded(layer) and (not self._store or self._pushed[layer]):
            began = time.perf_counter()
            self._wait_recorded(layer, None)  # its enqueue is still with the issuer thread
            self._blocked[layer] += time.perf_counter() - began
        if ((self.abandoned is not None and not self._seen[layer]) or self._errors[layer] is not None
                or not self._is_recorded(layer)):
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
        if not self._is_recorded(layer):
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
            started=tuple(held.started(self.num_layers)), issued=tuple(self._issue_times()),
            blocked=tuple(self._blocked))
        held.release()
        return self._timeline

    def _issue_times(self) -> list[float | None]:
        """Host seconds from the submit to each layer's record being handed to the device:
        on the native path when the issuer thread's call of the record returned (the
        ticket's stamps, on the same clock as ``time.perf_counter``)."""
        out = list(self._issued_at)
        stamps: dict[int, tuple[float, ...] | None] = {}
        for layer, ticket in enumerate(self._tickets):
            if ticket is None:
                continue
            key = id(ticket)
            if key not in stamps:
                stamps[key] = ticket.stamps()
            times = stamps[key]
            need = self._need[layer]
            if times is not None and 0 < need <= len(times):
                out[layer] = times[need - 1] - self._submitted
        return out
