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

``fold_layers`` finds those runs layer by layer, in numpy whatever the job's size. A run
of at least ``min_height`` copies becomes one pitched op; shorter ones stay plain
descriptors of the layer's one batched call. A copy is in exactly one op, and an op never
spans two layers or two page tensors (a 2-D copy may not span two allocations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...layer_plan import CopySlice

__all__ = ["MIN_LAYER_PITCHED_HEIGHT", "STAGE_ABOVE_US", "LayerOps", "PitchedRows", "fold_layers",
           "prefer_staged", "worth_staging"]

# A pitched op costs the driver several descriptors' worth of host time, so a run shorter
# than this goes as plain descriptors (docs/layerwise.md, "Few descriptors a layer").
MIN_LAYER_PITCHED_HEIGHT = 4
# Estimated host microseconds of the driver's calls (as ``program.py`` estimates them): a
# call, a plain descriptor, a pitched op, a kernel launch.
US_PER_CALL, US_PER_DESCRIPTOR, US_PER_PITCHED_OP, US_PER_LAUNCH = 1.5, 0.8, 3.0, 2.0
# A layer whose copies straight to its pages cost more host time than this (about 250
# plain descriptors: scattered GPU blocks) goes through the device slot
# (``layer_staging``) where that costs at most half as much. Below it, runs go straight to
# the pages even where the slot would take fewer calls: the slot costs SM time, device
# memory and a second pass over the bytes, and a layer's enqueue of a few tens of
# microseconds stays far ahead of its copy (docs/layerwise.md, "Few descriptors a layer").
# The one place the choice is made.
STAGE_ABOVE_US = 200.0


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
        if self.staged is not None:
            return US_PER_CALL * 2 + self.staged.cost_us(layer)
        plain = int(self.bounds[layer + 1] - self.bounds[layer])
        pitched = int(self.pbounds[layer + 1] - self.pbounds[layer])
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


def prefer_staged(direct: LayerOps, staged: Any) -> bool:
    """Whether a job goes through the slot: its costliest layer straight to its pages is
    over ``STAGE_ABOVE_US`` and the slot takes at most half of that."""
    worst = max((direct.cost_us(layer) for layer in range(direct.num_layers)), default=0.0)
    if worst <= STAGE_ABOVE_US:
        return False
    through = max(staged.cost_us(layer) for layer in range(direct.num_layers))
    return bool(2 * through <= worst)


def worth_staging(direct: LayerOps) -> bool:
    """Whether to plan the slot at all (it takes memory on first use)."""
    return any(direct.cost_us(layer) > STAGE_ABOVE_US for layer in range(direct.num_layers))


def _u64(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)


def fold_layers(plan: CopySlice, bounds: np.ndarray, device_base: np.ndarray, host_base: int, *,
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
