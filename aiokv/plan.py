"""Specs + layout -> copy plan. Pure numpy: arrays in, arrays out, no streams or state.

A job's GPU blocks are paired with host slots (``map_blocks``), then expanded into page
copies that merge where a run is contiguous on both sides (``plan_copies``); where each
page lands in the host pool is ``host_layout.HostLayout``'s to say.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidSpec

# Re-exported: both were defined here once, and callers import them from here still.
from .host_layout import CHUNK_ALIGN, HostLayout

__all__ = [
    "CHUNK_ALIGN",
    "BlockMapping",
    "CopyPlan",
    "HostLayout",
    "IdPlan",
    "map_blocks",
    "plan_copies",
    "plan_ids",
]

_INT64_MAX = (1 << 63) - 1
# Jobs up to this many blocks (one group) / pages are planned in plain Python: numpy's
# per-call overhead would be most of a small job's submit time.
_SMALL_JOB = 16
_SMALL_PLAN = 64


@dataclass(frozen=True)
class BlockMapping:
    """Pairs of (GPU block, host slot) per group; slot = chunk * blocks_per_chunk + sub.

    ``by_host``: for one group of one block per chunk, the same pairs sorted by host slot
    (GPU blocks, slots), which validation computed anyway; a staged plan walks them in that
    order, so neighbouring chunks merge into one DMA whatever order the job lists them in.
    """

    gpu_blocks: tuple[np.ndarray, ...]
    host_slots: tuple[np.ndarray, ...]
    by_host: tuple[np.ndarray, np.ndarray] | None = None


class CopyPlan:
    """A job's blocks and, computed on first use, its coalesced byte copies.

    Copy ``i`` moves ``nbytes[i]`` bytes between offset ``device_offset[i]`` of tensor
    ``tensor_idx[i]`` and offset ``host_offset[i]`` of the pool. Direction is not part of
    the plan: the handler that runs it knows it. The copies are lazy because a strategy
    that plans its own way (pitched copies) never needs them.
    """

    def __init__(self, mapping: BlockMapping, layout: HostLayout) -> None:
        self.mapping = mapping
        self.layout = layout
        self.total_bytes = sum(
            int(blocks.size) * size for blocks, size in zip(mapping.gpu_blocks, layout.block_bytes)
        )

    @property
    def num_pages(self) -> int:
        """Pages the job moves (copies before coalescing); cheap, unlike ``len``."""
        blocks = self.mapping.gpu_blocks
        return sum(int(b.size) * len(self.layout.tensor_idx[g]) for g, b in enumerate(blocks))

    @functools.cached_property
    def _copies(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if self.num_pages <= _SMALL_PLAN:
            return _plan_small(self.mapping, self.layout)
        return _plan_numpy(self.mapping, self.layout)

    @property
    def tensor_idx(self) -> np.ndarray:
        return self._copies[0]

    @property
    def device_offset(self) -> np.ndarray:
        return self._copies[1]

    @property
    def host_offset(self) -> np.ndarray:
        return self._copies[2]

    @property
    def nbytes(self) -> np.ndarray:
        return self._copies[3]

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    def check(self) -> None:
        """Raise what planning raises for bad input (planned already: nothing to raise)."""


class IdPlan(CopyPlan):
    """A job of one group of one block per chunk, as the ids its caller passed: a lane with
    a native planner builds the job's program from them in C, checking them as
    ``map_blocks`` does; anything else reads ``mapping``, which checks and maps them then
    (raising ``InvalidSpec`` for bad input, as planning always did). Read at submit only:
    callers may reuse their id buffers once it returned."""

    def __init__(self, block_ids: Any, chunk_ids: Any, count: int, layout: HostLayout, num_chunks: int,
                 unique_gpu: bool, unique_host: bool) -> None:
        self.block_ids = block_ids
        self.chunk_ids = chunk_ids
        self.layout = layout
        self.total_bytes = count * layout.block_bytes[0]
        self._count = count
        self._num_chunks = num_chunks
        self._unique = (unique_gpu, unique_host)

    @functools.cached_property
    def mapping(self) -> BlockMapping:  # type: ignore[override]
        unique_gpu, unique_host = self._unique
        return map_blocks(self.block_ids, self.chunk_ids, layout=self.layout, num_chunks=self._num_chunks,
                          unique_gpu=unique_gpu, unique_host=unique_host)

    @property
    def num_pages(self) -> int:
        return self._count * len(self.layout.tensor_idx[0])

    def check(self) -> None:
        """Check the ids now (raising ``InvalidSpec``), and keep copies of them: a job
        planned later (held behind an open layerwise store) must not read ids its caller
        has reused since."""
        mapping = self.mapping
        self.block_ids, self.chunk_ids = mapping.gpu_blocks[0], mapping.host_slots[0]


def _as_ids(ids: Any, what: str) -> np.ndarray:
    if type(ids) in (list, tuple) and ids and type(ids[0]) is not bool:
        # A list of ints read as C int64s: half of numpy's time, which first works out
        # the list's type. Floats, ids past int64 or anything else raise here, and a list
        # of bools is left alone: those go the checked way below, whose errors it keeps.
        try:
            return np.array(array.array("q", ids), dtype=np.int64)
        except (TypeError, OverflowError, ValueError):
            pass
    try:
        arr = np.asarray(ids)
    except Exception as exc:  # pragma: no cover - numpy raises many types here
        raise InvalidSpec(f"{what} could not be read as an array of integers: {exc}") from exc
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidSpec(f"{what} must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
    if arr.dtype.kind == "u" and int(arr.max()) > _INT64_MAX:
        raise InvalidSpec(f"{what} must be valid int64 ids; got {int(arr.max())}")
    return np.array(arr, dtype=np.int64)  # our own copy: callers reuse their id buffers


def map_blocks(
    block_ids: Any,
    chunk_ids: Any,
    *,
    layout: HostLayout,
    num_chunks: int,
    group_sizes: Sequence[int] | None = None,
    block_indices: Sequence[int] | None = None,
    unique_gpu: bool = False,
    unique_host: bool = False,
) -> BlockMapping:
    """Pair each GPU block with its host slot, validating everything first.

    Example: blocks_per_chunk=3, block_indices=[5], GPU blocks [a, b, c, d], chunks
    [X, Y]: skip 5 % 3 = 2 sub-blocks, so slots are [3X+2, 3Y+0, 3Y+1, 3Y+2].

    Args:
        unique_gpu / unique_host: reject a destination written twice in one job.

    Raises:
        InvalidSpec: wrong types, group sizes that do not add up, a chunk count that does
            not match ``ceil((blocks + skip) / blocks_per_chunk)`` per group, ids out of
            range, or a duplicated destination.
    """
    if layout.num_groups == 1:
        small = _map_small(block_ids, chunk_ids, layout, num_chunks, group_sizes, block_indices,
                           unique_gpu, unique_host)
        if small is not None:
            return small
    bpc = layout.blocks_per_chunk
    gpu = _as_ids(block_ids, "block_ids")
    chunks = _as_ids(chunk_ids, "chunk_ids")
    ngroups = layout.num_groups
    plain = group_sizes is None and block_indices is None and gpu.size == chunks.size
    if ngroups == 1 and bpc == 1 and plain:  # most jobs: the shortest checks
        return _map_one_per_chunk(gpu, chunks, layout.num_gpu_blocks[0], num_chunks, unique_gpu, unique_host)
    # Per-group scalars stay Python ints: numpy's per-call cost would dominate here.
    if group_sizes is None:
        if ngroups != 1:
            raise InvalidSpec(f"the KV cache has {ngroups} groups; pass group_sizes")
        sizes = [int(gpu.size)]
    else:
        sizes = _as_ids(group_sizes, "group_sizes").tolist()
        if len(sizes) != ngroups:
            raise InvalidSpec(f"group_sizes has {len(sizes)} entries but the KV cache has {ngroups} groups")
        if min(sizes) < 0 or sum(sizes) != gpu.size:
            raise InvalidSpec(
                f"group_sizes {sizes} must be non-negative and add up to the {gpu.size} block ids given"
            )
    if block_indices is None:
        starts = [0] * ngroups
    else:
        starts = _as_ids(block_indices, "block_indices").tolist()
        if len(starts) != ngroups or min(starts, default=0) < 0:
            raise InvalidSpec(f"block_indices must hold {ngroups} non-negative values, got {starts}")
    skips = [start % bpc for start in starts]
    needed = [-(-(n + skip) // bpc) if n > 0 else 0 for n, skip in zip(sizes, skips)]
    if sum(needed) != chunks.size:
        raise InvalidSpec(
            f"{chunks.size} chunk ids given but {sum(needed)} are needed: each group "
            f"uses ceil((blocks + skip) / blocks_per_chunk) chunks with blocks_per_chunk={bpc} "
            f"(blocks per group {sizes}, skips {skips})"
        )
    if ngroups == 1 and bpc == 1:
        return _map_one_per_chunk(gpu, chunks, layout.num_gpu_blocks[0], num_chunks, unique_gpu, unique_host)
    if chunks.size and (chunks.min() < 0 or chunks.max() >= num_chunks):
        raise InvalidSpec(f"chunk ids must lie in [0, {num_chunks}); got {chunks.min()}..{chunks.max()}")
    gpu_out, host_out = [], []
    b0 = c0 = 0
    for g in range(ngroups):
        n, nchunks, skip = sizes[g], needed[g], skips[g]
        blocks = gpu[b0 : b0 + n]
        limit = layout.num_gpu_blocks[g]
        if n and (blocks.min() < 0 or blocks.max() >= limit):
            raise InvalidSpec(
                f"group {g}: GPU block ids must lie in [0, {limit}); got {blocks.min()}..{blocks.max()}"
            )
        if bpc == 1:
            slots = chunks[c0 : c0 + nchunks]
        else:
            pos = np.arange(skip, skip + n, dtype=np.int64)
            slots = chunks[c0 : c0 + nchunks][pos // bpc] * bpc + pos % bpc
        if unique_gpu and n and _has_duplicates(blocks):
            raise InvalidSpec(f"group {g}: a GPU block appears twice, so one load would write it twice")
        gpu_out.append(blocks)
        host_out.append(slots)
        b0 += n
        c0 += nchunks
    if unique_host and gpu.size:
        # Groups share the pool, so a slot must be unique across groups too.
        if _has_duplicates(host_out[0] if ngroups == 1 else np.concatenate(host_out)):
            raise InvalidSpec("a host chunk slot appears twice, so one store would write it twice")
        # And a chunk holds one group: every group's blocks start at byte 0 of theirs.
        if ngroups > 1 and bpc > 1:
            owned = [np.unique(s // bpc) for s in host_out if s.size]
            if len(owned) > 1 and _has_duplicates(np.concatenate(owned)):
                raise InvalidSpec("two groups store into one chunk, whose bytes they would share; "
                                  "a chunk holds the blocks of one group")
    return BlockMapping(tuple(gpu_out), tuple(host_out))


def _map_one_per_chunk(
    gpu: np.ndarray, chunks: np.ndarray, limit: int, num_chunks: int, unique_gpu: bool, unique_host: bool
) -> BlockMapping:
    """``map_blocks``' checks for one group of one block per chunk (counts already match),
    with fewer numpy calls: one sort of the chunks gives their range, their duplicates and
    ``by_host``, and one unsigned maximum the GPU ids' range (a negative id wraps high)."""
    order = chunks.argsort(kind="stable")
    slots = chunks[order]
    if slots.size and (slots[0] < 0 or slots[-1] >= num_chunks):
        raise InvalidSpec(f"chunk ids must lie in [0, {num_chunks}); got {slots[0]}..{slots[-1]}")
    if gpu.size and gpu.view(np.uint64).max() >= limit:
        raise InvalidSpec(f"group 0: GPU block ids must lie in [0, {limit}); got {gpu.min()}..{gpu.max()}")
    if unique_gpu and gpu.size and _has_duplicates(gpu):
        raise InvalidSpec("group 0: a GPU block appears twice, so one load would write it twice")
    if unique_host and slots.size > 1 and (slots[1:] == slots[:-1]).any():
        raise InvalidSpec("a host chunk slot appears twice, so one store would write it twice")
    return BlockMapping((gpu,), (chunks,), by_host=(gpu[order], slots))


