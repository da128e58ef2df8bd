"""``LayerwiseFuture``: a layerwise job on the async face, awaitable whole or layer by layer.

``await fut`` is the job (every layer), as for any ``TransferFuture``; ``await
fut.layer(i)`` is layer ``i`` alone, and returns its ``LayerStatus`` (never raises for a
failure). The gate, the blocking wait and the pushes are the core's ``LayerwiseJob``
operations, callable from any thread, so a model runner on another thread can use them.

``LayerWatch`` holds the awaited layers for the poller: each poll advances every watched
job past its layers known done, querying only its oldest open layer, and wakes the tasks
waiting on the layers passed (layers resolve in layer order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.lowlevel

from .doorbell import Doorbell
from .errors import UsageError
from .future import TransferFuture
from .layer_timeline import LayerTimeline
from .layers import LayerwiseJob
from .loops import LoopEvent, loop_event
from .specs import LayerStatus, TransferResult

__all__ = ["LayerWatch", "LayerwiseFuture"]


class LayerWatch:
    """The awaited layers of one async face's jobs (used on its loop thread only).
    ``wake`` wakes the poller: a nap in progress is armed on its heads' ends only, so a
    layer awaited from then on would be seen only when the nap ends."""

    def __init__(self, wake: Callable[[], None] = lambda: None) -> None:
        self._wake = wake
        # Per job with awaited layers, its waiters; empty while none is awaited (the
        # poller tests it on every poll, so a plain dict: no call).
        self.waiting: dict[LayerwiseJob, list[tuple[int, LoopEvent]]] = {}
        self._waiters = self.waiting
        # Per watched job: the layer asked to ring the doorbell, and whether it will.
        self._armed: dict[LayerwiseJob, tuple[int, bool]] = {}

    def add(self, job: LayerwiseJob, layer: int) -> LoopEvent:
        event = loop_event()
        self._waiters.setdefault(job, []).append((layer, event))
        self._wake()
        return event

    def remove(self, job: LayerwiseJob, event: LoopEvent) -> None:
        waiters = self._waiters.get(job)
        if waiters is not None:
            waiters[:] = [w for w in waiters if w[1] is not event]
            if not waiters:
                self._forget(job)

    def poll(self) -> int:
        """Advance every watched job; wake the waiters of the layers it passed. Returns how
        many were woken."""
        woken = 0
        for job, waiters in list(self._waiters.items()):
            open_layer = job.advance()
            keep = []
            for layer, event in sorted(waiters, key=lambda w: w[0]):  # woken in layer order
                if layer < open_layer:
                    event.set()
                    woken += 1
                else:
                    keep.append((layer, event))
            if keep:
                waiters[:] = keep
            else:
                self._forget(job)
        return woken

    def finish(self, job: LayerwiseJob) -> None:
        """The job ended: every layer is final, wake all its waiters."""
        for _, event in self._waiters.get(job, ()):
            event.set()
        self._forget(job)

    def arm(self, bell: Doorbell) -> bool:
        """Have each watched job's oldest open layer ring ``bell`` as it ends; False if one
        cannot (the poller then naps on its timer)."""
        armed = True
        for job in self._waiters:
            layer = job.advance()
            if layer >= job.num_layers:
                continue  # the next poll wakes its waiters
            state = self._armed.get(job)
            if state is None or state[0] != layer or not state[1]:  # asked again until it can
                state = self._armed[job] = (layer, job.ring_when_done(layer, bell))
            armed = armed and state[1]
        return armed

    def _forget(self, job: LayerwiseJob) -> None:
        self._waiters.pop(job, None)
        self._armed.pop(job, None)


class LayerwiseFuture(TransferFuture):
    """The future of a layerwise job (``submit_load(..., layerwise=True)`` or
    ``submit_store(..., layerwise=True)``): ``await fut`` is the whole job; the layers are
    ``await fut.layer(i)``, ``fut.gate(i)``, ``fut.wait_layer(i, timeout)`` and, for a
    store, ``fut.push(i)``. ``fut.layers`` is the ``LayerwiseJob`` underneath (hand it to a
    model-runner thread)."""

    __slots__ = ("_layers", "_watch")

    def __init__(self, job: LayerwiseJob, watch: LayerWatch) -> None:
        super().__init__(job.job_id)
        self._layers = job
        self._watch = watch

    @property
    def layers(self) -> LayerwiseJob:
        """The per-layer operations, usable from any thread (the sync face's handle)."""
        return self._layers

    @property
    def num_layers(self) -> int:
        return self._layers.num_layers

    def layer(self, layer: int) -> Awaitable[LayerStatus]:
        """Await layer ``layer``'s copies: ``READY`` or ``FAILED`` (never raises for a
        failure). Cancelling the awaiting task cancels the wait, not the copy. Raises
        ``InvalidSpec`` at once for a layer out of range; awaiting it on another thread
        than the submitting loop raises ``UsageError``."""
        return self._await_layer(self._layers.index(layer))

    async def _await_layer(self, index: int) -> LayerStatus:
        job = self._layers
        status = job.layer_status(index)
        if status is not LayerStatus.PENDING:
            job.note_wait(0.0 if status is LayerStatus.READY else None)
            await anyio.lowlevel.checkpoint()
            return status
        if threading.get_ident() != self._thread:
            raise UsageError(f"layer {index} of job {self.job_id} was awaited on another thread than the "
                             "event loop that submitted it; use wait_layer() or gate() from other threads")
        began = time.perf_counter()
        while status is LayerStatus.PENDING:
            event = self._watch.add(job, index)
            try:
                await event.wait()
            finally:
                if not event.is_set():  # cancelled: the wait goes, the copy stays
                    self._watch.remove(job, event)
            status = job.layer_status(index)
            if status is LayerStatus.PENDING and self.done():
                status = LayerStatus.FAILED  # the job ended and the layer never did
        job.note_wait(time.perf_counter() - began)
        return status

    def push(self, layer: int, *, after: Any = None) -> bool:
        """``LayerwiseJob.push``: a store's layer, behind ``after`` (default: the calling
        thread's current stream)."""
        return self._layers.push(layer, after=after)

    def gate(self, layer: int, stream: Any = None) -> LayerStatus:
        """``LayerwiseJob.gate``: ``stream`` waits on the layer on the device."""
        return self._layers.gate(layer, stream)

    def wait_layer(self, layer: int, timeout: float | None = None) -> LayerStatus:
        """``LayerwiseJob.wait_layer``: blocks the calling thread (not for the loop's)."""
        return self._layers.wait_layer(layer, timeout)

    def layer_status(self, layer: int) -> LayerStatus:
        return self._layers.layer_status(layer)

    def failed_blocks(self) -> set[int]:
        """``LayerwiseJob.failed_blocks``: GPU blocks to recompute (or not stored)."""
        return self._layers.failed_blocks()

    def timeline(self) -> LayerTimeline | None:
        """``LayerwiseJob.timeline``: each layer's copy end and its gate's marks."""
        return self._layers.timeline()

    def _resolve(self, result: TransferResult, cause: BaseException | None = None) -> None:
        try:
            super()._resolve(result, cause)
        finally:
            self._watch.finish(self._layers)

    def __repr__(self) -> str:
        return f"<LayerwiseFuture {self._layers!r}{' done' if self.done() else ''}>"
