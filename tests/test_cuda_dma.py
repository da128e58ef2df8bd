"""How the DMA strategy spreads one job over streams and cuts it (pure arithmetic, no device)."""

from __future__ import annotations

import itertools

import numpy as np

from aiokv.backends.cuda.dma import MIN_SLICE_BYTES, MIN_SLICE_DESCRIPTORS, stream_parts
from aiokv.backends.cuda.strategy import byte_splits


def test_small_pages_use_every_stream_large_pages_a_few() -> None:
    # 8192 pages of 32 KiB: descriptor-bound, so every stream gets a slice.
    assert stream_parts(8192 * 32768, 8192, 16, MIN_SLICE_DESCRIPTORS) == 16
    # 128 pages of 2 MiB: one batch call on one stream, not sixteen of 8 copies.
    assert stream_parts(128 << 21, 128, 16, MIN_SLICE_DESCRIPTORS) == 1
    # Without a descriptor floor (the staged strategy's few large runs) bytes alone decide.
    assert stream_parts(128 << 21, 128, 16) == 16


def test_small_or_empty_jobs_stay_on_one_stream_and_the_cap_holds() -> None:
    assert stream_parts(MIN_SLICE_BYTES - 1, 1000, 16, MIN_SLICE_DESCRIPTORS) == 1
    assert stream_parts(1 << 30, 127, 16, MIN_SLICE_DESCRIPTORS) == 1
    assert stream_parts(1 << 30, 256, 16, MIN_SLICE_DESCRIPTORS) == 2
    assert stream_parts(0, 0, 16) == 1
    assert stream_parts(1 << 40, 1 << 20, 3, MIN_SLICE_DESCRIPTORS) == 3


def _check_cuts(sizes: np.ndarray, parts: int) -> list[int]:
    bounds = byte_splits(sizes, parts)
    n = len(sizes)
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(lo < hi for lo, hi in itertools.pairwise(bounds)), f"empty or unordered slice in {bounds}"
    assert len(bounds) - 1 <= max(1, min(parts, n))
    return bounds


def test_byte_splits_cut_equal_copies_into_equal_counts() -> None:
    sizes = np.full(128, 2 << 20, dtype=np.uint64)
    assert _check_cuts(sizes, 4) == [0, 32, 64, 96, 128]
    assert _check_cuts(sizes[:10], 4) == [0, 2, 5, 7, 10]
    assert _check_cuts(sizes[:3], 16) == [0, 1, 2, 3]
    assert _check_cuts(sizes, 1) == [0, 128]


def test_byte_splits_balance_bytes_when_copies_differ() -> None:
    rng = np.random.default_rng(3)
    for parts in (2, 3, 4, 16):
        sizes = rng.integers(1, 64, 500).astype(np.uint64) << np.uint64(12)
        bounds = _check_cuts(sizes, parts)
        share = [int(sizes[lo:hi].sum()) for lo, hi in itertools.pairwise(bounds)]
        # Each slice is within one copy of an equal share.
        assert max(share) - sum(share) / len(share) <= int(sizes.max())
    # One huge copy among small ones: cuts never produce an empty slice.
    lopsided = np.array([1 << 30] + [4096] * 7, dtype=np.uint64)
    _check_cuts(lopsided, 4)
