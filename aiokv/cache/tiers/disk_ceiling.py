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

import numpy as np

from .disk_io import BINARY_FLAG, DIRECT_FLAG, TEMP_PREFIX, probe_direct, round_up

__all__ = ["raw_read_ceiling"]

_CEILING_BUFFER_BYTES = 256 << 20


def raw_read_ceiling(directory: str, nbytes: int, count: int, io_size: int | None = None, *,
                     direct: bool | None = None, threads: int = 1, rounds: int = 3) -> float:
    """GB/s of plain reads of ``count`` files of ``nbytes`` from ``directory``: no header, no
    checksum, no index, ``io_size`` bytes per read call, ``threads`` files read at once.

    What a disk tier's restore is measured against: the same directory, the same mode
    (``direct=None`` probes it as ``DiskTier`` does), the same I/O size (``DiskTier.io_size``)
    and the same threads (``DiskTier.io_threads``). The files are written first (random
    bytes) and removed after; buffered reads come from the page cache like the tier's would.
    The best of ``rounds`` passes is returned.
    """
    if nbytes <= 0 or count <= 0 or threads <= 0 or rounds <= 0:
        raise ValueError("nbytes, count, threads and rounds must be positive")
    io_size = nbytes if io_size is None else io_size
    if direct is None:
        direct = probe_direct(directory)
    size = round_up(nbytes) if direct else nbytes
    io_size = round_up(io_size) if direct else io_size
    if io_size <= 0:
        raise ValueError("io_size must be positive")
    work = os.path.join(directory, f"{TEMP_PREFIX}ceiling-{secrets.token_hex(6)}")
    os.makedirs(work)
    paths = [os.path.join(work, str(i)) for i in range(count)]
    buffers: list[mmap.mmap] = []
    try:
        data = os.urandom(size)
        for path in paths:
            with open(path, "wb") as f:
                f.write(data)
                # Written back now: a direct read of dirty pages would wait for writeback
                # first and understate the ceiling (the tier's own direct writes are done).
                f.flush()
                os.fsync(f.fileno())
        flags = os.O_RDONLY | BINARY_FLAG | (DIRECT_FLAG if direct else 0)

        # Each thread reads into a few distinct buffers in turn, as a restore fills distinct
        # host chunks: one reused buffer would stay in the CPU cache and flatter the ceiling.
        # They are touched before the clock starts, as a host pool's chunks are.
        span = round_up(io_size)
        slots = max(1, min(16, _CEILING_BUFFER_BYTES // threads // span))
        workers_n = min(threads, count)
        buffers = [mmap.mmap(-1, slots * span) for _ in range(workers_n)]
        for buf in buffers:
            np.frombuffer(buf, dtype=np.uint8)[:] = 1

        def read_files(queue: deque[str], buf: mmap.mmap) -> None:
            view = memoryview(buf)
            try:
                for j in itertools.count():
                    try:
                        path = queue.popleft()
                    except IndexError:
                        return
                    base = (j % slots) * span
                    fd = os.open(path, flags)
                    try:
                        offset = 0
                        while offset < size:
                            step = min(io_size, size - offset)
                            got = os.preadv(fd, [view[base:base + step]], offset)
                            if got <= 0:
                                raise OSError(errno.EIO, f"{path} is shorter than {size} bytes")
                            offset += got
                    finally:
                        os.close(fd)
            finally:
                view.release()

        failures: list[BaseException] = []

        def run(queue: deque[str], buf: mmap.mmap) -> None:
            try:
                read_files(queue, buf)
            except BaseException as exc:  # reported by the caller's thread below
                failures.append(exc)

        best = 0.0
        for _ in range(rounds):
            # One shared queue, as DiskTier's threads share one per call.
            queue = deque(paths)
            workers = [threading.Thread(target=run, args=(queue, buf)) for buf in buffers]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            elapsed = time.perf_counter() - start
            if failures:
                raise failures[0]
            best = max(best, count * nbytes / elapsed / 1e9)
        return best
    finally:
        for buf in buffers:
            buf.close()
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(work)
        except OSError:
            pass
