"""The ceilings a tier's restores are measured against: what the medium gives without a tier.

Disk: plain reads of whole files from the tier's own directory, with the tier's mode (direct
or buffered), the I/O size of one of its block files and its threads, but no header, no
checksum, no index. Redis: plain redis-py GETs of values of the same size from the same
server. A tier's restore rate then reads as a fraction of its ceiling (docs/tiers.md).
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
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from ..cache.tiers.disk import DiskTier
from ..cache.tiers.disk_io import (
    BINARY_FLAG,
    BLOCK_SUFFIX,
    DIRECT_FLAG,
    TEMP_PREFIX,
    file_size,
    probe_direct,
    round_up,
)
from ..errors import InvalidSpec, TierError, UsageError
from ..extras import require

__all__ = ["disk_io_size", "disk_read_ceiling", "raw_read_ceiling", "read_files_ceiling",
           "redis_get_ceiling"]

_CEILING_BUFFER_BYTES = 256 << 20


def disk_io_size(block_bytes: int) -> int:
    """Bytes one ``DiskTier`` read call moves for one block of ``block_bytes`` (header
    page, payload, padding): the I/O size its ceiling reads with."""
    return file_size(b"", block_bytes)


async def disk_read_ceiling(tier: DiskTier, count: int = 64, *, rounds: int = 3) -> float:
    """GB/s of plain reads of up to ``count`` of an open tier's own block files, whole,
    with its mode, I/O size and threads: the same bytes, through the same caches, as a
    restore from it. A tier that holds no files measures ``count`` new block-sized files
    in its directory instead. Runs in a thread; needs the tier's block size known.
    """
    block_bytes = tier.block_bytes
    if block_bytes is None:
        raise UsageError("the block size is known once a block was stored or found")
    if count < 1:
        raise InvalidSpec(f"count must be >= 1, got {count}")
    directory = tier.directory
    names = sorted(n for n in os.listdir(directory) if n.endswith(BLOCK_SUFFIX))[:count]
    io_size = disk_io_size(block_bytes)
    if names:
        measure = partial(read_files_ceiling, [os.path.join(directory, n) for n in names],
                          block_bytes, io_size=io_size, direct=tier.direct,
                          threads=tier.io_threads, rounds=rounds)
    else:
        measure = partial(raw_read_ceiling, directory, block_bytes, count, io_size,
                          direct=tier.direct, threads=tier.io_threads, rounds=rounds)
    try:
        return float(await anyio.to_thread.run_sync(measure))
    except OSError as exc:  # a file evicted meanwhile, a failing disk
        raise TierError(f"cannot measure the read ceiling: {exc}") from exc


def raw_read_ceiling(directory: str, nbytes: int, count: int, io_size: int | None = None, *,
                     direct: bool | None = None, threads: int = 1, rounds: int = 3) -> float:
    """GB/s of plain reads of ``count`` new files of ``nbytes`` in ``directory``: no header,
    no checksum, no index, ``io_size`` bytes per read call, ``threads`` files read at once.

    ``direct=None`` probes the directory as ``DiskTier`` does. The files are written
    (random bytes, flushed) first and removed after.
    """
    if nbytes <= 0 or count <= 0:
        raise InvalidSpec(f"nbytes and count must be positive, got {nbytes} and {count}")
    if direct is None:
        direct = probe_direct(directory) is True
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
        raise InvalidSpec("paths, nbytes, threads and rounds must be non-empty/positive")
    sizes = {path: os.path.getsize(path) for path in paths}
    io_size = max(sizes.values()) if io_size is None else io_size
    if io_size <= 0:
        raise InvalidSpec(f"io_size must be positive, got {io_size}")
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


async def redis_get_ceiling(url: str, nbytes: int, count: int, *, cluster: bool | None = None,
                            timeout: float = 10.0) -> float:
    """GB/s of plain redis-py GETs of ``count`` random values of ``nbytes`` each, one GET
    per round trip, from the server at ``url``: the ceiling beside a ``RedisTier``'s
    restore rate. Writes and then deletes its own ``aiokv:ceiling:*`` keys.

    Runs redis-py's blocking client on one worker thread (what any loop can run), with the
    same socket options as the tier.
    """
    if nbytes <= 0 or count <= 0:
        raise InvalidSpec(f"nbytes and count must be positive, got {nbytes} and {count}")
    redis = require("redis")
    require("redis", "redis.cluster")
    from ..cache.tiers.redis_client import client_options, split_url

    base, is_cluster = split_url(url, cluster)

    def measure() -> float:
        options = client_options(timeout)
        client: Any = (redis.cluster.RedisCluster.from_url(base, **options) if is_cluster
                       else redis.Redis.from_url(base, **options))
        keys = [f"aiokv:ceiling:{os.getpid()}:{secrets.token_hex(4)}:{i}" for i in range(count)]
        try:
            for key in keys:
                client.set(key, os.urandom(nbytes))
            client.get(keys[0])  # connect before the clock starts
            start = time.perf_counter()
            for key in keys:
                value = client.get(key)
                if value is None or len(value) != nbytes:
                    got = None if value is None else len(value)
                    raise TierError(f"GET {key} returned {got} bytes, not {nbytes}")
            seconds = time.perf_counter() - start
        finally:
            for key in keys:
                client.delete(key)
            client.close()
        return nbytes * count / seconds / 1e9

    return float(await anyio.to_thread.run_sync(measure))
