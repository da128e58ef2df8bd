"""CPU backend: "device" tensors are CPU tensors and each direction is a worker thread.

A real backend with the semantics of the CUDA one (copies run asynchronously, in order
per direction), so the async machinery is proven on machines without a GPU. A layerwise
job is one queue item per layer and one for its end; a gate blocks the calling thread
until its layer is done (the CPU's stream wait).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from ..doorbell import Doorbell
from ..errors import HostMemoryError, InvalidSpec
from ..host_layout import HostLayout
from ..layer_plan import CopySlice, LayerPlan
from ..layer_timeline import LayerTimeline
from ..layout import CanonicalKVCaches
from ..plan import CopyPlan
from ..specs import Direction
from .base import Backend, Completion, HostPool, Lane, LayerRun, StallMeter
from .shared_file import SharedFile

__all__ = ["CpuBackend"]


class CpuCompletion(Completion):
    """Set by the lane's thread when the job's copies are over."""

    __slots__ = ("_bells", "_done", "_elapsed", "_error", "_lock", "_started")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._elapsed: float | None = None
        self._started: float | None = None
        self._lock = threading.Lock()
        self._bells: list[Doorbell] = []

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def ring_when_done(self, bell: Doorbell) -> bool:
        with self._lock:
            if not self._done.is_set():
                self._bells.append(bell)
                return True
        bell.ring()
        return True

    def _finish(self, error: BaseException | None, elapsed: float | None) -> None:
        self._error, self._elapsed = error, elapsed
        with self._lock:
            self._done.set()
            bells, self._bells = self._bells, []
        for bell in bells:
            bell.ring()


class CpuHostPool(HostPool):
    """The chunks in ordinary memory, or in a shared file (``file``, see ``shared_file``)."""

    def __init__(self, nbytes: int, file: str | None = None) -> None:
        self._shared: SharedFile | None = None
        if file is not None:
            self._shared = SharedFile(file, nbytes)
            self.tensor = torch.from_numpy(np.frombuffer(self._shared.map, dtype=np.uint8, count=nbytes))
            return
        try:
            # Page-aligned, as a pinned CUDA pool is: a disk tier's direct reads then land
            # in a chunk's pages as they are (docs/tiers.md, "Restore"), not via a bounce.
            raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
            skip = -raw.data_ptr() % _PAGE
            self.tensor = raw[skip : skip + nbytes]
        except (RuntimeError, MemoryError) as exc:  # torch says "DefaultCPUAllocator: can't allocate"
            raise HostMemoryError(
                f"could not allocate a host pool of {nbytes} bytes ({nbytes / 2**30:.3g} GiB): {exc}; "
                "ask for fewer chunks or bytes"
            ) from exc

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._shared is not None:
            self._shared.close()


def flat_bytes(view: torch.Tensor) -> np.ndarray:
    """A flat numpy byte array spanning every row of a ``(num_blocks, row)`` byte view."""
    rows, width = view.shape
    span = (rows - 1) * view.stride(0) + width if rows else 0
    # As uint8: an engine's byte view may be int8, bool or fp8 (numpy has no fp8, and
    # would convert bools).
    return torch.as_strided(view.view(torch.uint8), (span,), (1,)).numpy()


_Item = tuple["CopyPlan | CopySlice", CpuCompletion, "threading.Event | None"]

_PAGE = 4096
"""Alignment of the host pool's start (a memory page, what direct I/O needs)."""
_ABANDON_WAIT_SECONDS = 5.0
# How often a thread blocked on a layer looks whether the worker abandoned its job.
_LAYER_WAIT_SLICE = 0.05
_NO_COPIES = CopySlice(*(np.zeros(0, dtype=np.int64),) * 4)


class _JobEnd(CpuCompletion):
    """A layerwise job's end: its last queue item, behind every layer it enqueued. Fails
    with the first layer's error; its time is the sum of its layers' copy times, so a
    store's time leaves out the gaps in which the forward computed the next layer."""

    __slots__ = ("_run",)

    def __init__(self, run: CpuLayerRun) -> None:
        super().__init__()
        self._run = run

    def _finish(self, error: BaseException | None, elapsed: float | None) -> None:
        layers = self._run.layers
        error = error or next((c.error for c in layers if c.error is not None), None)
        starts = [c._started for c in layers if c._started is not None]
        elapsed = sum(c._elapsed or 0.0 for c in layers) if starts and error is None else None
        super()._finish(error, elapsed)


