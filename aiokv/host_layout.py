"""Where each page of each GPU block sits in the host pool (ours to choose).

The pool is an array of chunks of ``chunk_bytes`` each. Inside a chunk, group ``g``'s pages
are stored page-major: all ``blocks_per_chunk`` sub-blocks of one page, then of the next,
and so on. A run of consecutive GPU blocks therefore lands on consecutive host bytes, and
coalesces into one copy (``plan.py``).

Pages follow the device address of their tensors, not the order of the refs: when page
tensors sit at a uniform pitch on the device (one allocation, or per-layer allocations
that the caching allocator placed back to back, in either direction), one block's pages
then form a single pitched (2D) copy instead of one copy per page (the CUDA backend's
``pitched.plan_pitched``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .errors import InvalidSpec
from .layout import CanonicalKVCaches

__all__ = ["CHUNK_ALIGN", "HostLayout"]

CHUNK_ALIGN = 512
"""Host chunks are padded to a multiple of this many bytes, so every chunk starts aligned
(engines that size their own pools, such as the vLLM plug-in, must pad the same way)."""


@dataclass(frozen=True)
class HostLayout:
    """Where each page of each sub-block sits in the host pool.

    ``page_offsets[g][k]`` is where page ``k`` of group ``g`` starts inside a chunk;
    sub-block ``s`` of it is ``s * page_sizes[g][k]`` further on.
    """

    blocks_per_chunk: int
    chunk_bytes: int
    tensor_idx: tuple[tuple[int, ...], ...]
    page_sizes: tuple[tuple[int, ...], ...]
    page_offsets: tuple[tuple[int, ...], ...]
    row_strides: tuple[int, ...]
    num_gpu_blocks: tuple[int, ...]
    # Per group, each page's ``CanonicalKVCacheTensor.page_format`` ("" where unknown).
    page_formats: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def build(cls, kv: CanonicalKVCaches, blocks_per_chunk: int) -> HostLayout:
        if blocks_per_chunk < 1:
            raise InvalidSpec(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if not kv.tensors or not kv.group_data_refs or not all(kv.group_data_refs):
            raise InvalidSpec("the KV-cache description has no tensors or an empty group")
        row_strides = []
        for i, t in enumerate(kv.tensors):
            tensor = t.tensor
            if tensor.dim() != 2 or tensor.element_size() != 1 or tensor.stride(1) != 1:
                raise InvalidSpec(
                    f"tensors[{i}] must be a byte view shaped (num_blocks, page_bytes) with "
                    f"contiguous rows; got shape {tuple(tensor.shape)}, dtype {tensor.dtype}"
                )
            row_strides.append(int(tensor.stride(0)))
        idx, sizes, offsets, nblocks = [], [], [], []
        formats: list[tuple[str, ...]] = []
        widest = 0
        for g, refs in enumerate(kv.group_data_refs):
            g_idx, g_sizes = [], []
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(kv.tensors):
                    raise InvalidSpec(f"group {g} refers to tensor {ref.tensor_idx}, which does not exist")
                row = kv.tensors[ref.tensor_idx].tensor.shape[1]
                if not 0 < ref.page_size_bytes <= row:
                    raise InvalidSpec(
                        f"group {g}: page_size_bytes={ref.page_size_bytes} does not fit a row "
                        f"of {row} bytes in tensor {ref.tensor_idx}"
                    )
                g_idx.append(ref.tensor_idx)
                g_sizes.append(ref.page_size_bytes)
            # Host order = device address order (see the module docstring).
            order = sorted(range(len(refs)), key=lambda k: kv.tensors[g_idx[k]].tensor.data_ptr())
            g_offs = [0] * len(refs)
            off = 0
            for k in order:
                g_offs[k] = off
                off += g_sizes[k] * blocks_per_chunk
            widest = max(widest, off)
            idx.append(tuple(g_idx))
            formats.append(tuple(kv.tensors[i].page_format for i in g_idx))
            sizes.append(tuple(g_sizes))
            offsets.append(tuple(g_offs))
            nblocks.append(min(int(kv.tensors[i].tensor.shape[0]) for i in g_idx))
        chunk_bytes = -(-widest // CHUNK_ALIGN) * CHUNK_ALIGN
        return cls(
            blocks_per_chunk=blocks_per_chunk,
            chunk_bytes=chunk_bytes,
            tensor_idx=tuple(idx),
            page_sizes=tuple(sizes),
            page_offsets=tuple(offsets),
            row_strides=tuple(row_strides),
            num_gpu_blocks=tuple(nblocks),
            page_formats=tuple(formats),
        )

    @functools.cached_property
    def group_arrays(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]:
        """Per group, as column vectors: tensor index, page size, row stride, page offset."""
        strides = np.asarray(self.row_strides, dtype=np.int64)
        out = []
        for g in range(self.num_groups):
            tensors = np.asarray(self.tensor_idx[g], dtype=np.int64)[:, None]
            out.append((
                tensors,
                np.asarray(self.page_sizes[g], dtype=np.int64)[:, None],
                strides[tensors],
                np.asarray(self.page_offsets[g], dtype=np.int64)[:, None],
            ))
        return tuple(out)

    @property
    def num_groups(self) -> int:
        return len(self.tensor_idx)

    @functools.cached_property
    def block_bytes(self) -> tuple[int, ...]:
        """Bytes one GPU block of each group moves (read in every submit: kept)."""
        return tuple(sum(s) for s in self.page_sizes)
