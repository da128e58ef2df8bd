"""SM gather/scatter over a zero-copy CUDA view of the pinned pool (UVA).

The registered host pool is wrapped as a CUDA tensor through ``__cuda_array_interface__``
(its device address is valid in kernels), and each job becomes torch index ops: rows of
``unit`` bytes, where ``unit`` divides every copy's size and offsets, gathered and
scattered per page tensor. Fast for small pages on an idle GPU; it needs SMs, so it is
starved by (and slows) heavy compute. Jobs whose unit is too small to be efficient fall
back to DMA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...plan import CopyPlan
from .dma import DmaBatch, MultiStreamDma
from .strategy import CopyContext, CopyStrategy, copy_unit, expand_rows

__all__ = ["KernelCopy", "RowViews"]

# Below this many bytes per row, index ops move too little per thread; use DMA instead.
MIN_UNIT = 256


class _HostAsCuda:
    """Exposes pinned host memory to torch as a CUDA buffer (its UVA address)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _element(unit: int, *addresses: int) -> torch.dtype:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if unit % size == 0 and all(a % size == 0 for a in addresses):
            return dtype
    return torch.uint8


class RowViews:
    """Cached ``(rows, unit)`` views of each page tensor, of the pool, and of staging buffers."""

    def __init__(self, ctx: CopyContext) -> None:
        self.ctx = ctx
        self._device: dict[tuple[int, int], torch.Tensor] = {}
        self._host: dict[int, torch.Tensor] = {}
        pool = ctx.pool.tensor
        with torch.cuda.device(ctx.device):
            self.host_bytes = torch.as_tensor(_HostAsCuda(ctx.host_base, pool.numel()), device=ctx.device)

    def element(self, unit: int) -> torch.dtype:
        return _element(unit, self.ctx.host_base, *self.ctx.device_base.tolist())

    @staticmethod
    def rows(flat: torch.Tensor, unit: int, dtype: torch.dtype) -> torch.Tensor:
        nrows = flat.numel() // unit
        return flat[: nrows * unit].view(dtype).view(nrows, -1)

    def device(self, tensor_idx: int, unit: int) -> torch.Tensor:
        key = (tensor_idx, unit)
        view = self._device.get(key)
        if view is None:
            t = self.ctx.kv.tensors[tensor_idx].tensor
            nrows, width = t.shape
            span = (nrows - 1) * t.stride(0) + width if nrows else 0
            flat = torch.as_strided(t, (span,), (1,))
            view = self._device[key] = self.rows(flat, unit, self.element(unit))
        return view

    def host(self, unit: int) -> torch.Tensor:
        view = self._host.get(unit)
        if view is None:
            view = self._host[unit] = self.rows(self.host_bytes, unit, self.element(unit))
        return view


@dataclass
class RowPlan:
    """One job as row indices per page tensor: ``idx[0]`` device rows, ``idx[1]`` other rows."""

    unit: int
    idx: np.ndarray  # (2, rows) int64: device rows, then host (or staging) rows
    groups: list[tuple[int, int, int]]  # (tensor_idx, lo, hi) slices of idx's columns


def row_plan(plan: CopyPlan, other_offset: np.ndarray, unit: int) -> RowPlan:
    """Expand copies into unit rows and group them by page tensor (numpy only)."""
    counts = plan.nbytes // unit
    t_rows = np.repeat(plan.tensor_idx, counts)
    d_rows = expand_rows(plan.device_offset, counts, unit)
    o_rows = expand_rows(other_offset, counts, unit)
    order = np.argsort(t_rows, kind="stable")
    if not np.array_equal(order, np.arange(order.size)):
        t_rows, d_rows, o_rows = t_rows[order], d_rows[order], o_rows[order]
    cuts = np.flatnonzero(np.diff(t_rows)) + 1
    bounds = np.concatenate(([0], cuts, [t_rows.size])).tolist()
    groups = [(int(t_rows[lo]), lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]
    return RowPlan(unit, np.stack([d_rows, o_rows]), groups)


def upload(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    """Index rows to the device on the current stream (pinned staging keeps it async)."""
    return torch.from_numpy(idx).pin_memory().to(device, non_blocking=True)


class KernelCopy(CopyStrategy):
    """torch index ops on a high-priority stream; the pool is addressed through UVA."""

    name = "kernel"

    def __init__(self, ctx: CopyContext) -> None:
        self.ctx = ctx
        drv = ctx.driver
        self.main_stream = drv.create_stream(high_priority=True)
        self.torch_stream = torch.cuda.ExternalStream(int(self.main_stream), device=ctx.device)
        self.views = RowViews(ctx)
        self.fallback = MultiStreamDma(ctx, self.main_stream, ctx.streams or 16)

    def prepare(self, plan: CopyPlan) -> RowPlan | DmaBatch:
        unit = copy_unit(plan)
        if len(plan) == 0 or unit < MIN_UNIT:
            return self.fallback.split(*self.ctx.pointers(plan))
        return row_plan(plan, plan.host_offset, unit)

    def enqueue(self, prepared: RowPlan | DmaBatch, dependency: Any, start: Any, stop: Any, *,
                hold_gil: bool | None = None) -> None:
        drv, main = self.ctx.driver, self.main_stream
        if dependency is not None:
            drv.stream_wait(main, dependency)
        drv.record(start, main)
        if isinstance(prepared, DmaBatch):
            self.fallback.issue(prepared, hold_gil=hold_gil)
        else:
            with torch.cuda.stream(self.torch_stream):
                self._run(prepared)
        drv.record(stop, main)

    def _run(self, rp: RowPlan) -> None:
        idx = upload(rp.idx, self.ctx.device)
        host = self.views.host(rp.unit)
        for t, lo, hi in rp.groups:
            dev = self.views.device(t, rp.unit)
            d_rows, h_rows = idx[0, lo:hi], idx[1, lo:hi]
            if self.ctx.to_host:
                host.index_copy_(0, h_rows, dev.index_select(0, d_rows))
            else:
                dev.index_copy_(0, d_rows, host.index_select(0, h_rows))

    def close(self) -> None:
        self.fallback.close()
        self.ctx.driver.destroy_stream(self.main_stream)
