"""Pitched (2D) copies: one copy per block moves all of its pages that sit at a uniform
device pitch, instead of one copy per page.

The host layout (``host_layout.HostLayout``) puts a group's pages in device address order, so
page tensors at a uniform pitch on the device (one allocation, or per-layer allocations the
caching allocator placed back to back) land at a uniform pitch in the host chunk too. Pure
numpy, like ``plan``; only the CUDA backend's DMA strategy uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...host_layout import HostLayout
from ...plan import BlockMapping

__all__ = ["PitchedPlan", "PitchedRun", "pitched_runs", "plan_pitched"]


@dataclass(frozen=True)
class PitchedRun:
    """Pages of one group that a block moves as one pitched copy.

    ``refs`` (indices into the group's refs, in host order) have equal page size and row
    stride, and their rows sit ``device_pitch`` bytes apart on the device; on the host they
    are ``page_bytes * blocks_per_chunk`` apart by construction.
    """

    group: int
    refs: tuple[int, ...]
    device_pitch: int


@dataclass(frozen=True)
class PitchedPlan:
    """Pitched copies: op ``i`` moves ``height[i]`` rows of ``width[i]`` bytes.

    Rows start at ``device_addr[i] + r * device_pitch[i]`` on the device and at
    ``host_offset[i] + r * host_pitch[i]`` in the pool.
    """

    device_addr: np.ndarray
    device_pitch: np.ndarray
    host_offset: np.ndarray
    host_pitch: np.ndarray
    width: np.ndarray
    height: np.ndarray
    total_bytes: int

    def __len__(self) -> int:
        return int(self.width.shape[0])


def pitched_runs(
    layout: HostLayout, device_base: np.ndarray, max_pitch: int, allocation: np.ndarray | None = None
) -> tuple[PitchedRun, ...]:
    """Cut each group's pages (in host order) into maximal runs of uniform device pitch.

    ``device_base[t]`` is the address of row 0 of tensor ``t``. A pitch must be at least
    the page size (rows may not overlap) and at most ``max_pitch`` (the driver's limit).
    ``allocation[t]`` names the device allocation tensor ``t`` lives in: one copy may not
    span two allocations (the driver rejects it), even when they sit back to back.
    """
    runs: list[PitchedRun] = []
    for g in range(layout.num_groups):
        refs = sorted(range(len(layout.tensor_idx[g])), key=lambda k: layout.page_offsets[g][k])
        current: list[int] = []
        pitch = 0
        for k in refs:
            if current:
                last = current[-1]
                t_last, t_k = layout.tensor_idx[g][last], layout.tensor_idx[g][k]
                delta = int(device_base[t_k]) - int(device_base[t_last])
                size = layout.page_sizes[g][k]
                fits = (
                    size == layout.page_sizes[g][last]
                    and (allocation is None or allocation[t_k] == allocation[t_last])
                    and layout.row_strides[t_k] == layout.row_strides[t_last]
                    and size <= delta <= max_pitch
                    and (len(current) == 1 or delta == pitch)
                )
                if fits:
                    pitch = delta
                    current.append(k)
                    continue
                runs.append(_run(layout, g, current, pitch))
            current, pitch = [k], 0
        if current:
            runs.append(_run(layout, g, current, pitch))
    return tuple(runs)


def plan_pitched(
    mapping: BlockMapping, layout: HostLayout, runs: Sequence[PitchedRun], device_base: np.ndarray
) -> PitchedPlan:
    """One pitched copy per (block, run): the rows of a block's pages in that run.

    Example: 64 pages of 32 KiB at a uniform device pitch and 128 blocks give 128 copies of
    64 rows each, where ``plan_copies`` gives 8192 copies.
    """
    bpc = layout.blocks_per_chunk
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("dev", "dp", "host", "hp", "w", "h")}
    for run in runs:
        blocks, slots = mapping.gpu_blocks[run.group], mapping.host_slots[run.group]
        if blocks.size == 0:
            continue
        first = run.refs[0]
        tensor = layout.tensor_idx[run.group][first]
        width = layout.page_sizes[run.group][first]
        chunk, sub = np.divmod(slots, bpc)
        n = blocks.size
        cols["dev"].append(int(device_base[tensor]) + blocks * layout.row_strides[tensor])
        cols["host"].append(chunk * layout.chunk_bytes + layout.page_offsets[run.group][first] + sub * width)
        cols["dp"].append(np.full(n, run.device_pitch, dtype=np.int64))
        cols["hp"].append(np.full(n, width * bpc, dtype=np.int64))
        cols["w"].append(np.full(n, width, dtype=np.int64))
        cols["h"].append(np.full(n, len(run.refs), dtype=np.int64))
    if not cols["w"]:
        empty = np.zeros(0, dtype=np.int64)
        return PitchedPlan(empty, empty, empty, empty, empty, empty, 0)
    w, h = np.concatenate(cols["w"]), np.concatenate(cols["h"])
    return PitchedPlan(
        device_addr=np.concatenate(cols["dev"]).astype(np.int64),
        device_pitch=np.concatenate(cols["dp"]),
        host_offset=np.concatenate(cols["host"]).astype(np.int64),
        host_pitch=np.concatenate(cols["hp"]),
        width=w,
        height=h,
        total_bytes=int((w * h).sum()),
    )


def _run(layout: HostLayout, group: int, refs: list[int], pitch: int) -> PitchedRun:
    # A single page still needs a pitch the driver accepts (>= its width).
    return PitchedRun(group, tuple(refs), pitch if len(refs) > 1 else layout.page_sizes[group][refs[0]])
