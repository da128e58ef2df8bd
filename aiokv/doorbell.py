"""A pipe whose read end an event loop sleeps on until a copy ends.

Backends ring it when a job they were asked about is over. The CUDA backend rings it
without Python: ``cuLaunchHostFunc`` runs libc's ``fclose`` on a ``FILE`` that wraps a dup
of the write end and holds one buffered byte (``deferred_ring``), so the driver's callback
thread writes that byte with no GIL to take. On the H200 the byte was readable 15-140 us
(p50) after the copy's event (probes/probe_doorbell.py), where an asyncio timer nap
overshoots by a millisecond or more.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["Doorbell"]


class _Libc:
    """The three libc calls a deferred ring needs (None where libc cannot be loaded)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fdopen = libc.fdopen
        self.fdopen.restype, self.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
        self.fputc = libc.fputc
        self.fputc.restype, self.fputc.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]
        self.fclose = libc.fclose
        self.fclose.restype, self.fclose.argtypes = ctypes.c_int, [ctypes.c_void_p]
        # What the driver calls: void fn(void *userData), userData being the FILE*.
        self.fclose_address = int(ctypes.cast(libc.fclose, ctypes.c_void_p).value or 0)


_LIBC: _Libc | bool | None = False  # False: not loaded yet


def _libc() -> _Libc | None:
    global _LIBC
    if _LIBC is False:
        try:
            _LIBC = _Libc()
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC if isinstance(_LIBC, _Libc) else None


class Doorbell:
    """One non-blocking pipe: ``ring`` from any thread, the loop waits on ``fileno()``."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.closed = False

    def fileno(self) -> int:
        """The read end, readable once rung (until ``drain``)."""
        return self._read

    def ring(self) -> None:
        """Make the read end readable. Safe from any thread; a full pipe is rung already."""
        try:
            os.write(self._write, b"!")
        except (BlockingIOError, OSError):
            pass  # full (a ring is pending) or closed (nobody is listening any more)

    def drain(self) -> int:
        """Consume every pending ring; returns how many there were."""
        count = 0
        while True:
            try:
                data = os.read(self._read, 4096)
            except (BlockingIOError, OSError):
                return count
            if not data:
                return count
            count += len(data)

    @staticmethod
    def host_function() -> int:
        """Address of the C function a driver calls with ``deferred_ring()``'s pointer (0: none)."""
        libc = _libc()
        return libc.fclose_address if libc is not None else 0

    def deferred_ring(self) -> int:
        """A ``FILE*`` that rings once when ``host_function()`` is called on it.

        The caller hands it to exactly one call (by the driver, or ``cancel_deferred``).
        Raises ``OSError`` where libc is unavailable or out of descriptors.
        """
        libc = _libc()
        if libc is None:
            raise OSError("libc is not loadable here; deferred rings are unavailable")
        fd = os.dup(self._write)
        handle = libc.fdopen(fd, b"w")
        if not handle:
            os.close(fd)
            raise OSError(ctypes.get_errno(), "fdopen failed")
        libc.fputc(ord("!"), handle)  # buffered: written only by fclose
        return int(handle)

    @staticmethod
    def cancel_deferred(handle: Any) -> None:
        """Close a deferred ring the driver never took (it rings now, harmlessly)."""
        libc = _libc()
        if libc is not None:
            libc.fclose(handle)

    def close(self) -> None:
        """Close both ends. Deferred rings still pending write into a closed pipe, which
        Python's default SIGPIPE handling turns into a harmless EPIPE."""
        if not self.closed:
            self.closed = True
            os.close(self._read)
            os.close(self._write)
