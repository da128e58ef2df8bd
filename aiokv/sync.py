"""``SyncOffloadingWorker``: the classic step-loop interface over the same core.

Engines such as vLLM call ``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait``
/ ``shutdown`` from their model-runner thread. No event loop is involved: the adapter
drives the core's handlers directly, so ordering and bookkeeping have one implementation.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterable
from typing import Any

from .core import WorkerStatistics
from .errors import InvalidSpec
from .handler import Job
from .lifecycle import Face, State
from .specs import Direction, TransferResult
from .worker import AsyncOffloadingWorker

__all__ = ["OffloadingWorker", "SyncOffloadingWorker"]

# How often a submit blocked at the ``max_in_flight`` bound looks at the worker's state.
_ROOM_CHECK_SECONDS = 0.05


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
    def wait(self, job_ids: set[int]) -> None:
        """Block until those jobs are done; unknown ids are ignored; reports nothing."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Drain everything in flight, then release memory."""


class SyncOffloadingWorker(OffloadingWorker):
    """Blocking face of an ``AsyncOffloadingWorker`` that was never opened on a loop.

    Bad input raises the same typed errors as the async face; ``True`` means enqueued.
    Each copy waits on the calling thread's current CUDA stream at submit time. Submits
    never wait for a copy unless ``WorkerOptions.max_in_flight`` is set: then a submit
    past the bound blocks until a job in flight ends (its result is kept for
    ``get_finished()``).

    Raises:
        InvalidSpec: ``async_worker`` is not an ``AsyncOffloadingWorker``.
        UsageError: the worker is open on an event loop or wrapped by another adapter;
            ``WorkerClosed`` if it is closed.
    """

    def __init__(self, async_worker: AsyncOffloadingWorker) -> None:
        if not isinstance(async_worker, AsyncOffloadingWorker):
            raise InvalidSpec(f"expected an AsyncOffloadingWorker, got {type(async_worker).__name__}")
        async_worker._core.lifecycle.open(Face.SYNC)  # owned by this adapter from now on
        self._worker = async_worker
        self._core = async_worker._core
        self._lifecycle = self._core.lifecycle
        self._unreported: list[TransferResult] = []
        self._lock = threading.Lock()
        self._shutdown_lock = threading.Lock()  # one drain at a time; not held by get_finished

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *, after: Any = None) -> bool:
        """Enqueue a GPU -> host copy; True once enqueued. It waits on ``after``, else on the
        calling thread's current CUDA stream."""
        self._submit(Direction.STORE, job_id, src_spec, dst_spec, after)
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, *, after: Any = None
    ) -> bool:
        """Enqueue a host -> GPU copy; True once enqueued. ``expedited`` loads have their own
        queue, so they never wait behind ordinary ones."""
        self._submit(Direction.of_load(expedited), job_id, src_spec, dst_spec, after)
        return True

    def _submit(self, direction: Direction, job_id: int, src: Any, dst: Any, after: Any) -> None:
        core = self._core
        checked = False
        while True:
            with self._lock:
                self._lifecycle.check_open(Face.SYNC)
                if core.has_room():
                    core.submit(direction, job_id, src, dst, after)
                    return
                if not checked:  # bad input raises now, not once (if ever) there is room
                    core.check(direction, job_id, src, dst, after)
                    checked = True
                pending = core.pending()
            # At the max_in_flight bound: wait (without the lock, so get_finished() and
            # shutdown() go on) for the oldest job to end, then pop what ended. In slices,
            # so a shutdown meanwhile is seen (WorkerClosed) even if that job never ends.
            if pending:
                min(pending, key=lambda j: j.submitted_at).completion.wait(_ROOM_CHECK_SECONDS)
            with self._lock:
                self._unreported.extend(job.result for job in core.poll() if job.result is not None)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call, each reported once, in submission order within
        each direction. Never waits for a transfer; calls on other threads take turns with
        ``submit_*``."""
        with self._lock:
            done = self._unreported
            done.extend(job.result for job in self._core.poll() if job.result is not None)
            self._unreported = []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until those jobs are done (unknown ids are ignored); reports nothing, so
        their results still come from ``get_finished()``. Raises ``InvalidSpec`` unless
        ``job_ids`` is a collection of int ids."""
        self._core.wait_for(job_ids)

    def shutdown(self, *, drain_timeout: float | None = None) -> None:
        """Drain, then free host memory. Results of drained jobs stay for get_finished().

        The drain ends once no job has ended for ``drain_timeout`` seconds (default
        ``WorkerOptions.drain_timeout``, 30 s) or on a KeyboardInterrupt: the jobs still in
        flight are then abandoned (a warning names them, their results report failure)
        and the host pool is kept, not freed, since their copies may still write it. The
        drain does not hold the adapter's lock, so ``get_finished()`` on another thread
        waits at most for the memory to be freed; a second ``shutdown()`` waits for the
        first.
        """
        timeout = self._core.options.drain_timeout_or(drain_timeout)
        with self._shutdown_lock:
            with self._lock:
                if self._lifecycle.begin_close(Face.SYNC) is not State.OPEN:
                    return  # closed (or closing) already
            why = "the drain was interrupted"
            try:
                if not self._core.drain(timeout):
                    why = f"no job ended for {timeout:g} s of the drain (drain_timeout)"
            finally:
                with self._lock:
                    self._core.close(why, report=self._keep)

    def _keep(self, jobs: list[Job]) -> None:
        """Keep the results of jobs the core let go of for ``get_finished()``."""
        self._unreported.extend(job.result for job in jobs if job.result is not None)

    def statistics(self) -> WorkerStatistics:
        """A snapshot: jobs in flight, completed and failed, and bytes moved, per direction."""
        return self._core.statistics()

    def __repr__(self) -> str:
        state = "closed" if self._core.closed else "open"
        return f"<SyncOffloadingWorker {state} in_flight: {self._core.describe_in_flight()}>"
