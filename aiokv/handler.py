"""One direction's FIFO of jobs: submit in order, pop finished ones from the head.

Only the head needs a query: a lane completes jobs in launch order, so when the head is
not done nothing behind it is either. A poll costs O(1) per direction, not O(jobs).

A layerwise store is enqueued a layer at a time, as the forward pass pushes them. While
one is open (layers still to come), every later job of its direction is **held**: a plain
job is launched once the open store has all its layers, a later layerwise store's pushes
are enqueued then. So the lane still sees every job's copies in submission order, and two
stores to one chunk land in that order; only the oldest open store has copies still to
come (docs/layerwise.md, "Ordering").
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .backends.base import Completion, FailedCompletion, Lane, LayerRun
from .doorbell import Doorbell
from .layer_plan import LayerPlan
from .plan import CopyPlan
from .specs import Direction, TransferResult

__all__ = ["Handler", "HeldCompletion", "Job", "LayerJob", "Wait"]


@dataclass(eq=False)
class Job:
    """A submitted transfer and, once popped, its result."""

    # Whether its host-clock span and device time measure the lane's copy rate.
    teaches_rate: ClassVar[bool] = True
    job_id: int
    direction: Direction
    nbytes: int
    completion: Completion
    result: TransferResult | None = None
    error: BaseException | None = None
    # Keeps the plan alive until the copy is over (a lane may read it asynchronously).
    plan: CopyPlan | None = field(default=None, repr=False)
    # When the launch began (the device may start then) and when it returned (the job
    # cannot have been seen finished before this; a CUDA lane's issuer thread may still be
    # enqueueing it, and the job is not done before that either).
    submitted_at: float = field(default_factory=time.perf_counter, repr=False)
    launched_at: float = field(default_factory=time.perf_counter, repr=False)
    # Set when popped: when the poll found it done, and the last time before that a poll
    # saw its direction's head not done (or its launch, if later). Their difference bounds
    # how late the job's end was noticed.
    noticed_at: float = field(default=0.0, repr=False)
    running_seen_at: float = field(default=0.0, repr=False)

    @property
    def started_at(self) -> float:
        """When the device could start: the backend's stamp, else the launch's start."""
        started = self.completion.started_at
        return self.submitted_at if started is None else started

    def finish(self) -> TransferResult:
        """Turn the completion into a result and drop what the copy no longer needs."""
        err = self.completion.error
        if err is None:
            # The device time is read when first asked for, or by ``Handler.settle``.
            timer = _elapsed_of(self.completion)
            self.result = TransferResult.timed_later(self.job_id, self.nbytes, timer,
                                                     self.direction.transfer_type)
        else:
            self.fail(_without_frames(err))
        self.plan = None
        return self.result  # type: ignore[return-value]

    def fail(self, error: BaseException) -> TransferResult:
        """Report the job failed with ``error`` (its copy failed, or was abandoned)."""
        self.error = error
        self.result = TransferResult(self.job_id, False, transfer_type=self.direction.transfer_type)
        return self.result


@dataclass(eq=False)
class LayerJob(Job):
    """A layerwise job: ``run`` holds its layers' ends. A store held behind an open one
    gets its pushes enqueued by ``release`` (True once it then has every layer)."""

    # Its time says little of the lane's rate (a store waits on the forward between
    # pushes; a load runs on one stream): the poller's forecast does not learn from it.
    teaches_rate: ClassVar[bool] = False
    run: LayerRun | None = field(default=None, repr=False)
    release: Callable[[], bool] | None = field(default=None, repr=False)


class HeldCompletion(Completion):
    """The end of a job held behind an open layerwise store: not on the device yet. Once
    launched it answers as the lane's completion does; doorbells and waits asked for
    before then carry over."""

    def __init__(self, plan: CopyPlan, dependency: Any) -> None:
        self._plan: CopyPlan | None = plan
        self._dependency = dependency
        self._real: Completion | None = None
        self._launched = threading.Event()
        self._lock = threading.Lock()
        self._bells: list[Doorbell] = []
        self._error = self._elapsed = self._started = None

    def launch(self, lane: Lane) -> None:
        """Launch the held job now (a failure fails the job: it was accepted at submit)."""
        plan, dependency, self._plan, self._dependency = self._plan, self._dependency, None, None
        try:
            real = lane.launch(plan, dependency)  # type: ignore[arg-type]
        except Exception as exc:
            real = FailedCompletion(exc)
        with self._lock:
            self._real = real
            bells, self._bells = self._bells, []
            self._launched.set()
        for bell in bells:
            if not real.ring_when_done(bell):
                bell.ring()  # the poller then falls back to polling

    def query(self) -> bool:
        real = self._real
        return real is not None and real.query()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._launched.wait(timeout):
            return False
        real = self._real
        assert real is not None
        return real.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def ring_when_done(self, bell: Doorbell) -> bool:
        with self._lock:
            real = self._real
            if real is None:
                self._bells.append(bell)
                return True
        return real.ring_when_done(bell)

    @property
    def started_at(self) -> float | None:
        real = self._real
        return None if real is None else real.started_at

    @property
    def error(self) -> BaseException | None:
        real = self._real
        return None if real is None else real.error

    @property
    def elapsed(self) -> float | None:
        real = self._real
        return None if real is None else real.elapsed

    def settle(self) -> None:
        if self._real is not None:
            self._real.settle()


@dataclass(frozen=True)
class Wait:
    """What a face waits on next (the core says which): ``job``'s end, for at most
    ``timeout`` seconds (None: no bound) before it asks again. A thread blocks on it; a
    loop naps instead."""

    job: Job
    timeout: float | None

    def block(self) -> bool:
        """Block the calling thread until the job ended or the timeout passed."""
        return self.job.completion.wait(self.timeout)


_NONE: list[Job] = []  # what ``Handler.poll`` returns with nothing in flight: never mutated


def _elapsed_of(completion: Completion) -> Callable[[], float | None]:
    return lambda: completion.elapsed


def _without_frames(err: BaseException) -> BaseException:
    """The error with its tracebacks dropped, its causes' too: the frames are the lane's (a
    thread holding the host pool), and a caller may keep the error, through its future,
    long after the worker closed."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return err


