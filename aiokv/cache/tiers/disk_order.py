"""The disk tier's read order: read calls served earliest first by every read thread, and
writes that yield to them.

A server restores several requests at once (the next ones beside the model), each as
read calls of a few blocks (its batches). Given threads of their own, those calls share
the disk: every restore then ends at the pace of all of them, the earliest as late as the
last. Here every call joins one queue, ordered by the ``order`` it gives (a restore's
ticket, then its batch's position; calls without one go by arrival), and a read thread
that frees up takes the earliest call that has blocks left and room for another thread:
one request's reads at the full rate, then the next's, so the earliest request finishes
first and the model can start on it while the next one reads (docs/tiers.md, "Reads in
arrival order").

The calls' own tasks do the work, there is no scheduler task: a call runs its share of
threads (``threads``), each taking the earliest open call when it gets a thread, its own
or an earlier one, until its own call has no block left to take; then it waits for its
blocks in flight. Writes of blocks on their way down go one at a time at the device
while reads are queued or running (``WriteGate``), so a restore does not share the disk
with up to ``io_threads`` writes; they never stop, so the cache's backpressure slows the
writers' offers instead of dropping them.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import anyio.to_thread

__all__ = ["UNORDERED", "ReadJob", "ReadOrder", "WriteGate", "rank_of"]

UNORDERED = 1 << 62
"""The rank of a call without an order: after every ordered one (ranks fit a C long long)."""
_POSITION_BITS = 24


def rank_of(order: tuple[int, int] | None) -> int:
    """The rank of a call of ``order`` (restore, position): lower goes first."""
    if order is None:
        return UNORDERED
    restore, position = order
    rank = (max(0, restore) << _POSITION_BITS) | min(max(0, position), (1 << _POSITION_BITS) - 1)
    return min(rank, UNORDERED - 1)


class WriteGate:
    """Writes at the device at once: ``slots``, or one while reads are waiting or running.

    Entered by the write threads around each block's write; the read order (on the event
    loop) says when reads start and stop (``reading``)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._writing = 0
        self._reads = 0
        self._cond = threading.Condition()
        self.waits = 0
        """Writes that found no slot free and waited (for tests and benches)."""

    def reading(self, n: int) -> None:
        """Reads queued or running now (0 lets every slot write again)."""
        with self._cond:
            self._reads = n
            if n == 0:
                self._cond.notify_all()

    def __enter__(self) -> WriteGate:
        with self._cond:
            if self._writing >= (1 if self._reads else self.slots):
                self.waits += 1
            while self._writing >= (1 if self._reads else self.slots):
                self._cond.wait()
            self._writing += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._writing -= 1
            self._cond.notify()


@dataclass(eq=False)
class ReadJob:
    """One read call: ``run(rank)`` reads its blocks until none is left to take (several
    threads may run it at once, sharing its queue), ``threads`` of them at most; at the
    device, a lower rank takes a free slot first."""

    key: tuple[int, int]  # its rank, then its arrival
    run: Callable[[int], None]
    threads: int
    joined: int = 0  # threads that took it
    running: int = 0  # of them, still reading
    drained: bool = False  # a thread came back from it: no block is left to take
    done: anyio.Event = field(default_factory=anyio.Event)
    error: Exception | None = None

    @property
    def open(self) -> bool:
        """Whether another thread can take blocks of it now."""
        return not self.drained and self.joined < self.threads


class ReadOrder:
    """The read calls of one tier, in order (module docs); ``threads`` read at once."""

    def __init__(self, threads: int, gate: WriteGate | None = None) -> None:
        self._free = threads  # read threads not taken
        self._limiter = anyio.CapacityLimiter(threads)  # never waited on: ``_free`` bounds it
        self._changed = anyio.Event()  # a thread came free or a call changed: look again
        self._looking = 0  # helpers waiting on ``_changed``
        self._queue: list[ReadJob] = []  # by key: the earliest first
        self._seq = itertools.count()
        self._gate = gate
        self._active = 0  # calls queued or reading

    async def run(self, work: Callable[[int], None], threads: int,
                  order: tuple[int, int] | None = None) -> None:
        """Run ``work(rank)`` (blocking, shared by up to ``threads`` threads, each running
        it until it has nothing left to take) in its turn, and return once it is done. A
        cancelled call whose work began waits for it (it writes into the caller's
        buffers); one not yet begun is dropped from the queue."""
        job = ReadJob((rank_of(order), next(self._seq)), work, max(1, threads))
        bisect.insort(self._queue, job, key=lambda j: j.key)
        self._moved(1)
        self._wake()
        try:
            if job.threads == 1:  # no task group: most calls of small blocks take one thread
                await self._help(job)
            else:
                async with anyio.create_task_group() as tg:
                    for _ in range(job.threads - 1):
                        tg.start_soon(self._help, job)
                    await self._help(job)
            await job.done.wait()
        except BaseException:
            if job.joined == 0:  # nothing of it began: it never will
                job.drained = True
                self._finish(job)
            else:
                with anyio.CancelScope(shield=True):
                    await job.done.wait()
            raise
        if job.error is not None:
            raise job.error

    async def _help(self, own: ReadJob) -> None:
        """Read for the earliest open call, each time a thread is free, until ``own`` has
        nothing left to take (another call's helper may have taken it meanwhile)."""
        while own.open:
            job = self._head() if self._free else None
            if job is None:
                self._looking += 1
                try:
                    await self._changed.wait()
                finally:
                    self._looking -= 1
                continue
            await anyio.lowlevel.checkpoint_if_cancelled()  # a cancelled helper takes none
            self._free -= 1
            job.joined += 1
            job.running += 1
            self._wake()  # the call may have no room for more threads now
            try:
                # Shielded: a job taken is run. The thread writes the job's buffers, and a
                # cancel before it started (anyio checkpoints first) would drain and finish
                # a job, maybe another restore's, that nothing read.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(job.run, job.key[0], limiter=self._limiter)
            except Exception as exc:
                job.error = job.error or exc
            finally:
                self._free += 1
                job.running -= 1
                job.drained = True
                if job.running == 0:
                    self._finish(job)
                self._wake()

    def _wake(self) -> None:
        """Let every waiting helper look again (a thread came free, a call came or left);
        a new event only when one waits (making one costs the loop microseconds)."""
        if self._looking:
            self._changed.set()
            self._changed = anyio.Event()

    def _head(self) -> ReadJob | None:
        """The earliest call another thread can take blocks of (drained ones leave)."""
        queue = self._queue
        while queue and queue[0].drained:
            queue.pop(0)
        return next((job for job in queue if job.open), None)

    def _finish(self, job: ReadJob) -> None:
        if job.done.is_set():
            return
        job.done.set()
        if job in self._queue:
            self._queue.remove(job)
        self._moved(-1)
        self._wake()

    def _moved(self, n: int) -> None:
        self._active += n
        if self._gate is not None and (self._active == 0 or (n > 0 and self._active == 1)):
            self._gate.reading(self._active)
