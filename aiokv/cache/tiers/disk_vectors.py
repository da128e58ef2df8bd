"""Vectored reads and writes of the disk tier's files that see a transfer through: a short
read is continued, a write that makes no progress is a full disk, and copies between
buffers go through numpy, which lets the GIL go. Blocking; worker threads only."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import numpy as np

__all__ = ["IOV_MAX", "advance", "copy_bytes", "read_all", "spread_copy", "write_all"]

IOV_MAX = 1024
"""Buffers one preadv takes at most (Linux's and macOS's IOV_MAX)."""


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` through numpy, which copies without the GIL (a memoryview slice
    assignment holds it for the whole copy, stalling the loop and the model's thread)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def spread_copy(parts: Sequence[memoryview], src: memoryview) -> None:
    """Copy ``src`` into ``parts`` one after another (see ``copy_bytes``)."""
    at = 0
    for part in parts:
        copy_bytes(part, src[at:at + part.nbytes])
        at += part.nbytes


def read_all(fd: int, buffers: Sequence[memoryview], offset: int = 0) -> int:
    """preadv into ``buffers`` from ``offset`` until they are full or the file ends; the
    bytes read. A short read is continued, not taken for the end of the file (it could be
    one on a signal or a large request), so only a truly short file reads as truncated;
    at most ``IOV_MAX`` buffers go to one call."""
    views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
    total = 0
    while views:
        n = os.preadv(fd, views[:IOV_MAX], offset + total)
        if n <= 0:
            break
        total += n
        advance(views, n)
    return total


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from ``views`` (what a vectored read or write moved)."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]


def write_all(fd: int, buffers: list[memoryview | bytes]) -> None:
    """pwritev until everything is written; a write that makes no progress is ENOSPC."""
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += n
        advance(views, n)
