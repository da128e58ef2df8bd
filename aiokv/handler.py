"""One direction's FIFO of jobs: submit in order, pop finished ones from the head.

Only the head needs a query: a lane completes jobs in launch order, so when the head is
not done nothing behind it is either. A poll costs O(1) per direction, not O(jobs).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .backends.base import Completion, Lane
from .plan import CopyPlan
from .specs import Direction, TransferResult

__all__ = ["Handler", "Job", "Wait"]


@dataclass(eq=False)
class Job:
    """A submitted transfer and, once popped, its result."""

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

    def submit(self, job_id: int, plan: CopyPlan, dependency: Any) -> Job:
        """Launch the plan behind every earlier job of this direction; never blocks."""
        # The device may start on the first copies while the host still issues the rest,
        # so ``Job.started_at`` prefers the backend's stamp of when the copies were handed
        # over, and falls back on this time, before the launch.
        started = time.perf_counter()
        completion = self.lane.launch(plan, dependency)
        job = Job(job_id, self.direction, plan.total_bytes, completion, plan=plan, submitted_at=started)
        self._fifo.append(job)
        self.submitted += 1
        return job

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
