"""The disk tier: KV blocks as files under a directory, read and written off the event loop.

Each layout gets its own subdirectory (named by its fingerprint), so two models never read
each other's files. The index of held keys lives in memory (``holds`` does no I/O) and is
rebuilt from the files' headers at ``open``, so a new tier on the same directory and layout
finds what an earlier one stored. Capacity counts payload bytes, so a tier sized for N
blocks holds N blocks; the eviction policy comes from the cache's policy registry.

Durability: a block is written to a temporary file in the same directory and renamed into
place, and every read verifies the header (layout, key, length) and the payload's crc32.
A crash therefore never leaves a half-written block that reads as whole: it is dropped at
the next ``open`` (bad header or length) or at its first read (bad checksum). With
``fsync=True`` each block is also on stable storage before ``write`` reports it stored.

Threads: every file operation runs in a thread, reads and writes each bounded by ``io_threads``
(so a restore never queues behind the writes of blocks on their way down); a call's blocks
are shared out among them. Where the native reader is built (``disk_native``), each read thread
reads and checksums its share of a call's blocks in one call without the GIL (docs/tiers.md,
"The restore read"). Calls carry no timeout of their own and a cancelled call waits
for its threads: a read thread writes into the caller's buffers, so abandoning it would let
the caller reuse memory that is still being filled. A local disk answers or fails with an
error; ``simulated_latency`` models a slow one in tests.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from ...errors import InvalidSpec, TierError, UsageError
from ..policies import EvictionPolicy
from . import codec
from .base import (
    ByteParts,
    Tier,
    TierStatistics,
    byte_parts,
    byte_view,
    check_capacity,
    positive_count,
    positive_seconds,
)
from .disk_direct import DirectMode
from .disk_index import DiskIndex
from .disk_io import (
    BlockFiles,
    FileEntry,
    ReadStatus,
)
from .disk_order import ReadOrder, WriteGate
from .health import FailureLog

__all__ = ["DiskTier"]

T = TypeVar("T")
_log = logging.getLogger("aiokv")

SPREAD_BYTES = 1 << 20
"""Bytes of one read call's blocks that earn it another I/O thread (up to ``io_threads``)."""
NATIVE_SPREAD_BYTES = 4 << 20
"""The same with the native reader, whose thread reads any number of blocks in one call
without the GIL: each thread hop then costs more than the blocks it adds (a GIL retake on
the thread and one on the loop), so a thread takes a few blocks (docs/tiers.md)."""


