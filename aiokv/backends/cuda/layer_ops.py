"""A layerwise job's copies folded into few driver operations per layer.

Why: a host chunk holds one block's pages of every layer, so one layer's pages of
neighbouring chunks sit ``chunk_bytes`` apart on the host and never merge into longer
copies: a 16k-token prefix of a 32-layer model is 2,048 descriptors a layer, and the driver
spends about half a microsecond of host time on each (docs/layerwise.md, "Few descriptors
a layer"). But those pages sit at a uniform pitch on both sides wherever a job's chunk ids
and GPU block ids advance together (the cache hands out chunks lowest id first, and an
engine's free blocks come in runs): one 2-D copy (``cuMemcpy3DBatchAsync``) moves such a
run, its rows ``width`` bytes wide, ``host_pitch`` apart on the host and
``device_pitch`` apart on the device.

``fold_ids`` finds those runs once, on the job's block and chunk ids (a few hundred
numbers at 16k tokens), and gives every page tensor of every layer the same runs: the
submit never touches the job's 60,000 page copies. ``fold_layers`` does the same from the
layer plan's page columns, for the layouts ``fold_ids`` does not cover (several blocks a
chunk). Either way a run of at least ``min_height`` copies becomes one pitched op; shorter
ones stay plain descriptors of the layer's one batched call. A copy is in exactly one op,
and an op never spans two layers or two page tensors (a 2-D copy may not span two
allocations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...host_layout import HostLayout
from ...layer_plan import CopySlice, LayerMap, LayerPlan
from ...plan import BlockMapping

__all__ = ["MIN_LAYER_PITCHED_HEIGHT", "STAGE_ABOVE_COPY", "STAGE_ABOVE_US", "STAGE_COPY_GBPS", "IdFolder",
           "LayerOps", "PitchedRows", "fold_ids",
           "fold_layers",
           "may_stage", "prefer_staged", "worth_staging"]

# A pitched op costs the driver several descriptors' worth of host time, so a run shorter
# than this goes as plain descriptors (docs/layerwise.md, "Few descriptors a layer").
MIN_LAYER_PITCHED_HEIGHT = 4
# Estimated host microseconds of the driver's calls (as ``program.py`` estimates them): a
# call, a plain descriptor, a pitched op, a kernel launch.
US_PER_CALL, US_PER_DESCRIPTOR, US_PER_PITCHED_OP, US_PER_LAUNCH = 1.5, 0.8, 3.0, 2.0
# A job goes through the device slot (``layer_staging``) only where a layer's copies
# straight to its pages could not be enqueued as fast as the copy engine moves them: its
# estimated driver time over STAGE_ABOVE_COPY times its copy at STAGE_COPY_GBPS (a little
# under the pinned ceiling) and over STAGE_ABOVE_US (a shorter enqueue never matters), and
# the slot's at most half of that. A layerwise load runs
# beside the forward's GEMMs, and there the slot's scatter, an SM kernel, is starved and
# slows the forward, while copy engines hold up; and the enqueue is the native issuer
# thread's, off the caller's. So scattered 32 KiB pages go straight, as batched
# descriptors (about 0.8 us of host time to 0.65 us of copy each); pages of a few KiB,
# whose descriptors would starve the copy engine, go through the slot (docs/layerwise.md,
# "Few descriptors a layer"). The one place the choice is made.
STAGE_ABOVE_COPY = 2.0
STAGE_COPY_GBPS = 50.0
STAGE_ABOVE_US = 100.0


@dataclass(frozen=True)
class PitchedRows:
    """2-D copies in the lane's direction: op ``i`` moves ``height[i]`` rows of
    ``width[i]`` bytes from ``src[i] + r * src_pitch[i]`` to ``dst[i] + r * dst_pitch[i]``."""

    dst: np.ndarray
    dst_pitch: np.ndarray
    src: np.ndarray
    src_pitch: np.ndarray
    width: np.ndarray
    height: np.ndarray

    def __len__(self) -> int:
        return int(self.width.shape[0])


@dataclass(frozen=True)
class LayerOps:
    """Per layer, its plain descriptors (``dst``, ``src``, ``sizes``: copies
    ``[bounds[l], bounds[l + 1])``) and its pitched ops (``pitched`` rows
    ``[pbounds[l], pbounds[l + 1])``), all in the lane's direction."""

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    bounds: np.ndarray
    pitched: PitchedRows
    pbounds: np.ndarray
    # The driver's packed rows of ``pitched`` (``Driver.pitched_ops``), once packed.
    packed: np.ndarray | None = None
    # Set where the job goes through the lane's device slot instead (``layer_staging``).
    staged: Any = None

    @property
    def num_layers(self) -> int:
        return int(self.bounds.shape[0]) - 1

    def descriptors(self, layer: int) -> int:
        """Driver operations layer ``layer`` takes: plain descriptors and pitched ops (or,
        through the slot, its 2-D ops and kernel launches)."""
        if self.staged is not None:
            return int(self.staged.layer_ops(layer))
        plain = self.bounds[layer + 1] - self.bounds[layer]
        return int(plain + self.pbounds[layer + 1] - self.pbounds[layer])

    def cost_us(self, layer: int) -> float:
        """Estimated host time of layer ``layer``'s driver calls, its event's record included."""
        return float(self.costs_us()[layer])

    def costs_us(self) -> np.ndarray:
        """``cost_us`` of every layer at once."""
        if self.staged is not None:
            return US_PER_CALL * 2 + np.asarray(self.staged.costs_us(), dtype=np.float64)
        plain, pitched = np.diff(self.bounds), np.diff(self.pbounds)
        return (US_PER_CALL * (1 + (plain > 0) + (pitched > 0)) + US_PER_DESCRIPTOR * plain
                + US_PER_PITCHED_OP * pitched)

    def with_packed(self, pack: Any) -> LayerOps:
        """The same ops with ``packed`` = ``pack(dst, dst_pitch, src, src_pitch, width, height)``."""
        p = self.pitched
        if not len(p):
            return self
        packed = pack(p.dst, p.dst_pitch, p.src, p.src_pitch, p.width, p.height)
        return LayerOps(self.dst, self.src, self.sizes, self.bounds, p, self.pbounds,
                        np.ascontiguousarray(packed, dtype=np.uint64))

    def with_staged(self, staged: Any) -> LayerOps:
        return LayerOps(self.dst, self.src, self.sizes, self.bounds, self.pitched, self.pbounds, self.packed,
                        staged)


