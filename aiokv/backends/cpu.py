"""CPU backend: "device" tensors are CPU tensors and each direction is a worker thread.

A real backend with the semantics of the CUDA one (copies run asynchronously, in order
per direction), so the async machinery is proven on machines without a GPU.
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
from ..layout import CanonicalKVCaches
from ..plan import CopyPlan, HostLayout
from ..specs import Direction
from .base import Backend, Completion, HostPool, Lane

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
    def __init__(self, nbytes: int) -> None:
        try:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as exc:  # torch says "DefaultCPUAllocator: can't allocate"
            raise HostMemoryError(
                f"could not allocate a host pool of {nbytes} bytes ({nbytes / 2**30:.3g} GiB): {exc}; "
                "ask for fewer chunks or bytes"
            ) from exc

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)


def flat_bytes(view: torch.Tensor) -> np.ndarray:
    """A flat numpy byte array spanning every row of a ``(num_blocks, row)`` byte view."""
    rows, width = view.shape
    span = (rows - 1) * view.stride(0) + width if rows else 0
    # As uint8: an engine's byte view may be int8, bool or fp8 (numpy has no fp8, and
    # would convert bools).
    return torch.as_strided(view.view(torch.uint8), (span,), (1,)).numpy()


_Item = tuple[CopyPlan, CpuCompletion, "threading.Event | None"]

_ABANDON_WAIT_SECONDS = 5.0


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

    def _copy(self, plan: CopyPlan) -> None:
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

    def allocate_pool(self, nbytes: int) -> HostPool:
        return CpuHostPool(nbytes)

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
