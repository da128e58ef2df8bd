"""The canonical description of a KV cache: byte views of blocks, grouped by layer.

Same shape as vLLM's ``CanonicalKVCaches``, so an engine's objects can be handed over
as they are; ``CanonicalKVCaches.from_tensors`` builds one from ordinary per-layer tensors.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .errors import InvalidSpec

__all__ = ["CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches"]


@dataclass
class CanonicalKVCacheTensor:
    """A byte view shaped ``(num_blocks, page_bytes)``: row ``b`` is block ``b``'s page.

    Rows may be further apart than ``page_bytes`` (the row stride is read from the tensor).
    """

    tensor: torch.Tensor
    # Bytes of one block's page in this tensor.
    page_size_bytes: int
    # What the bytes are, as the engine allocated them ("torch.bfloat16[16x8x128]": dtype
    # and page shape, tokens per block included), when known: lower cache tiers key their
    # blocks by it, so caches of another dtype or block size never share them. "" if unknown.
    page_format: str = ""


@dataclass
class CanonicalKVCacheRef:
    """One layer's page inside a canonical tensor; only ``page_size_bytes`` of it move."""

    # Index into ``CanonicalKVCaches.tensors``.
    tensor_idx: int
    # Bytes copied from the start of each row of that tensor.
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """Every page tensor, and which of them (and how much) each KV-cache group moves."""

    tensors: list[CanonicalKVCacheTensor]
    # group_data_refs[g] lists the pages that one block of group g owns (the host chunk
    # holds them in device address order; see aiokv.plan).
    group_data_refs: list[list[CanonicalKVCacheRef]] = field(default_factory=list)
    # ref_layers[g][k]: the model layer (0, 1, ... in forward order) that ref k of group g
    # belongs to, for layerwise jobs. None: each ref is a layer of its own, group after
    # group (vLLM's description: one ref per attention layer). ``from_tensors`` sets it.
    ref_layers: list[list[int]] | None = None

    @classmethod
    def coerce(cls, kv: object) -> CanonicalKVCaches:
        """Accept ours, or any object with the same fields (vLLM's ``CanonicalKVCaches``).

        Fields are read by attribute: ``tensors[i].tensor`` / ``.page_size_bytes`` and
        ``group_data_refs[g][k].tensor_idx`` / ``.page_size_bytes``.
        """
        if isinstance(kv, cls):
            return kv
        try:
            if not all(isinstance(t.tensor, torch.Tensor) for t in kv.tensors):  # type: ignore[attr-defined]
                raise InvalidSpec(
                    "kv_caches must be a CanonicalKVCaches whose tensors[i].tensor are torch "
                    "tensors; build one with CanonicalKVCaches.from_tensors(tensors)"
                )
            return cls(
                tensors=[
                    CanonicalKVCacheTensor(t.tensor, int(t.page_size_bytes),
                                           str(getattr(t, "page_format", "") or ""))
                    for t in kv.tensors  # type: ignore[attr-defined]
                ],
                group_data_refs=[
                    [CanonicalKVCacheRef(int(r.tensor_idx), int(r.page_size_bytes)) for r in refs]
                    for refs in kv.group_data_refs  # type: ignore[attr-defined]
                ],
                ref_layers=_ref_layers(getattr(kv, "ref_layers", None)),
            )
        except InvalidSpec:
            raise
        except (AttributeError, TypeError, ValueError) as exc:
            raise InvalidSpec(
                "kv_caches must be a CanonicalKVCaches (or an object with its fields, such as "
                "vLLM's); build one with CanonicalKVCaches.from_tensors(tensors)"
            ) from exc

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], block_dim: int | None = None
    ) -> CanonicalKVCaches:
        """Describe per-layer KV tensors as one group; tensor ``i`` is model layer ``i``
        (``ref_layers``), whose pages (K and V, when split) a layerwise job moves together.

        ``block_dim`` names the dimension that indexes blocks. Dimensions before it split
        into separate page tensors (the 2 of K and V in ``(2, num_blocks, ...)``, which
        takes ``block_dim=1``); everything after it is one block's page, which must be one
        dense range of memory (contiguous, or a permuted view of a contiguous page).
        ``(num_blocks, ...)`` and cross-layer ``(num_blocks, layers, ...)`` take
        ``block_dim=0``, the default, except where dimension 0 has size 2: that reads like
        a K/V split, so it must be said (``block_dim=1`` for K/V, ``block_dim=0`` for a
        cache of two blocks) rather than silently moving K and V as two blocks.

        Raises:
            InvalidSpec: empty input, a bad or ambiguous ``block_dim``, mixed devices, a
                page that is not one dense range of memory, or pages that overlap.
        """
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        elif not isinstance(tensors, Sequence):
            tensors = list(tensors)  # a generator: read once
        if len(tensors) == 0:
            raise InvalidSpec("from_tensors() needs at least one KV-cache tensor")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            bad = next(type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor))
            raise InvalidSpec(f"from_tensors() takes torch.Tensor layers, got a {bad}")
        block_dim = _block_dim(block_dim, tensors)
        device = tensors[0].device
        pages: list[CanonicalKVCacheTensor] = []
        page_layers: list[int] = []
        for layer, t in enumerate(tensors):
            if t.device != device:
                raise InvalidSpec(
                    f"layer {layer} is on {t.device} but layer 0 is on {device}; "
                    "every KV-cache tensor must live on one device"
                )
            if not 0 <= block_dim < t.dim():
                raise InvalidSpec(
                    f"layer {layer}: block_dim={block_dim} is out of range for a tensor "
                    f"of shape {tuple(t.shape)}"
                )
            if block_dim == t.dim() - 1:
                raise InvalidSpec(
                    f"layer {layer}: block_dim={block_dim} is the last dimension, so a "
                    "block has no page; pass the dimension that indexes blocks"
                )
            if math.prod(t.shape[: block_dim + 1]) == 0:
                raise InvalidSpec(f"layer {layer}: tensor of shape {tuple(t.shape)} is empty")
            # unbind, never reshape: a reshape may copy, and a copy would silently
            # detach the description from the tensor the model reads.
            parts = [t]
            for _ in range(block_dim):
                parts = [q for p in parts for q in p.unbind(0)]
            for part in parts:
                pages.append(_page_view(part, layer))
                page_layers.append(layer)
        refs = [CanonicalKVCacheRef(i, p.page_size_bytes) for i, p in enumerate(pages)]
        return cls(tensors=pages, group_data_refs=[refs], ref_layers=[page_layers])


