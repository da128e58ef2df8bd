"""The synchronous core under both faces: validation, host pool, handlers, bookkeeping.

It changes state and returns what happened; it never awaits and never blocks except in
``wait_for`` and ``wait_all``, which the sync adapter calls from an engine thread, and in
``close``, which waits for what is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .backends import resolve_backend
from .backends.base import HostPool, LaneStatistics
from .errors import DuplicateJob, InvalidSpec, WorkerBroken, WorkerClosed
from .handler import Handler, Job
from .layout import CanonicalKVCaches
from .options import WorkerOptions
from .plan import HostLayout, map_blocks, plan_copies
from .specs import Direction, check_job_id

__all__ = ["OffloadCore", "WorkerStatistics"]

_log = logging.getLogger("aiokv")

@dataclass(frozen=True)
class WorkerStatistics:
    """A snapshot of one worker: jobs and bytes per direction."""

    backend: str
    num_cpu_chunks: int
    chunk_bytes: int
    in_flight: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    # Per direction: the lane's strategy and its counters (``LaneStatistics``).
    lanes: dict[str, LaneStatistics] = field(default_factory=dict)


class OffloadCore:
    """Owns the host pool and one handler per direction; both faces drive it."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_cpu_chunks: int | None = None,
        cpu_bytes: int | None = None,
        blocks_per_chunk: int = 1,
        backend: str = "auto",
        options: WorkerOptions | Mapping[str, Any] | None = None,
    ) -> None:
        kv_caches = CanonicalKVCaches.coerce(kv_caches)
        if not isinstance(blocks_per_chunk, int) or isinstance(blocks_per_chunk, bool):
            raise InvalidSpec(f"blocks_per_chunk must be an int, got {blocks_per_chunk!r}")
        self.options = WorkerOptions.coerce(options)
        self.kv_caches = kv_caches
        self.layout = HostLayout.build(kv_caches, blocks_per_chunk)
        self.num_cpu_chunks = _chunk_count(num_cpu_chunks, cpu_bytes, self.layout.chunk_bytes)
        self.backend = resolve_backend(backend, kv_caches, self.options)
        self.handlers: dict[Direction, Handler] = {}
        try:  # whatever fails, the backend (a CUDA context reference) is released
            self.backend.check_caches(kv_caches)
            self.pool = self.backend.allocate_pool(self.num_cpu_chunks * self.layout.chunk_bytes)
            for d in Direction:
                self.handlers[d] = Handler(d, self.backend.open_lane(d, kv_caches, self.layout, self.pool))
        except BaseException:
            self._release()
            raise
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        self.closed = False
        # A worker dropped without shutdown()/aclose(): say so, let lane threads end, and
        # keep a pinned pool that copies may still write.
        lanes = [h.lane for h in self.handlers.values()]
        self._finalizer = weakref.finalize(self, _abandoned, lanes, self.pool, self.backend.name)
        self._finalizer.atexit = False  # at exit the process frees it all anyway
        # Set by the first job that failed with a sticky device error; refuses new work.
        self.broken: WorkerBroken | None = None

    # -- submitting ---------------------------------------------------------------------

    def submit(self, direction: Direction, job_id: int, src: Any, dst: Any, after: Any = None) -> Job:
        """Validate, plan and launch one job; raises before anything is enqueued."""
        if self.closed:
            raise WorkerClosed("the worker is closed; create a new one to transfer more")
        self.check_healthy()
        check_job_id(job_id)
        gpu, cpu = (src, dst) if direction is Direction.STORE else (dst, src)
        for role, spec in (("GPU", gpu), ("CPU", cpu)):
            if not hasattr(spec, "block_ids"):
                raise InvalidSpec(
                    f"the {role} spec of a {direction.value} must have block_ids "
                    f"(got {type(spec).__name__}); pass GPULoadStoreSpec / CPULoadStoreSpec"
                )
        mapping = map_blocks(
            gpu.block_ids,
            cpu.block_ids,
            layout=self.layout,
            num_chunks=self.num_cpu_chunks,
            group_sizes=getattr(gpu, "group_sizes", None),
            block_indices=getattr(gpu, "block_indices", None),
            unique_gpu=not direction.to_host,
            unique_host=direction.to_host,
        )
        plan = plan_copies(mapping, self.layout)
        with self._lock:
            if job_id in self._jobs:
                raise DuplicateJob(f"job {job_id} is still in flight; use a new id")
            dependency = self.backend.capture(after)
            job = self.handlers[direction].submit(job_id, plan, dependency)
            self._jobs[job_id] = job
        return job

    def check_healthy(self) -> None:
        """Raise ``WorkerBroken`` once a sticky device error was seen."""
        if self.broken is not None:
            raise WorkerBroken(
                f"the device failed under this worker ({self.broken}); every pending job failed. "
                "Close it and create a new worker (the CUDA context may need a process restart)"
            ) from self.broken

    # -- completing ---------------------------------------------------------------------

    def poll(self) -> list[Job]:
        """Pop every finished job, per direction in submission order; never blocks.

        Jobs popped by the poll before are settled first, if ``settle`` has not run."""
        failed: list[Job] = []
        with self._lock:
            done: list[Job] = []
            for handler in self.handlers.values():
                handler.settle()
                if handler.in_flight:
                    done.extend(handler.pop_finished())
            if not done:
                return done  # most polls, while the poller spins on a job in flight
            for job in done:
                del self._jobs[job.job_id]
                if job.error is not None:
                    failed.append(job)
            broke = self.broken is None and any(isinstance(job.error, WorkerBroken) for job in failed)
            if broke:
                self.broken = next(j.error for j in failed if isinstance(j.error, WorkerBroken))
        # Logged outside the lock: a slow handler must not stall submits on other threads.
        # The sync face has no other way to say why (a TransferResult cannot). A logging
        # filter that raises must not lose the jobs popped here: they are forgotten already.
        try:
            if broke:
                _log.error("the device failed under this worker; every pending job fails: %s", self.broken)
            for job in failed:
                if not isinstance(job.error, WorkerBroken):
                    _log.warning("%s job %s failed: %r", job.direction.value, job.job_id, job.error)
        except Exception:
            pass
        return done

    def settle(self) -> None:
        """Read the device time of jobs popped so far and pool their events: call it after
        their waiters were woken, so a wake-up does not wait for that bookkeeping."""
        with self._lock:
            for handler in self.handlers.values():
                handler.settle()

    def holds(self, job_id: int) -> bool:
        """Whether ``job_id`` is in flight (submitted, not yet popped by ``poll``)."""
        return job_id in self._jobs

    def wait_for(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until the given in-flight jobs are done (unknown ids are ignored).

        Pops nothing: results still come from ``poll``. For threads, not event loops.
        """
        with self._lock:
            jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        return _wait_jobs(jobs, timeout)

    def wait_all(self, timeout: float | None = None) -> bool:
        """Block until every job in flight is done."""
        with self._lock:
            jobs = [job for h in self.handlers.values() for job in h.pending()]
        return _wait_jobs(jobs, timeout)

    def heads(self) -> list[Job]:
        """The oldest job still in flight of each direction (the next to finish in each)."""
        with self._lock:
            return [h.head for h in self.handlers.values() if h.head is not None]

    def expected_wait(self) -> float | None:
        """Seconds until the soonest head job should finish (None when unknown)."""
        now = time.perf_counter()
        soonest: float | None = None
        for handler in self.handlers.values():
            wait = handler.expected_wait(now)
            if wait is not None and (soonest is None or wait < soonest):
                soonest = wait
        return soonest

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def is_in_flight(self, job_id: int) -> bool:
        return job_id in self._jobs

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Free lanes and host memory. Callers drain first; in-flight jobs are waited for."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        self.wait_all()
        self.settle()  # read what results still lack before the events are destroyed
        self._release()

    def _release(self) -> None:
        try:
            for handler in self.handlers.values():
                handler.lane.close()
            pool = getattr(self, "pool", None)  # unset if allocating it failed
            if pool is not None:
                pool.close()
        finally:
            self.backend.close()

    def statistics(self) -> WorkerStatistics:
        hs = self.handlers.items()
        return WorkerStatistics(
            backend=self.backend.name,
            num_cpu_chunks=self.num_cpu_chunks,
            chunk_bytes=self.layout.chunk_bytes,
            in_flight={d.value: h.in_flight for d, h in hs},
            completed={d.value: h.completed for d, h in hs},
            failed={d.value: h.failed for d, h in hs},
            bytes_moved={d.value: h.bytes_moved for d, h in hs},
            lanes={d.value: h.lane.statistics() for d, h in hs},
        )

    def describe_in_flight(self) -> str:
        return " ".join(f"{d.value}={h.in_flight}" for d, h in self.handlers.items())


def _wait_jobs(jobs: list[Job], timeout: float | None) -> bool:
    """Wait for every job; ``timeout`` bounds the whole wait, not each job's."""
    if timeout is None:
        return all(job.completion.wait() for job in jobs)
    deadline = time.monotonic() + timeout
    return all(job.completion.wait(max(0.0, deadline - time.monotonic())) for job in jobs)


def _abandoned(lanes: list[Any], pool: HostPool, backend: str) -> None:
    pool.abandon()  # first: under -W error the warning raises
    for lane in lanes:
        lane.abandon()
    warnings.warn(
        f"an aiokv worker ({backend}) was dropped without shutdown() or aclose(), so "
        "nothing waited for its copies" + ("" if backend == "cpu" else " and its pinned memory leaks"),
        ResourceWarning, stacklevel=1,  # a finalizer has no caller to point at
    )


def _chunk_count(num_cpu_chunks: int | None, cpu_bytes: int | None, chunk_bytes: int) -> int:
    """Exactly one of the two sizes: a chunk count, or bytes rounded down to chunks."""
    if (num_cpu_chunks is None) == (cpu_bytes is None):
        raise InvalidSpec("pass exactly one of num_cpu_chunks= and cpu_bytes=")
    if num_cpu_chunks is not None:
        if not isinstance(num_cpu_chunks, int) or isinstance(num_cpu_chunks, bool) or num_cpu_chunks < 1:
            raise InvalidSpec(f"num_cpu_chunks must be a positive int, got {num_cpu_chunks!r}")
        return num_cpu_chunks
    if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes < chunk_bytes:
        raise InvalidSpec(
            f"cpu_bytes must be an int of at least one chunk ({chunk_bytes} bytes), got {cpu_bytes!r}"
        )
    return cpu_bytes // chunk_bytes
