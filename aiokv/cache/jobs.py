"""The copies one ``OffloadCache`` submits: job ids shared with the other caches of its
worker, the futures still in flight, and the bytes and device time of finished copies."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anyio

from ..errors import DuplicateJob, TransferFailed, UsageError
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
from .counters import Counters
from .protocol import CacheWorker, result_or_none

__all__ = ["Jobs", "Submit"]

Submit = Callable[[CPULoadStoreSpec, list[int]], TransferFuture]


class Jobs:
    """Submits a cache's copies and remembers those in flight."""

    def __init__(self, worker: CacheWorker, job_ids: Iterator[int], counters: Counters) -> None:
        self._worker = worker
        self._job_ids = job_ids
        self._n = counters
        self.in_flight: dict[int, TransferFuture] = {}
        self._on_idle: Callable[[], None] | None = None
        self.closed = False

    def submit(self, submit: Callable[[int], TransferFuture]) -> TransferFuture:
        """Submit under the next free job id (ids the caller uses on the same worker are
        skipped); the future leaves ``in_flight`` before any later done callback runs.
        Refused once the cache closed (a call still in progress when it did), so nothing
        writes chunks the cache gave back."""
        if self.closed:
            raise UsageError("the OffloadCache closed while this call was in progress")
        for _ in range(1024):
            job_id = next(self._job_ids)
            try:
                future = submit(job_id)
            except DuplicateJob:
                continue
            self.in_flight[job_id] = future
            future.add_done_callback(self._landed)
            return future
        raise DuplicateJob("OffloadCache found no free job id in 1024 tries")

    def _landed(self, fut: TransferFuture) -> None:
        self.in_flight.pop(fut.job_id, None)
        if not self.in_flight and self._on_idle is not None:
            on_idle, self._on_idle = self._on_idle, None
            on_idle()

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Refuse further submits, then call ``callback`` now if nothing is in flight, else
        once the last copy ends."""
        self.closed = True
        if self.in_flight:
            self._on_idle = callback
        else:
            callback()

    def loader(self, expedited: bool, after: Any) -> Submit:
        """A function submitting one load (host chunks -> GPU blocks)."""

        def load(src: CPULoadStoreSpec, blocks: list[int]) -> TransferFuture:
            dst = GPULoadStoreSpec(blocks)
            future = self.submit(
                lambda jid: self._worker.submit_load(jid, src, dst, expedited=expedited, after=after)
            )
            future.add_done_callback(lambda fut: self._count_load(fut, Direction.of_load(expedited)))
            return future

        return load

    def store(self, blocks: list[int], chunks: list[int], after: Any) -> TransferFuture:
        """Submit one store (GPU blocks -> absolute host chunks)."""
        src, dst = GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks)
        future = self.submit(lambda jid: self._worker.submit_store(jid, src, dst, after=after))
        future.add_done_callback(self._count_store)
        return future

    def _count_load(self, fut: TransferFuture, direction: Direction) -> None:
        if (res := result_or_none(fut)) is not None:
            self._n.load_bytes += res.transfer_size or 0
            self._n.untimed_loads.append((res, direction))

    def _count_store(self, fut: TransferFuture) -> None:
        if (res := result_or_none(fut)) is not None:
            self._n.store_bytes += res.transfer_size or 0
            self._n.untimed_stores.append(res)

    async def wait(self) -> None:
        """Until every copy in flight now is over (failed ones included)."""
        if not self.in_flight:
            await anyio.lowlevel.checkpoint()
        for future in list(self.in_flight.values()):
            try:
                await future
            except TransferFailed:
                pass  # its done callbacks have run