def _ref_layers(value: object) -> list[list[int]] | None:
    """An engine's ``ref_layers`` as lists of ints (checked against the refs later, by
    ``aiokv.layer_plan.LayerMap``); None stays None."""
    if value is None:
        return None
    return [[operator.index(x) for x in group] for group in value]  # type: ignore[attr-defined]


def _block_dim(block_dim: object, tensors: Sequence[torch.Tensor]) -> int:
    """The dimension that indexes blocks: as given (any integral type, not a bool), else 0
    unless dimension 0 has size 2, which a K/V layout would have too."""
    if block_dim is None:
        if any(t.dim() > 1 and t.shape[0] == 2 for t in tensors):
            shape = tuple(next(t for t in tensors if t.dim() > 1 and t.shape[0] == 2).shape)
            raise InvalidSpec(
                f"a KV-cache tensor of shape {shape} has 2 in dimension 0: pass block_dim=1 for "
                "a (2, num_blocks, ...) K/V layout, or block_dim=0 if it really holds 2 blocks"
            )
        return 0
    if isinstance(block_dim, bool):
        raise InvalidSpec(f"block_dim must be an int, got {block_dim!r}")
    try:
        return operator.index(block_dim)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidSpec(f"block_dim must be an int, got {block_dim!r}") from None


def _page_view(part: torch.Tensor, layer: int) -> CanonicalKVCacheTensor:
    """View ``(num_blocks, ...)`` as ``(num_blocks, page_bytes)`` bytes without copying."""
    page_shape = part.shape[1:]
    # Dense in some order of its dimensions is enough: pages move as raw bytes, so a
    # permuted view of a contiguous page (an HND allocation seen as NHD) moves as one range.
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(page_shape, part.stride()[1:]) if sz != 1):
        if stride != expected:
            raise InvalidSpec(
                f"layer {layer}: a block's page (shape {tuple(page_shape)}, strides "
                f"{tuple(part.stride()[1:])}) is not one dense range of memory; pass a tensor "
                "whose dimensions after block_dim are contiguous in some order, e.g. call "
                ".contiguous() once at allocation"
            )
        expected *= size
    num_blocks = part.shape[0]
    page_bytes = expected * part.element_size()
    row_stride = part.stride(0) * part.element_size()
    if num_blocks > 1 and row_stride < page_bytes:
        raise InvalidSpec(
            f"layer {layer}: blocks are {row_stride} bytes apart but a page is {page_bytes} "
            "bytes, so pages overlap (an expand or unfold view?); pass the tensor the cache "
            "was allocated as"
        )
    # The page is one dense range starting at its first element (strides are positive), so
    # unit strides address the same memory; then bytes for every dtype, 1-byte ones too (numpy, which
    # the CPU lane copies with, has no fp8 and would convert bools).
    base = part.as_strided((num_blocks, expected), (part.stride(0), 1))
    as_bytes = base.view(torch.uint8).as_strided((num_blocks, page_bytes), (row_stride, 1))
    page_format = f"{part.dtype}[{'x'.join(str(int(d)) for d in page_shape)}]"
    return CanonicalKVCacheTensor(tensor=as_bytes, page_size_bytes=page_bytes, page_format=page_format)
