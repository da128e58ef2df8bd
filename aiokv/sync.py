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
from .errors import WorkerClosed
from .specs import Direction, TransferResult
from .worker import AsyncOffloadingWorker, _State

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
    def wait(self, job_ids: set[int]) -> None:
        """Block until those jobs are done; unknown ids are ignored; reports nothing."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Drain everything in flight, then release memory."""


class SyncOffloadingWorker(OffloadingWorker):
    """Blocking face of an ``AsyncOffloadingWorker`` that was never opened on a loop.

    Bad input raises the same typed errors as the async face; ``True`` means enqueued.
    Each copy waits on the calling thread's current CUDA stream at submit time.
    """

    def __init__(self, async_worker: AsyncOffloadingWorker) -> None:
        if not isinstance(async_worker, AsyncOffloadingWorker):
            raise TypeError(f"expected an AsyncOffloadingWorker, got {type(async_worker).__name__}")
        if async_worker._state is not _State.NEW:
            raise WorkerClosed(
                "the async worker is already in use (open on an event loop, wrapped by "
                "another SyncOffloadingWorker) or closed; give the sync adapter a fresh one"
            )
        async_worker._state = _State.OPEN  # owned by this adapter from now on
        self._worker = async_worker
        self._core = async_worker._core
        self._unreported: list[TransferResult] = []
        self._lock = threading.Lock()
        self._closing = False  # shutdown() has begun: submits are refused from then on
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
        with self._lock:
            if self._closing:
                raise WorkerClosed("this worker was shut down; create a new one to transfer more")
            self._core.submit(direction, job_id, src, dst, after)

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
        their results still come from ``get_finished()``."""
        self._core.wait_for(job_ids)

    def shutdown(self) -> None:
        """Drain, then free host memory. Results of drained jobs stay for get_finished().

        The drain does not hold the adapter's lock, so ``get_finished()`` on another thread
        waits at most for the memory to be freed; a second ``shutdown()`` waits for the
        first.
        """
        with self._shutdown_lock:
            with self._lock:
                self._closing = True
                if self._core.closed:
                    return
            self._core.wait_all()
            with self._lock:
                for job in self._core.poll():
                    if job.result is not None:
                        self._unreported.append(job.result)
                self._core.close()
                self._worker._state = _State.CLOSED
                self._worker._closed.set()  # what the async face's aclose() waits for

    def statistics(self) -> WorkerStatistics:
        """A snapshot: jobs in flight, completed and failed, and bytes moved, per direction."""
        return self._core.statistics()

    def __repr__(self) -> str:
        state = "closed" if self._core.closed else "open"
        return f"<SyncOffloadingWorker {state} in_flight: {self._core.describe_in_flight()}>"