def _outpaced(direct: LayerOps, layer_bytes: np.ndarray) -> np.ndarray:
    """Per layer, whether its copies straight to its pages would take longer to enqueue
    than ``STAGE_ABOVE_COPY`` times their copy, and over ``STAGE_ABOVE_US``."""
    copy_us = np.asarray(layer_bytes, dtype=np.float64) / (STAGE_COPY_GBPS * 1e3)
    costs = direct.costs_us()
    return np.asarray((costs > STAGE_ABOVE_COPY * copy_us) & (costs > STAGE_ABOVE_US))


def prefer_staged(direct: LayerOps, staged: Any, layer_bytes: np.ndarray) -> bool:
    """Whether a job goes through the slot: some layer straight to its pages could not be
    enqueued as fast as it copies, and the slot takes at most half as long to enqueue."""
    outpaced = _outpaced(direct, layer_bytes)
    if not outpaced.any():
        return False
    worst = float(direct.costs_us()[outpaced].max())
    return bool(2 * float(np.max(staged.costs_us())) <= worst)


def may_stage(direct: LayerOps) -> bool:
    """Whether some layer's enqueue straight to its pages takes over ``STAGE_ABOVE_US``:
    where none does, ``worth_staging`` is False whatever the bytes (a cheap test first)."""
    if direct.num_layers <= 0:
        return False
    if direct.staged is None:  # a layer's cost is at most its calls' and its ops' (no diffs of costs)
        calls, b, pb = US_PER_CALL * 3, direct.bounds, direct.pbounds
        if calls + US_PER_DESCRIPTOR * int(b[-1] - b[0]) + US_PER_PITCHED_OP * int(pb[-1] - pb[0]) \
                <= STAGE_ABOVE_US:
            return False
        most = (calls + US_PER_DESCRIPTOR * int((b[1:] - b[:-1]).max())
                + US_PER_PITCHED_OP * int((pb[1:] - pb[:-1]).max()))
        if most <= STAGE_ABOVE_US:
            return False
    return bool(float(direct.costs_us().max()) > STAGE_ABOVE_US)


