"""Batched memcpy on the copy engines, one job spread over several streams.

One ``cuMemcpyBatchAsync`` call feeds one copy engine and is descriptor-bound for pages
under about 512 KiB; the device has several engines, so a job's descriptors are cut
into byte-balanced slices, each issued on its own stream. Those streams fork from the
lane's main stream (an event) and join back into it (one event each), so the job's end
event on the main stream marks completion and jobs of one direction stay in order.
Pointer arrays are built in numpy once per job and handed to the driver as they are.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...plan import CopyPlan
from .pitched import plan_pitched
from .strategy import DEFAULT_DMA_STREAMS, MIN_PITCHED_HEIGHT, CopyContext, CopyStrategy, byte_splits

__all__ = ["DmaCopy", "MultiStreamDma", "stream_parts"]

# A slice smaller than this is not worth its own stream (its fork and join cost device time).
MIN_SLICE_BYTES = 2 << 20
# Nor is a job slice of fewer descriptors: each stream's batch call and fork/join edges cost
# host time, and a few large copies keep an engine busy anyway (large copies move at the
# same rate on one stream as on many). Beside a busy Python thread each batch call (it drops
# the GIL) costs a switch interval. So 128 copies of 2 MiB go as one call on one stream: a
# shorter submit, beside a busy thread too, and the same rate both directions at once
# (docs/performance.md, "Submit threads").
MIN_SLICE_DESCRIPTORS = 128
# Below this many descriptors a thread handoff costs more than the driver call it spreads.
MIN_THREADED_DESCRIPTORS = 1024
# Pitched jobs are few, large ops: one engine already runs them near the ceiling, and each
# extra stream is another batch call (beside a busy Python thread, another switch interval)
# and a fork and a join: one stream gives the same round trip idle as four, and a submit a
# quarter as long beside a busy thread (docs/performance.md, "Copy strategies").
PITCHED_STREAMS = 1


@dataclass
class DmaBatch:
    """One job's descriptors and where they are cut between streams."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    bounds: list[int]


@dataclass
class PitchedBatch:
    """One job as packed 2D copies (``Driver.pitched_ops`` rows), cut between streams."""

    ops: np.ndarray
    bounds: list[int]


def stream_parts(total_bytes: int, descriptors: int, max_streams: int, min_descriptors: int = 1) -> int:
    """How many streams a job of ``descriptors`` copies and ``total_bytes`` is spread over."""
    by_bytes = total_bytes // MIN_SLICE_BYTES
    by_count = descriptors // max(1, min_descriptors)
    return max(1, min(max_streams, by_bytes, by_count))