def _has_duplicates(ids: np.ndarray) -> bool:
    """Whether a value repeats (a sort and one compare: ``np.unique`` costs 4x as much)."""
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def _small_ids(ids: Any) -> list[int] | None:
    """``ids`` as a short list of plain ints, or None (the numpy path then validates)."""
    if isinstance(ids, (list, tuple, range)) and len(ids) <= _SMALL_JOB and all(type(x) is int for x in ids):
        return list(ids)
    return None


def _map_small(
    block_ids: Any, chunk_ids: Any, layout: HostLayout, num_chunks: int, group_sizes: Any,
    block_indices: Any, unique_gpu: bool, unique_host: bool,
) -> BlockMapping | None:
    """``map_blocks`` for a short, valid, one-group job in plain Python (numpy's per-call
    overhead is most of a small job's planning); None sends anything unusual, including
    every error, down the numpy path, so errors read the same either way."""
    gpu, chunks = _small_ids(block_ids), _small_ids(chunk_ids)
    if gpu is None or chunks is None:
        return None
    n = len(gpu)
    if group_sizes is not None and _small_ids(group_sizes) != [n]:
        return None
    start = 0
    if block_indices is not None:
        starts = _small_ids(block_indices)
        if starts is None or len(starts) != 1 or starts[0] < 0:
            return None
        start = starts[0]
    bpc = layout.blocks_per_chunk
    skip = start % bpc
    if len(chunks) != (-(-(n + skip) // bpc) if n else 0):
        return None
    limit = layout.num_gpu_blocks[0]
    if not all(0 <= b < limit for b in gpu) or not all(0 <= c < num_chunks for c in chunks):
        return None
    slots = [chunks[(i + skip) // bpc] * bpc + (i + skip) % bpc for i in range(n)]
    if (unique_gpu and len(set(gpu)) != n) or (unique_host and len(set(slots)) != n):
        return None
    return BlockMapping((np.array(gpu, dtype=np.int64),), (np.array(slots, dtype=np.int64),))


def plan_ids(block_ids: Any, chunk_ids: Any, *, layout: HostLayout, num_chunks: int,
             group_sizes: Any = None, block_indices: Any = None, unique_gpu: bool = False,
             unique_host: bool = False) -> IdPlan | None:
    """The job as an ``IdPlan`` (nothing checked yet) where it is one group of one block
    per chunk with as many chunk ids as block ids; else None (plan it with ``map_blocks``).
    ``group_sizes`` / ``block_indices`` pass when they say nothing more than that (vLLM's
    specs carry them for every job)."""
    if len(layout.tensor_idx) != 1 or layout.blocks_per_chunk != 1:
        return None
    try:
        count = len(block_ids)
        if count == 0 or count != len(chunk_ids):
            return None
        if group_sizes is not None and (len(group_sizes) != 1 or int(group_sizes[0]) != count):
            return None
        if block_indices is not None and (len(block_indices) != 1 or int(block_indices[0]) < 0):
            return None
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return IdPlan(block_ids, chunk_ids, count, layout, num_chunks, unique_gpu, unique_host)


def plan_copies(mapping: BlockMapping, layout: HostLayout) -> CopyPlan:
    """Expand blocks into page copies and merge runs that are contiguous on both sides.

    Example: one page of 4 KiB per block, blocks [7, 8, 2] to slots [0, 1, 2] gives two
    copies: 8 KiB (blocks 7-8 to slots 0-1) and 4 KiB (block 2 to slot 2).
    """
    return CopyPlan(mapping, layout)


_Copies = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _plan_small(mapping: BlockMapping, layout: HostLayout) -> _Copies:
    """``plan_copies`` in plain Python, same order and merging, for a few pages."""
    bpc, cb = layout.blocks_per_chunk, layout.chunk_bytes
    rows: list[list[int]] = []
    for g, (blocks, slots) in enumerate(zip(mapping.gpu_blocks, mapping.host_slots)):
        pairs = [(b, *divmod(slot, bpc)) for b, slot in zip(blocks.tolist(), slots.tolist())]
        for t, page, off in zip(layout.tensor_idx[g], layout.page_sizes[g], layout.page_offsets[g]):
            stride = layout.row_strides[t]
            for b, chunk, sub in pairs:
                d, h = b * stride, chunk * cb + off + sub * page
                last = rows[-1] if rows else None
                if last and last[0] == t and last[1] + last[3] == d and last[2] + last[3] == h:
                    last[3] += page
                else:
                    rows.append([t, d, h, page])
    cols = np.array(rows, dtype=np.int64).reshape(-1, 4).T
    return cols[0].copy(), cols[1].copy(), cols[2].copy(), cols[3].copy()


def _plan_numpy(mapping: BlockMapping, layout: HostLayout) -> _Copies:
    """``plan_copies`` vectorised, for everything but tiny jobs."""
    bpc = layout.blocks_per_chunk
    t_idx, d_off, h_off, size = [], [], [], []
    for g, (blocks, slots) in enumerate(zip(mapping.gpu_blocks, mapping.host_slots)):
        if blocks.size == 0:
            continue
        # Rows: pages of the group; columns: blocks. Raveled page-major, so each page
        # tensor's copies are adjacent and runs can merge.
        tensors, pages, strides, offsets = layout.group_arrays[g]
        chunk, sub = np.divmod(slots, bpc) if bpc > 1 else (slots, 0)
        t_idx.append(np.repeat(tensors.ravel(), blocks.size))
        d_off.append((strides * blocks[None, :]).ravel())
        h_off.append((chunk[None, :] * layout.chunk_bytes + offsets + sub * pages).ravel())
        size.append(np.repeat(pages.ravel(), blocks.size))
    if not t_idx:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    t, d, h, s = (np.concatenate(x) if len(x) > 1 else x[0] for x in (t_idx, d_off, h_off, size))
    joins = (t[1:] == t[:-1]) & (d[1:] == d[:-1] + s[:-1]) & (h[1:] == h[:-1] + s[:-1])
    if not joins.any():
        return t, d, h, s
    starts = np.flatnonzero(~joins) + 1
    starts = np.concatenate((np.zeros(1, dtype=starts.dtype), starts))
    return t[starts], d[starts], h[starts], np.add.reduceat(s, starts)