def worth_staging(direct: LayerOps, layer_bytes: np.ndarray) -> bool:
    """Whether to plan the slot at all (it takes memory on first use)."""
    return bool(_outpaced(direct, layer_bytes).any())


def _u64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)


def fold_layers(plan: CopySlice | LayerPlan, bounds: np.ndarray, device_base: np.ndarray, host_base: int, *,
                to_host: bool, max_pitch: int = 0, min_height: int = MIN_LAYER_PITCHED_HEIGHT) -> LayerOps:
    """Fold a layerwise plan's copies (layer ``l``: copies ``[bounds[l], bounds[l + 1])``)
    into pitched runs and plain descriptors (module doc). ``max_pitch`` is the driver's
    limit on a pitch; 0 folds nothing (the driver has no pitched copies).

    Example: layer 0 moves K pages of blocks 4, 5, 6, 7 from chunks 10-13 (chunks 2 MiB
    apart, pages 32 KiB): one op of 4 rows, device pitch 32 KiB, host pitch 2 MiB.
    """
    cuts = np.asarray(bounds, dtype=np.int64)
    nlayers = int(cuts.shape[0]) - 1
    t = np.asarray(plan.tensor_idx, dtype=np.int64)
    dev = np.asarray(device_base, dtype=np.int64)[t] + np.asarray(plan.device_offset, dtype=np.int64)
    host = np.asarray(plan.host_offset, dtype=np.int64) + int(host_base)
    size = np.asarray(plan.nbytes, dtype=np.int64)
    n = int(size.shape[0])
    layer = np.repeat(np.arange(nlayers, dtype=np.int64), np.diff(cuts))
    used = np.zeros(max(0, n - 1), dtype=bool)
    if max_pitch > 0 and n > 1 and min_height > 1:
        # Host order within each layer and page tensor: a run is a stretch of copies whose
        # host and device addresses both advance by one pitch each.
        order = np.lexsort((host, size, t, layer))
        t, dev, host, size, layer = t[order], dev[order], host[order], size[order], layer[order]
        dd, dh = np.diff(dev), np.diff(host)
        valid = ((layer[1:] == layer[:-1]) & (t[1:] == t[:-1]) & (size[1:] == size[:-1])
                 & (dd >= size[:-1]) & (dh >= size[:-1]) & (dd <= max_pitch) & (dh <= max_pitch))
        # A link joins a run where the link before it is not one, or has the same pitches:
        # consecutive links then always share their pitches, so each run is uniform.
        same = np.ones_like(valid)
        same[1:] = ~valid[:-1] | ((dd[1:] == dd[:-1]) & (dh[1:] == dh[:-1]))
        used = valid & same
    starts = np.flatnonzero(np.concatenate(([True], ~used))) if n else np.zeros(0, dtype=np.int64)
    heights = np.diff(np.append(starts, n)) if n else np.zeros(0, dtype=np.int64)
    tall = heights >= max(2, min_height)
    # Plain copies: every copy of a short run, in layer order (each layer's slice contiguous).
    plain = np.repeat(~tall, heights) if n else np.zeros(0, dtype=bool)
    p_layer = layer[plain]
    pd, ph, ps = dev[plain], host[plain], size[plain]
    first = starts[tall]
    h = heights[tall]
    second = first + 1
    rd = dev[second] - dev[first] if first.size else np.zeros(0, dtype=np.int64)
    rh = host[second] - host[first] if first.size else np.zeros(0, dtype=np.int64)
    if to_host:
        dst, src, pitched = _u64(ph), _u64(pd), PitchedRows(host[first], rh, dev[first], rd, size[first], h)
    else:
        dst, src, pitched = _u64(pd), _u64(ph), PitchedRows(dev[first], rd, host[first], rh, size[first], h)
    return LayerOps(dst, src, _u64(ps), _layer_bounds(p_layer, nlayers), pitched,
                    _layer_bounds(layer[first], nlayers))


