"""A native lane's planner: one C call turns a job's block and chunk ids into its whole
program and queues it on the lane's issuer (``_native.Planner``, in ``_native_plan.c``).

Why: planning and recording a per-layer job in Python (numpy per job, a row per driver
call, ctypes to copy its tables) cost more host time than the driver calls it hands over,
and beside a busy Python thread every numpy or ctypes call that lets the GIL go may cost a
switch interval. The C planner makes the same rows from the ids alone, with the layout's
page table prepared once per lane here, and never lets the GIL go.

It covers the jobs that matter for time: one KV-cache group of one block per chunk, on the
``dma`` strategy without pitched copies, and on ``staged`` / ``auto`` both the by-block ring
jobs and the DMA jobs (small ones included). Everything else, and any job whose ids it does
not accept (bad input among them), the lane plans in Python as before, with the same
result (tests/test_cuda_native_plan.py compares the two on random jobs).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...host_layout import HostLayout
from . import native, pieces
from .dma import MIN_SLICE_BYTES, MIN_SLICE_DESCRIPTORS, DmaCopy, MultiStreamDma
from .program import RUN_HERE_US
from .staged import DIRECT_PIECE_BYTES, MIN_STAGED_PIECES, StagedCopy
from .strategy import CopyContext, CopyStrategy

__all__ = ["MAX_STREAMS", "layout_pages", "make_planner"]

# DMA streams per lane the C planner spreads a job over (``_native_plan.c``'s MAX_STREAMS);
# a lane with more plans in Python.
MAX_STREAMS = 64


def layout_pages(layout: HostLayout, device_base: np.ndarray) -> np.ndarray:
    """Group 0's pages in the layout's order, one row each: tensor index, the tensor's
    device base, its row stride, the page's bytes and its offset in a host chunk."""
    tensors = np.asarray(layout.tensor_idx[0], dtype=np.int64)
    pages = np.empty((tensors.size, 5), dtype=np.uint64)
    pages[:, 0] = tensors
    pages[:, 1] = np.asarray(device_base, dtype=np.int64)[tensors].view(np.uint64)
    pages[:, 2] = np.asarray(layout.row_strides, dtype=np.int64)[tensors]
    pages[:, 3] = layout.page_sizes[0]
    pages[:, 4] = layout.page_offsets[0]
    return pages


def make_planner(strategy: CopyStrategy, ctx: CopyContext, issuer: Any, main: int, rescue: int,
                 num_chunks: int) -> Any:
    """The ``_native.Planner`` of a lane running ``strategy`` on ``issuer``, or None where
    its jobs are planned in Python only (another layout, strategy or helper)."""
    ext = native.helper()
    if ext is None or not isinstance(strategy, (StagedCopy, DmaCopy)):
        return None
    layout = ctx.layout
    if layout.num_groups != 1 or layout.blocks_per_chunk != 1:
        return None
    if isinstance(strategy, StagedCopy):
        staged: dict[str, Any] = {
            "staged": True, "kernel_stream": int(strategy.kernel_stream),
            "dma_stream": int(strategy.dma_stream),
            "full": [int(e) for e in strategy.full], "free": [int(e) for e in strategy.free],
            "joined": int(strategy.joined), "function": int(strategy.kernel.function),
            "slot_bytes": strategy.slot_bytes, "gains_only": strategy.only_where_it_gains,
            "has_shape": strategy.shape is not None, "longest": strategy.shape[2] if strategy.shape else 0,
            "min_staged_pieces": MIN_STAGED_PIECES, "direct_piece_bytes": DIRECT_PIECE_BYTES,
            "max_ctas": pieces.MAX_CTAS or 0,  # read now: tests set it before building a worker
        }
    elif not ctx.runs:  # pitched jobs stay in Python
        staged = {}
    else:
        return None
    dma: MultiStreamDma = strategy.dma
    if dma.threads is not None or dma.max_streams > MAX_STREAMS:
        return None
    return ext.Planner(
        issuer, layout_pages(layout, ctx.device_base), layout.chunk_bytes, ctx.host_base, num_chunks,
        layout.num_gpu_blocks[0], ctx.to_host, main, rescue, [int(s) for s in dma.subs],
        [int(e) for e in dma.joins], dma.max_streams, MIN_SLICE_BYTES, MIN_SLICE_DESCRIPTORS, RUN_HERE_US,
        **staged)
