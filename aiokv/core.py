"""The synchronous core under both faces: lifecycle, validation (once), host pool,
handlers, bookkeeping, and the rules of waiting (drain, backpressure) both faces share.

It changes state and returns what happened; it never awaits and blocks only in
``wait_for``, which the sync face calls from an engine thread. Where a face must wait
(for room under ``max_in_flight``, for a drain), the core says what to wait on next
(``room``, ``Drain.next``) and each face chooses how: the sync face blocks its thread, the
async face naps on its loop. Faces check only the calling thread and the lifecycle
(``lifecycle.check_open``); every check of what a call passes happens here.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .backends import resolve_backend
from .backends.base import HostPool, Lane, LaneStatistics
from .errors import DuplicateJob, InvalidSpec, QueueFull, WorkerBroken, WorkerClosed
from .handler import Handler, Job, Wait
from .host_layout import HostLayout
from .host_memory import available_host_memory, check_pool_fits  # the first re-exported
from .layers import LayerStatistics, Layerwise, LayerwiseJob
from .layout import CanonicalKVCaches
from .lifecycle import Lifecycle, State
from .options import WorkerOptions, chunk_count
from .plan import CopyPlan, map_blocks, plan_copies, plan_ids
from .specs import Direction, as_count, as_job_id, side_of

__all__ = ["Drain", "OffloadCore", "WorkerStatistics", "available_host_memory"]

_log = logging.getLogger("aiokv")

# How long a face waiting on one job's end goes before it asks again: another direction's
# head may end first, and a submit blocked at the bound must see a shutdown meanwhile.
_SLICE_SECONDS = 0.05


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
    # Layerwise jobs: pushes, gates, failed layers and per-layer stalls.
    layers: LayerStatistics = field(default_factory=LayerStatistics)


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
        strategy: str | None = None,
        options: WorkerOptions | Mapping[str, Any] | None = None,
    ) -> None:
        kv_caches = CanonicalKVCaches.coerce(kv_caches)
        blocks_per_chunk = as_count(blocks_per_chunk, "blocks_per_chunk")
        self.options = WorkerOptions.coerce(options)
        if strategy is not None:
            self.options = self.options.with_strategy(strategy)
        self.kv_caches = kv_caches
        self.layout = HostLayout.build(kv_caches, blocks_per_chunk)
        self.num_cpu_chunks = chunk_count(num_cpu_chunks, cpu_bytes, self.layout.chunk_bytes)
        check_pool_fits(self.num_cpu_chunks, self.layout.chunk_bytes)
        self.lifecycle = Lifecycle()
        self.backend = resolve_backend(backend, kv_caches, self.options)
        self.handlers: dict[Direction, Handler] = {}
        try:  # whatever fails, the backend (a CUDA context reference) is released
            self.backend.check_caches(kv_caches)
            self.pool = self.backend.allocate_pool(self.num_cpu_chunks * self.layout.chunk_bytes,
                                                   self.options.host_pool_file)
            for d in Direction:
                self.handlers[d] = Handler(d, self.backend.open_lane(d, kv_caches, self.layout, self.pool))
        except BaseException:
            self._release()
            raise
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()
        # The backend plans a job of one group from its ids itself (a native planner): hand
        # it the ids, checked as it plans them (``plan.IdPlan``).
        self._plans_ids = bool(getattr(self.backend, "plans_ids", False))
        self.layerwise = Layerwise(kv_caches, self.layout, self.backend, self._lock, self.lifecycle)
        # A worker dropped without shutdown()/aclose(): say so, let lane threads end, and
        # keep a pinned pool that copies may still write.
        self._finalizer = weakref.finalize(
            self, _abandoned, list(self.handlers.values()), self.pool, self.backend.name, self.lifecycle
        )
        self._finalizer.atexit = False  # at exit the process frees it all anyway
        # Set by the first job that failed with a sticky device error; refuses new work.
        self.broken: WorkerBroken | None = None

    # -- submitting ---------------------------------------------------------------------

    def submit(
        self, direction: Direction, job_id: Any, src: Any, dst: Any, after: Any = None,
        *, reserved: Collection[int] = (),
    ) -> Job:
        """Validate, plan and launch one job; raises before anything is enqueued.

        The face checked the lifecycle and the calling thread. ``reserved`` holds ids the
        face still holds for jobs the core reported already (the async face's futures not
        resolved yet), which may not be reused until it lets them go.
        """
        self.check_healthy()
        job_id, plan = self._plan(direction, job_id, src, dst)
        bound = self.options.max_in_flight
        with self._lock:
            self._check_new_id(job_id, reserved)
            if bound and len(self._jobs) >= bound:
                raise self._full(bound)
            dependency = self.backend.capture(after)
            job = self.handlers[direction].submit(job_id, plan, dependency)
            self._jobs[job_id] = job
        return job

    def submit_layers(self, direction: Direction, job_id: Any, src: Any, dst: Any, after: Any = None,
                      *, reserved: Collection[int] = ()) -> LayerwiseJob:
        """``submit`` of a layerwise job (``aiokv.layers``): a load's layers are enqueued now,
        a store's as they are pushed; ``InvalidSpec`` where the layout has no layers."""
        self.check_healthy()
        job_id, plan = self._plan(direction, job_id, src, dst)
        layers = self.layerwise.plan(plan, direction, after)
        bound = self.options.max_in_flight
        with self._lock:
            self._check_new_id(job_id, reserved)
            if bound and len(self._jobs) >= bound:
                raise self._full(bound)
            dependency = None if direction.to_host else self.backend.capture(after)
            job = self.layerwise.submit(self.handlers[direction], job_id, layers, dependency)
            self._jobs[job_id] = job._job
        return job

    def _full(self, bound: int) -> QueueFull:
        return QueueFull(f"{len(self._jobs)} jobs are in flight, the bound set by max_in_flight={bound}; "
                         "wait for room (await worker.wait_for_room()) and submit again")

    def check(
        self, direction: Direction, job_id: Any, src: Any, dst: Any, after: Any = None
    ) -> None:
        """Raise what ``submit`` would raise for this input, except ``QueueFull``; enqueue
        nothing. A face that waits for room checks first, so bad input raises at once
        rather than after (or, behind a job that never ends, instead of) the wait.
        ``job_id=None`` checks the specs alone (callers that pick ids later)."""
        self.check_healthy()
        if job_id is None:
            self._plan(direction, 0, src, dst)[1].check()
        else:
            job_id, plan = self._plan(direction, job_id, src, dst)
            plan.check()
            with self._lock:
                self._check_new_id(job_id, ())
        self.check_ready(after)

    def check_ready(self, after: Any = None) -> None:
        """Raise what a submit would raise for the worker's health or ``after`` (checked
        without recording anything)."""
        self.check_healthy()
        if after is not None:
            self.backend.check_after(after)

    def _plan(self, direction: Direction, job_id: Any, src: Any, dst: Any) -> tuple[int, CopyPlan]:
        """The job id as an int and the copy plan of the specs; raises ``InvalidSpec``."""
        job_id = as_job_id(job_id)
        gpu, cpu = (src, dst) if direction is Direction.STORE else (dst, src)
        for role, spec in (("GPU", gpu), ("CPU", cpu)):
            if not hasattr(spec, "block_ids"):
                raise InvalidSpec(
                    f"the {role} spec of a {direction.value} must have block_ids "
                    f"(got {type(spec).__name__}); pass GPULoadStoreSpec / CPULoadStoreSpec"
                )
            side = side_of(spec)
            if side is not None and side != role:
                raise InvalidSpec(
                    f"the {role} side of a {direction.value} got a {type(spec).__name__}, which "
                    f"describes {side} blocks: are source and destination swapped? A store takes "
                    "(GPU spec, CPU spec), a load (CPU spec, GPU spec)"
                )
        group_sizes, block_indices = getattr(gpu, "group_sizes", None), getattr(gpu, "block_indices", None)
        if self._plans_ids:
            plan = plan_ids(gpu.block_ids, cpu.block_ids, layout=self.layout, num_chunks=self.num_cpu_chunks,
                            group_sizes=group_sizes, block_indices=block_indices,
                            unique_gpu=not direction.to_host, unique_host=direction.to_host)
            if plan is not None:
                return job_id, plan
        mapping = map_blocks(
            gpu.block_ids, cpu.block_ids, layout=self.layout, num_chunks=self.num_cpu_chunks,
            group_sizes=group_sizes, block_indices=block_indices,
            unique_gpu=not direction.to_host, unique_host=direction.to_host,
        )
        return job_id, plan_copies(mapping, self.layout)

    def _check_new_id(self, job_id: int, reserved: Collection[int]) -> None:
        """Refuse an id still in use (call under the lock)."""
        if job_id in self._jobs:
            raise DuplicateJob(f"job {job_id} is still in flight; use a new id")
        if job_id in reserved:
            raise DuplicateJob(f"job {job_id} finished but its future is not resolved yet; reuse it after")

    def check_healthy(self) -> None:
        """Raise ``WorkerBroken`` once a sticky device error was seen."""
        if self.broken is not None:
            raise WorkerBroken(
                f"the device failed under this worker ({self.broken}); every pending job failed. "
                "Close it and create a new worker (the CUDA context may need a process restart)"
            ) from self.broken

    def has_room(self) -> bool:
        """Whether a submit would pass the ``max_in_flight`` bound now."""
        bound = self.options.max_in_flight
        return not bound or len(self._jobs) < bound

    def room(self) -> Wait | None:
        """None while a submit would pass the ``max_in_flight`` bound; else what to wait on
        for a slot. Slots free up only as ``poll`` pops ended jobs: poll after the wait."""
        if self.has_room():
            return None
        return self.next_end(_SLICE_SECONDS)

    # -- completing ---------------------------------------------------------------------

    def poll(self) -> list[Job]:
        """Pop every finished job, per direction in submission order; never blocks.

        Jobs popped by the poll before are settled first, if ``settle`` has not run."""
        failed: list[Job] = []
        with self._lock:
            done: list[Job] = []
            for handler in self.handlers.values():
                done.extend(handler.poll())
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

    def wait_for(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until the given in-flight jobs are done (unknown ids are ignored).

        Pops nothing: results still come from ``poll``. For threads, not event loops.
        Raises ``InvalidSpec`` unless ``job_ids`` is an iterable of int ids.
        """
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
            raise InvalidSpec(f"job_ids must be a collection of job ids, got {type(job_ids).__name__}")
        ids = [as_job_id(j) for j in job_ids]
        with self._lock:
            jobs = [self._jobs[j] for j in ids if j in self._jobs]
        return _wait_jobs(jobs, timeout)

    def next_end(self, bound: float) -> Wait | None:
        """What a waiting face waits on next: the oldest job in flight (the oldest head), for
        at most ``bound`` seconds, or a slice of that while several directions are busy
        (another head may end first) or no bound is set (a thread's wait without a timeout
        is, on CUDA, one blocking driver call, where a KeyboardInterrupt lands only once the
        job ends); None when nothing is in flight."""
        heads = self.heads()
        if not heads:
            return None
        timeout = min(bound, _SLICE_SECONDS) if len(heads) > 1 or math.isinf(bound) else bound
        oldest = min(heads, key=lambda j: j.submitted_at)
        return Wait(oldest, timeout)

    def drain(self, idle_timeout: float, collect: Callable[[], object]) -> Drain:
        """The drain of a closing face (once closing began), its idle clock starting now;
        ``collect`` pops what ended and reports it the face's way (see ``Drain``). Open
        layerwise stores take no more pushes: each ends behind the layers it has."""
        with self._lock:
            self.layerwise.seal("the worker is closing")
        return Drain(self, idle_timeout, collect)

    @property
    def ended(self) -> int:
        """Jobs popped so far (completed or failed), every direction: a drain's progress."""
        return sum(h.completed + h.failed for h in self.handlers.values())

    def heads(self) -> list[Job]:
        """The oldest job still in flight of each direction (the next to finish in each)."""
        with self._lock:
            return [h.head for h in self.handlers.values() if h.head is not None]

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet popped by ``poll``."""
        return len(self._jobs)

    @property
    def num_gpu_blocks(self) -> int:
        """GPU blocks addressable in every group (block ids must be below this)."""
        return min(self.layout.num_gpu_blocks)

    # -- lifetime -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.lifecycle.state is State.CLOSED

    def close(
        self, why: str = "", report: Callable[[list[Job]], object] | None = None
    ) -> tuple[list[Job], list[Job]]:
        """Free lanes and host memory; returns (jobs finished since the last poll, jobs
        abandoned). Callers drain first: a job still running then is abandoned (failed with
        ``WorkerClosed``, named in a warning that says ``why``), its lane let go and the
        host pool kept, since its copy may still write it. Idempotent.

        ``report`` is handed both lists' jobs, results set, before anything is let go, so
        an interrupt or a teardown error there costs no job its report."""
        if self.closed:
            return [], []
        self._finalizer.detach()
        try:
            finished = self.poll()
            with self._lock:
                abandoned = [job for h in self.handlers.values() for job in h.abandon()]
                for job in abandoned:
                    del self._jobs[job.job_id]
            self.settle()  # read what results still lack before the events are destroyed
            self.layerwise.close()  # and the gates' stall samples
            error = WorkerClosed("the worker closed before this job's copy ended; it was abandoned "
                                 "(its bytes may or may not have moved)")
            for job in abandoned:
                job.fail(error)
            self.layerwise.abandon(abandoned, error)
            try:
                if report is not None:
                    report(finished + abandoned)
            finally:
                if abandoned:
                    self._abandon(abandoned, why)
                else:
                    self._release()
        finally:
            self.lifecycle.finish_close()
        return finished, abandoned

    def _abandon(self, jobs: list[Job], why: str) -> None:
        busy = {job.direction for job in jobs}
        try:
            for direction, handler in self.handlers.items():
                if direction in busy:
                    handler.lane.abandon()  # its thread or stream may still run the copy
                else:
                    handler.lane.close()
            self.pool.abandon()
        finally:
            # The backend stays open (a lane may still use it); the pool stays referenced.
            names = ", ".join(f"{job.direction.value} job {job.job_id}" for job in jobs[:20])
            more = f" and {len(jobs) - 20} more" if len(jobs) > 20 else ""
            warnings.warn(
                f"an aiokv worker ({self.backend.name}) closed with {len(jobs)} job(s) still in "
                f"flight{f' ({why})' if why else ''}: {names}{more}. Their futures/results "
                "fail; the host pool is kept, not freed, since their copies may still write it",
                RuntimeWarning, stacklevel=3,
            )

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
            layers=self.layerwise.statistics(),
        )

    def describe(self) -> str:
        """The middle of both faces' reprs: backend, pool size, jobs in flight per direction."""
        in_flight = " ".join(f"{d.value}={h.in_flight}" for d, h in self.handlers.items())
        return f"backend={self.backend.name} chunks={self.num_cpu_chunks} in_flight: {in_flight}"


class Drain:
    """One drain's idle clock, the same for both faces: it ends once nothing is in flight,
    or gives up once no job has ended, in any direction, for ``idle_timeout`` seconds (a
    long queue that keeps finishing jobs drains to the end). ``why`` is what a close that
    abandons jobs then says: an interrupt, unless the drain ended by itself."""

    def __init__(self, core: OffloadCore, idle_timeout: float, collect: Callable[[], object]) -> None:
        self._source, self.idle_timeout, self._collect = core, idle_timeout, collect
        self._ended, self._last_end = core.ended, time.monotonic()
        self.why = "the drain was interrupted"

    def next(self) -> Wait | None:
        """Collect what ended, then say what to wait on next; None once the drain is over
        (every job ended, or the idle bound passed: ``why`` says so)."""
        self._collect()
        core, now = self._source, time.monotonic()
        ended = core.ended  # jobs a face's own poller popped meanwhile count too
        if ended != self._ended:
            self._ended, self._last_end = ended, now
        left = self._last_end + self.idle_timeout - now
        wait = core.next_end(left)
        if wait is None:
            self.why = ""
        elif left <= 0:
            self.why = f"no job ended for {self.idle_timeout:g} s of the drain (drain_timeout)"
            wait = None
        return wait


def _wait_jobs(jobs: list[Job], timeout: float | None) -> bool:
    """Wait for every job; ``timeout`` bounds the whole wait, not each job's."""
    if timeout is None:
        return all(job.completion.wait() for job in jobs)
    deadline = time.monotonic() + timeout
    return all(job.completion.wait(max(0.0, deadline - time.monotonic())) for job in jobs)


def _abandoned(handlers: list[Handler], pool: HostPool, backend: str, lifecycle: Lifecycle) -> None:
    """The worker was collected without being closed: let its lanes go and say so."""
    in_flight = sum(h.in_flight for h in handlers)
    pool.abandon()  # first: under -W error the warning raises
    lanes: list[Lane] = [h.lane for h in handlers]
    for lane in lanes:
        lane.abandon()
    if lifecycle.state is State.NEW:
        what = "it was never opened, so no copies ran"
    elif in_flight:
        what = f"{in_flight} job(s) were still in flight and nothing waited for their copies"
    else:
        what = "no copies were in flight"
    memory = ("its host memory is freed with it" if backend == "cpu"
              else "its pinned memory leaks (kept until the process exits: the device may write it)")
    warnings.warn(
        f"an aiokv worker ({backend}) was dropped without shutdown() or aclose(); {what}; {memory}",
        ResourceWarning, stacklevel=1,  # a finalizer has no caller to point at
    )