def _layer_bounds(layer_of: np.ndarray, nlayers: int) -> np.ndarray:
    """Cut points of items sorted by layer: layer ``l`` is ``[out[l], out[l + 1])``."""
    return np.searchsorted(layer_of, np.arange(nlayers + 1, dtype=np.int64), side="left").astype(np.int64)


class IdFolder:
    """``fold_ids`` for one lane: the layout's tables (each ref's layer, page tensor, device
    base, offset in a chunk, page size and row stride, by kind) built once, so a job's fold
    is a few numpy calls on its ids. ``usable`` is False where the layout is not covered."""

    def __init__(self, layout: HostLayout, lmap: LayerMap, device_base: np.ndarray, host_base: int, *,
                 to_host: bool, max_pitch: int, min_height: int = MIN_LAYER_PITCHED_HEIGHT) -> None:
        self.to_host, self.max_pitch, self.min_height = to_host, max_pitch, min_height
        self.num_layers = lmap.num_layers
        self.chunk_bytes = cb = int(layout.chunk_bytes)
        g_of, k_of, l_of = lmap.order_group.tolist(), lmap.order_ref.tolist(), lmap.order_layer.tolist()
        tensor = np.array([layout.tensor_idx[g][k] for g, k in zip(g_of, k_of)], dtype=np.int64)
        size = np.array([layout.page_sizes[g][k] for g, k in zip(g_of, k_of)], dtype=np.int64)
        offset = np.array([layout.page_offsets[g][k] for g, k in zip(g_of, k_of)], dtype=np.int64)
        stride = np.asarray(layout.row_strides, dtype=np.int64)[tensor] if tensor.size else tensor
        base = np.asarray(device_base, dtype=np.int64)[tensor] if tensor.size else tensor
        # Two refs of a layer in one tensor could merge into one copy; pages as large as a
        # chunk run on into the next one: neither is folded from the ids.
        pairs = set(zip(l_of, tensor.tolist()))
        self.usable = (layout.blocks_per_chunk == 1 and max_pitch > 0 and min_height >= 2
                       and len(pairs) == tensor.size and not (size >= cb).any())
        # Per group, its refs by (row stride, page size): (stride, size, layer, tensor,
        # device base, host base + offset), the refs in (layer, tensor) order.
        self.kinds: list[list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = []
        for g in range(layout.num_groups):
            mine = np.flatnonzero(lmap.order_group == g)
            kinds = []
            for s_, p_ in sorted(set(zip(stride[mine].tolist(), size[mine].tolist()))):
                refs = mine[(stride[mine] == s_) & (size[mine] == p_)]
                refs = refs[np.lexsort((tensor[refs], lmap.order_layer[refs]))]
                kinds.append((s_, p_, lmap.order_layer[refs], tensor[refs], base[refs][:, None],
                              (int(host_base) + offset[refs])[:, None]))
            self.kinds.append(kinds)
        self.sort = sum(len(k) for k in self.kinds) > 1  # else the ops come out in order
        # The common layout, one group and one kind (``_fold_one``): the kind's refs before
        # each layer (a job's per-layer cut points are these times its runs), and the range
        # of id steps that make a link, as bounds on the steps themselves.
        self._one: tuple[Any, ...] | None = None
        if (self.usable and layout.num_groups == 1 and len(self.kinds[0]) == 1 and self.kinds[0][0][0] > 0
                and self.kinds[0][0][1] > 0):
            s_, p_, layer = self.kinds[0][0][:3]
            before = np.searchsorted(layer, np.arange(self.num_layers + 1, dtype=np.int64), side="left")
            self._one = (before.astype(np.int64), -(-p_ // s_), max_pitch // s_, -(-p_ // cb),
                         max_pitch // cb)

    def fold(self, mapping: BlockMapping) -> LayerOps:
        """The job's ops (``usable`` layouts only)."""
        if self._one is not None and len(mapping.gpu_blocks) == 1:
            return self._fold_one(mapping)
        cb, max_pitch, min_height = self.chunk_bytes, self.max_pitch, self.min_height
        pitched: list[tuple[np.ndarray, ...]] = []  # layer, tensor, dev, dpitch, host, hpitch, width, height
        plain: list[tuple[np.ndarray, ...]] = []  # layer, tensor, dev, host, size
        for g, blocks in enumerate(mapping.gpu_blocks):
            n = int(blocks.size)
            if not n or not self.kinds[g]:
                continue
            if g == 0 and mapping.by_host is not None:  # sorted by the planner already
                b, c = (np.asarray(x, dtype=np.int64) for x in mapping.by_host)
            else:
                order = np.argsort(mapping.host_slots[g], kind="stable")
                b = np.asarray(blocks, dtype=np.int64)[order]
                c = np.asarray(mapping.host_slots[g], dtype=np.int64)[order]
            db, dc = np.diff(b), np.diff(c)
            for s_, p_, layer, tensor, base, host in self.kinds[g]:
                dd, dh = s_ * db, cb * dc
                valid = (dd >= p_) & (dh >= p_) & (dd <= max_pitch) & (dh <= max_pitch)
                same = np.ones_like(valid)
                same[1:] = ~valid[:-1] | ((db[1:] == db[:-1]) & (dc[1:] == dc[:-1]))
                starts = np.flatnonzero(np.concatenate(([True], ~(valid & same))))
                heights = np.diff(np.append(starts, n))
                tall = heights >= min_height
                refs, m = layer.shape[0], int(np.count_nonzero(tall))
                if m:  # every ref of this kind, every run: refs x runs ops, ref-major
                    first, h = starts[tall], heights[tall]
                    dpitch, hpitch = s_ * (b[first + 1] - b[first]), cb * (c[first + 1] - c[first])
                    dev, pool = (base + s_ * b[first]).ravel(), (host + cb * c[first]).ravel()
                    pitched.append((np.repeat(layer, m), np.repeat(tensor, m), dev, np.tile(dpitch, refs),
                                    pool, np.tile(hpitch, refs), np.full(refs * m, p_), np.tile(h, refs)))
                if m < starts.size:
                    short = np.flatnonzero(np.repeat(~tall, heights))
                    k = short.size
                    plain.append((np.repeat(layer, k), np.repeat(tensor, k), (base + s_ * b[short]).ravel(),
                                  (host + cb * c[short]).ravel(), np.full(refs * k, p_)))
        pl, _, pdev, pdp, phost, php, pw, ph = _joined(pitched, 8, self.sort)
        dl, _, ddev, dhost, ds = _joined(plain, 5, self.sort)
        if self.to_host:
            dst, src, rows = _u64(dhost), _u64(ddev), PitchedRows(phost, php, pdev, pdp, pw, ph)
        else:
            dst, src, rows = _u64(ddev), _u64(dhost), PitchedRows(pdev, pdp, phost, php, pw, ph)
        return LayerOps(dst, src, _u64(ds), _layer_bounds(dl, self.num_layers), rows,
                        _layer_bounds(pl, self.num_layers))

    def _fold_one(self, mapping: BlockMapping) -> LayerOps:
        """``fold`` of one group of one kind, in fewer numpy calls (the same ops): a step
        ``db`` of block ids links where ``p <= s * db <= max_pitch``, that is ``db`` in
        ``[ceil(p / s), max_pitch // s]`` (one unsigned compare), likewise the chunk steps;
        the ops come out ref-major, so in layer order, and each layer's cut points are its
        refs before it times the job's runs."""
        cb, min_height = self.chunk_bytes, self.min_height
        assert self._one is not None
        before, lo_b, hi_b, lo_c, hi_c = self._one
        s_, p_, _layer, _tensor, base, host = self.kinds[0][0]
        refs = int(before[-1])
        blocks = mapping.gpu_blocks[0]
        n = int(blocks.size)
        if mapping.by_host is not None:  # sorted by the planner already
            b, c = (np.asarray(x, dtype=np.int64) for x in mapping.by_host)
        else:
            order = np.argsort(mapping.host_slots[0], kind="stable")
            b = np.asarray(blocks, dtype=np.int64)[order]
            c = np.asarray(mapping.host_slots[0], dtype=np.int64)[order]
        empty = np.zeros(0, dtype=np.int64)
        pbounds = bounds = np.zeros(self.num_layers + 1, dtype=np.int64)
        rows = PitchedRows(empty, empty, empty, empty, empty, empty)
        dst = src = sizes = empty.view(np.uint64)
        if n:
            # numpy's C calls only (np.diff, np.append, np.flatnonzero are Python around them)
            db, dc = b[1:] - b[:-1], c[1:] - c[:-1]
            if hi_b >= lo_b and hi_c >= lo_c:
                valid = (((db - lo_b).view(np.uint64) <= hi_b - lo_b)
                         & ((dc - lo_c).view(np.uint64) <= hi_c - lo_c))
            else:
                valid = np.zeros(n - 1, dtype=bool)
            link = valid.copy()
            link[1:] &= ~valid[:-1] | ((db[1:] == db[:-1]) & (dc[1:] == dc[:-1]))
            starts = np.concatenate((_ZERO, (~link).nonzero()[0] + 1))
            heights = np.concatenate((starts[1:], (n,))) - starts
            tall = heights >= min_height
            m = int(np.count_nonzero(tall))
            if m:
                first = starts[tall]  # a tall run's first step is its pitch: db[first]
                bf, cf = b[first], c[first]
                dev, pool = (base + s_ * bf).ravel(), (host + cb * cf).ravel()
                per = np.empty((4, refs, m), dtype=np.int64)  # each run's, once a ref
                per[0] = s_ * db[first]
                per[1] = cb * dc[first]
                per[2] = p_
                per[3] = heights[tall]
                pdp, php, pw, ph = (x.ravel() for x in per)
                rows = (PitchedRows(pool, php, dev, pdp, pw, ph) if self.to_host
                        else PitchedRows(dev, pdp, pool, php, pw, ph))
                pbounds = before * m
            if m < starts.size:
                short = np.repeat(~tall, heights).nonzero()[0]
                k = short.size
                ddev, dhost = (base + s_ * b[short]).ravel(), (host + cb * c[short]).ravel()
                dst, src = (_u64(dhost), _u64(ddev)) if self.to_host else (_u64(ddev), _u64(dhost))
                sizes = _u64(np.full(refs * k, p_))
                bounds = before * k
        return LayerOps(dst, src, sizes, bounds, rows, pbounds)


_ZERO = np.zeros(1, dtype=np.int64)


def _joined(parts: list[tuple[np.ndarray, ...]], width: int, sort: bool) -> list[np.ndarray]:
    """Columns of ops made kind by kind, flat, in ``fold_layers``' order (by layer, then
    page tensor, then host address: column 0, 1, and the host column, 4 or 3)."""
    if not parts:
        return [np.zeros(0, dtype=np.int64)] * width
    cols = [np.concatenate([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(width)]
    if sort:
        order = np.lexsort((cols[4 if width == 8 else 3], cols[1], cols[0]))
        cols = [col[order] for col in cols]
    return cols


def fold_ids(plan: LayerPlan, device_base: np.ndarray, host_base: int, *, to_host: bool, max_pitch: int,
             min_height: int = MIN_LAYER_PITCHED_HEIGHT) -> LayerOps | None:
    """``fold_layers`` of the same job, found on its block and chunk ids alone (module doc);
    the same ops in the same order. None where the layout is not one this covers: one
    block a chunk, each layer's refs in tensors of their own, and a driver with 2-D copies.
    A lane keeps an ``IdFolder`` instead, its tables built once.

    Why it may: with one block a chunk, page ``k`` of the pair (block ``b``, chunk ``c``)
    sits at ``base[t_k] + stride_k * b`` on the device and ``c * chunk_bytes + offset_k``
    in the pool, so the links between pairs in chunk order (and the runs they make) are
    the same for every page tensor of equal page size and row stride.
    """
    folder = IdFolder(plan.layout, plan.layer_map, device_base, host_base, to_host=to_host,
                      max_pitch=max_pitch, min_height=min_height)
    return folder.fold(plan.mapping) if folder.usable else None
