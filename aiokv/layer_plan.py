"""Which pages form each model layer, and a layerwise job's copies in layer order.

A layer is what a model's forward pass reads or writes at once: every page one block owns
in that layer (its K and V pages, when split). ``CanonicalKVCaches.ref_layers`` says which
ref of which group belongs to which layer; ``from_tensors`` sets it (tensor ``i`` is
layer ``i``), and without it each ref is a layer of its own, group after group, which is
what vLLM's description holds (one ref per attention layer). A layout whose one page spans
every layer (cross-layer ``(num_blocks, layers, ...)``, vLLM's packed layouts) has no
layer to move on its own: layerwise jobs are refused there with ``InvalidSpec``.

A ``LayerPlan`` lists a job's copies layer after layer, merged where contiguous on both
sides but never across a layer's end, so copies ``[bounds[l], bounds[l + 1])`` move
exactly layer ``l``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidSpec
from .host_layout import HostLayout
from .layout import CanonicalKVCaches
from .plan import BlockMapping

__all__ = ["CopySlice", "LayerMap", "LayerPlan", "plan_layers"]


@dataclass(frozen=True)
class LayerMap:
    """The layers of one KV-cache description, and why layerwise jobs are refused on it
    (``refusal``; None where they are not)."""

    num_layers: int
    # The refs in layer order (layer, then group, then ref): one entry per ref.
    order_layer: np.ndarray
    order_group: np.ndarray
    order_ref: np.ndarray
    # The groups each layer has pages in (a job's blocks of those groups move with it).
    layer_groups: tuple[tuple[int, ...], ...]
    refusal: str | None
    # Whether layer order is the refs' own order, group after group (no gather needed).
    in_ref_order: bool = False
    # refs_per_layer[l, g]: how many refs of group g layer l has (its copies per block).
    refs_per_layer: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))

    @classmethod
    def build(cls, kv: CanonicalKVCaches, layout: HostLayout) -> LayerMap:
        """Read ``kv.ref_layers`` (or each ref a layer). Raises ``InvalidSpec`` for a
        ``ref_layers`` that does not match the refs; a layout that cannot go layer by layer
        builds all the same, with its ``refusal``."""
        groups = kv.group_data_refs
        given = kv.ref_layers
        if given is None:
            layers: list[list[int]] = []
            first = 0
            for refs in groups:
                layers.append(list(range(first, first + len(refs))))
                first += len(refs)
        else:
            layers = _checked(given, [len(refs) for refs in groups])
        entries = sorted((layer, g, k) for g, group in enumerate(layers) for k, layer in enumerate(group))
        num_layers = entries[-1][0] + 1 if entries else 0
        present = sorted({e[0] for e in entries})
        if present != list(range(num_layers)):
            missing = sorted(set(range(num_layers)) - set(present))
            raise InvalidSpec(f"ref_layers names layers 0..{num_layers - 1} but no ref belongs to "
                              f"layer(s) {missing}; number the layers 0, 1, ... in forward order")
        cols = np.array(entries, dtype=np.int64).reshape(-1, 3).T
        touched: list[set[int]] = [set() for _ in range(num_layers)]
        for layer, g, _ in entries:
            touched[layer].add(g)
        tensors = {groups[g][k].tensor_idx for _, g, k in entries}
        refusal = None
        if num_layers < 2 or len(tensors) < 2:
            refusal = (
                f"this KV cache has {num_layers} layer(s) in {len(tensors)} page tensor(s): one page "
                "spans every layer (a cross-layer (num_blocks, layers, ...) or packed layout), so no "
                "layer can move on its own. Layerwise jobs need per-layer tensors "
                "(CanonicalKVCaches.from_tensors(per_layer_tensors)); submit this job without layerwise"
            )
        in_ref_order = [(g, k) for _, g, k in entries] == [(g, k) for g, group in enumerate(layers)
                                                            for k in range(len(group))]
        per_layer = np.zeros((num_layers, len(groups)), dtype=np.int64)
        np.add.at(per_layer, (cols[0], cols[1]), 1)
        return cls(num_layers, cols[0].copy(), cols[1].copy(), cols[2].copy(),
                   tuple(tuple(sorted(s)) for s in touched), refusal, in_ref_order, per_layer)

    def check(self) -> None:
        """Raise ``InvalidSpec`` where layerwise jobs cannot run on this layout."""
        if self.refusal is not None:
            raise InvalidSpec(self.refusal)

    def index(self, layer: Any) -> int:
        """``layer`` as a valid layer index; raises ``InvalidSpec`` (a bool, a float, or out
        of range)."""
        if isinstance(layer, (bool, np.bool_)):
            raise InvalidSpec(f"a layer index must be an int, got {layer!r}")
        try:
            index = operator.index(layer)
        except TypeError:
            raise InvalidSpec(f"a layer index must be an int, got {type(layer).__name__}") from None
        if not 0 <= index < self.num_layers:
            raise InvalidSpec(f"layer {index} is out of range: this KV cache has layers "
                              f"0..{self.num_layers - 1}")
        return index


def _checked(given: Any, sizes: list[int]) -> list[list[int]]:
    """``ref_layers`` as lists of non-negative ints, one per ref of each group."""
    try:
        layers = [[operator.index(x) for x in group] for group in given]
    except TypeError as exc:
        raise InvalidSpec(f"ref_layers must be lists of int layer indices, one list per group "
                          f"({exc})") from None
    if [len(g) for g in layers] != sizes:
        raise InvalidSpec(f"ref_layers has {[len(g) for g in layers]} entries per group, but the groups "
                          f"have {sizes} refs: give one layer index per ref")
    if any(x < 0 for g in layers for x in g):
        raise InvalidSpec("ref_layers holds a negative layer index")
    return layers


class CopySlice:
    """Some of a plan's copies (the four columns a lane reads, as ``CopyPlan`` has them)."""

    __slots__ = ("device_offset", "host_offset", "nbytes", "tensor_idx")

    def __init__(self, tensor_idx: np.ndarray, device_offset: np.ndarray, host_offset: np.ndarray,
                 nbytes: np.ndarray) -> None:
        self.tensor_idx = tensor_idx
        self.device_offset = device_offset
        self.host_offset = host_offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])


