"""Batched memcpy on the copy engines, one job spread over several streams.

One ``cuMemcpyBatchAsync`` call feeds one copy engine and is descriptor-bound for pages
under about 512 KiB; the device has several engines, so a job's descriptors are cut
into byte-balanced slices, each issued on its own stream. Those streams fork from the
lane's main stream (an event) and join back into it (one event each), so the job's end
event on the main stream marks completion and jobs of one direction stay in order.
Pointer arrays are built in numpy once per job and handed to the driver as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..plan import CopyPlan
from . import DEFAULT_DMA_STREAMS, CopyContext, CopyStrategy, byte_splits

__all__ = ["DmaCopy", "MultiStreamDma"]

# A slice smaller than this is not worth its own stream (fork/join cost ~10 us of device time).
MIN_SLICE_BYTES = 2 << 20


@dataclass
class DmaBatch:
    """One job's descriptors and where they are cut between streams."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    bounds: np.ndarray


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
        try:
            if self.max_streams > 1:
                self.fork = self.driver.create_event()
                for _ in range(self.max_streams):
                    self.subs.append(self.driver.create_stream())
                    self.joins.append(self.driver.create_event())
        except BaseException:
            self.close()
            raise

    def split(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> DmaBatch:
        total = int(sizes.sum()) if sizes.size else 0
        parts = min(self.max_streams, max(1, total // MIN_SLICE_BYTES))
        return DmaBatch(dst, src, sizes, byte_splits(sizes, parts))

    def issue(self, batch: DmaBatch, *, stream_ordered: bool = True) -> None:
        """Enqueue the batch behind everything already on ``home``; ``home`` waits for it."""
        drv, bounds = self.driver, batch.bounds
        nparts = len(bounds) - 1
        if nparts <= 1 or not self.subs:
            drv.memcpy_batch(batch.dst, batch.src, batch.sizes, self.home,
                             stream_ordered=stream_ordered, to_host=self.to_host)
            return
        drv.record(self.fork, self.home)
        issued = 0
        try:
            for i in range(nparts):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                sub = self.subs[i]
                drv.stream_wait(sub, self.fork)
                issued = i + 1
                drv.memcpy_batch(batch.dst[lo:hi], batch.src[lo:hi], batch.sizes[lo:hi], sub,
                                 stream_ordered=stream_ordered, to_host=self.to_host)
        finally:
            # Join every stream that may hold work, even after a failure, so the home
            # stream's next event still covers it.
            for i in range(issued):
                drv.record(self.joins[i], self.subs[i])
                drv.stream_wait(self.home, self.joins[i])

    def close(self) -> None:
        for s in self.subs:
            self.driver.destroy_stream(s)
        self.subs = []


class DmaCopy(CopyStrategy):
    """Copy engines only: the choice that holds up while the GPU computes."""

    name = "dma"

    def __init__(self, ctx: CopyContext) -> None:
        self.ctx = ctx
        self.main_stream = ctx.driver.create_stream()
        try:
            self.dma = MultiStreamDma(ctx, self.main_stream, ctx.streams or DEFAULT_DMA_STREAMS)
        except BaseException:
            ctx.driver.destroy_stream(self.main_stream)
            raise

    def prepare(self, plan: CopyPlan) -> DmaBatch:
        return self.dma.split(*self.ctx.pointers(plan))

    def enqueue(self, prepared: DmaBatch, dependency: Any, start: Any, stop: Any) -> None:
        drv, main = self.ctx.driver, self.main_stream
        if dependency is not None:
            drv.stream_wait(main, dependency)
        drv.record(start, main)
        self.dma.issue(prepared)
        drv.record(stop, main)

    def close(self) -> None:
        self.dma.close()
        self.ctx.driver.destroy_stream(self.main_stream)
