"""``SyncOffloadingWorker``: the classic step-loop face over its own core.

Engines such as vLLM call ``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait``
/ ``shutdown`` from their model-runner thread. No event loop is involved: the face builds
an ``OffloadCore`` and drives it from the calling thread, so ordering, validation, drain
and backpressure have one implementation (the core's); this face only blocks the thread
where the core says what to wait on.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

from .core import OffloadCore
from .errors import InvalidSpec
from .facts import WorkerFacts
from .handler import Job
from .layers import LayerwiseJob
from .layout import CanonicalKVCaches
from .lifecycle import State
from .options import WorkerOptions
from .specs import Direction, TransferResult, flag

__all__ = ["OffloadingWorker", "SyncOffloadingWorker"]


class OffloadingWorker(abc.ABC):
    """The worker-side interface engines drive from their step loop (vLLM's shape)."""

    @abc.abstractmethod
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Enqueue a GPU -> medium transfer; True when enqueued."""

    @abc.abstractmethod
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """Enqueue a medium -> GPU transfer; True when enqueued."""

    @abc.abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, each reported once. Never waits for a
        transfer (calls from several threads take turns with ``submit_*``)."""

    @abc.abstractmethod
    def wait(self, job_ids: set[int]) -> bool | None:
        """Block until those jobs are done; unknown ids are ignored; reports nothing (vLLM
        ignores what it returns; aiokv's says whether the jobs ended within a timeout)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Drain everything in flight, then release memory."""


class SyncOffloadingWorker(WorkerFacts, OffloadingWorker):
    """Moves KV blocks between device memory and a host pool, driven from an engine thread.

    Takes the same arguments as ``AsyncOffloadingWorker`` and is open once built:
    ``SyncOffloadingWorker(kv, num_cpu_chunks=...)``; ``shutdown()`` closes it. Bad input
    raises the same typed errors as the async face; ``True`` means enqueued. Each copy
    waits on the calling thread's current CUDA stream at submit time. Submits never wait
    for a copy unless ``WorkerOptions.max_in_flight`` is set: then a submit past the bound
    blocks until a job in flight ends (its result is kept for ``get_finished()``).

    Args:
        kv_caches: the KV cache to serve (``CanonicalKVCaches.from_tensors(...)``, or an
            engine's object with the same fields, such as vLLM's).
        num_cpu_chunks: host pool size in chunks (pass this or ``cpu_bytes``).
        cpu_bytes: host pool size in bytes, rounded down to whole chunks.
        blocks_per_chunk: consecutive GPU blocks one host chunk holds.
        backend: ``"auto"`` (where the tensors live), ``"cuda"`` or ``"cpu"``.
        strategy: CUDA copy strategy, ``"auto" | "dma" | "kernel" | "staged"``.
        options: further knobs, a ``WorkerOptions`` or a dict.

    Raises:
        InvalidSpec: bad sizes, options, backend or KV-cache description (a worker given
            in place of the KV caches among them).
        HostMemoryError: the host pool is larger than the memory available, or could not
            be allocated.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_cpu_chunks: int | None = None,
        cpu_bytes: int | None = None,
        blocks_per_chunk: int = 1,
        backend: str = "auto",
        strategy: str | None = None,
        options: WorkerOptions | Mapping[str, Any] | None = None,
    ) -> None:
        if callable(getattr(kv_caches, "submit_store", None)):
            raise InvalidSpec(
                f"SyncOffloadingWorker takes the KV caches, not a worker (got {type(kv_caches).__name__}): "
                "it builds its own core from the same arguments as AsyncOffloadingWorker, e.g. "
                "SyncOffloadingWorker(kv_caches, num_cpu_chunks=...)"
            )
        self._core = OffloadCore(
            kv_caches, num_cpu_chunks=num_cpu_chunks, cpu_bytes=cpu_bytes,
            blocks_per_chunk=blocks_per_chunk, backend=backend, strategy=strategy, options=options,
        )
        self._lifecycle = self._core.lifecycle
        self._lifecycle.open()
        self._unreported: list[TransferResult] = []
        # Layerwise jobs not reported by get_finished() yet, for ``layers(job_id)``.
        self._layerwise: dict[int, LayerwiseJob] = {}
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()  # one drain at a time; not held by get_finished

    # -- facts --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Jobs submitted whose results ``get_finished()`` has not returned yet."""
        with self._lock:
            return self._core.in_flight + len(self._unreported)

    def __repr__(self) -> str:
        return (f"<SyncOffloadingWorker {self._lifecycle.state.value} {self._core.describe()} "
                f"unreported={len(self._unreported)}>")

    # -- submitting ---------------------------------------------------------------------

    @overload
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: Literal[False] = False) -> bool: ...

    @overload
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: Literal[True]) -> LayerwiseJob: ...

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None,
                     layerwise: bool = False) -> bool | LayerwiseJob:
        """Enqueue a GPU -> host copy; True once enqueued. It waits on ``after``, else on the
        calling thread's current CUDA stream.

        ``layerwise=True`` returns the job's ``LayerwiseJob`` instead (true as well): nothing
        is copied until the forward pass pushes each layer (``job.push(i)``), each behind
        the compute that wrote it (docs/layerwise.md)."""
        if flag("layerwise", layerwise):
            return self._submit(Direction.STORE, job_id, src_spec, dst_spec, after, True)
        self._submit(Direction.STORE, job_id, src_spec, dst_spec, after)
        return True

    @overload
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, *,
                    after: Any = None, layerwise: Literal[False] = False) -> bool: ...

    @overload
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, *,
                    after: Any = None, layerwise: Literal[True]) -> LayerwiseJob: ...

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, *,
                    after: Any = None, layerwise: bool = False) -> bool | LayerwiseJob:
        """Enqueue a host -> GPU copy; True once enqueued. ``expedited`` loads have their own
        queue, so they never wait behind ordinary ones.

        ``layerwise=True`` enqueues every layer in this one call, each layer's end marked
        behind its copies, and returns the job's ``LayerwiseJob`` (true as well): the
        forward pass gates each layer on it (``job.gate(i)``) instead of waiting for the
        whole job (docs/layerwise.md)."""
        direction = Direction.of_load(expedited)
        if flag("layerwise", layerwise):
            return self._submit(direction, job_id, src_spec, dst_spec, after, True)
        self._submit(direction, job_id, src_spec, dst_spec, after)
        return True

    def layers(self, job_id: int) -> LayerwiseJob:
        """The per-layer handle of a layerwise job not reported by ``get_finished()`` yet
        (the one its submit returned). Raises ``InvalidSpec`` for any other id."""
        with self._lock:
            job = self._layerwise.get(job_id)
        if job is None:
            raise InvalidSpec(f"job {job_id!r} is no layerwise job in flight (or it was reported already)")
        return job

    def _submit(self, direction: Direction, job_id: int, src: Any, dst: Any, after: Any,
                layerwise: bool = False) -> Any:
        core = self._core
        checked = False
        while True:
            with self._lock:
                self._lifecycle.check_open()
                if core.has_room():  # the common case, first: no bound, or below it
                    if not layerwise:
                        return core.submit(direction, job_id, src, dst, after)
                    job = self._layerwise[job_id] = core.submit_layers(direction, job_id, src, dst, after)
                    return job
                if not checked:  # bad input raises now, not once (if ever) there is room
                    if layerwise:
                        core.layerwise.check(direction, after)
                        after = None if direction.to_host else after
                    core.check(direction, job_id, src, dst, after)
                    checked = True
                room = core.room()
            # At the bound: block (without the lock, so get_finished() and shutdown() go
            # on) for as long as the core says, then pop what ended and look again.
            if room is not None:
                room.block()
            self._collect()

    def _collect(self) -> None:
        """Pop what ended and keep it for ``get_finished()``: under the lock, so results
        reach it in the order the core popped them."""
        with self._lock:
            self._keep(self._core.poll())

    def _keep(self, jobs: list[Job]) -> None:
        self._unreported.extend(job.result for job in jobs if job.result is not None)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, each reported once, in submission order within
        each direction. Never waits for a transfer; calls on other threads take turns with
        ``submit_*``."""
        with self._lock:
            done = self._unreported
            done.extend(job.result for job in self._core.poll() if job.result is not None)
            self._unreported = []
            if self._layerwise:
                for result in done:
                    self._layerwise.pop(result.job_id, None)
        return done

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until those jobs are done (unknown ids are ignored); reports nothing, so
        their results still come from ``get_finished()``.

        Returns True once every job is done, or False when ``timeout`` seconds (for the
        whole wait) passed first: the jobs then stay in flight, untouched, and are still
        reported by ``get_finished()`` when they end. Without a timeout it blocks as long
        as the jobs take (a plain store queued behind an open layerwise store waits for
        that store's last push). Raises ``InvalidSpec`` unless ``job_ids`` is a collection
        of int ids and ``timeout`` is None or seconds >= 0."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout >= 0):
            raise InvalidSpec(f"timeout must be None or seconds >= 0, got {timeout!r}")
        return self._core.wait_for(job_ids, None if math.isinf(timeout or 0) else timeout)

    # -- lifetime -----------------------------------------------------------------------

    def shutdown(self, *, drain_timeout: float | None = None) -> None:
        """Drain, then free host memory. Results of drained jobs stay for get_finished().

        The drain ends once no job has ended for ``drain_timeout`` seconds (default
        ``WorkerOptions.drain_timeout``, 30 s) or on a KeyboardInterrupt: the jobs still in
        flight are then abandoned (a warning names them, their results report failure)
        and the host pool is kept, not freed, since their copies may still write it. The
        drain does not hold the face's lock, so ``get_finished()`` on another thread
        waits at most for the memory to be freed; a second ``shutdown()`` waits for the
        first.
        """
        timeout = self._core.options.drain_timeout_or(drain_timeout)
        with self._shutdown_lock:
            with self._lock:
                if self._lifecycle.begin_close() is not State.OPEN:
                    return  # closed already
            drain = self._core.drain(timeout, self._collect)
            try:
                while (wait := drain.next()) is not None:
                    wait.block()
            finally:
                with self._lock:
                    self._core.close(drain.why, report=self._keep)
