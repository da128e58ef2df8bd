"""Layerwise jobs whose GPU blocks do not run: a layer at a time through a device slot.

Why: pitched copies straight into the GPU pages (``layer_ops``) need runs where chunk ids
and GPU block ids advance together. An engine's free GPU blocks scatter as it runs, while
the cache hands chunks out lowest id first, so a job's chunks still run. Here each layer
moves as 2-D copies of whole chunk runs between the host and a device slot (the layer's
pages of each block side by side, the blocks in host order), and the piece kernel
(``pieces.py``, 256 blocks a launch) scatters the slot into the blocks' rows (a load) or
gathers them into it (a store): a few ops a layer whatever the block ids.

Everything runs on the lane's main stream, so one slot serves every layer of every job in
order; a layer larger than the slot goes in slices. Only one-group layouts of one block a
chunk, 16-byte aligned, take this path (``LayerStaging.shape``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...host_layout import HostLayout
from ...layer_plan import LayerMap, LayerPlan
from .layer_ops import US_PER_CALL, US_PER_LAUNCH, US_PER_PITCHED_OP
from .pieces import ROWS_PER_LAUNCH, fits

__all__ = ["LayerShape", "LayerStaging", "StagedLayers", "TorchSlot"]

_log = logging.getLogger("aiokv")

# Slots of lanes whose worker was dropped unclosed (``LayerStaging.abandon``).
_KEPT: list[Any] = []


class TorchSlot:
    """The slot's device memory from torch's caching allocator, on the lane's stream (its
    blocks are reused only in that stream's order)."""

    def __init__(self, device: Any, stream_of: Callable[[Any], Any]) -> None:
        self.device = device
        self._stream_of = stream_of
        self.tensor: Any = None

    def __call__(self, nbytes: int, stream: Any) -> int | None:
        import torch

        try:
            with torch.cuda.stream(self._stream_of(stream)):
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            _log.warning("no device memory for a %d-byte layer slot: layerwise jobs copy straight to "
                         "their pages", nbytes)
            return None
        return int(self.tensor.data_ptr())

    def release(self) -> None:
        """Let the memory go (nothing on the lane's stream uses it any more)."""
        self.tensor = None


@dataclass(frozen=True)
class LayerShape:
    """What the kernel and the 2-D copies need of a layout, per layer: its rows of the
    lane's page table (``rows[l]:rows[l + 1]``), its bytes a block (``image``), and its
    pages as stretches contiguous in a chunk (``segments[l]``: (offset in the chunk,
    offset in the block's image, bytes))."""

    table: np.ndarray  # (P, 4) uint64: device base, row stride, bytes, offset in the image
    rows: np.ndarray
    image: np.ndarray
    segments: tuple[tuple[tuple[int, int, int], ...], ...]
    longest: int


