"""The piece kernel's launches, on a fake driver (no GPU): every (page, block) of a slice
is launched exactly once, tile numbers fit the kernel's 31 bits however large the slice,
and the argument block each launch hands the driver holds that launch's values."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from aiokv.copy import pieces
from aiokv.copy.pieces import TILE_BYTES, PieceKernel

from .sim_device import launch_values


class FakeDriver:
    def __init__(self) -> None:
        self.launches: list[tuple[int, tuple[int, ...]]] = []

    def load_function(self, image: bytes, name: bytes) -> str:
        return name.decode()

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: Any,
               params: ctypes.Array[ctypes.c_void_p]) -> None:
        """Read the arguments now, as the driver copies them at launch."""
        values = launch_values(params)
        assert grid[1:] == (1, 1) and block == pieces.THREADS
        self.launches.append((grid[0], values))


def _launch(monkeypatch: pytest.MonkeyPatch, max_tiles: int, max_ctas: int | None,
            pages: tuple[int, int], blocks: tuple[int, int], longest: int) -> FakeDriver:
    monkeypatch.setattr(pieces, "MAX_TILES", max_tiles)
    monkeypatch.setattr(pieces, "MAX_CTAS", max_ctas)
    drv = FakeDriver()
    PieceKernel(drv, None).launch((0xAA00, 0xBB00), pages, blocks, longest, True, 7)  # type: ignore[arg-type]
    return drv


@pytest.mark.parametrize("max_tiles", [(1 << 31) - 1, 40, 7, 3])
@pytest.mark.parametrize("max_ctas", [None, 5, 0])
def test_launches_cover_every_page_of_every_block_once(
    monkeypatch: pytest.MonkeyPatch, max_tiles: int, max_ctas: int | None
) -> None:
    pages, blocks, longest = (3, 14), (5, 22), 2 * TILE_BYTES + 16  # 3 tiles per page
    drv = _launch(monkeypatch, max_tiles, max_ctas, pages, blocks, longest)
    seen: list[tuple[int, int]] = []
    for ctas, (pt, bt, p, b, to_device, tiles, np_, total) in drv.launches:
        assert (pt, bt, to_device, tiles) == (0xAA00, 0xBB00, 1, 3)
        assert total % (tiles * np_) == 0
        nb = total // (tiles * np_)
        assert total <= max(max_tiles, tiles)  # tile numbers fit (a page's tiles are never cut)
        assert ctas == (total if max_ctas is None else max(1, min(total, max_ctas)))
        seen += [(pp, bb) for bb in range(b, b + nb) for pp in range(p, p + np_)]
    want = [(pp, bb) for bb in range(*blocks) for pp in range(*pages)]
    assert sorted(seen) == sorted(want)  # each exactly once


def test_an_empty_span_launches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _launch(monkeypatch, 1 << 20, None, (4, 4), (0, 8), TILE_BYTES).launches == []
    assert _launch(monkeypatch, 1 << 20, None, (0, 8), (3, 3), TILE_BYTES).launches == []
