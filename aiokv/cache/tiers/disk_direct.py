"""Direct I/O for the disk tier: alignment, per-thread bounce buffers, and whether a
directory takes ``O_DIRECT`` at all.

``O_DIRECT`` bypasses the page cache, so a restore reads straight from the device into the
caller's (page-aligned) buffer and a large tier does not evict the rest of the host's page
cache. Not every filesystem takes it (tmpfs refused it before Linux 6.6; some accept the
flag and fail the first I/O), so the tier asks by writing and reading one aligned page. A
full disk cannot answer that question: ``probe_direct`` then says "unknown" (None), and
``DirectMode`` keeps asking before each write until it can (docs/tiers.md, disk tier).
Everything here blocks and runs on the tier's worker threads.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading

import numpy as np

__all__ = ["ALIGN", "DIRECT_FLAG", "Bounce", "DirectMode", "aligned", "probe_direct", "round_up"]

ALIGN = 4096
"""Alignment of offsets, lengths and buffers for direct I/O (covers 512 B and 4 KiB sectors)."""
DIRECT_FLAG = getattr(os, "O_DIRECT", 0)
"""``os.O_DIRECT`` where the platform has it, else 0."""
PROBE_PREFIX = ".tmp-probe-"
"""Probe files start like the tier's temporary files, so a crash leaves nothing ``open``
does not clean up."""
# errnos that say "this filesystem does not do O_DIRECT"; any other failure says nothing.
_REFUSALS = {errno.EINVAL, getattr(errno, "EOPNOTSUPP", errno.EINVAL),
             getattr(errno, "ENOTSUP", errno.EINVAL)}


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def aligned(view: memoryview) -> bool:
    """Whether a buffer can take direct I/O as it is: whole pages at a page address."""
    return view.nbytes % ALIGN == 0 and int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % ALIGN == 0


class Bounce(threading.local):
    """One page-aligned buffer per worker thread (anonymous mmaps are page-aligned)."""

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def get(self, size: int) -> memoryview:
        if self.buf is None or len(self.buf) < size:
            if self.buf is not None:
                try:
                    self.buf.close()
                except BufferError:  # a view of it is still alive; let it go with the view
                    pass
            self.buf = mmap.mmap(-1, round_up(size, mmap.PAGESIZE))
        return memoryview(self.buf)[:size]


def probe_direct(directory: str) -> bool | None:
    """Whether ``directory``'s filesystem takes aligned ``O_DIRECT`` writes and reads:
    True, False (refused: EINVAL or EOPNOTSUPP at open or at the I/O, or the page did not
    read back), or None when the probe could not tell (no room for its page, a quota, an
    I/O error)."""
    if not DIRECT_FLAG:
        return False
    path = os.path.join(directory, f"{PROBE_PREFIX}{secrets.token_hex(8)}")
    page, back = mmap.mmap(-1, ALIGN), mmap.mmap(-1, ALIGN)
    fd = -1
    try:
        page.write(secrets.token_bytes(ALIGN))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | DIRECT_FLAG, 0o600)
        if os.pwritev(fd, [page], 0) != ALIGN:
            return None  # room for part of a page only
        return os.preadv(fd, [back], 0) == ALIGN and back[:] == page[:]
    except OSError as exc:
        return False if exc.errno in _REFUSALS else None
    finally:
        if fd >= 0:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
        page.close()
        back.close()


class DirectMode:
    """Whether one directory's block files use ``O_DIRECT``.

    ``wanted`` False never does, True always does (``open`` refuses a filesystem that says
    no; one that cannot answer yet is taken at its word), None does where the probe says
    it works. While the probe cannot tell (a full disk at ``open``), I/O is buffered and
    ``decide`` asks again before each write batch; the first answer holds for good.
    """

    def __init__(self, directory: str, wanted: bool | None) -> None:
        self.directory = directory
        self.on = bool(wanted)
        self.known = wanted is not None
        self._lock = threading.Lock()

    def decide(self) -> bool | None:
        """Probe if still undecided; the decision, or None while it cannot be made."""
        if self.known:
            return self.on
        with self._lock:
            if not self.known:
                answer = probe_direct(self.directory)
                if answer is not None:
                    self.on, self.known = answer, True
        return self.on if self.known else None