@dataclass(frozen=True)
class StagedLayers:
    """One job through the slot: blocks (GPU rows, in host order) cut into slices that fit
    it; per (layer, slice) its packed 2-D ops ``ops[bounds[k]:bounds[k + 1]]`` with
    ``k = layer * slices + slice``."""

    rows: np.ndarray  # uint32
    cuts: list[int]  # slice s is blocks [cuts[s], cuts[s + 1])
    ops: np.ndarray  # packed rows (``Driver.pitched_ops``)
    bounds: np.ndarray
    slot: int  # device address
    table: int  # device address of the lane's page table
    shape: LayerShape

    @property
    def slices(self) -> int:
        return len(self.cuts) - 1

    @property
    def launches(self) -> int:
        """Kernel launches a layer takes (256 blocks a launch)."""
        return sum(-(-(self.cuts[s + 1] - self.cuts[s]) // ROWS_PER_LAUNCH) for s in range(self.slices))

    def layer_ops(self, layer: int) -> int:
        """2-D ops and kernel launches of one layer."""
        k = layer * self.slices
        return int(self.bounds[k + self.slices] - self.bounds[k]) + self.launches

    def cost_us(self, layer: int) -> float:
        """Estimated host time of one layer's calls (its event's record aside)."""
        return float(self.costs_us()[layer])

    def costs_us(self) -> np.ndarray:
        """``cost_us`` of every layer at once."""
        ops = np.diff(self.bounds[:: self.slices])
        return US_PER_CALL * self.slices + US_PER_PITCHED_OP * ops + US_PER_LAUNCH * self.launches


class LayerStaging:
    """A lane's slot and page table for staged layers (module doc). ``kernel``: the piece
    kernel (``PieceKernel``: ``upload``, ``launch``), made on first use by ``make_kernel``;
    ``allocate(nbytes, stream)`` returns a device address (None: no memory), called once:
    the slot is taken whole on first use and kept until ``close``, because a job's layers
    may wait on the issuer thread long after it was planned on the slot, and memory let go
    meanwhile could be handed to another tensor, or freed, before they are enqueued."""

    def __init__(self, layout: HostLayout, layer_map: LayerMap, device_base: np.ndarray, host_base: int,
                 slot_bytes: int, make_kernel: Callable[[], Any],
                 allocate: Callable[[int, Any], int | None]) -> None:
        self.slot_bytes = slot_bytes // 512 * 512
        self.host_base = host_base
        self._make_kernel = make_kernel
        self._allocate = allocate
        self.kernel: Any = None
        self.table: int | None = None
        self.slot: int | None = None
        self.slot_size = 0
        self.shape = _shape(layout, layer_map, device_base, host_base) if self.slot_bytes else None
        self.chunk_bytes = layout.chunk_bytes

    def plan(self, plan: LayerPlan, stream: Any, pack: Callable[..., np.ndarray], to_host: bool,
             ) -> StagedLayers | None:
        """The job through the slot, or None where it cannot go (a layout or job it does
        not fit, no device memory, the kernel unavailable)."""
        shape = self.shape
        mapping = plan.mapping
        if shape is None or len(mapping.gpu_blocks) != 1 or not mapping.gpu_blocks[0].size:
            return None
        widest = int(shape.image.max())
        if widest > self.slot_bytes or not self._ready(stream):
            return None
        assert self.slot is not None and self.table is not None
        per = self.slot_size // widest
        order = np.argsort(mapping.host_slots[0], kind="stable")
        chunks = mapping.host_slots[0][order].astype(np.int64)
        rows = mapping.gpu_blocks[0][order]
        n = int(chunks.size)
        cuts = [*range(0, n, per), n]
        # A chunk run starts at each slice and wherever a chunk does not follow the one before.
        cut = np.ones(n, dtype=bool)
        cut[1:] = chunks[1:] != chunks[:-1] + 1
        cut[cuts[:-1]] = True
        starts = np.flatnonzero(cut)
        heights = np.diff(np.append(starts, n))
        place = starts % per  # a run's first block's place in its slice
        slice_of = np.searchsorted(np.asarray(cuts), starts, side="right") - 1
        nslices = len(cuts) - 1
        # Per (layer, slice), in that order: each segment of the layer over each run of the
        # slice. The combos are few (layers x slices x segments); the runs are expanded for
        # all of them at once (a 16k-token job is some 20 runs, 32 layers).
        run_lo = np.searchsorted(slice_of, np.arange(nslices), side="left")
        run_n = np.searchsorted(slice_of, np.arange(nslices), side="right") - run_lo
        combos = np.array([(layer, s, *segment) for layer, segments in enumerate(shape.segments)
                           for s in range(nslices) for segment in segments], dtype=np.int64).reshape(-1, 5)
        c_layer, c_slice, c_chunk_off, c_image_off, c_bytes = combos.T
        per_combo = run_n[c_slice]
        total = int(per_combo.sum())
        combo = np.repeat(np.arange(combos.shape[0]), per_combo)
        before = np.concatenate(([0], np.cumsum(per_combo)[:-1]))
        run = run_lo[c_slice[combo]] + np.arange(total) - before[combo]
        step = shape.image[c_layer[combo]].astype(np.int64)
        host = self.host_base + chunks[starts[run]] * self.chunk_bytes + c_chunk_off[combo]
        slot = self.slot + place[run] * step + c_image_off[combo]
        w, h = c_bytes[combo], heights[run]
        hp = np.full(total, self.chunk_bytes, dtype=np.int64)
        sp = step
        if to_host:
            ops = pack(host, hp, slot, sp, w, h)
        else:
            ops = pack(slot, sp, host, hp, w, h)
        counts = np.bincount(c_layer * nslices + c_slice, weights=per_combo,
                             minlength=len(shape.segments) * nslices).astype(np.int64)
        bounds = np.zeros(counts.size + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return StagedLayers(rows.astype(np.uint32), cuts, np.ascontiguousarray(ops, dtype=np.uint64), bounds,
                            self.slot, self.table, shape)

    def _ready(self, stream: Any) -> bool:
        """The kernel loaded, the page table uploaded and the slot taken."""
        assert self.shape is not None
        try:
            if self.kernel is None:
                self.kernel = self._make_kernel()
            if self.table is None:
                self.table = int(self.kernel.upload(self.shape.table, stream, keep=True))
        except Exception as exc:  # e.g. the driver cannot compile the kernel for this GPU
            _log.warning("staged layers unavailable (%s): layerwise jobs copy straight to their pages", exc)
            self.shape = None
            return False
        if self.slot is None:
            at = self._allocate(self.slot_bytes, stream)
            if at is None:
                return False
            self.slot, self.slot_size = at, self.slot_bytes
        return True

    def close(self) -> None:
        """The lane closed and its stream is synchronised: the slot and the page table go
        (``allocate``'s ``release``, where it has one), and nothing goes through it again."""
        self.shape = None
        self.slot, self.table, self.slot_size = None, None, 0
        release = getattr(self._allocate, "release", None)
        if release is not None:
            release()
        kernel, self.kernel = self.kernel, None
        if kernel is not None:
            kernel.close()

    def abandon(self) -> None:
        """The worker was dropped unclosed: copies may still use the slot and the table,
        so both stay for the rest of the process."""
        _KEPT.append(self._allocate)
        if self.kernel is not None:
            self.kernel.abandon()

    def emit(self, target: Any, job: StagedLayers, layer: int, stream: Any, to_host: bool) -> None:
        """Layer ``layer``'s copies through the slot, on ``stream`` through ``target``."""
        shape, kernel = job.shape, self.kernel
        pages = (int(shape.rows[layer]), int(shape.rows[layer + 1]))
        step = int(shape.image[layer])
        for s in range(job.slices):
            k = layer * job.slices + s
            ops = job.ops[int(job.bounds[k]) : int(job.bounds[k + 1])]
            rows = job.rows[job.cuts[s] : job.cuts[s + 1]]
            if not to_host:
                target.memcpy_pitched(ops, stream)
            kernel.launch(job.table, pages, rows, job.slot, step, shape.longest, not to_host, stream,
                          driver=target)
            if to_host:
                target.memcpy_pitched(ops, stream)


def _shape(layout: HostLayout, layer_map: LayerMap, device_base: np.ndarray, host_base: int,
           ) -> LayerShape | None:
    """The layout's per-layer shape, or None where staged layers cannot run on it."""
    if layout.num_groups != 1 or layout.blocks_per_chunk != 1 or layout.num_gpu_blocks[0] >= 1 << 32:
        return None
    refs = [layer_map.order_ref[layer_map.order_layer == layer].tolist()
            for layer in range(layer_map.num_layers)]
    if not all(refs):
        return None
    tensors = layout.tensor_idx[0]
    table, rows, image, segments = [], [0], [], []
    for mine in refs:
        mine = sorted(mine, key=lambda k: layout.page_offsets[0][k])  # host order in the chunk
        offset, segs = 0, list[tuple[int, int, int]]()
        for k in mine:
            chunk_off, size = layout.page_offsets[0][k], layout.page_sizes[0][k]
            t = tensors[k]
            table.append((int(device_base[t]), layout.row_strides[t], size, offset))
            if segs and segs[-1][0] + segs[-1][2] == chunk_off:  # contiguous in the chunk: one copy
                segs[-1] = (segs[-1][0], segs[-1][1], segs[-1][2] + size)
            else:
                segs.append((chunk_off, offset, size))
            offset += size
        rows.append(len(table))
        image.append(offset)
        segments.append(tuple(segs))
    pages = np.array(table, dtype=np.uint64)
    if not fits(pages, layout.chunk_bytes, host_base, *image):
        return None
    return LayerShape(pages, np.array(rows, dtype=np.int64), np.array(image, dtype=np.int64), tuple(segments),
                      int(pages[:, 2].max()))
