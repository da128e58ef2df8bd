"""The raw read ceiling a disk tier's restores are measured against (the bench's column).

A plain read of the same number of bytes from the same directory, with the same I/O size,
the same direct or buffered mode and the same threads as the tier, but without headers,
checksums or an index: what the filesystem gives, so a tier's figure reads as a fraction.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from .disk_io import BINARY_FLAG, DIRECT_FLAG, TEMP_PREFIX, probe_direct, round_up

__all__ = ["raw_read_ceiling", "read_files_ceiling"]

_CEILING_BUFFER_BYTES = 256 << 20


def raw_read_ceiling(directory: str, nbytes: int, count: int, io_size: int | None = None, *,
                     direct: bool | None = None, threads: int = 1, rounds: int = 3) -> float:
    """GB/s of plain reads of ``count`` new files of ``nbytes`` in ``directory``: no header,
    no checksum, no index, ``io_size`` bytes per read call, ``threads`` files read at once.

    What a disk tier's restore is measured against when it holds nothing to read: the same
    directory, the same mode (``direct=None`` probes it as ``DiskTier`` does), the same I/O
    size (``DiskTier.io_size``) and threads (``DiskTier.io_threads``). The files are written
    (random bytes, flushed) first and removed after. ``DiskTier.read_ceiling`` reads the
    tier's own files instead, so both figures see the same caches.
    """
    if nbytes <= 0 or count <= 0:
        raise ValueError("nbytes and count must be positive")
    if direct is None:
        direct = probe_direct(directory)
    size = round_up(nbytes) if direct else nbytes
    work = os.path.join(directory, f"{TEMP_PREFIX}ceiling-{secrets.token_hex(6)}")
    os.makedirs(work)
    paths = [os.path.join(work, str(i)) for i in range(count)]
    try:
        data = os.urandom(size)
        for path in paths:
            with open(path, "wb") as f:
                f.write(data)
                # Written back now: a direct read of dirty pages would wait for writeback
                # first and understate the ceiling (the tier's own direct writes are done).
                f.flush()
                os.fsync(f.fileno())
        return read_files_ceiling(paths, nbytes, io_size=io_size, direct=direct,
                                  threads=threads, rounds=rounds)
    finally:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(work)
        except OSError:
            pass


def read_files_ceiling(paths: Sequence[str], nbytes: int, *, io_size: int | None = None,
                       direct: bool, threads: int = 1, rounds: int = 3) -> float:
    """GB/s of plain reads of whole existing files, counting ``nbytes`` per file (the
    payload, when the files are a tier's blocks), ``io_size`` bytes per read call, on
    ``threads`` threads sharing one queue as ``DiskTier``'s do. Best of ``rounds``.
    """
    if not paths or nbytes <= 0 or threads <= 0 or rounds <= 0:
        raise ValueError("paths, nbytes, threads and rounds must be non-empty/positive")
    sizes = {path: os.path.getsize(path) for path in paths}
    io_size = max(sizes.values()) if io_size is None else io_size
    if io_size <= 0:
        raise ValueError("io_size must be positive")
    if direct:
        io_size = round_up(io_size)
    flags = os.O_RDONLY | BINARY_FLAG | (DIRECT_FLAG if direct else 0)
    # Each thread reads into a few distinct buffers in turn, as a restore fills distinct
    # host chunks: one reused buffer would stay in the CPU cache and flatter the ceiling.
    # They are touched before the clock starts, as a host pool's chunks are.
    span = round_up(io_size)
    slots = max(1, min(16, _CEILING_BUFFER_BYTES // threads // span))
    buffers = [mmap.mmap(-1, slots * span) for _ in range(min(threads, len(paths)))]
    failures: list[BaseException] = []

    def read_files(queue: deque[str], buf: mmap.mmap) -> None:
        view = memoryview(buf)
        try:
            for j in itertools.count():
                try:
                    path = queue.popleft()
                except IndexError:
                    return
                base = (j % slots) * span
                size = sizes[path]
                fd = os.open(path, flags)
                try:
                    offset = 0
                    while offset < size:
                        step = min(io_size, round_up(size - offset) if direct else size - offset)
                        got = os.preadv(fd, [view[base:base + step]], offset)
                        if got <= 0:
                            raise OSError(errno.EIO, f"{path} is shorter than {size} bytes")
                        offset += got
                finally:
                    os.close(fd)
        except BaseException as exc:  # reported by the caller's thread below
            failures.append(exc)
        finally:
            view.release()

    try:
        for buf in buffers:
            np.frombuffer(buf, dtype=np.uint8)[:] = 1
        best = 0.0
        for _ in range(rounds):
            queue = deque(paths)
            workers = [threading.Thread(target=read_files, args=(queue, buf)) for buf in buffers]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.perf_counter() - start
            if failures:
                raise failures[0]
            best = max(best, len(paths) * nbytes / elapsed / 1e9)
        return best
    finally:
        for buf in buffers:
            buf.close()