class DiskTier(Tier):
    """Blocks in files under ``path``, bounded by ``capacity_bytes`` of KV payload.

    Args:
        path: the directory to keep blocks in (created if missing); each layout uses its
            own subdirectory.
        capacity_bytes: KV payload bytes held at most (headers and padding not counted).
        write_through: the cache writes every stored block here at once (see ``Tier``).
        policy: an eviction policy name from the registry (``"lru"``, ``"arc"``, ...) or
            an unused ``EvictionPolicy`` instance.
        io_threads: blocks read at the device at once (by twice as many threads, which
            checksum one block while the next is read), and threads writing at once (one
            call's blocks are spread over them): reads never wait behind writes.
        direct: use ``O_DIRECT`` (bypass the page cache): None probes the filesystem at
            ``open`` and uses it where it works (tmpfs before Linux 6.6 refuses it; a full
            disk cannot tell, so the tier is buffered until a later write can), False
            never does, True requires it (``open`` raises ``TierError`` where it fails).
        fsync: make each block durable before ``write`` reports it (see module docs).
        simulated_latency: seconds each I/O batch sleeps in its thread before it starts, to
            model a slow device in tests and benchmarks; 0 in production.
    """

    name = "disk"
    remote = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        write_through: bool = False,
        policy: str | EvictionPolicy = "lru",
        io_threads: int = 4,
        direct: bool | None = None,
        fsync: bool = False,
        simulated_latency: float = 0.0,
    ) -> None:
        self.path = _directory(path)
        self.capacity_bytes = positive_count(capacity_bytes, "capacity_bytes")
        self.io_threads = positive_count(io_threads, "io_threads")
        if simulated_latency != 0:
            simulated_latency = positive_seconds(simulated_latency, "simulated_latency")
        self.write_through = bool(write_through)
        self._direct_wanted = direct
        self._fsync = bool(fsync)
        self._latency = float(simulated_latency)
        self._files: BlockFiles | None = None
        self._closed = False
        self._limiter: anyio.CapacityLimiter | None = None
        self._reads: ReadOrder | None = None
        self._gate = WriteGate(self.io_threads)
        self._index = DiskIndex(self.capacity_bytes, policy)
        self.temp_files_removed = 0
        """Temporary files (writes a crash interrupted) removed by ``open``."""
        self._health = FailureLog(f"DiskTier({self.path})")

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def direct(self) -> bool:
        """Whether this tier uses direct I/O now (known after ``open``; see ``direct=``)."""
        return self._files is not None and self._files.direct

    @property
    def directory(self) -> str:
        """This layout's own directory (known after ``open``)."""
        return self._opened().directory

    @property
    def block_bytes(self) -> int | None:
        """Payload bytes of one block, once a block was stored or found."""
        return self._index.block_bytes

    def check_block_bytes(self, block_bytes: int) -> None:
        """Refuse a ``capacity_bytes`` below one block of ``block_bytes`` (the cache's block
        size, named before ``open``), and keep that size: a file of another is not ours."""
        block_bytes = positive_count(block_bytes, "block_bytes")
        check_capacity("DiskTier", self.capacity_bytes, block_bytes)
        if self._index.block_bytes is None and self._files is None:
            self._index.block_bytes = block_bytes

    async def open(self, fingerprint: bytes) -> None:
        """Create or reopen this layout's directory, probe direct I/O and rebuild the index
        from the files there (dropping temporary files and files that do not verify)."""
        if self._files is not None or self._closed:
            raise UsageError("a DiskTier is opened once")
        fingerprint = bytes(fingerprint)
        if len(fingerprint) < 16:
            raise InvalidSpec("a tier fingerprint has at least 16 bytes "
                              "(make it with codec.layout_fingerprint)")
        self._limiter = anyio.CapacityLimiter(self.io_threads)
        # Reads have threads of their own: a restore, which a request waits for, never
        # queues behind the background writes of blocks on their way down, and while reads
        # wait or run, writes go one at a time (``WriteGate``). Twice as many as read at the
        # device at once (``BlockFiles(read_slots=...)``), so a block's checksum runs beside
        # the next block's read instead of holding the disk idle; they serve the read
        # calls earliest first (``disk_order``).
        self._reads = ReadOrder(2 * self.io_threads, self._gate)
        directory = os.path.join(self.path, fingerprint.hex())
        want = self._direct_wanted
        locked: list[BlockFiles] = []  # seen even if this call is cancelled meanwhile

        def prepare() -> tuple[BlockFiles, list[str], int]:
            os.makedirs(directory, exist_ok=True)
            mode = DirectMode(directory, False if want is False else None)
            answer = mode.decide()
            if want and answer is False:
                raise TierError(f"direct=True, but the filesystem of {directory} refuses "
                                f"O_DIRECT; pass direct=None to fall back to buffered I/O")
            if want:
                mode = DirectMode(directory, True)  # a probe that could not tell: as asked
            elif answer is None:
                _log.warning("disk tier at %s: cannot tell whether O_DIRECT works (a full "
                             "disk?); buffered I/O until a write can tell", directory)
            files = BlockFiles(directory, fingerprint, direct=mode, fsync=self._fsync,
                               delay=self._latency, read_slots=self.io_threads, write_gate=self._gate)
            if not files.lock():
                raise UsageError(f"another DiskTier (in this or another process) is using "
                                 f"{directory}; give each cache its own directory")
            locked.append(files)
            return (files, *files.list_blocks())

        entries: list[FileEntry] = []
        try:
            files, names, temps = await self._run(prepare)
            # Checking headers costs a few syscalls per file: spread them over the threads.
            parts = max(1, min(self.io_threads, len(names) // 256))
            bads = [0] * parts

            async def check(part: int) -> None:
                bads[part] = await self._run(files.check_blocks, names[part::parts], entries)

            async with anyio.create_task_group() as tg:
                for part in range(parts):
                    tg.start_soon(check, part)
            bad = sum(bads)
            entries.sort(key=lambda e: e.mtime_ns)
            # One layout has one block size: the cache's, else the newest file's.
            block = self._index.block_bytes or (entries[-1].payload_len if entries else None)
            if block is not None:
                check_capacity("DiskTier", self.capacity_bytes, block)
        except BaseException as exc:
            for files in locked:
                files.unlock()
            if isinstance(exc, OSError) and not isinstance(exc, TierError):
                raise TierError(f"cannot open the disk tier at {directory}: {exc}") from exc
            raise
        self._files = files
        self.temp_files_removed = temps
        self._index.counts["corrupt"] += bad
        if entries and block is not None:
            doomed = self._index.adopt(entries, block)
            if doomed:
                await self._run(self._remove_files, doomed)

    async def aclose(self) -> None:
        """Stop serving and unlock the directory; the files stay for the next tier opened
        on it. Reads and writes still in flight finish in their threads."""
        if self._closed:
            return
        self._closed = True
        if self._files is not None:
            self._files.unlock()

    # -- the Tier contract -----------------------------------------------------------------

    def holds(self, key: bytes) -> bool:
        """Whether ``key``'s block is on disk (from the in-memory index, no I/O)."""
        self._opened()
        return codec.stored_keys([key])[0] in self._index.held

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count keys held or being written as used now, for the eviction policy."""
        self._opened()
        self._index.touch(codec.stored_keys(keys))

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are held (the index answers; no I/O)."""
        self._opened()
        keys = codec.stored_keys(keys)
        await anyio.lowlevel.checkpoint()
        held = self._index.held
        return [key in held for key in keys]

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Fill ``out[i]`` with the verified block of ``keys[i]``; False is a miss.

        A file that is truncated, torn or foreign is removed and counted as corrupt; an
        I/O error is counted and is a miss. Reads of one call are spread over the I/O
        threads; a cancelled call waits for the reads in flight (they write into ``out``)
        before it raises.
        """
        return await self.read_parts(keys, [(byte_view(v, writable=True),) for v in out])

    async def read_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]], *,
                         order: tuple[int, int] | None = None) -> list[bool]:
        """``read``, each block into its ``parts[i]``, which take its payload one after
        another: a host chunk's pages in portable order, so a restore reads a block straight
        into place (direct I/O where every part is page-aligned) instead of into a row it
        then copies from (docs/tiers.md, "Restore").

        ``order`` puts the call in the tier's read queue (a restore's ticket, then its
        batch's position): the read threads serve the earliest call first, so of several
        restores reading at once the earliest finishes first; calls without one are
        served in arrival order after those with one (``disk_order``)."""
        files = self._opened()
        keys = codec.stored_keys(keys)
        # Parts checked once already (a cache's staging chunks) are taken as they are.
        outs = [block if isinstance(block, ByteParts) else byte_parts(block) for block in parts]
        if len(outs) != len(keys):
            raise InvalidSpec(f"read got {len(keys)} keys and {len(outs)} buffers")
        index = self._index
        for block in outs:
            if index.block_bytes is not None and block.nbytes != index.block_bytes:
                raise InvalidSpec(f"read buffers must be {index.block_bytes} bytes, "
                                  f"got {block.nbytes}")
        status = [0] * len(keys)
        todo = [i for i, key in enumerate(keys) if key in index.held]
        pinned = [keys[i] for i in todo]
        index.pin(pinned)
        try:
            if todo:
                queue = files.read_queue(keys, outs, todo)
                assert self._reads is not None
                await self._reads.run(partial(files.read_many, keys, outs, status, queue),
                                      self._threads(len(todo), reading=True), order)
        finally:
            index.unpin(pinned)
            self._note(index.after_read(keys, index.block_bytes or 0, status))
        return [s == ReadStatus.HIT for s in status]

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        """Store each payload under its key; a key already held is left as it is (True).

        Room is made by evicting through the policy before the new files are written; when
        more keys are new than the tier can hold, the first ones (a request's head) are
        kept. False: not stored (no room, a full disk, an I/O error); nothing half-written
        is left either way.
        """
        files = self._opened()
        keys = codec.stored_keys(keys)
        views = [byte_view(p) for p in payloads]
        if len(views) != len(keys):
            raise InvalidSpec(f"write got {len(keys)} keys and {len(views)} payloads")
        index = self._index
        for view in views:
            size = index.block_bytes if index.block_bytes is not None else views[0].nbytes
            if view.nbytes != size or size <= 0:
                raise InvalidSpec(f"payloads must all be {size} bytes (one block), "
                                  f"got {view.nbytes}")
        if not keys:
            return []
        if index.block_bytes is None:
            index.block_bytes = views[0].nbytes
        check_capacity("DiskTier", self.capacity_bytes, index.block_bytes)
        stored: list[bool | None] = [None] * len(keys)
        todo, doomed, first = index.plan_write(keys, stored)
        try:
            if doomed:  # free the room first: on a nearly full disk it is needed
                await self._run(self._remove_files, doomed)
            await self._spread(partial(files.write_many, keys, views, stored, deque(todo)), len(todo))
        finally:
            failed = index.after_write(keys, stored, todo, doomed)
            if todo:
                self._note(failed)
        return [bool(stored[first[key]]) for key in keys]

    def statistics(self) -> TierStatistics:
        """A snapshot of this tier's counters (``blocks``/``bytes_held``: payload only)."""
        return self._index.statistics(self.name)

    # -- helpers ---------------------------------------------------------------------------

    def _note(self, failed: bool) -> None:
        if not failed:
            self._health.succeeded()
        elif self._files is not None:
            self._health.failed(self._files.last_error or "an I/O error")

    def _opened(self) -> BlockFiles:
        if self._closed:
            raise UsageError("this DiskTier is closed")
        if self._files is None:
            raise UsageError("open() the DiskTier (the cache does) before using it")
        return self._files

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def _threads(self, count: int, *, reading: bool = False) -> int:
        """Threads that share the queue of one call of ``count`` blocks at most (each
        takes the next block when it is free). A read takes one for each ``SPREAD_BYTES``
        of it at most (``NATIVE_SPREAD_BYTES`` through the native reader): a hop to a
        thread costs the event loop tens of microseconds, more than a thread takes to read
        a few small blocks; a large read takes up to twice ``io_threads`` (half of them
        checksumming at any time). A write takes them all: how soon its blocks land
        decides what a block demoted again meanwhile counts for (docs/tiers.md, "On their
        way down")."""
        spread = NATIVE_SPREAD_BYTES if self._files is not None and self._files.native else SPREAD_BYTES
        per = max(1, spread // max(1, self._index.block_bytes or spread)) if reading else 1
        return min(2 * self.io_threads if reading else self.io_threads, -(-count // per))

    async def _spread(self, work: Callable[[], None], count: int) -> None:
        """Run the write ``work()`` on ``_threads(count)`` threads sharing its queue."""
        if not count:
            return
        parts = self._threads(count)
        if parts == 1:
            await self._run(work)
            return
        async with anyio.create_task_group() as tg:
            for _ in range(parts):
                tg.start_soon(self._run, work)

    def _remove_files(self, keys: list[bytes]) -> None:
        assert self._files is not None
        for key in keys:
            self._files.remove(key)


def _directory(path: Any) -> str:
    """The tier's directory as a str; an empty path would mean the current directory, which
    is never what a cache directory should be."""
    try:
        text = os.fsdecode(os.fspath(path))
    except TypeError:
        raise InvalidSpec(f"path must be a directory path, got {type(path).__name__}") from None
    if not text:
        raise InvalidSpec("path is empty: give the disk tier a directory of its own "
                          "(an empty path would be the current directory)")
    return text