class CpuLayerRun(LayerRun):
    """A layerwise job's items on a CPU lane: one completion per layer, set by the lane's
    thread as that layer's copies end, and the job's end behind them."""

    def __init__(self, lane: CpuLane, plan: LayerPlan) -> None:
        self._lane = lane
        self._plan = plan
        self.num_layers = n = plan.num_layers
        self.layers = [CpuCompletion() for _ in range(n)]
        self.completion: _JobEnd = _JobEnd(self)
        self._queued = bytearray(n)
        self._finished = False
        # Host clock marks for ``timeline``: each layer's enqueue, and each gate's
        # arrival and return (the first gate of a layer).
        self._submitted = time.perf_counter()
        self._issued_at: list[float | None] = [None] * n
        self._reached: list[float | None] = [None] * n
        self._gone_on: list[float | None] = [None] * n

    def load(self, dependency: Any) -> None:
        for layer in range(self.num_layers):
            self._put(layer, dependency if layer == 0 else None)
        self._finished = True
        self._lane.put((_NO_COPIES, self.completion, None))

    def _put(self, layer: int, dependency: Any) -> None:
        self._queued[layer] = 1
        self._issued_at[layer] = time.perf_counter() - self._submitted
        self._lane.put((self._plan.layer(layer), self.layers[layer], dependency))

    def push(self, layer: int, dependency: Any) -> bool:
        self._put(layer, dependency)
        return True

    def fail(self, layer: int, error: BaseException) -> None:
        self._queued[layer] = 1  # nothing to queue: it ends here, before the job's end
        self.layers[layer]._finish(error, None)

    def finish(self, error: BaseException | None) -> None:
        if self._finished:
            return
        self._finished = True
        for layer, queued in enumerate(self._queued):
            if not queued:
                self.layers[layer]._finish(error, None)
        self._lane.put((_NO_COPIES, self.completion, None))

    def query(self, layer: int) -> bool:
        return self.layers[layer].query()

    def error(self, layer: int) -> BaseException | None:
        return self.layers[layer].error

    def enqueued(self, layer: int) -> bool:
        return bool(self._queued[layer])

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        done = self.layers[layer]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.query():
            if self.abandoned is not None:
                return False
            left = _LAYER_WAIT_SLICE
            if deadline is not None:
                left = min(left, deadline - time.monotonic())
            if left <= 0:
                return False
            done.wait(left)
        return True

    def gate(self, layer: int, consumer: Any, meter: StallMeter) -> bool:
        done = self.layers[layer]
        began = time.perf_counter()
        if done.query():
            self._note_gate(layer, began, began)
            meter.add(0.0)
            return done.error is None
        finished = self.wait(layer)
        now = time.perf_counter()
        self._note_gate(layer, began, now)
        meter.add(now - began)
        return finished and done.error is None

    def _note_gate(self, layer: int, arrived: float, went_on: float) -> None:
        if self._reached[layer] is None:
            self._reached[layer], self._gone_on[layer] = arrived, went_on

    def timeline(self) -> LayerTimeline | None:
        if not self.completion.query():
            return None
        starts = [c._started for c in self.layers if c._started is not None]
        if not starts:
            return None
        origin = min(starts)

        def since(t: float | None) -> float | None:
            return None if t is None else t - origin

        done = [since(c._started + c._elapsed) if c._started is not None and c._elapsed is not None else None
                for c in self.layers]
        return LayerTimeline(clock="host", copy_done=tuple(done), reached=tuple(map(since, self._reached)),
                             started=tuple(map(since, self._gone_on)), issued=tuple(self._issued_at),
                             blocked=(0.0,) * self.num_layers)

    def ring_when_done(self, layer: int, bell: Doorbell) -> bool:
        return self.layers[layer].ring_when_done(bell)


