"""How the DMA strategy spreads one job over streams (pure arithmetic, no device)."""

from __future__ import annotations

from aiokv.copy.dma import MIN_SLICE_BYTES, MIN_SLICE_DESCRIPTORS, stream_parts


def test_small_pages_use_every_stream_large_pages_a_few() -> None:
    # 8192 pages of 32 KiB: descriptor-bound, so every stream gets a slice.
    assert stream_parts(8192 * 32768, 8192, 16, MIN_SLICE_DESCRIPTORS) == 16
    # 128 pages of 2 MiB: four slices of 32 copies, not sixteen of 8.
    assert stream_parts(128 << 21, 128, 16, MIN_SLICE_DESCRIPTORS) == 4
    # Without a descriptor floor (the staged strategy's few large runs) bytes alone decide.
    assert stream_parts(128 << 21, 128, 16) == 16


def test_small_or_empty_jobs_stay_on_one_stream_and_the_cap_holds() -> None:
    assert stream_parts(MIN_SLICE_BYTES - 1, 1000, 16, MIN_SLICE_DESCRIPTORS) == 1
    assert stream_parts(1 << 30, 31, 16, MIN_SLICE_DESCRIPTORS) == 1
    assert stream_parts(0, 0, 16) == 1
    assert stream_parts(1 << 40, 1 << 20, 3, MIN_SLICE_DESCRIPTORS) == 3