class LayerPlan:
    """A layerwise job's copies in layer order: layer ``l`` is copies ``[bounds[l],
    bounds[l + 1])`` (possibly none: a layer of a group the job has no blocks in).

    The page columns (``tensor_idx``, ``device_offset``, ``host_offset``, ``nbytes``) and
    ``bounds`` are built on first use: a CUDA lane with 2-D copies folds a job's layers
    from its block and chunk ids alone (``backends/cuda/layer_ops.fold_ids``), and a
    16k-token prefix is some 60,000 page copies, a millisecond of numpy it never needs.
    """

    __slots__ = ("_columns", "layer_map", "layout", "mapping", "total_bytes")

    def __init__(self, mapping: BlockMapping, layout: HostLayout, layer_map: LayerMap) -> None:
        self.mapping = mapping
        self.layout = layout
        self.layer_map = layer_map
        self.total_bytes = sum(int(b.size) * size for b, size in zip(mapping.gpu_blocks, layout.block_bytes))
        self._columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _built(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        columns = self._columns
        if columns is None:
            columns = self._columns = _columns(self.mapping, self.layout, self.layer_map)
        return columns

    @property
    def tensor_idx(self) -> np.ndarray:
        return self._built()[0]

    @property
    def device_offset(self) -> np.ndarray:
        return self._built()[1]

    @property
    def host_offset(self) -> np.ndarray:
        return self._built()[2]

    @property
    def nbytes(self) -> np.ndarray:
        return self._built()[3]

    @property
    def bounds(self) -> np.ndarray:
        return self._built()[4]

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def num_layers(self) -> int:
        return self.layer_map.num_layers

    def layer(self, index: int) -> CopySlice:
        """Layer ``index``'s copies (views, no copy)."""
        lo, hi = int(self.bounds[index]), int(self.bounds[index + 1])
        return CopySlice(self.tensor_idx[lo:hi], self.device_offset[lo:hi], self.host_offset[lo:hi],
                         self.nbytes[lo:hi])

    def layer_bytes(self) -> np.ndarray:
        """Bytes each layer moves (from the ids alone: no page columns are built)."""
        lmap, layout = self.layer_map, self.layout
        counts = np.array([b.size for b in self.mapping.gpu_blocks], dtype=np.int64)
        sizes = np.array([layout.page_sizes[g][k] for g, k in zip(lmap.order_group.tolist(),
                                                                   lmap.order_ref.tolist())], dtype=np.int64)
        out = np.zeros(lmap.num_layers, dtype=np.int64)
        np.add.at(out, lmap.order_layer, sizes * counts[lmap.order_group])
        return out

    def blocks(self, layers: Iterable[int]) -> set[int]:
        """The GPU blocks whose pages those layers hold in this job: a block of a group one
        of them has pages in (a failed layer leaves every such block incomplete)."""
        groups = {g for layer in layers for g in self.layer_map.layer_groups[layer]}
        out: set[int] = set()
        for g in sorted(groups):
            out.update(self.mapping.gpu_blocks[g].tolist())
        return out


def plan_layers(mapping: BlockMapping, layout: HostLayout, layer_map: LayerMap) -> LayerPlan:
    """The job's page copies grouped by layer, in layer order, merged within a layer (the
    columns are built on first use, see ``LayerPlan``)."""
    return LayerPlan(mapping, layout, layer_map)


def _columns(mapping: BlockMapping, layout: HostLayout, layer_map: LayerMap,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A job's page copies in layer order, merged within a layer, and the layer bounds.

    Vectorized whatever the number of layers: each group's copies are built page-major as
    in ``aiokv.plan``, then one gather puts each ref's run of copies where its layer wants it.
    """
    bpc, cb = layout.blocks_per_chunk, layout.chunk_bytes
    cols: list[list[np.ndarray]] = [[], [], [], []]
    counts = np.zeros(layout.num_groups, dtype=np.int64)
    for g, (blocks, slots) in enumerate(zip(mapping.gpu_blocks, mapping.host_slots)):
        n = int(blocks.size)
        counts[g] = n
        tensors, pages, strides, offsets = layout.group_arrays[g]
        chunk, sub = np.divmod(slots, bpc) if bpc > 1 else (slots, 0)
        cols[0].append(np.repeat(tensors.ravel(), n))
        cols[1].append((strides * blocks[None, :]).ravel())
        cols[2].append((chunk[None, :] * cb + offsets + sub * pages).ravel())
        cols[3].append(np.repeat(pages.ravel(), n))
    t, d, h, s = (c[0] if len(c) == 1 else np.concatenate(c) for c in cols)
    total = int(t.shape[0])
    if not layer_map.in_ref_order:  # else the page-major arrays are in layer order already
        # Ref k of group g is the run [start[g] + k * n[g], ... + n[g]) of the arrays.
        sizes = np.array([len(r) for r in layout.tensor_idx], dtype=np.int64) * counts
        group_start = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        g_of = layer_map.order_group
        run_len = counts[g_of]
        run_start = group_start[g_of] + layer_map.order_ref * run_len
        before = np.cumsum(run_len) - run_len
        order = np.repeat(run_start - before, run_len) + np.arange(total, dtype=np.int64)
        t, d, h, s = t[order], d[order], h[order], s[order]
    cuts = np.zeros(layer_map.num_layers + 1, dtype=np.int64)
    np.cumsum(layer_map.refs_per_layer @ counts, out=cuts[1:])
    if total > 1:
        joins = (t[1:] == t[:-1]) & (d[1:] == d[:-1] + s[:-1]) & (h[1:] == h[:-1] + s[:-1])
        inner = cuts[(cuts > 0) & (cuts < total)]
        joins[inner - 1] = False  # a layer's first copy never merges into the layer before
        if joins.any():
            starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
            t, d, h, s = t[starts], d[starts], h[starts], np.add.reduceat(s, starts)
            cuts = np.searchsorted(starts, cuts)
    return t, d, h, s, cuts.astype(np.int64)
