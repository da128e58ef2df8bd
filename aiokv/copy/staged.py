"""A device gather into a staging ring laid out like the host chunks, then a few large DMAs.

Why: a per-layer job is thousands of small pages. As one DMA descriptor each, the driver
spends ~0.65-0.9 us of host time per page (60-80% of the transfer on the H200), and the
copy engines lose ~25% of their rate on 32 KiB pieces under a GEMM. Here one launch of the
piece kernel (``pieces.py``) gathers a slice of the job at HBM speed into a staging slot in
host order, and the slot moves as runs of whole host chunks, the sizes at which the copy
engines hold their rate under load. Slices alternate between two slots, so the gather of
one overlaps the DMA of the one before. Loads run the other way: DMA into a slot, scatter.

Two streams per lane: the kernel stream (high priority, so its short launches take SMs
from a GEMM as soon as some free up) and the DMA stream. The stream that ends a job is the
lane's main stream: the DMA stream for stores, the kernel stream for loads. Jobs that are
not 16-byte aligned or hold a piece larger than a slot go as batched DMA from the main
stream; under ``auto`` so do jobs of few pieces or of large ones (the copy engines already
run 2 MiB pages at the ceiling).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..plan import CopyPlan
from . import DEFAULT_DMA_STREAMS, CopyContext, CopyStrategy
from .dma import MIN_SLICE_DESCRIPTORS, DmaBatch, MultiStreamDma
from .pieces import PieceKernel, fits, piece_table

__all__ = ["StagedCopy"]

_log = logging.getLogger("aiokv")

SLOTS = 2
# Mean piece size from which a job goes straight to the copy engines: 2 MiB pages ran at
# 0.97-1.00 of the ceiling idle and under the GEMMs with 2.6-3.8% of host time in the driver.
DIRECT_PIECE_BYTES = 1 << 20
# Below this many pieces a job is a few descriptors: one batched call beats a launch.
MIN_STAGED_PIECES = 64


@dataclass
class StagedJob:
    """One job in host order, cut into slices that each fit a staging slot."""

    device: np.ndarray  # device address of each piece (uint64)
    in_slot: np.ndarray  # offset of each piece in its slice's slot (uint64)
    slice_of: np.ndarray  # slice index of each piece
    nbytes: np.ndarray  # uint64
    bounds: list[int]  # pieces [bounds[s], bounds[s + 1]) form slice s
    longest: int
    run_host: np.ndarray  # host address of each run of host-adjacent pieces (uint64)
    run_slot: np.ndarray  # its offset in the slot (uint64)
    run_bytes: np.ndarray  # uint64
    run_bounds: list[int]  # runs [run_bounds[s], run_bounds[s + 1]) belong to slice s

    @property
    def slices(self) -> int:
        return len(self.bounds) - 1


def staged_job(device: np.ndarray, host: np.ndarray, nbytes: np.ndarray, slot_bytes: int) -> StagedJob:
    """Sort pieces by host address, cut slices of at most ``slot_bytes``, merge runs (numpy)."""
    order = np.argsort(host, kind="stable")
    h, n, d = host[order], nbytes[order], device[order]
    end = np.cumsum(n)
    start = end - n
    bounds = [0]
    while bounds[-1] < n.size:  # a few slices per job; each cut is a binary search
        lo = bounds[-1]
        bounds.append(int(np.searchsorted(end, start[lo] + slot_bytes, side="right")))
    counts = np.diff(bounds)
    slice_of = np.repeat(np.arange(len(counts)), counts)
    in_slot = start - np.repeat(start[bounds[:-1]], counts)
    # A run ends where the host bytes stop being adjacent or a slice ends.
    cut = np.zeros(n.size, dtype=bool)
    cut[0] = True
    cut[1:] = h[1:] != h[:-1] + n[:-1]
    cut[bounds[:-1]] = True
    starts = np.flatnonzero(cut)
    return StagedJob(
        device=d.astype(np.uint64),
        in_slot=in_slot.astype(np.uint64),
        slice_of=slice_of,
        nbytes=n.astype(np.uint64),
        bounds=bounds,
        longest=int(n.max()),
        run_host=h[starts].astype(np.uint64),
        run_slot=in_slot[starts].astype(np.uint64),
        run_bytes=np.add.reduceat(n, starts).astype(np.uint64),
        run_bounds=np.searchsorted(starts, bounds).tolist(),
    )


class StagedCopy(CopyStrategy):
    """Gather (or scatter) on the SMs in one launch per slice; DMA whole chunks."""

    name = "staged"

    def __init__(self, ctx: CopyContext, only_where_it_gains: bool = False) -> None:
        self.ctx = ctx
        # ``auto``: jobs of few or large pieces go straight to DMA. ``staged``: every job
        # that fits the ring goes through it.
        self.only_where_it_gains = only_where_it_gains
        self.slot_bytes = ctx.staging_bytes // SLOTS
        drv = ctx.driver
        self.kernel = PieceKernel(drv, ctx.device)
        self.staged_jobs = 0  # jobs that went through the ring (tests and the bench read it)
        self.full = [drv.create_event() for _ in range(SLOTS)]  # events go with the driver
        self.free = [drv.create_event() for _ in range(SLOTS)]
        self.joined = drv.create_event()
        self.kernel_stream = drv.create_stream(high_priority=True)
        try:
            self.dma_stream = drv.create_stream()
        except BaseException:
            drv.destroy_stream(self.kernel_stream)
            raise
        self.main_stream = self.dma_stream if ctx.to_host else self.kernel_stream
        try:
            self.dma = MultiStreamDma(ctx, self.main_stream, ctx.streams or DEFAULT_DMA_STREAMS)
        except BaseException:
            drv.destroy_stream(self.kernel_stream)
            drv.destroy_stream(self.dma_stream)
            raise
        self.staging: torch.Tensor | None = None
        self.next_slot = 0

    def prepare(self, plan: CopyPlan) -> StagedJob | DmaBatch:
        ctx = self.ctx
        dst, src, sizes = ctx.pointers(plan)
        pieces = int(sizes.shape[0])
        gains = pieces >= MIN_STAGED_PIECES and int(sizes.sum()) < DIRECT_PIECE_BYTES * pieces
        if (pieces == 0 or (self.only_where_it_gains and not gains)
                or int(sizes.max()) > self.slot_bytes or not fits(dst, src, sizes)):
            return self.dma.split(dst, src, sizes, min_descriptors=MIN_SLICE_DESCRIPTORS)
        if self.staging is None and not self._allocate_staging():
            return self.dma.split(dst, src, sizes, min_descriptors=MIN_SLICE_DESCRIPTORS)
        device, host = (src, dst) if ctx.to_host else (dst, src)
        return staged_job(device, host, sizes, self.slot_bytes)

    def _allocate_staging(self) -> bool:
        """Take the ring on first use, so a lane that never stages holds none. Without the
        memory, every job goes as plain DMA from then on."""
        try:
            self.staging = torch.empty(SLOTS * self.slot_bytes, dtype=torch.uint8, device=self.ctx.device)
        except torch.OutOfMemoryError:
            _log.warning("no device memory for %d bytes of staging; copying with DMA only",
                         SLOTS * self.slot_bytes)
            self.slot_bytes = 0
            return False
        return True

    def enqueue(self, job: StagedJob | DmaBatch, dependency: Any, start: Any, stop: Any) -> None:
        drv, main = self.ctx.driver, self.main_stream
        if isinstance(job, DmaBatch):
            if dependency is not None:
                drv.stream_wait(main, dependency)
            drv.record(start, main)
            self.dma.issue(job, fork=start)
            drv.record(stop, main)
            return
        assert self.staging is not None
        self.staged_jobs += 1
        slots = (self.next_slot + np.arange(job.slices)) % SLOTS
        self.next_slot = (self.next_slot + job.slices) % SLOTS
        slot_base = np.uint64(self.staging.data_ptr()) + slots.astype(np.uint64) * np.uint64(self.slot_bytes)
        staged = slot_base[job.slice_of] + job.in_slot
        k, d = self.kernel_stream, self.dma_stream
        drv.record(start, d)
        src, dst = (job.device, staged) if self.ctx.to_host else (staged, job.device)
        table = self.kernel.upload(piece_table(src, dst, job.nbytes), k)
        if self.ctx.to_host and dependency is not None:
            drv.stream_wait(k, dependency)  # the source's pending writers
        try:
            for s in range(job.slices):
                slot = int(slots[s])
                lo, hi = job.bounds[s], job.bounds[s + 1]
                rlo, rhi = job.run_bounds[s], job.run_bounds[s + 1]
                runs_slot = slot_base[s] + job.run_slot[rlo:rhi]
                runs_host, sizes = job.run_host[rlo:rhi], job.run_bytes[rlo:rhi]
                if self.ctx.to_host:
                    drv.stream_wait(k, self.free[slot])
                    self.kernel.launch(table, hi - lo, job.longest, k, first=lo)
                    drv.record(self.full[slot], k)
                    drv.stream_wait(d, self.full[slot])
                    drv.memcpy_batch(runs_host, runs_slot, sizes, d, to_host=True)
                    drv.record(self.free[slot], d)
                else:
                    drv.stream_wait(d, self.free[slot])
                    drv.memcpy_batch(runs_slot, runs_host, sizes, d, to_host=False)
                    drv.record(self.full[slot], d)
                    drv.stream_wait(k, self.full[slot])
                    if s == 0 and dependency is not None:
                        drv.stream_wait(k, dependency)  # the destination's pending readers
                    self.kernel.launch(table, hi - lo, job.longest, k, first=lo)
                    drv.record(self.free[slot], k)
        except BaseException:
            # The main stream's next event must cover what the other stream holds.
            drv.record(self.joined, k if self.ctx.to_host else d)
            drv.stream_wait(main, self.joined)
            raise
        drv.record(stop, main)

    def close(self) -> None:
        self.dma.close()
        self.ctx.driver.destroy_stream(self.kernel_stream)
        self.ctx.driver.destroy_stream(self.dma_stream)
        self.kernel.close()
        self.staging = None
