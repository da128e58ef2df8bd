"""Layerwise jobs, the core's part (the same for both faces).

A layerwise load's submit enqueues its first layers and the backend the rest (on CUDA from
the lane's issuer thread), each layer's end marked behind its copies, so consumers can
start on layer 0 while later layers are still being handed over and copied. A layerwise
store enqueues nothing at submit: the forward pass pushes each layer once the compute that
writes it is enqueued (``push(i, after=...)``), and the job ends once every layer is
pushed and copied. ``LayerwiseJob`` is one job's per-layer operations (the sync face's
handle; the async face's ``LayerwiseFuture`` wraps it); ``Layerwise`` is the core's
bookkeeping: planning, launching, pushing, refusing what is left at close, statistics.

Failures never raise from a gate, a wait or a push: they return ``LayerStatus.FAILED``
(or False), and ``failed_blocks()`` says which GPU blocks must be recomputed. Misuse does
raise, before anything is enqueued: a layer out of range (``InvalidSpec``), a push twice or
on a load, a gate on a store layer not enqueued yet (``UsageError``): a gate there would
otherwise have to pass on an event never recorded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from .backends.base import Backend, LayerRun, StallMeter
from .errors import InvalidSpec, UsageError, WorkerClosed
from .handler import Handler, LayerJob
from .host_layout import HostLayout
from .layer_plan import LayerMap, LayerPlan, plan_layers
from .layer_timeline import LayerTimeline
from .layout import CanonicalKVCaches
from .lifecycle import Lifecycle, State
from .plan import CopyPlan
from .specs import Direction, LayerStatus

__all__ = ["LayerStatistics", "Layerwise", "LayerwiseJob"]

READY, FAILED, PENDING = LayerStatus.READY, LayerStatus.FAILED, LayerStatus.PENDING


@dataclass(frozen=True)
class LayerStatistics:
    """What layerwise jobs did so far on one worker (counters only grow).

    Attributes:
        jobs: layerwise jobs submitted.
        pushed: store layers pushed.
        gates: gates made (``gate``).
        waits: per-layer waits made, blocking (``wait_layer``) or awaited (``layer``).
        failed_layers: layers that ended failed (copies failed, or never pushed).
        stalls: seconds each gate's consumer waited on its layer after it was due, most
            recent last (the last 4096): on CUDA in device time on its stream (measured
            with ``WorkerOptions(layer_stalls=True)``, the time before the layer was
            handed to the device included; without it gates add none), on the CPU the
            host time the gate blocked. A layer already done counts about 0.
        stalls_measured: how many gate stalls were measured in all.
        waited: host seconds each wait (``wait_layer``, or an awaited ``layer``) took,
            most recent last (the last 4096); 0 for a layer already done. Kept apart from
            ``stalls``: another clock, and a wait may begin long before its layer is due.
    """

    jobs: int = 0
    pushed: int = 0
    gates: int = 0
    waits: int = 0
    failed_layers: int = 0
    stalls: tuple[float, ...] = ()
    stalls_measured: int = 0
    waited: tuple[float, ...] = ()


class LayerwiseJob:
    """One layerwise job's per-layer operations. Safe to use from any thread (an engine's
    model-runner thread gates and pushes; a loop awaits). Layer ``i`` is the ``i``-th layer
    of the KV-cache description (``CanonicalKVCaches.ref_layers``)."""

    def __init__(self, owner: Layerwise, job_id: int, direction: Direction, plan: LayerPlan) -> None:
        self.job_id = job_id
        self.direction = direction
        self.num_layers = plan.num_layers
        self._owner = owner
        self._plan = plan
        self._store = direction.to_host
        self._pushed = bytearray(self.num_layers)
        # Pushes accepted while the job waits behind an older open store (None: they go to
        # the lane as they come).
        self._deferred: list[tuple[int, Any]] | None = None
        self._sealed: BaseException | None = None
        self._final: list[LayerStatus | None] = [None] * self.num_layers
        self._next = 0
        self._job: LayerJob
        self._handler: Handler

    def _bind(self, job: LayerJob, handler: Handler, deferred: bool) -> None:
        self._job, self._handler = job, handler
        assert job.run is not None
        self._run: LayerRun = job.run
        if deferred:
            self._deferred = []

    def __repr__(self) -> str:
        # Asked of each layer (never waiting): a gate that found its layer done, or the
        # job's end, leaves no final status behind, yet the layer is done.
        done = self.num_layers if self.done() else sum(
            self.layer_status(i) is not PENDING for i in range(self.num_layers))
        return f"<LayerwiseJob {self.direction.value} job={self.job_id} layers={done}/{self.num_layers} done>"

    # -- the operations -------------------------------------------------------------------

    def index(self, layer: Any) -> int:
        """``layer`` as an int in ``[0, num_layers)``; raises ``InvalidSpec`` otherwise."""
        return self._owner.map.index(layer)

    def push(self, layer: int, *, after: Any = None) -> bool:
        """A store: enqueue layer ``layer``'s copies once the compute that writes it is
        done: by default behind the calling thread's current CUDA stream as it stands now,
        else behind ``after`` (an event or stream, as ``submit_*`` takes it; on the CPU a
        ``threading.Event``). The job ends once every layer is pushed and copied.

        Returns True when enqueued (or queued behind an older open layerwise store), False
        when the layer will not be stored (the device failed, the worker is closing): the
        job then reports failure. Raises ``InvalidSpec`` (layer out of range, bad
        ``after``) or ``UsageError`` (pushed already, or the job is a load) with nothing
        enqueued."""
        return self._owner.push(self, layer, after)

    def gate(self, layer: int, stream: Any = None) -> LayerStatus:
        """Make the consumer wait for layer ``layer`` without blocking the host: on CUDA,
        ``stream`` (default: the calling thread's current stream) waits on the layer's
        event; on the CPU the calling thread blocks until the layer is done.

        Returns ``READY``, or ``FAILED`` (nothing waits; recompute ``failed_blocks()``);
        never raises for a failure. Raises ``InvalidSpec`` for a layer out of range or an
        unusable ``stream``, and ``UsageError`` for a store layer whose copies are not
        enqueued yet (not pushed, or pushed behind an older open store): a gate there
        would have nothing recorded to wait on."""
        owner = self._owner
        index = owner.map.index(layer)
        consumer = owner.backend.consumer(stream)
        owner.count("gates")
        final = self._final[index]
        run = self._run
        if final is not None:
            if final is READY and run.measures_gates:
                owner.meter.add(0.0)
            return final
        if run.abandoned is not None:
            return self._settle(index, FAILED)
        if self._store and not run.enqueued(index):
            if self._sealed is not None or (not self._pushed[index] and run.query(index)):
                return self._settle(index, FAILED)
            why = ("is not pushed yet" if not self._pushed[index]
                   else "waits behind an older open store's pushes")
            raise UsageError(f"layer {index} of store job {self.job_id} {why}, so nothing is enqueued "
                             "for a gate to wait on; gate a store layer once its push reached the lane, "
                             "or use wait_layer()")
        if not run.gate(index, consumer, owner.meter):
            return self._settle(index, FAILED)
        return READY

    def wait_layer(self, layer: int, timeout: float | None = None) -> LayerStatus:
        """Block the calling thread until layer ``layer`` is done: ``READY``, ``FAILED``, or
        ``PENDING`` once ``timeout`` seconds passed first. A store layer not pushed yet is
        waited for through its push. Never raises for a failure."""
        owner = self._owner
        index = owner.map.index(layer)
        owner.count("waits")
        status = self.layer_status(index)
        if status is not PENDING:
            if status is READY:
                owner.waited.add(0.0)
            return status
        began = time.perf_counter()
        if self._run.wait(index, timeout):
            owner.waited.add(time.perf_counter() - began)
        return self.layer_status(index)

    def layer_status(self, layer: int) -> LayerStatus:
        """Layer ``layer`` now, without waiting: ``READY``, ``FAILED`` or ``PENDING``."""
        index = self._owner.map.index(layer)
        final = self._final[index]
        if final is not None:
            return final
        run = self._run
        if run.abandoned is not None:
            return self._settle(index, FAILED)
        if self._store and not self._pushed[index]:
            return self._settle(index, FAILED) if run.query(index) else PENDING
        if not run.query(index):
            return PENDING
        return self._settle(index, FAILED if run.error(index) is not None else READY)

    def failed_blocks(self) -> set[int]:
        """GPU block ids that must be recomputed (a load) or were not stored (a store): the
        blocks of every layer that failed; once the job ended failed, of every layer not
        known ``READY`` (an engine feeds them to vLLM's ``get_block_ids_with_load_errors``).
        Empty while nothing failed."""
        ended = self._run.completion.query()
        failed_job = ended and self._run.completion.error is not None
        layers = [i for i in range(self.num_layers)
                  if (status := self.layer_status(i)) is FAILED or (failed_job and status is not READY)]
        return self._plan.blocks(layers)

    def done(self) -> bool:
        """True once every layer's copies are over (successfully or not)."""
        return self._run.completion.query()

    def timeline(self) -> LayerTimeline | None:
        """When each layer's copies ended and when the consumer reached and passed its gate
        (``LayerTimeline``), once the job is done and its gates ran on their streams; None
        before, and on CUDA unless the worker has ``WorkerOptions(layer_stalls=True)``."""
        return self._run.timeline()

    @property
    def layers_pushed(self) -> int:
        """Layers pushed so far (a load: every layer, at submit)."""
        return sum(self._pushed) if self._store else self.num_layers

    def advance(self) -> int:
        """Past the layers known done (``READY`` or ``FAILED``), oldest first; returns the
        oldest layer still open (``num_layers`` when none is). Only that layer is queried,
        so a poll costs one query per watched job."""
        while self._next < self.num_layers and self.layer_status(self._next) is not PENDING:
            self._next += 1
        return self._next

    def note_wait(self, seconds: float | None) -> None:
        """Count a wait made elsewhere (an awaited layer) and how long it took (None: not
        kept, the layer had failed)."""
        self._owner.count("waits")
        if seconds is not None:
            self._owner.waited.add(seconds)

    def ring_when_done(self, layer: int, bell: Any) -> bool:
        """Have ``bell`` rung when layer ``layer`` ends (False where it cannot be armed)."""
        return self._run.enqueued(layer) and self._run.ring_when_done(layer, bell)

    # -- the core's part ------------------------------------------------------------------

    def _settle(self, index: int, status: LayerStatus) -> LayerStatus:
        return self._owner.settle(self, index, status)

    def _release(self) -> bool:
        """Its turn at the lane came (called under the core's lock): enqueue the pushes it
        took meanwhile; True once it has every layer (it then ends behind them)."""
        deferred, self._deferred = self._deferred or [], None
        for index, dependency in deferred:
            self._run.push(index, dependency)
        if self._sealed is None and not all(self._pushed):
            return False
        self._finish()
        return True

    def _finish(self) -> None:
        self._run.finish(self._sealed)
        self._owner.closed_store(self)


class Layerwise:
    """The core's bookkeeping of layerwise jobs: the layer map, open stores, statistics.
    ``lock`` is the core's: submits, pushes and closing take turns under it."""

    def __init__(self, kv: CanonicalKVCaches, layout: HostLayout, backend: Backend, lock: threading.Lock,
                 lifecycle: Lifecycle) -> None:
        self.map = LayerMap.build(kv, layout)
        self.backend = backend
        self.meter = StallMeter()  # gates' stalls
        self.waited = StallMeter()  # waits' and awaits' host times
        self._lock = lock
        self._lifecycle = lifecycle
        self._stats_lock = threading.Lock()
        self._open: list[LayerwiseJob] = []  # stores with layers still to come, oldest first
        self._counts = dict.fromkeys(("jobs", "pushed", "gates", "waits", "failed_layers"), 0)

    def check(self, direction: Direction, after: Any) -> None:
        """Raise ``InvalidSpec`` where the layout has no layers of its own, or for
        ``after=`` on a store (each push takes its own)."""
        self.map.check()
        if direction.to_host and after is not None:
            raise InvalidSpec("a layerwise store waits on each layer's compute as it is pushed: pass "
                              "after= to push(layer, after=...), not to submit_store")

    def plan(self, plan: CopyPlan, direction: Direction, after: Any) -> LayerPlan:
        """The job's copies in layer order (``check`` first)."""
        self.check(direction, after)
        return plan_layers(plan.mapping, plan.layout, self.map)

    def submit(self, handler: Handler, job_id: int, plan: LayerPlan, dependency: Any) -> LayerwiseJob:
        """Launch a load's layers, or open a store (call under the core's lock)."""
        job = LayerwiseJob(self, job_id, handler.direction, plan)
        if handler.direction.to_host:
            layer_job, now = handler.open_layers(job_id, plan, job._release)
            job._bind(layer_job, handler, deferred=not now)
            self._open.append(job)
        else:
            job._bind(handler.launch_layers(job_id, plan, dependency), handler, deferred=False)
        self.count("jobs")
        return job

    def push(self, job: LayerwiseJob, layer: Any, after: Any) -> bool:
        index = self.map.index(layer)
        if not job._store:
            raise UsageError(f"job {job.job_id} is a layerwise load: its layers were all enqueued at submit; "
                             "push() is for layerwise stores")
        with self._lock:
            if job._pushed[index]:
                raise UsageError(f"layer {index} of store job {job.job_id} was pushed already")
            if job._sealed is not None or self._lifecycle.state is not State.OPEN:
                return False  # closing: the layer is failed, the job reports it
            try:
                dependency = self.backend.capture(after)
            except InvalidSpec:
                raise  # a bad after=: misuse, nothing taken
            except Exception as exc:  # the device failed: the layer does, never the forward
                return self._failed_push(job, index, exc)
            job._pushed[index] = 1
            self.count("pushed")
            if job._deferred is not None:
                try:  # pinned now, on this thread: its launch comes from another
                    job._handler.lane.fix(dependency)
                except Exception as exc:  # a device failure never raises inside a forward
                    return self._failed_push(job, index, exc)
                job._deferred.append((index, dependency))
                return True
            ok = job._run.push(index, dependency)
            if all(job._pushed):
                job._finish()
                job._handler.pushed_all(job._job)
            return ok

    def _failed_push(self, job: LayerwiseJob, index: int, error: BaseException) -> bool:
        """A push whose dependency could not be taken: the layer counts as pushed, failed,
        so the store still ends once the others are pushed (under the core's lock)."""
        job._pushed[index] = 1
        job._run.fail(index, error)
        if job._deferred is None and all(job._pushed):
            job._finish()
            job._handler.pushed_all(job._job)
        return False

    def closed_store(self, job: LayerwiseJob) -> None:
        if job in self._open:
            self._open.remove(job)

    def seal(self, why: str) -> None:
        """Closing: no more pushes. Every layer not pushed yet fails; each open store ends
        behind the layers it has, and what was held behind it is launched (nothing is
        dropped). Call under the core's lock."""
        if not self._open:
            return
        error = WorkerClosed(f"the worker closed before this layer was pushed ({why})")
        for job in self._open:
            job._sealed = error
        for job in list(self._open):
            if job._deferred is None and job in self._open:
                job._finish()
                job._handler.pushed_all(job._job)
        for job in list(self._open):  # none, unless a handler lost track of one
            job._finish()

    def abandon(self, jobs: list[Any], error: BaseException) -> None:
        """The worker closed with these jobs still running: their layer waits end, failed."""
        for job in jobs:
            if isinstance(job, LayerJob) and job.run is not None:
                job.run.abandon(error)

    def close(self) -> None:
        """The worker is closing: read the stall samples that are ready, let go of the rest
        (their events belong to the backend, which goes next)."""
        self.meter.collect()
        self.meter.close()

    def settle(self, job: LayerwiseJob, index: int, status: LayerStatus) -> LayerStatus:
        """Make a layer's status final (the first one found wins)."""
        with self._stats_lock:
            final = job._final[index]
            if final is None:
                job._final[index] = final = status
                if status is FAILED:
                    self._counts["failed_layers"] += 1
        return final

    def count(self, what: str) -> None:
        with self._stats_lock:
            self._counts[what] += 1

    def statistics(self) -> LayerStatistics:
        meter = self.meter
        meter.collect()
        with self._stats_lock:
            counts = dict(self._counts)
        return LayerStatistics(stalls=tuple(meter.samples), stalls_measured=meter.count,
                               waited=tuple(self.waited.samples), **counts)