class CpuLane(Lane):
    """Runs each launched plan on one thread, in launch order."""

    def __init__(self, direction: Direction, kv: CanonicalKVCaches, pool: HostPool) -> None:
        self.direction = direction
        self._device = [flat_bytes(t.tensor) for t in kv.tensors]
        self._host = pool.tensor.numpy()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # The ``after`` event the thread waits on now, if any (see ``abandon``).
        self._waiting_on: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"aiokv-cpu-{direction.value}", daemon=True)
        self._thread.start()

    def launch(self, plan: CopyPlan, dependency: Any) -> Completion:
        completion = CpuCompletion()
        self._queue.put((plan, completion, dependency))
        return completion

    def put(self, item: _Item) -> None:
        """Queue one item behind everything launched (a layerwise run's layers and end)."""
        self._queue.put(item)

    def launch_layers(self, plan: LayerPlan, dependency: Any) -> LayerRun:
        run = CpuLayerRun(self, plan)
        run.load(dependency)
        return run

    def open_layers(self, plan: LayerPlan) -> LayerRun:
        return CpuLayerRun(self, plan)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        # Views keep their memory alive: without this the pool outlived shutdown().
        self._host = np.empty(0, dtype=np.uint8)
        self._device = []

    def abandon(self) -> None:
        self._queue.put(None)  # the thread ends after what is queued, and lets the lane go
        # Waited for, up to a bound: a thread still ending as the interpreter shut down
        # dropped the lane's torch-backed arrays then, which aborted the process
        # ("terminate called without an active exception") when a script exited just
        # after dropping an unclosed worker. A lane whose thread waits on an ``after``
        # event nobody set is left to its thread at once: the wait would only delay.
        if threading.current_thread() is self._thread:
            return
        deadline = time.monotonic() + _ABANDON_WAIT_SECONDS
        while self._thread.is_alive() and time.monotonic() < deadline:
            waiting_on = self._waiting_on
            if waiting_on is not None and not waiting_on.is_set():
                return
            self._thread.join(0.01)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            plan, completion, dependency = item
            if dependency is not None:
                self._waiting_on = dependency
                dependency.wait()
                self._waiting_on = None
            start = completion._started = time.perf_counter()
            try:
                self._copy(plan)
            except BaseException as exc:  # report, never kill the lane
                completion._finish(exc, None)
            else:
                completion._finish(None, time.perf_counter() - start)

    def _copy(self, plan: CopyPlan | CopySlice) -> None:
        host, device, to_host = self._host, self._device, self.direction.to_host
        for t, d, h, n in zip(
            plan.tensor_idx.tolist(), plan.device_offset.tolist(),
            plan.host_offset.tolist(), plan.nbytes.tolist(),
        ):
            if to_host:
                host[h : h + n] = device[t][d : d + n]
            else:
                device[t][d : d + n] = host[h : h + n]


class CpuBackend(Backend):
    name = "cpu"

    def check_caches(self, kv: CanonicalKVCaches) -> None:
        for i, t in enumerate(kv.tensors):
            if t.tensor.device.type != "cpu":
                raise InvalidSpec(
                    f"tensors[{i}] is on {t.tensor.device}, but the CPU backend needs CPU "
                    "tensors; use backend='cuda' (or 'auto') for GPU tensors"
                )

    def allocate_pool(self, nbytes: int, file: str | None = None) -> HostPool:
        return CpuHostPool(nbytes, file)

    def capture(self, after: Any) -> Any:
        """CPU writes are synchronous, so by default nothing is awaited. ``after`` may be a
        ``threading.Event``: the copy starts once it is set (a latch for tests and for
        producers that fill tensors from other threads)."""
        self.check_after(after)
        return after

    def check_after(self, after: Any) -> None:
        if after is not None and not isinstance(after, threading.Event):
            raise InvalidSpec(
                f"the CPU backend takes after=None or a threading.Event, got {type(after).__name__}"
            )

    def open_lane(
        self, direction: Direction, kv: CanonicalKVCaches, layout: HostLayout, pool: HostPool
    ) -> Lane:
        return CpuLane(direction, kv, pool)
