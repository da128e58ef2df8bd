"""A device gather into a staging ring laid out like the host chunks, then a few large DMAs.

Why: a per-layer job is thousands of small pages. As one DMA descriptor each, the driver
spends host time on every page, and the copy engines lose rate on small pieces under a
GEMM (docs/performance.md, "Copy strategies"). Here one launch of the
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

from ...plan import CopyPlan
from .dma import MIN_SLICE_DESCRIPTORS, DmaBatch, MultiStreamDma
from .pieces import PieceKernel, fits
from .strategy import DEFAULT_DMA_STREAMS, CopyContext, CopyStrategy

__all__ = ["StagedCopy"]

_log = logging.getLogger("aiokv")

SLOTS = 2
# Mean piece size from which a job goes straight to the copy engines: they hold their rate
# on pieces this large, idle and under a GEMM (docs/performance.md, "Copy strategies").
DIRECT_PIECE_BYTES = 1 << 20
# Below this many pieces a job is a few descriptors: one batched call beats a launch.
MIN_STAGED_PIECES = 64


@dataclass
class StagedJob:
    """One job as the piece kernel's page table and block rows, cut into slices that each
    fit a slot; a slice's blocks have their images one after another from its slot's start.

    Slices cut the blocks (``by_block``: every page of each block, the lane's own page
    table) or, for jobs planned piece by piece, the pages of one block per slice (the
    job's own table, uploaded with it).
    """

    pages: np.ndarray | None  # (P, 4) uint64 (base, stride, bytes, offset); None: the lane's
    rows: np.ndarray  # (B,) uint32 device row of each block
    image_step: int  # bytes between the images of a slice's consecutive blocks
    by_block: bool
    bounds: list[int]  # slice s is rows [bounds[s], bounds[s + 1]) of blocks or pages
    longest: int
    # The DMA runs, one column each, int64 rows: host address, offset in the slot, bytes.
    # One C-contiguous (3, runs) array, so a slice's batched call takes pointers into it
    # with no per-call conversion (``_move``; replace it whole, never with a view).
    runs: np.ndarray
    run_bounds: list[int]  # runs [run_bounds[s], run_bounds[s + 1]) belong to slice s
    npages: int  # page rows a block has
    runs_at: int = 0  # address of ``runs`` (C-contiguous), read by the first batched slice

    @property
    def slices(self) -> int:
        return len(self.bounds) - 1

    @property
    def run_host(self) -> np.ndarray:
        return self.runs[0]

    @property
    def run_slot(self) -> np.ndarray:
        return self.runs[1]

    @property
    def run_bytes(self) -> np.ndarray:
        return self.runs[2]

    def span(self, s: int) -> tuple[tuple[int, int], np.ndarray]:
        """(page rows, device rows of the blocks) slice ``s`` launches."""
        lo, hi = self.bounds[s], self.bounds[s + 1]
        if self.by_block:
            return (0, self.npages), self.rows[lo:hi]
        return (lo, hi), self.rows[s : s + 1]


def _runs(host: np.ndarray, in_slot: np.ndarray, nbytes: np.ndarray, bounds: list[int]) -> dict[str, Any]:
    """Merge rows that are adjacent on the host (and so in the slot) into DMA runs; a run
    never crosses a slice."""
    cut = np.ones(host.size, dtype=bool)
    cut[1:] = host[1:] != host[:-1] + nbytes[:-1]
    cut[bounds[:-1]] = True
    starts = np.flatnonzero(cut)
    runs = np.empty((3, starts.size), dtype=np.int64)
    runs[0], runs[1], runs[2] = host[starts], in_slot[starts], np.add.reduceat(nbytes, starts)
    return {"runs": runs, "run_bounds": np.searchsorted(starts, bounds).tolist()}


def block_job(rows: np.ndarray, host: np.ndarray, page_rows: np.ndarray, block_bytes: int,
              slot_bytes: int, *, in_host_order: bool = False, longest: int | None = None) -> StagedJob:
    """Plan a job whose blocks each move every page of one group, one block per chunk:
    a block's image in staging is its host chunk's first ``block_bytes``. Arrays have one
    row per block, so this costs the same for 8 pages a block as for 80.

    Blocks go in host order, so chunks that are neighbours on the host merge into one DMA
    run whatever order the job lists them in (an engine's own chunk manager may list them
    in any order, e.g. a LIFO free list's newest first). ``in_host_order``: ``host`` is
    ascending already (``BlockMapping.by_host``). ``longest``: ``page_rows``' largest page,
    if known. A few numpy calls per job: each has a fixed cost, and this runs inside
    every submit.
    """
    if not in_host_order:
        order = host.argsort(kind="stable")
        host, rows = host[order], rows[order]
    host = host.astype(np.int64, copy=False)
    n = host.size
    per = slot_bytes // block_bytes
    # A run starts with each slice and wherever a chunk does not follow the one before.
    cut = np.empty(n, dtype=bool)
    cut[0] = True
    np.not_equal(host[1:], host[:-1] + block_bytes, out=cut[1:])
    cut[::per] = True
    starts = cut.nonzero()[0]
    runs = np.empty((3, starts.size), dtype=np.int64)
    runs[0] = host[starts]
    np.multiply(starts % per, block_bytes, out=runs[1])  # each run's place in its slot
    blocks_in_run = runs[2]
    np.subtract(starts[1:], starts[:-1], out=blocks_in_run[:-1])
    blocks_in_run[-1] = n - starts[-1]
    blocks_in_run *= block_bytes
    # Every slice starts a run: the runs whose offset in the slot is 0.
    run_bounds = [*(runs[1] == 0).nonzero()[0].tolist(), starts.size]
    return StagedJob(
        None, rows.astype(np.uint32), block_bytes, True, [*range(0, n, per), n],
        int(page_rows[:, 2].max()) if longest is None else longest,
        runs=runs, run_bounds=run_bounds, npages=int(page_rows.shape[0]),
    )


def piece_job(device: np.ndarray, host: np.ndarray, nbytes: np.ndarray, slot_bytes: int) -> StagedJob:
    """Plan any job piece by piece: sort by host address, cut slices of at most
    ``slot_bytes``, one block row per slice whose pages are the slice's pieces."""
    order = np.argsort(host, kind="stable")
    h, n, d = host[order], nbytes[order], device[order]
    end = np.cumsum(n)
    start = end - n
    bounds = [0]
    while bounds[-1] < n.size:  # a few slices per job; each cut is a binary search
        lo = bounds[-1]
        bounds.append(int(np.searchsorted(end, start[lo] + slot_bytes, side="right")))
    counts = np.diff(bounds)
    in_slot = start - np.repeat(start[bounds[:-1]], counts)
    pages = np.zeros((n.size, 4), dtype=np.uint64)
    pages[:, 0] = d
    pages[:, 2] = n
    pages[:, 3] = in_slot
    runs = _runs(h.astype(np.int64), in_slot.astype(np.int64), n.astype(np.int64), bounds)
    return StagedJob(pages, np.zeros(len(counts), dtype=np.uint32), 0, False, bounds, int(n.max()),
                     npages=int(n.size), **runs)


class StagedCopy(CopyStrategy):
    """Gather (or scatter) on the SMs, one launch per slice of up to 256 blocks; DMA whole
    chunks."""

    name = "staged"

    def __init__(self, ctx: CopyContext, only_where_it_gains: bool = False) -> None:
        self.ctx = ctx
        # A native lane's planner (``planner.make_planner``) plans most jobs in C: the
        # ring's state is then its, shared with the jobs planned here.
        self.planner: Any = None
        # ``auto``: jobs of few or large pieces go straight to DMA. ``staged``: every job
        # that fits the ring goes through it.
        self.only_where_it_gains = only_where_it_gains
        self.slot_bytes = ctx.staging_bytes // SLOTS // 512 * 512  # slots stay 512-byte aligned
        drv = ctx.driver
        self.kernel = PieceKernel(drv, ctx.device)
        self.staged_jobs = 0  # jobs that went through the ring (``Lane.statistics``)
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
        self.page_table: int | None = None  # device address of the layout's, once uploaded
        self.next_slot = 0
        self.shape = self._block_shape()
        # Where a slice's batched call finds its runs' slot addresses (see ``_move``).
        self._slot_at = np.empty(0, dtype=np.int64)
        self._slot_at_ptr = 0

    @property
    def next_slot(self) -> int:
        """The slot the next job through the ring starts in."""
        return self._next_slot if self.planner is None else int(self.planner.next_slot)

    @next_slot.setter
    def next_slot(self, slot: int) -> None:
        if self.planner is None:
            self._next_slot = slot
        else:
            self.planner.next_slot = slot

    @property
    def staged_jobs(self) -> int:
        """Jobs that went through the ring (``Lane.statistics``)."""
        return self._staged_jobs if self.planner is None else int(self.planner.staged_jobs)

    @staged_jobs.setter
    def staged_jobs(self, jobs: int) -> None:
        if self.planner is None:
            self._staged_jobs = jobs
        else:
            self.planner.staged_jobs = jobs

    def _block_shape(self) -> tuple[np.ndarray, int, int] | None:
        """The page table of a layout whose jobs plan by block (one group, one block per
        chunk, 16-byte aligned, device rows that fit the kernel's 32 bits): rows in host
        order within the chunk, with a block's bytes and its largest page. None otherwise."""
        ctx, layout = self.ctx, self.ctx.layout
        if layout.num_groups != 1 or layout.blocks_per_chunk != 1 or layout.num_gpu_blocks[0] > 1 << 32:
            return None
        order = np.argsort(layout.page_offsets[0], kind="stable")
        tensors = np.asarray(layout.tensor_idx[0], dtype=np.int64)[order]
        pages = np.empty((order.size, 4), dtype=np.uint64)
        pages[:, 0] = ctx.device_base[tensors]
        pages[:, 1] = np.asarray(layout.row_strides, dtype=np.int64)[tensors]
        pages[:, 2] = np.asarray(layout.page_sizes[0], dtype=np.int64)[order]
        pages[:, 3] = np.asarray(layout.page_offsets[0], dtype=np.int64)[order]
        if not fits(pages, layout.chunk_bytes, ctx.host_base):
            return None
        return pages, layout.block_bytes[0], int(pages[:, 2].max())

    def prepare(self, plan: CopyPlan) -> StagedJob | DmaBatch:
        ctx = self.ctx
        pieces = plan.num_pages
        gains = pieces >= MIN_STAGED_PIECES and plan.total_bytes < DIRECT_PIECE_BYTES * pieces
        if pieces and (gains or not self.only_where_it_gains):
            shape, mapping = self.shape, plan.mapping
            if shape is not None and mapping is not None and shape[1] <= self.slot_bytes:
                if self.staging is not None or self._allocate_staging():
                    self._upload_layout_table()
                    cb, base = ctx.layout.chunk_bytes, ctx.host_base
                    if mapping.by_host is not None:
                        rows, chunks = mapping.by_host
                        return block_job(rows, chunks * cb + base, shape[0], shape[1], self.slot_bytes,
                                         in_host_order=True, longest=shape[2])
                    rows, chunks = mapping.gpu_blocks[0], mapping.host_slots[0]
                    return block_job(rows, chunks * cb + base, shape[0], shape[1], self.slot_bytes,
                                     longest=shape[2])
            dst, src, sizes = ctx.pointers(plan)
            if (int(sizes.max()) <= self.slot_bytes and fits(dst, src, sizes)
                    and (self.staging is not None or self._allocate_staging())):
                device, host = (src, dst) if ctx.to_host else (dst, src)
                return piece_job(device, host, sizes, self.slot_bytes)
        return self.dma.split(*ctx.pointers(plan), min_descriptors=MIN_SLICE_DESCRIPTORS)

    def _upload_layout_table(self) -> None:
        """Queue the layout's page table to the device once, on the kernel stream, ahead of
        the first by-block job. In ``prepare``, not ``enqueue``: there a native lane only
        records the calls, so a job failing before its copy would leave ``page_table`` set
        to a table never filled, which every later job would launch on."""
        if self.page_table is None:
            assert self.shape is not None
            self.page_table = self.kernel.upload(self.shape[0], self.kernel_stream, keep=True)

    def _allocate_staging(self) -> bool:
        """Take the ring on first use, so a lane that never stages holds none. Without the
        memory, every job goes as plain DMA from then on."""
        try:
            # Allocated on the kernel stream: from the submitting thread's current stream,
            # the caching allocator could hand back a block its queued kernels still use.
            with torch.cuda.stream(self.kernel.torch_stream(self.kernel_stream)):
                self.staging = torch.empty(SLOTS * self.slot_bytes, dtype=torch.uint8, device=self.ctx.device)
        except torch.OutOfMemoryError:
            _log.warning("no device memory for %d bytes of staging; copying with DMA only",
                         SLOTS * self.slot_bytes)
            self.slot_bytes = 0
            return False
        return True

    def enqueue(self, job: StagedJob | DmaBatch, dependency: Any, start: Any, stop: Any, *,
                hold_gil: bool | None = None) -> None:
        drv, main = self.ctx.driver, self.main_stream
        if isinstance(job, DmaBatch):
            if dependency is not None:
                drv.stream_wait(main, dependency)
            drv.record(start, main)
            self.dma.issue(job, fork=start, hold_gil=hold_gil)
            drv.record(stop, main)
            return
        assert self.staging is not None
        k, d = self.kernel_stream, self.dma_stream
        if not self.staged_jobs:
            # The DMA stream writes the ring too: it starts behind its allocation once.
            # (Here, not in ``prepare``: this runs in order with the streams' other work.)
            drv.record(self.joined, k)
            drv.stream_wait(d, self.joined)
        self.staged_jobs += 1
        first = self.next_slot
        self.next_slot = (first + job.slices) % SLOTS
        to_host = self.ctx.to_host
        ring = self.staging.data_ptr()
        try:
            if to_host and dependency is not None:
                # The DMA waits for the gather anyway; waiting here too keeps the source's
                # writer out of the job's measured time, as on the DMA path.
                drv.stream_wait(d, dependency)
            # A job's time runs from where the DMA stream reaches it: in a pipeline, its
            # share of the link (a gather that overlapped the job before is not counted
            # twice), which is the span the handler's rate estimate predicts ends with.
            drv.record(start, d)
            if job.pages is not None:
                table = self.kernel.upload(job.pages, k)
            else:  # the layout's page table, uploaded by ``prepare``
                assert self.page_table is not None
                table = self.page_table
            if to_host and dependency is not None:
                drv.stream_wait(k, dependency)  # the source's pending writers
            # Locals: this loop runs inside every submit, four times for a 256 MiB job.
            wait, record, launch, move = drv.stream_wait, drv.record, self.kernel.launch, self._move
            full, free, step, longest = self.full, self.free, job.image_step, job.longest
            for s in range(job.slices):
                slot = (first + s) % SLOTS
                at = ring + slot * self.slot_bytes
                pages, rows = job.span(s)
                if to_host:
                    wait(k, free[slot])
                    launch(table, pages, rows, at, step, longest, False, k)
                    record(full[slot], k)
                    wait(d, full[slot])
                    move(job, s, at, d, hold_gil)
                    record(free[slot], d)
                else:
                    wait(d, free[slot])
                    move(job, s, at, d, hold_gil)
                    record(full[slot], d)
                    wait(k, full[slot])
                    if s == 0 and dependency is not None:
                        wait(k, dependency)  # the destination's pending readers
                    launch(table, pages, rows, at, step, longest, True, k)
                    record(free[slot], k)
        except BaseException:
            # The main stream's next event must cover what the other stream holds.
            drv.record(self.joined, k if to_host else d)
            drv.stream_wait(main, self.joined)
            raise
        drv.record(stop, main)

    def _move(self, job: StagedJob, s: int, at: int, stream: Any, hold_gil: bool | None = None) -> None:
        """Slice ``s``'s DMA runs between the slot at ``at`` and the host chunks. One run
        (neighbouring chunks) goes as a plain copy, cheaper to enqueue than a batch of one.
        A batch takes pointers into the job's run table and into ``slot_at``, where the
        runs' slot addresses are written: no arrays are built per call."""
        drv, to_host, runs = self.ctx.driver, self.ctx.to_host, job.runs
        lo, hi = job.run_bounds[s], job.run_bounds[s + 1]
        if hi - lo == 1:
            chunk, in_slot = int(runs[0, lo]), at + int(runs[1, lo])
            dst, src = (chunk, in_slot) if to_host else (in_slot, chunk)
            drv.memcpy(dst, src, int(runs[2, lo]), stream)
            return
        if getattr(drv, "program", None) is not None:  # recorded: the row takes its own tables
            chunks, slots = runs[0, lo:hi], runs[1, lo:hi] + at
            dst_t, src_t = (chunks, slots) if to_host else (slots, chunks)
            drv.memcpy_batch(dst_t, src_t, runs[2, lo:hi], stream, to_host=to_host)
            return
        n = hi - lo
        if self._slot_at.size < n:
            self._slot_at = np.empty(max(n, 2 * self._slot_at.size), dtype=np.int64)
            self._slot_at_ptr = self._slot_at.ctypes.data
        np.add(runs[1, lo:hi], at, out=self._slot_at[:n])
        table = job.runs_at
        if not table:
            table = job.runs_at = runs.ctypes.data
        host, sizes, slot = table + 8 * lo, table + 2 * runs.strides[0] + 8 * lo, self._slot_at_ptr
        if to_host:
            drv.memcpy_batch_at(host, slot, sizes, n, stream, to_host=True, hold_gil=hold_gil)
        else:
            drv.memcpy_batch_at(slot, host, sizes, n, stream, to_host=False, hold_gil=hold_gil)

    def abandon(self) -> None:
        self.kernel.abandon()

    def close(self) -> None:
        self.dma.close()
        self.ctx.driver.destroy_stream(self.kernel_stream)
        self.ctx.driver.destroy_stream(self.dma_stream)
        self.kernel.close()
        self.staging = None
        self.page_table = None
