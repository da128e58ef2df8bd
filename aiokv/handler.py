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

__all__ = ["Handler", "Job"]

# How late a job may run past its predicted end and still be spun for (see expected_wait).
_SLACK_SHARE = 0.25
_MAX_SLACK = 2e-3


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
    # Whether the job will ring the async face's doorbell when it ends (None: it cannot).
    bell_armed: bool | None = field(default=False, repr=False)
    # Host-clock span from when it could start to when it was seen done (a rate estimate
    # for when the device time is unknown).
    host_span: float = field(default=0.0, repr=False)

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
            self.error = _without_frames(err)
            self.result = TransferResult(self.job_id, False, transfer_type=self.direction.transfer_type)
        self.plan = None
        return self.result


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
        # Observed bytes/s of large jobs (EWMA), to predict when the head will finish.
        self._rate: float | None = None
        self._last_done = 0.0
        # When a query last found the head not done, and, per finished job, how long before
        # it was seen done that could have been: an upper bound on how late completion
        # was noticed (the benchmark reports it as the wake-up latency).
        self._last_miss = 0.0
        self.detect_windows: deque[float] = deque(maxlen=4096)
        # Finished jobs whose completions are not settled yet (see ``settle``).
        self._unsettled: list[Job] = []

    def submit(self, job_id: int, plan: CopyPlan, dependency: Any) -> Job:
        """Launch the plan behind every earlier job of this direction; never blocks."""
        # The device may start on the first copies while the host still issues the rest,
        # so a job's predicted end counts from the backend's stamp of when the copies were
        # handed over (``Job.started_at``), or from here, before the launch, without one.
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
            seen = time.perf_counter()
            self.detect_windows.append(seen - max(self._last_miss, job.launched_at))
            result = job.finish()
            if result.success:
                self.completed += 1
                self.bytes_moved += job.nbytes
                job.host_span = seen - max(job.started_at, self._last_done)
                self._unsettled.append(job)
            else:
                self.failed += 1
            self._last_done = time.perf_counter()
            done.append(job)
        return done

    def settle(self) -> None:
        """Settle the completions of jobs popped earlier and learn the rate from them. Run
        after their waiters were woken, so the device-time reads are off the wake-up path."""
        if not self._unsettled:
            return
        jobs, self._unsettled = self._unsettled, []
        for job in jobs:
            job.completion.settle()
            self._learn_rate(job)

    def _learn_rate(self, job: Job) -> None:
        elapsed = job.completion.elapsed
        if elapsed is None:
            elapsed = job.host_span
        if job.nbytes >= 1 << 20 and elapsed > 0:
            rate = job.nbytes / elapsed
            self._rate = rate if self._rate is None else 0.8 * self._rate + 0.2 * rate

    def expected_wait(self, now: float) -> float | None:
        """Seconds until the head job should finish, from the observed rate; None if unknown.

        A job a little late (under a quarter of its predicted time, at most 2 ms) reads as
        due now (0.0), so the poller keeps spinning for it instead of taking a ~1 ms nap;
        later than that, the prediction is stale and the true (negative) value is returned.
        """
        if not self._fifo or self._rate is None:
            return None
        head = self._fifo[0]
        span = head.nbytes / self._rate
        eta = max(head.started_at, self._last_done) + span - now
        if -min(_MAX_SLACK, _SLACK_SHARE * span) < eta < 0:
            return 0.0
        return eta

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
