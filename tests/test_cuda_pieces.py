"""The piece kernel's launches, on a fake driver (no GPU): every (page, block) of a slice
is launched exactly once with its block's device row and staging image, the rows fit the
launch's parameters and tile numbers the kernel's 31 bits however large the slice, and the
argument block each launch hands the driver holds that launch's values."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from aiokv.backends.cuda import pieces
from aiokv.backends.cuda.pieces import ROWS_PER_LAUNCH, TILE_BYTES, PieceKernel

from .sim_device import launch_values

IMAGE, STEP = 0xBB0000, 0x3000


class FakeDriver:
    def __init__(self) -> None:
        self.launches: list[tuple[int, tuple[int, ...], list[int]]] = []

    def load_function(self, image: bytes, name: bytes) -> str:
        return name.decode()

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: Any,
               params: ctypes.Array[ctypes.c_void_p], packed: Any = None) -> None:
        """Read the arguments now, as the driver copies them at launch; the packed blob
        (what a native launch copies) holds the same values."""
        values, rows = launch_values(params)
        blob, offsets = packed
        assert [ctypes.addressof(ctypes.c_char.from_buffer(blob, int(o))) for o in offsets] == list(params)
        assert grid[1:] == (1, 1) and block == pieces.THREADS
        self.launches.append((grid[0], values, rows))


def _launch(monkeypatch: pytest.MonkeyPatch, max_tiles: int, max_ctas: int | None,
            pages: tuple[int, int], rows: np.ndarray, longest: int) -> FakeDriver:
    monkeypatch.setattr(pieces, "MAX_TILES", max_tiles)
    monkeypatch.setattr(pieces, "MAX_CTAS", max_ctas)
    drv = FakeDriver()
    kernel = PieceKernel(drv, None)  # type: ignore[arg-type]
    kernel.launch(0xAA00, pages, rows, IMAGE, STEP, longest, True, 7)
    return drv


@pytest.mark.parametrize("max_tiles", [(1 << 31) - 1, 40, 7, 3])
@pytest.mark.parametrize("max_ctas", [None, 5, 0])
@pytest.mark.parametrize("nrows", [17, 2 * ROWS_PER_LAUNCH + 3])
def test_launches_cover_every_page_of_every_block_once(
    monkeypatch: pytest.MonkeyPatch, max_tiles: int, max_ctas: int | None, nrows: int
) -> None:
    pages, longest = (3, 14), 2 * TILE_BYTES + 16  # 3 tiles per page
    rows = np.random.default_rng(nrows).permutation(4 * nrows)[:nrows].astype(np.uint32)
    drv = _launch(monkeypatch, max_tiles, max_ctas, pages, rows, longest)
    seen: list[tuple[int, int, int]] = []
    for ctas, (table, image, step, p, to_device, tiles, np_, total), launched in drv.launches:
        assert (table, step, to_device, tiles) == (0xAA00, STEP, 1, 3)
        assert total % (tiles * np_) == 0
        assert total // (tiles * np_) == len(launched) <= ROWS_PER_LAUNCH
        assert total <= max(max_tiles, tiles)  # tile numbers fit (a page's tiles are never cut)
        assert ctas == (total if max_ctas is None else max(1, min(total, max_ctas)))
        seen += [(pp, row, image + z * step) for z, row in enumerate(launched) for pp in range(p, p + np_)]
    want = [(pp, row, IMAGE + i * STEP) for i, row in enumerate(rows.tolist()) for pp in range(*pages)]
    assert sorted(seen) == sorted(want)  # each exactly once, with its own image


def test_an_empty_span_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = np.arange(8, dtype=np.uint32)
    assert _launch(monkeypatch, 1 << 20, None, (4, 4), rows, TILE_BYTES).launches == []
    assert _launch(monkeypatch, 1 << 20, None, (0, 8), rows[:0], TILE_BYTES).launches == []


def test_an_abandoned_kernel_keeps_its_table_buffers_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped worker's queued copies may still read a pinned table buffer, which torch's
    host allocator would reuse at once if freed: ``abandon`` keeps every slot."""
    import gc
    import weakref

    import torch

    kept: list[Any] = []
    monkeypatch.setattr(pieces, "_KEPT_TABLES", kept)
    kernel = PieceKernel(FakeDriver(), None)  # type: ignore[arg-type]
    bufs = [torch.empty(64, dtype=torch.uint8) for _ in range(2)]
    kernel._tables.append(pieces._TableSlot(bufs[0], bufs[0], None))
    kernel._kept.append(pieces._TableSlot(bufs[1], bufs[1], None))
    refs = [weakref.ref(b) for b in bufs]
    kernel.abandon()
    del kernel, bufs
    gc.collect()
    assert all(r() is not None for r in refs) and len(kept) == 2
