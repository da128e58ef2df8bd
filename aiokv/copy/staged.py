"""Device-side gather into a staging buffer laid out like the host chunks, then large DMAs.

The host layout is chunk-contiguous (plan.py), so a job's host bytes form a few long
runs (one per run of chunks). A store gathers the job's pages on the device, at HBM
speed, into a staging buffer in host order, then moves each run with one large DMA
(spread over several streams). A load does the reverse. The gather (store) or the DMA
into staging (load) runs on a side stream, so it overlaps the previous job's second
half; the main stream keeps the lane's order and carries the end event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..plan import CopyPlan
from . import CopyContext, CopyStrategy, copy_unit
from .dma import DmaBatch, MultiStreamDma
from .kernel import MIN_UNIT, RowPlan, RowViews, row_plan, upload

__all__ = ["StagedCopy"]


@dataclass
class StagedJob:
    rows: RowPlan
    total: int
    run_host: np.ndarray  # host offset of each run
    run_stage: np.ndarray  # staging offset of each run
    run_bytes: np.ndarray


def staged_job(plan: CopyPlan) -> StagedJob:
    """Order copies by host offset, assign staging offsets, merge host-adjacent copies into runs."""
    order = np.argsort(plan.host_offset, kind="stable")
    h = plan.host_offset[order]
    n = plan.nbytes[order]
    stage_sorted = np.cumsum(n) - n
    stage = np.empty_like(stage_sorted)
    stage[order] = stage_sorted
    breaks = np.flatnonzero(h[1:] != h[:-1] + n[:-1]) + 1
    starts = np.concatenate(([0], breaks))
    run_bytes = np.add.reduceat(n, starts) if n.size else n
    unit = copy_unit(plan)
    return StagedJob(
        rows=row_plan(plan, stage, unit),
        total=int(n.sum()),
        run_host=h[starts],
        run_stage=stage_sorted[starts],
        run_bytes=run_bytes,
    )


class StagedCopy(CopyStrategy):
    """Large DMAs against a chunk-ordered staging buffer; short device gathers/scatters."""

    name = "staged"

    def __init__(self, ctx: CopyContext) -> None:
        self.ctx = ctx
        drv = ctx.driver
        self.main_stream = drv.create_stream(high_priority=True)
        self.side_stream = drv.create_stream(high_priority=True)
        self.ready = drv.create_event()
        dev = ctx.device
        self.torch_main = torch.cuda.ExternalStream(int(self.main_stream), device=dev)
        self.torch_side = torch.cuda.ExternalStream(int(self.side_stream), device=dev)
        self.views = RowViews(ctx)
        # Stores DMA from the main stream; loads DMA into staging on the side stream.
        home = self.main_stream if ctx.to_host else self.side_stream
        self.dma = MultiStreamDma(ctx, home, ctx.streams or 8)

    def prepare(self, plan: CopyPlan) -> StagedJob | DmaBatch | None:
        if len(plan) == 0:
            return None
        if copy_unit(plan) < MIN_UNIT:
            return self.dma.split(*self.ctx.pointers(plan))
        return staged_job(plan)

    def _runs(self, job: StagedJob, staging: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stage = (job.run_stage + staging.data_ptr()).astype(np.int64).view(np.uint64)
        host = (job.run_host + self.ctx.host_base).astype(np.int64).view(np.uint64)
        size = job.run_bytes.astype(np.int64).view(np.uint64)
        return (host, stage, size) if self.ctx.to_host else (stage, host, size)

    def enqueue(self, job: StagedJob | DmaBatch | None, dependency: Any, start: Any, stop: Any) -> None:
        drv, main, side = self.ctx.driver, self.main_stream, self.side_stream
        if not isinstance(job, StagedJob):
            # Empty, or rows too small to gather well: plain DMA from the DMA's home stream.
            home = self.dma.home
            if dependency is not None:
                drv.stream_wait(home, dependency)
            drv.record(start, home)
            if job is not None:
                self.dma.issue(job)
            if home is not main:
                drv.record(self.ready, home)
                drv.stream_wait(main, self.ready)
            drv.record(stop, main)
            return
        unit = job.rows.unit
        dtype = self.views.element(unit)
        if self.ctx.to_host:
            # Side: wait for the source's writer, gather into staging. Main: DMA the runs.
            if dependency is not None:
                drv.stream_wait(side, dependency)
            drv.record(start, side)
            with torch.cuda.stream(self.torch_side):
                staging = torch.empty(job.total, dtype=torch.uint8, device=self.ctx.device)
                rows = RowViews.rows(staging, unit, dtype)
                idx = upload(job.rows.idx, self.ctx.device)
                for t, lo, hi in job.rows.groups:
                    dev = self.views.device(t, unit)
                    rows.index_copy_(0, idx[1, lo:hi], dev.index_select(0, idx[0, lo:hi]))
                staging.record_stream(self.torch_main)
            drv.record(self.ready, side)
            drv.stream_wait(main, self.ready)
            self.dma.issue(self.dma.split(*self._runs(job, staging)))
        else:
            # Side: DMA the runs into staging (host data is stable). Main: wait for the
            # destination's readers, then scatter.
            with torch.cuda.stream(self.torch_side):
                staging = torch.empty(job.total, dtype=torch.uint8, device=self.ctx.device)
                idx = upload(job.rows.idx, self.ctx.device)
                staging.record_stream(self.torch_main)
                idx.record_stream(self.torch_main)
            drv.record(start, side)
            self.dma.issue(self.dma.split(*self._runs(job, staging)))
            drv.record(self.ready, side)
            if dependency is not None:
                drv.stream_wait(main, dependency)
            drv.stream_wait(main, self.ready)
            with torch.cuda.stream(self.torch_main):
                rows = RowViews.rows(staging, unit, dtype)
                for t, lo, hi in job.rows.groups:
                    dev = self.views.device(t, unit)
                    dev.index_copy_(0, idx[0, lo:hi], rows.index_select(0, idx[1, lo:hi]))
        drv.record(stop, main)

    def close(self) -> None:
        self.dma.close()
        self.ctx.driver.destroy_stream(self.side_stream)
        self.ctx.driver.destroy_stream(self.main_stream)
