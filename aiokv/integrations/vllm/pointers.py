"""vLLM 0.34's ``DevicePointers`` read back as block ids of the registered KV tensors.

From 0.34 vLLM's connector hands a worker raw device addresses (one per block, per page,
per KV-cache group, in that canonical order) instead of block ids. aiokv plans its copies
from block ids (run coalescing, chunk skips, its copy strategies), so every address is
mapped back to the row of the tensor it must fall in; one that does not start a row of
that tensor, a size that is not that page's, or pages of one block that disagree, refuses
the whole job before anything is enqueued. Free of vLLM imports (duck-typed), so it is
tested wherever aiokv is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import InvalidSpec
from ...specs import GPULoadStoreSpec

__all__ = ["PointerMap", "is_device_pointers"]

_FIELDS = ("ptrs", "sizes", "group_block_counts", "group_data_ref_counts", "block_indices")


def is_device_pointers(spec: Any) -> bool:
    """True for vLLM 0.34's ``DevicePointers`` (or an object shaped like it)."""
    return hasattr(spec, "ptrs") and not hasattr(spec, "block_ids")


@dataclass(frozen=True)
class _Group:
    """One KV-cache group's pages, as column vectors (one row per page)."""

    tensor_idx: np.ndarray  # int64 (k,)
    bases: np.ndarray  # uint64 (k, 1): data_ptr of each page's tensor
    strides: np.ndarray  # uint64 (k, 1): bytes from one block's row to the next
    rows: np.ndarray  # uint64 (k, 1): blocks in each page's tensor
    pages: np.ndarray  # uint64 (k, 1): bytes vLLM copies per page (the un-padded size)


class PointerMap:
    """Maps device addresses back to blocks of the KV caches a worker was built over.

    Args:
        kv_caches: vLLM's ``CanonicalKVCaches`` (``tensors[i].tensor`` a ``(num_blocks,
            page_bytes)`` view; ``group_data_refs[g]`` the pages of group ``g``), the same
            object vLLM resolves its pointers against.
    """

    def __init__(self, kv_caches: Any) -> None:
        groups = []
        for refs in kv_caches.group_data_refs:
            idx = [int(ref.tensor_idx) for ref in refs]
            tensors = [kv_caches.tensors[i].tensor for i in idx]
            groups.append(_Group(
                tensor_idx=np.asarray(idx, dtype=np.int64),
                bases=_column([t.data_ptr() for t in tensors]),
                strides=_column([t.stride(0) * t.element_size() for t in tensors]),
                rows=_column([t.shape[0] for t in tensors]),
                pages=_column([int(ref.page_size_bytes) for ref in refs]),
            ))
        self._groups = tuple(groups)

    def to_spec(self, pointers: Any) -> GPULoadStoreSpec:
        """The block ids ``pointers`` address, as a GPU spec (group sizes and block
        indices carried over; null-block placeholders stay block 0).

        Raises:
            InvalidSpec: a field is missing or malformed, the groups or their page counts
                are not the registered ones, or an address or size does not map exactly.
        """
        missing = [f for f in _FIELDS if not hasattr(pointers, f)]
        if missing:
            raise InvalidSpec(
                f"expected vLLM's DevicePointers, got {type(pointers).__name__} without {missing}"
            )
        counts = _ints(pointers.group_block_counts, "group_block_counts")
        ref_counts = _ints(pointers.group_data_ref_counts, "group_data_ref_counts")
        starts = _ints(pointers.block_indices, "block_indices")
        registered = [len(g.tensor_idx) for g in self._groups]
        if len(counts) != len(registered) or len(starts) != len(registered):
            raise InvalidSpec(
                f"DevicePointers name {len(counts)} groups (block_indices: {len(starts)}); "
                f"the KV caches registered {len(registered)}"
            )
        if ref_counts != registered:
            raise InvalidSpec(
                f"DevicePointers have {ref_counts} pages per group; the KV caches registered {registered}"
            )
        ptrs = _addresses(pointers.ptrs, "ptrs")
        sizes = _addresses(pointers.sizes, "sizes")
        total = sum(n * k for n, k in zip(counts, registered))
        if ptrs.size != total or sizes.size != total:
            raise InvalidSpec(
                f"DevicePointers carry {ptrs.size} addresses and {sizes.size} sizes; their "
                f"group_block_counts {counts} over {registered} pages per group need {total}"
            )
        blocks = []
        offset = 0
        for g, (group, n) in enumerate(zip(self._groups, counts)):
            if n == 0:
                continue
            span = slice(offset, offset + n * len(group.tensor_idx))
            offset = span.stop
            blocks.append(self._group_blocks(g, group, ptrs[span].reshape(-1, n), sizes[span].reshape(-1, n)))
        block_ids = np.concatenate(blocks) if blocks else np.empty(0, dtype=np.int64)
        return GPULoadStoreSpec(block_ids, group_sizes=counts, block_indices=starts)

    @staticmethod
    def _group_blocks(g: int, group: _Group, ptrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Group ``g``'s block ids from its ``(pages, blocks)`` addresses and sizes."""
        bad = np.argwhere(sizes != group.pages)
        if bad.size:
            k, j = (int(v) for v in bad[0])
            raise InvalidSpec(
                f"group {g}, page {k}, block {j}: a copy of {int(sizes[k, j])} bytes, but the "
                f"registered page is {int(group.pages[k, 0])} bytes"
            )
        offsets = ptrs - group.bases  # wraps below the base, so the row check refuses it
        rows, rest = np.divmod(offsets, group.strides)
        bad = np.argwhere((rest != 0) | (rows >= group.rows))
        if bad.size:
            k, j = (int(v) for v in bad[0])
            raise InvalidSpec(
                f"group {g}, page {k}, block {j}: device address {int(ptrs[k, j]):#x} does not start "
                f"a block of the registered tensor {int(group.tensor_idx[k])} ({int(group.rows[k, 0])} "
                f"blocks of {int(group.strides[k, 0])} bytes from {int(group.bases[k, 0]):#x})"
            )
        bad = np.argwhere(rows != rows[0])
        if bad.size:
            k, j = (int(v) for v in bad[0])
            raise InvalidSpec(
                f"group {g}, block {j}: page 0 points at block {int(rows[0, j])} but page {k} at "
                f"block {int(rows[k, j])}; every page of a block must name the same block"
            )
        return rows[0].astype(np.int64)


def _column(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64).reshape(-1, 1)


def _ints(values: Any, name: str) -> list[int]:
    """A tuple of non-negative ints, or InvalidSpec naming the field."""
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise InvalidSpec(f"DevicePointers.{name} must be a sequence of ints, got {values!r}") from None
    if any(v < 0 for v in out) or any(isinstance(v, bool) for v in values):
        raise InvalidSpec(f"DevicePointers.{name} must hold non-negative ints, got {values!r}")
    return out


def _addresses(values: Any, name: str) -> np.ndarray:
    """A flat uint64 array of ``values`` (vLLM's own dtype), or InvalidSpec."""
    arr = np.asarray(values)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise InvalidSpec(
            f"DevicePointers.{name} must be a 1-D integer array, got {arr.dtype} shaped {arr.shape}"
        )
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.size and arr.min() < 0:
        raise InvalidSpec(f"DevicePointers.{name} holds a negative value ({int(arr.min())})")
    return arr.astype(np.uint64, copy=False)
