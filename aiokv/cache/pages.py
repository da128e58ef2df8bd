"""A block's bytes in a portable order, whatever order the worker's host pool keeps them in.

The host pool places a chunk's pages in device address order (``plan.HostLayout``), which
differs between processes and even between workers of one process. Bytes written to a
shared tier must mean the same thing to every reader, so tiers store a block as its pages
in the layout's own order (tensor reference order), without the chunk's alignment padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .protocol import CacheWorker

__all__ = ["PageMap", "page_map_of"]


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

    def gather(self, pool: np.ndarray, chunks: Sequence[int]) -> np.ndarray:
        """The blocks in ``chunks`` as ``(n, payload_bytes)`` portable rows (a copy)."""
        rows = pool.reshape(-1, self.chunk_bytes)
        if self.identity:
            return rows[list(chunks), : self.payload_bytes]
        out = np.empty((len(chunks), self.payload_bytes), dtype=np.uint8)
        picked = rows[list(chunks)]
        for size, h, p in zip(self.sizes, self.host, self.portable):
            out[:, p : p + size] = picked[:, h : h + size]
        return out

    def scatter(self, pool: np.ndarray, chunks: Sequence[int], rows: np.ndarray) -> None:
        """Write portable ``rows`` into the host ``chunks``."""
        view = pool.reshape(-1, self.chunk_bytes)
        for i, c in enumerate(chunks):
            for size, h, p in zip(self.sizes, self.host, self.portable):
                view[c, h : h + size] = rows[i, p : p + size]


def page_map_of(worker: CacheWorker) -> PageMap:
    """The page map of a worker's host chunks (one group, one block per chunk)."""
    layout = worker.host_layout
    return PageMap(worker.chunk_bytes, layout.page_sizes[0], layout.page_offsets[0])