class MultiStreamDma:
    """Issues batches from a home stream over ``streams`` forked sub-streams."""

    def __init__(self, ctx: CopyContext, home: Any, streams: int) -> None:
        self.driver = ctx.driver
        self.to_host = ctx.to_host
        self.home = home
        self.max_streams = max(1, streams)
        self.subs: list[Any] = []
        self.joins: list[Any] = []
        self.fork = None
        # The driver spends host time on every descriptor; issuing the slices from several
        # threads (their batch calls drop the GIL) can overlap that cost ("Submit threads").
        self.threads = (
            ThreadPoolExecutor(ctx.submit_threads, thread_name_prefix="aiokv-dma-submit")
            if ctx.submit_threads > 1 else None
        )
        try:
            if self.max_streams > 1:
                self.fork = self.driver.create_event()
                for _ in range(self.max_streams):
                    self.subs.append(self.driver.create_stream())
                    self.joins.append(self.driver.create_event())
        except BaseException:
            self.close()
            raise

    def split(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, min_descriptors: int = 1
    ) -> DmaBatch:
        """Cut a job between streams: byte-balanced slices of at least ``MIN_SLICE_BYTES``
        and ``min_descriptors`` copies each."""
        total = int(sizes.sum()) if sizes.size else 0
        parts = stream_parts(total, int(sizes.shape[0]), self.max_streams, min_descriptors)
        return DmaBatch(dst, src, sizes, byte_splits(sizes, parts))

    def split_pitched(self, ops: np.ndarray, nbytes: np.ndarray) -> PitchedBatch:
        total = int(nbytes.sum()) if nbytes.size else 0
        parts = min(self.max_streams, PITCHED_STREAMS, max(1, total // MIN_SLICE_BYTES))
        return PitchedBatch(ops, byte_splits(nbytes, parts))

    def _put(
        self, batch: DmaBatch | PitchedBatch, lo: int, hi: int, stream: Any, stream_ordered: bool,
        hold_gil: bool | None,
    ) -> None:
        if isinstance(batch, PitchedBatch):
            self.driver.memcpy_pitched(batch.ops[lo:hi], stream, hold_gil=hold_gil)
        elif hi - lo == 1:  # one copy: cheaper to enqueue plain than as a batch of one
            self.driver.memcpy(int(batch.dst[lo]), int(batch.src[lo]), int(batch.sizes[lo]), stream)
        else:
            self.driver.memcpy_batch(batch.dst[lo:hi], batch.src[lo:hi], batch.sizes[lo:hi], stream,
                                     stream_ordered=stream_ordered, to_host=self.to_host, hold_gil=hold_gil)

    def issue(self, batch: DmaBatch | PitchedBatch, *, stream_ordered: bool = True, fork: Any = None,
              hold_gil: bool | None = None) -> None:
        """Enqueue the batch behind everything already on ``home``; ``home`` waits for it.

        ``fork``: an event the caller just recorded on ``home`` (saves recording another).
        ``hold_gil``: passed to the driver's batched calls (``CopyStrategy``), except those
        of the submit threads, which drop it to run side by side.
        """
        drv, bounds = self.driver, batch.bounds
        nparts = len(bounds) - 1
        if nparts <= 1 or not self.subs:
            self._put(batch, 0, bounds[-1], self.home, stream_ordered, hold_gil)
            return
        if fork is None:
            fork = self.fork
            drv.record(fork, self.home)
        if (self.threads is not None and isinstance(batch, DmaBatch)
                and batch.sizes.shape[0] >= MIN_THREADED_DESCRIPTORS):
            self._issue_threaded(batch, stream_ordered, fork)
            return
        issued = 0
        try:
            for i in range(nparts):
                lo, hi = bounds[i], bounds[i + 1]
                sub = self.subs[i]
                drv.stream_wait(sub, fork)
                issued = i + 1
                self._put(batch, lo, hi, sub, stream_ordered, hold_gil)
        finally:
            # Join every stream that may hold work, even after a failure, so the home
            # stream's next event still covers it.
            for i in range(issued):
                drv.record(self.joins[i], self.subs[i])
                drv.stream_wait(self.home, self.joins[i])

    def _issue_threaded(self, batch: DmaBatch, stream_ordered: bool, fork: Any) -> None:
        drv, bounds = self.driver, batch.bounds

        def part(i: int) -> None:
            drv.ensure_context()
            lo, hi = bounds[i], bounds[i + 1]
            drv.stream_wait(self.subs[i], fork)
            drv.memcpy_batch(batch.dst[lo:hi], batch.src[lo:hi], batch.sizes[lo:hi], self.subs[i],
                             stream_ordered=stream_ordered, to_host=self.to_host, hold_gil=False)

        assert self.threads is not None
        nparts = len(bounds) - 1
        futures = [self.threads.submit(part, i) for i in range(nparts)]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
        # Join every sub-stream (a join on one that holds nothing is harmless).
        for i in range(nparts):
            drv.record(self.joins[i], self.subs[i])
            drv.stream_wait(self.home, self.joins[i])
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=True)
        for s in self.subs:
            self.driver.destroy_stream(s)
        self.subs = []


class DmaCopy(CopyStrategy):
    """Copy engines only: the choice that holds up while the GPU computes."""

    name = "dma"

    def __init__(self, ctx: CopyContext) -> None:
        self.ctx = ctx
        self.pitched_jobs = 0  # jobs that went as pitched copies (``Lane.statistics``)
        self.main_stream = ctx.driver.create_stream()
        try:
            self.dma = MultiStreamDma(ctx, self.main_stream, ctx.streams or DEFAULT_DMA_STREAMS)
        except BaseException:
            ctx.driver.destroy_stream(self.main_stream)
            raise

    def prepare(self, plan: CopyPlan) -> DmaBatch | PitchedBatch:
        ctx = self.ctx
        if ctx.runs and plan.mapping is not None:
            pitched = plan_pitched(plan.mapping, ctx.layout, ctx.runs, ctx.device_base)
            # Against the page count, not len(plan): that would build the 1-D plan anyway.
            if len(pitched) * MIN_PITCHED_HEIGHT <= plan.num_pages:
                self.pitched_jobs += 1
                return self.dma.split_pitched(*ctx.pitched(pitched))
        return self.dma.split(*ctx.pointers(plan), min_descriptors=MIN_SLICE_DESCRIPTORS)

    def enqueue(self, prepared: DmaBatch | PitchedBatch, dependency: Any, start: Any, stop: Any, *,
                hold_gil: bool | None = None) -> None:
        drv, main = self.ctx.driver, self.main_stream
        if dependency is not None:
            drv.stream_wait(main, dependency)
        drv.record(start, main)
        self.dma.issue(prepared, fork=start, hold_gil=hold_gil)
        drv.record(stop, main)

    def close(self) -> None:
        self.dma.close()
        self.ctx.driver.destroy_stream(self.main_stream)