class Handler:
    """Submits one direction's jobs to its lane and pops them in submission order."""

    def __init__(self, direction: Direction, lane: Lane) -> None:
        self.direction = direction
        self.lane = lane
        self._fifo: deque[Job] = deque()
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.bytes_moved = 0
        # When a query last found the head not done (see ``Job.running_seen_at``).
        self._last_miss = 0.0
        # Finished jobs whose completions are not settled yet (see ``settle``).
        self._unsettled: list[Job] = []
        # The oldest layerwise store with layers still to come, and the jobs after it.
        self._open: LayerJob | None = None
        self._held: deque[Job] = deque()

    def submit(self, job_id: int, plan: CopyPlan, dependency: Any) -> Job:
        """Launch the plan behind every earlier job of this direction; never blocks.

        While a layerwise store is open the instance's ``submit`` is ``_submit_held``
        instead, so this path does not even test for one."""
        # The device may start on the first copies while the host still issues the rest,
        # so ``Job.started_at`` prefers the backend's stamp of when the copies were handed
        # over, and falls back on this time, before the launch.
        started = time.perf_counter()
        completion = self.lane.launch(plan, dependency)
        job = Job(job_id, self.direction, plan.total_bytes, completion, plan=plan, submitted_at=started)
        self._fifo.append(job)
        self.submitted += 1
        return job

    def _submit_held(self, job_id: int, plan: CopyPlan, dependency: Any) -> Job:
        """``submit`` while a layerwise store is open: the job waits in the FIFO, held, its
        dependency pinned now (its launch comes from whichever thread completes the store).
        Its plan is checked now: bad input raises at submit, not when the job is launched."""
        plan.check()
        self.lane.fix(dependency)
        job = Job(job_id, self.direction, plan.total_bytes, HeldCompletion(plan, dependency), plan=plan)
        self._fifo.append(job)
        self._held.append(job)
        self.submitted += 1
        return job

    def launch_layers(self, job_id: int, plan: LayerPlan, dependency: Any) -> LayerJob:
        """A layerwise load: every layer enqueued now, like any job of the direction."""
        started = time.perf_counter()
        run = self.lane.launch_layers(plan, dependency)
        job = LayerJob(job_id, self.direction, plan.total_bytes, run.completion, submitted_at=started,
                       run=run)
        self._fifo.append(job)
        self.submitted += 1
        return job

    def open_layers(self, job_id: int, plan: LayerPlan,
                    release: Callable[[], bool]) -> tuple[LayerJob, bool]:
        """A layerwise store, nothing enqueued yet; and whether its pushes go to the lane at
        once (False: it waits behind an open store, and ``release`` runs when its turn
        comes). Later jobs are held until it has every layer (``pushed_all``)."""
        run = self.lane.open_layers(plan)
        job = LayerJob(job_id, self.direction, plan.total_bytes, run.completion, run=run, release=release)
        self._fifo.append(job)
        self.submitted += 1
        if self._open is None and not self._held:
            self._open = job
            self.submit = self._submit_held  # type: ignore[method-assign]
            return job, True
        self._held.append(job)
        return job, False

    @property
    def open_store(self) -> LayerJob | None:
        """The layerwise store whose pushes go to the lane now, if one is open."""
        return self._open

    def pushed_all(self, job: LayerJob) -> None:
        """The open store has all its layers (pushed, or refused at close): launch what was
        held behind it, in order, up to the next layerwise store still short of layers."""
        if job is not self._open:
            return
        self._open = None
        while self._held:
            nxt = self._held.popleft()
            if isinstance(nxt, LayerJob):
                self._open = nxt
                if nxt.release is None or not nxt.release():
                    return  # still short of layers: the rest stays held behind it
                self._open = None
            elif isinstance(nxt.completion, HeldCompletion):
                nxt.completion.launch(self.lane)
        del self.submit  # back to the class's: launch at once

    def pop_finished(self) -> list[Job]:
        """Pop finished jobs from the head, in submission order."""
        done: list[Job] = []
        fifo = self._fifo
        while fifo:
            if not fifo[0].completion.query():
                self._last_miss = time.perf_counter()
                break
            job = fifo.popleft()
            job.noticed_at = time.perf_counter()
            job.running_seen_at = max(self._last_miss, job.launched_at)
            result = job.finish()
            if result.success:
                self.completed += 1
                self.bytes_moved += job.nbytes
                self._unsettled.append(job)
            else:
                self.failed += 1
            done.append(job)
        return done

    def poll(self) -> list[Job]:
        """``settle`` what an earlier poll popped, then ``pop_finished``: the core's poll
        of this direction, in one call (the poller makes it every spinning turn)."""
        if self._unsettled:
            self.settle()
        return self.pop_finished() if self._fifo else _NONE

    def settle(self) -> None:
        """Settle the completions of jobs popped earlier (read their device times). Run
        after their waiters were woken, so the reads are off the wake-up path."""
        if not self._unsettled:
            return
        jobs, self._unsettled = self._unsettled, []
        for job in jobs:
            job.completion.settle()

    def abandon(self) -> list[Job]:
        """Forget every job not popped yet and return them, oldest first (their copies may
        still run: the worker is closing without them)."""
        jobs = list(self._fifo)
        self._fifo.clear()
        self.failed += len(jobs)
        if self._open is not None or self._held:
            self._open = None
            self._held.clear()
            del self.submit
        return jobs

    @property
    def in_flight(self) -> int:
        return len(self._fifo)

    @property
    def head(self) -> Job | None:
        return self._fifo[0] if self._fifo else None

    def pending(self) -> list[Job]:
        """A snapshot of jobs not yet popped, oldest first."""
        return list(self._fifo)

    def __repr__(self) -> str:
        return f"<Handler {self.direction.value} in_flight={self.in_flight} completed={self.completed}>"
