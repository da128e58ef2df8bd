"""A block's bytes in a portable order, whatever order the worker's host pool keeps them in.

The host pool places a chunk's pages in device address order (``host_layout.HostLayout``), which
differs between processes and even between workers of one process. Bytes written to a
shared tier must mean the same thing to every reader, so tiers store a block as its pages
in the layout's own order (tensor reference order), without the chunk's alignment padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .protocol import CacheWorker

__all__ = ["ROW_ALIGN", "PageMap", "aligned_rows", "page_map_of"]

ROW_ALIGN = 4096
"""Alignment of each row ``aligned_rows`` hands out: what direct I/O needs of a buffer."""


def aligned_rows(n: int, row_bytes: int) -> np.ndarray:
    """An ``(n, row_bytes)`` uint8 array whose every row starts on a page (``ROW_ALIGN``),
    so a disk tier with direct I/O writes each row as it is, without a bounce copy. One
    allocation a little larger than needed, the start moved up to the next page."""
    stride = -(-max(1, row_bytes) // ROW_ALIGN) * ROW_ALIGN
    raw = np.empty(max(1, n) * stride + ROW_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ROW_ALIGN
    whole = raw[skip : skip + max(1, n) * stride].reshape(max(1, n), stride)
    return whole[:n, :row_bytes]


class PageMap:
    """Where each page of a block sits in a host chunk and in the portable payload.

    Args:
        chunk_bytes: bytes of one host chunk (padding included).
        page_sizes: bytes of each page, in the layout's order.
        page_offsets: where each page starts inside a chunk.
    """

    def __init__(self, chunk_bytes: int, page_sizes: Sequence[int], page_offsets: Sequence[int]) -> None:
        self.chunk_bytes = chunk_bytes
        self.sizes = [int(s) for s in page_sizes]
        self.host = [int(o) for o in page_offsets]
        self.portable = [int(o) for o in np.cumsum([0, *self.sizes[:-1]])]
        self.payload_bytes = sum(self.sizes)
        # The common case: pages already in layout order from the chunk's start.
        self.identity = self.host == self.portable
        # Runs of pages that follow each other in both orders, as (host offset, bytes), in
        # portable order: the parts a block's payload is read into in place.
        self.runs: list[tuple[int, int]] = []
        for h, size in zip(self.host, self.sizes):
            if self.runs and sum(self.runs[-1]) == h:
                self.runs[-1] = (self.runs[-1][0], self.runs[-1][1] + size)
            else:
                self.runs.append((h, size))

    def gather(self, pool: np.ndarray, chunks: Sequence[int]) -> np.ndarray:
        """The blocks in ``chunks`` as ``(n, payload_bytes)`` portable rows (a copy), each
        row page-aligned (``aligned_rows``). numpy copies large runs without the GIL, so
        this runs beside the event loop and the model's thread."""
        rows = pool.reshape(-1, self.chunk_bytes)
        out = aligned_rows(len(chunks), self.payload_bytes)
        if self.identity:
            if out.flags.c_contiguous:  # one call; chunk ids are the cache's own, never out of range
                np.take(rows[:, : self.payload_bytes], chunks, axis=0, out=out, mode="clip")
            else:
                for i, c in enumerate(chunks):
                    np.copyto(out[i], rows[c, : self.payload_bytes])
            return out
        picked = rows[list(chunks)]
        for size, h, p in zip(self.sizes, self.host, self.portable):
            out[:, p : p + size] = picked[:, h : h + size]
        return out

    def parts(self, pool: np.ndarray, chunk: int) -> list[memoryview]:
        """Host ``chunk``'s pages as writable views in portable order: reading a block's
        payload into them, one after another, puts it in host order with no copy."""
        base = chunk * self.chunk_bytes
        return [memoryview(pool[base + h : base + h + n].data) for h, n in self.runs]

    def scatter(self, pool: np.ndarray, chunks: Sequence[int], rows: np.ndarray) -> None:
        """Write portable ``rows`` into the host ``chunks``: one numpy call per page of all
        the blocks at once (numpy copies without the GIL), not one per page of each."""
        view = pool.reshape(-1, self.chunk_bytes)
        at = np.asarray(chunks, dtype=np.intp)
        for size, h, p in zip(self.sizes, self.host, self.portable):
            view[at, h : h + size] = rows[: len(at), p : p + size]


def page_map_of(worker: CacheWorker) -> PageMap:
    """The page map of a worker's host chunks (one group, one block per chunk)."""
    layout = worker.host_layout
    return PageMap(worker.chunk_bytes, layout.page_sizes[0], layout.page_offsets[0])
