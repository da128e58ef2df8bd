"""Blocking file I/O of the disk tier: one file per block, direct I/O where it works.

Everything here blocks and runs in the disk tier's worker threads, never on an event loop.
A block file is the codec header, zero padding up to ``ALIGN``, the payload, and zero
padding up to the next multiple of ``ALIGN``::

    [header | 0...][payload ......................][0...]
    0              header_span(key)                file_size(key, payload_len)

Aligning the payload lets direct I/O (``O_DIRECT``, which bypasses the page cache) read it
straight into the caller's buffer when that buffer is aligned too, and lets both modes read
the same files. A file is written under a temporary name and renamed into place, and every
read checks the header (layout, key, length) and the payload's crc32, so a torn, truncated
or foreign file reads as a miss, never as a block.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; one tier per directory is then up to the user
    fcntl = None  # type: ignore[assignment]


from . import codec, disk_native
from .disk_direct import ALIGN, DIRECT_FLAG, Bounce, DirectMode, aligned, probe_direct, round_up
from .disk_order import UNORDERED
from .disk_vectors import copy_bytes, read_all, spread_copy, write_all

__all__ = [
    "ALIGN",
    "BINARY_FLAG",
    "DIRECT_FLAG",
    "BLOCK_SUFFIX",
    "TEMP_PREFIX",
    "BlockFiles",
    "FileEntry",
    "ReadQueue",
    "ReadStatus",
    "file_size",
    "header_span",
    "probe_direct",
    "read_all",
    "round_up",
]

BLOCK_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
LOCK_NAME = "lock"
PATHS_KEPT = 1 << 18
"""Encoded block paths a tier remembers for its reads at most (then it starts over)."""

BINARY_FLAG = getattr(os, "O_BINARY", 0)
"""``os.O_BINARY`` on Windows, else 0."""


class ReadStatus:
    """What reading one block found (small ints so a thread can fill a shared list)."""

    HIT = 1
    ABSENT = 2  # the file is gone: drop the index entry
    CORRUPT = 3  # header, length or checksum failed: the file was removed
    ERROR = 4  # an I/O error: a miss, the entry stays


@dataclass(frozen=True)
class FileEntry:
    """A verified block file found by ``BlockFiles.check_blocks``."""

    key: bytes
    payload_len: int
    mtime_ns: int


@dataclass
class ReadQueue:
    """One read call's blocks, shared by the threads of the call (``BlockFiles.read_many``):
    a native batch, read without the GIL, or, without the native reader, the indices the
    threads read from Python."""

    indices: list[int]
    """The call's block indices; the batch's job ``j`` is block ``indices[j]``."""
    rest: deque[int]
    batch: Any = None
    heads: list[memoryview] = field(default_factory=list)
    """Each job's header page (the batch reads the file's first bytes there)."""
    paths: list[bytes] = field(default_factory=list)


def header_span(key: bytes) -> int:
    """Offset of the payload in a block file: the header rounded up to ``ALIGN``."""
    return round_up(codec.header_size(key))


def file_size(key: bytes, payload_len: int) -> int:
    """Length of a complete block file (a shorter one is truncated, a longer one foreign)."""
    return round_up(header_span(key) + payload_len)


class BlockFiles:
    """The block files of one layout under one directory; every method blocks.

    Args:
        directory: the layout's own directory (created if missing).
        fingerprint: the tier's fingerprint; headers must match it.
        direct: use ``O_DIRECT``: a bool, or a ``DirectMode`` that may decide later.
        fsync: fsync each file before its rename and the directory after it, so a stored
            block survives a power loss; without it a crash may lose recent blocks (they
            read as misses or are dropped at the next scan), never turn them into wrong bytes.
        delay: seconds to sleep before each batch, to model a slow device (tests, benches).
        read_slots: block reads at the device at once, whatever the number of threads
            reading (None: no bound): threads past it checksum what they read meanwhile.
        native: read through the native reader where it is built and not turned off
            (``disk_native``); False always reads from Python.
        write_gate: entered around each block's write (``disk_order.WriteGate``: fewer
            writes at the device while reads wait); None: no bound beyond the threads.
    """

    def __init__(self, directory: str, fingerprint: bytes, *, direct: bool | DirectMode,
                 fsync: bool, delay: float = 0.0, read_slots: int | None = None,
                 native: bool = True,
                 write_gate: contextlib.AbstractContextManager[object] | None = None) -> None:
        self.directory = directory
        self.fingerprint = bytes(fingerprint)
        self.mode = direct if isinstance(direct, DirectMode) else DirectMode(directory, bool(direct))
        self.fsync = fsync
        self.delay = delay
        self.last_error: OSError | None = None
        """The latest I/O error a read or write met (for the tier's failure log)."""
        self._bounce = Bounce()
        self._native: Any = disk_native.reader() if native else None
        self._reading: contextlib.AbstractContextManager[object]
        if self._native is not None:  # one bound for native and Python reads, taken without the GIL
            self._reading = self._native.Slots(read_slots or 1 << 30)
        else:
            self._reading = (threading.BoundedSemaphore(read_slots) if read_slots
                             else contextlib.nullcontext())
        self._writing = write_gate if write_gate is not None else contextlib.nullcontext()
        self._paths: dict[bytes, bytes] = {}
        self._lock_fd = -1

    @property
    def direct(self) -> bool:
        """Whether block files are read and written with ``O_DIRECT`` now."""
        return self.mode.on

    @property
    def native(self) -> bool:
        """Whether reads go through the native reader (``disk_native``)."""
        return self._native is not None

    def lock(self) -> bool:
        """Take the directory's lock (an flock the kernel drops if the process dies);
        False if another tier holds it. Two tiers in one directory would each count only
        their own blocks and delete each other's files in flight."""
        if fcntl is None:
            return True
        fd = os.open(os.path.join(self.directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError:
            os.close(fd)
            raise
        self._lock_fd = fd
        return True

    def unlock(self) -> None:
        """Release the directory's lock (closing the file drops the flock)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def path(self, key: bytes) -> str:
        """Where the block of ``key`` lives (a digest: keys may hold any bytes)."""
        name = hashlib.blake2b(key, digest_size=20).hexdigest()
        return os.path.join(self.directory, name + BLOCK_SUFFIX)

    def path_bytes(self, key: bytes) -> bytes:
        """``path(key)`` encoded, remembered: a restore's keys are read again and again,
        and the digest costs the event loop microseconds a block (a bound, not an LRU)."""
        found = self._paths.get(key)
        if found is None:
            if len(self._paths) > PATHS_KEPT:
                self._paths.clear()
            found = self._paths[key] = os.fsencode(self.path(key))
        return found

    # -- reads -----------------------------------------------------------------------------

    def read_queue(self, keys: Sequence[bytes], outs: Sequence[Sequence[memoryview]],
                   todo: list[int]) -> ReadQueue:
        """The shared work of one read call of ``keys[i]`` into ``outs[i]`` for each ``i``
        in ``todo``: with the native reader, one batch its threads read together without
        the GIL (docs/tiers.md, "The restore read"). Cheap: no I/O."""
        native = self._native
        if native is None or not todo:
            return ReadQueue(list(todo), deque(todo))
        flags = os.O_RDONLY | BINARY_FLAG | (DIRECT_FLAG if self.mode.on else 0)
        spans = [header_span(keys[i]) for i in todo]
        # Every header lands on a page of its own (direct I/O reads whole pages there).
        pages = memoryview(mmap.mmap(-1, sum(spans)))
        heads, at = [], 0
        for span in spans:
            heads.append(pages[at:at + span])
            at += span
        paths = [self.path_bytes(keys[i]) for i in todo]
        batch = native.ReadBatch(self._reading, flags,
                                 [(p, h, outs[i]) for p, h, i in zip(paths, heads, todo)])
        return ReadQueue(list(todo), deque(), batch, heads, paths)

    def read_many(self, keys: Sequence[bytes], outs: Sequence[Sequence[memoryview]],
                  status: list[int], todo: ReadQueue, rank: int = UNORDERED) -> None:
        """Read ``keys[i]`` into the parts ``outs[i]`` for each ``i`` of ``todo`` (from
        ``read_queue``), setting ``status[i]``; the native reader takes a device slot
        before any thread of a higher ``rank`` (``disk_order``), the Python read in turn.

        Several threads share one queue, so one that drew slow files does not hold the
        whole call back while the others idle. The status list is shared with the caller,
        so what finished is known even if the awaiting task was cancelled meanwhile.
        """
        if self.delay:
            time.sleep(self.delay)
        if todo.batch is not None:
            for j, state, err, got, crc in todo.batch.run(rank):
                i = todo.indices[j]
                status[i] = self._settle(todo.paths[j], keys[i], todo.heads[j], outs[i],
                                         state, err, got, crc)
        while True:
            try:
                i = todo.rest.popleft()
            except IndexError:
                return
            status[i] = self.read_one(keys[i], outs[i])

    def _settle(self, path: bytes, key: bytes, head: memoryview, parts: Sequence[memoryview],
                state: int, err: int, got: int, crc: int) -> int:
        """The ``ReadStatus`` of one block the native reader read (as ``read_one`` decides)."""
        native = self._native
        if state != native.ST_READ:
            if state == native.ST_OPEN_FAILED and err == errno.ENOENT:
                return ReadStatus.ABSENT
            self.last_error = OSError(err, os.strerror(err), os.fsdecode(path))
            return ReadStatus.ERROR
        length = sum(p.nbytes for p in parts)
        if got < head.nbytes + length:  # truncated
            return self._drop(path)
        header = self._header(key, head, length)
        if header is None or crc != header.crc:
            return self._drop(path)
        return ReadStatus.HIT

    def read_one(self, key: bytes, parts: Sequence[memoryview]) -> int:
        """Read and verify one block into ``parts``, which take the payload one after
        another (one buffer, or a host chunk's pages in portable order, so a block lands in
        place without a copy); a ``ReadStatus``. The file I/O takes one of ``read_slots``;
        the checksum runs after it, beside other threads' reads. The Python read: the
        native reader does the same for a whole call (``read_queue``).

        On a miss the parts may hold partial bytes: the caller counts them as not read.
        """
        path = self.path(key)
        span = header_span(key)
        length = sum(p.nbytes for p in parts)
        size = file_size(key, length)
        direct = self.mode.on  # read once: another thread may decide it meanwhile
        flags = os.O_RDONLY | BINARY_FLAG | (DIRECT_FLAG if direct else 0)
        bounced: memoryview | None = None  # the payload, when it could not land in place
        with self._reading:
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:
                return ReadStatus.ABSENT
            except OSError as exc:
                self.last_error = exc
                return ReadStatus.ERROR
            try:
                if not direct:
                    head = memoryview(bytearray(span))
                    got = read_all(fd, [head, *parts])
                    payload = list(parts)
                elif all(aligned(p) for p in parts):
                    # Direct into the caller's buffers: the header lands in the bounce buffer.
                    head = self._bounce.get(span)
                    got = read_all(fd, [head, *parts])
                    payload = list(parts)
                else:
                    whole = self._bounce.get(size)
                    got = read_all(fd, [whole])
                    head = whole[:span]
                    bounced = whole[span:span + length]
                    payload = [bounced]
            except OSError as exc:
                self.last_error = exc
                return ReadStatus.ERROR
            finally:
                os.close(fd)
        if got < span + length:  # truncated (a longer file still verifies below)
            return self._drop(path)
        header = self._header(key, head, length)
        if header is None or codec.checksum_parts(payload) != header.crc:
            return self._drop(path)
        if bounced is not None:
            spread_copy(parts, bounced)
        return ReadStatus.HIT

    def _header(self, key: bytes, head: memoryview, length: int) -> codec.Header | None:
        """The header in ``head`` if it is this layout's, for ``key``, of ``length`` bytes."""
        header = codec.parse_header(head)
        if (header is None or not header.matches(self.fingerprint) or header.key != key
                or header.payload_len != length):
            return None
        return header

    @staticmethod
    def _drop(path: str | bytes) -> int:
        try:
            os.unlink(path)
        except OSError:
            pass
        return ReadStatus.CORRUPT

    # -- writes ----------------------------------------------------------------------------

    def write_many(self, keys: Sequence[bytes], payloads: Sequence[memoryview],
                   stored: list[bool | None], todo: deque[int]) -> None:
        """Write ``keys[i]`` for each ``i`` taken from ``todo``, setting ``stored[i]``
        (the queue and list are shared by the call's threads, as in ``read_many``)."""
        self.mode.decide()  # a no-op once decided: see DirectMode
        if self.delay:
            time.sleep(self.delay)
        while True:
            try:
                i = todo.popleft()
            except IndexError:
                return
            with self._writing:
                stored[i] = self.write_one(keys[i], payloads[i])

    def write_one(self, key: bytes, payload: memoryview) -> bool:
        """Write one block atomically (temporary file, then rename); False on any OSError,
        leaving no temporary file behind."""
        final = self.path(key)
        temp = os.path.join(self.directory, f"{TEMP_PREFIX}{secrets.token_hex(8)}")
        header = codec.encode(self.fingerprint, key, payload)
        span = header_span(key)
        length = payload.nbytes
        size = file_size(key, length)
        direct = self.mode.on  # read once: another thread may decide it meanwhile
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | BINARY_FLAG | (DIRECT_FLAG if direct else 0)
        fd = -1
        try:
            fd = os.open(temp, flags, 0o644)
            if direct and aligned(payload):
                # The payload goes straight from the caller's buffer; only the header page
                # is staged.
                head = self._bounce.get(span)
                head[: len(header)] = header
                head[len(header):] = bytes(span - len(header))
                write_all(fd, [head, payload])
            elif direct:
                whole = self._bounce.get(size)
                whole[: len(header)] = header
                whole[len(header):span] = bytes(span - len(header))
                copy_bytes(whole[span:span + length], payload)
                whole[span + length:] = bytes(size - span - length)
                write_all(fd, [whole])
            else:
                write_all(fd, [header + bytes(span - len(header)), payload,
                                bytes(size - span - length)])
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, final)
        except OSError as exc:
            self.last_error = exc
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            return False
        if self.fsync:
            self._sync_directory()
        return True

    def remove(self, key: bytes) -> None:
        """Delete the block file of ``key`` if it is there."""
        try:
            os.unlink(self.path(key))
        except OSError:
            pass

    def _sync_directory(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    # -- the index at start ----------------------------------------------------------------

    def list_blocks(self) -> tuple[list[str], int]:
        """Names of the block files here, after removing temporary files (writes a crash
        interrupted; no live writer can own them while this tier holds the lock).

        Returns:
            (block file names, temporary files removed).
        """
        names: list[str] = []
        temps = 0
        with os.scandir(self.directory) as it:
            for item in it:
                if item.name.startswith(TEMP_PREFIX):
                    temps += self._unlink(item.path)
                elif item.name.endswith(BLOCK_SUFFIX):
                    names.append(item.name)
        return names, temps

    def check_blocks(self, names: Sequence[str], entries: list[FileEntry]) -> int:
        """Verify each file's header and length (not the payload's checksum: reads check
        it), appending good ones to ``entries`` and removing bad ones.

        A file that cannot be read now (an I/O error) is neither indexed nor removed.

        Returns:
            bad files removed.
        """
        bad = 0
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                entry = self._check(path)
            except OSError:
                continue
            if entry is None:
                bad += self._unlink(path)
            else:
                entries.append(entry)
        return bad

    def _check(self, path: str) -> FileEntry | None:
        try:
            fd = os.open(path, os.O_RDONLY | BINARY_FLAG | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise
        except OSError:
            return None  # not a regular file we can open (a symlink, a directory): not ours
        try:
            st = os.fstat(fd)
            header = codec.parse_header(os.pread(fd, ALIGN, 0))  # stored keys fit one page
        finally:
            os.close(fd)
        if (header is None or not header.matches(self.fingerprint)
                or self.path(header.key) != path
                or st.st_size != file_size(header.key, header.payload_len)):
            return None
        return FileEntry(header.key, header.payload_len, st.st_mtime_ns)

    @staticmethod
    def _unlink(path: str) -> int:
        try:
            os.unlink(path)
        except OSError:
            return 0
        return 1
