"""A layerwise load's enqueue, mixed into ``layers.CudaLayerRun``.

The native path (``submit_load``): the whole load is one program for the lane's native
issuer thread: the wait on its dependency, the job's start, then each layer's copies and
its event's record, layer 0's first, and the job's end (``layer_program``). The submit
builds the rows and returns; layer ``i`` counts as enqueued once the ticket's
``rows_done`` passes its record's row, so a gate never waits for later layers, and nothing
the lane is handed later goes ahead of them (the issuer runs programs in order).

The Python path (``issue_load``): the submit enqueues the first layers itself
(``head_layers``), the lane's Python issuer thread the rest a layer at a time, each marked
as its record is enqueued, and the job's end behind the last (docs/layerwise.md, "Loads").
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .driver import Driver, JobEvents
from .layer_clock import Held
from .layer_copies import Dependency, LayerLane
from .layer_ops import LayerOps
from .layer_program import Rows, copy_rows, staged_rows

__all__ = ["LoadIssue"]


class LoadIssue:
    """The load half of a layerwise run (the state is the run's)."""

    _lane: LayerLane
    _drv: Driver
    _ops: LayerOps
    _job: JobEvents | None
    _held: Held | None
    _head: int
    _events: list[Any]
    _recorded: bytearray
    _errors: list[BaseException | None]
    _deps: list[Any]
    _issued: bool
    _changed: threading.Condition
    num_layers: int
    completion: Any

    # The run's own (``layers``).
    give_back: Callable[[], None]
    _mark: Callable[[range | list[int]], None]
    _attach: Callable[[list[int], Any, list[int]], None]

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

    def _layer_rows(self, rows: Rows, layers: list[int], *, sliced: bool) -> None:
        """Layers' copies and records appended to a native program (``layer_program``)."""
        lane, ops = self._lane, self._ops
        main = int(lane.stream)
        if ops.staged is None:
            copy_rows(rows, ops, layers, self._events, main, lane.direction.to_host, sliced=sliced)
            return
        staging, to_host = lane.layer_staging, lane.direction.to_host

        def emit(rec: Any, layer: int) -> None:
            staging.emit(rec, ops.staged, layer, main, to_host)

        staged_rows(rows, lane.recorder, emit, layers, self._events, main)

    def _refuse(self, dep: Dependency | None, exc: BaseException) -> NoReturn:
        """Raise a submit that failed before any of the load reached the device, or on a
        broken device: the job's events given back (unless the device broke: they stay
        with it), the dependency too, and the sticky error raised in place of ``exc``."""
        drv = self._drv
        if drv.broken is None:
            self.give_back()
        if dep is not None:
            drv.give_sync_event(dep.event)
        if drv.broken is not None and drv.broken is not exc:
            raise drv.broken from exc
        raise exc

    # -- the native path --------------------------------------------------------------------

    def submit_load(self, dep: Dependency | None) -> None:
        """Hand the whole load to the lane's native issuer as one program (module doc).
        Raises with nothing queued (the job's events and the dependency given back)."""
        lane = self._lane
        rec, native = lane.recorder, lane.native
        assert self._job is not None and rec is not None and native is not None
        main = int(lane.stream)
        layers = list(range(self.num_layers))
        try:
            rows = Rows()
            if dep is not None:
                rows.wait(main, int(dep.event))
            rows.record(int(self._job.start), main)
            if self._held is not None:
                rows.record(int(self._held.origin), main)
            self._layer_rows(rows, layers, sliced=False)
            rows.record(int(self._job.stop), main)
            ticket = native.submit(rows.words(), tuple(rows.buffers), rec.main, rec.rescue,
                                   int(self._job.stop), False, True)
        except BaseException as exc:
            self._refuse(dep, exc)
        if dep is not None:
            self._deps.append(dep.event)  # given back once the job ended: the wait was issued
        self._attach(layers, ticket, [rows.records[layer] + 1 for layer in layers])
        lane.last_ticket = ticket
        self.completion.attach(ticket, time.perf_counter(), None)

    # -- the Python path ----------------------------------------------------------------------

    def issue_load(self, dep: Dependency | None, on_issuer: bool) -> None:
        """Enqueue the first layers, then the rest a layer at a time from the issuer
        thread: handed to it from the caller's thread, or right here on it (a job queued
        behind other work), so each layer is marked as it is enqueued rather than once the
        whole job is. Raises (nothing enqueued, or a sticky error) on the caller's thread;
        otherwise a failure is the job's and the layers whose records were not reached."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        ev, main = self._job, lane.stream
        count = self._head
        last = count == self.num_layers
        error: BaseException | None = None
        recorded: list[int] = []
        enqueuing = False
        started = time.perf_counter()
        try:
            drv.ensure_context()
            drv.check_usable()
            enqueuing = True
            if dep is not None:
                dep.resolve(drv)
                drv.stream_wait(main, dep.event)
            drv.record(ev.start, main)
            if self._held is not None:
                drv.record(self._held.origin, main)
            for layer in range(count):
                self._emit(drv, layer)
                recorded.append(layer)
                if on_issuer:
                    self._mark([layer])
            if last:
                drv.record(ev.stop, main)
        except BaseException as exc:
            if not on_issuer and (not enqueuing or drv.broken is not None):
                self._refuse(dep, exc)
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
        """On the issuer thread: layers ``first..`` one at a time, each marked as it is
        enqueued, then the job's end. A failure fails the layers not reached."""
        lane, drv = self._lane, self._drv
        assert self._job is not None
        error: BaseException | None = None
        try:
            drv.ensure_context()
            last = self.num_layers - 1
            for layer in range(first, self.num_layers):
                drv.check_usable()
                self._emit(drv, layer)
                if layer == last:
                    drv.record(self._job.stop, lane.stream)
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
