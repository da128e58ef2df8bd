"""A pipe whose read end an event loop sleeps on until a copy ends (or an alarm goes off).

Backends ring it when a job they were asked about is over. The CUDA backend rings it
without Python: ``cuLaunchHostFunc`` runs libc's ``fclose`` on a ``FILE`` that wraps a dup
of the write end and holds one buffered byte (``deferred_ring``), so the driver's callback
thread writes that byte with no GIL to take. The byte is readable within a fraction of a
millisecond of the copy's event, where an asyncio timer nap overshoots by a millisecond or
more (docs/performance.md, "Doorbell").

Event loops only time naps to the millisecond (asyncio rounds every timeout up to the next
whole one), so the bell also carries a precise alarm: a ``timerfd`` watched together with
the pipe through one epoll descriptor, which is what the loop actually waits on.
"""

from __future__ import annotations

import ctypes
import os
import select
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
        # Drops a FILE's buffered bytes (glibc, musl), so an unused deferred ring stays silent.
        self.fpurge = getattr(libc, "__fpurge", None)
        if self.fpurge is not None:
            self.fpurge.restype, self.fpurge.argtypes = None, [ctypes.c_void_p]
        # What the driver calls: void fn(void *userData), userData being the FILE*.
        self.fclose_address = int(ctypes.cast(libc.fclose, ctypes.c_void_p).value or 0)


_LIBC: _Libc | bool | None = False  # False: not loaded yet

_CLOCK_MONOTONIC = 1  # perf_counter's clock on Linux
_TFD_NONBLOCK, _TFD_CLOEXEC = os.O_NONBLOCK, getattr(os, "O_CLOEXEC", 0)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Alarm:
    """A one-shot Linux timerfd, readable once it expires (nanosecond resolution)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._settime = libc.timerfd_settime
        self._settime.restype = ctypes.c_int
        self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        create = libc.timerfd_create
        create.restype, create.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
        self.fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self._spec = _Itimerspec()

    def set(self, seconds: float) -> None:
        """Go off ``seconds`` from now (at least 1 ns); 0 or less disarms."""
        value = self._spec.it_value
        if seconds <= 0:
            value.tv_sec = value.tv_nsec = 0
        else:
            ns = max(1, int(seconds * 1e9))
            value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._settime(self.fd, 0, ctypes.addressof(self._spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except (BlockingIOError, OSError):
            pass


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
        self.closed = False
        self._alarm: _Alarm | None = None
        self._epoll: Any = None
        try:
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)
            if hasattr(select, "epoll"):
                try:
                    self._alarm = _Alarm()
                except (OSError, AttributeError):
                    self._alarm = None
            if self._alarm is not None:
                self._epoll = select.epoll()
                self._epoll.register(self._read, select.EPOLLIN)
                self._epoll.register(self._alarm.fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def supported() -> bool:
        """Whether an event loop can wait on a pipe here (POSIX; Windows loops wait on sockets)."""
        return os.name == "posix"

    @property
    def has_alarm(self) -> bool:
        """Whether ``set_alarm`` is available (Linux)."""
        return self._alarm is not None

    def fileno(self) -> int:
        """What to wait on: readable once rung or once the alarm went off (until ``drain``)."""
        return self._epoll.fileno() if self._epoll is not None else self._read

    def set_alarm(self, seconds: float) -> bool:
        """Become readable ``seconds`` from now (replacing any earlier alarm; <= 0 clears
        it). False where there is no alarm, and the caller must time the nap itself."""
        if self._alarm is None or self.closed:
            return False
        self._alarm.set(seconds)
        if seconds <= 0:
            self._alarm.clear()
        return True

    def ring(self) -> None:
        """Make the read end readable. Safe from any thread; a full pipe is rung already."""
        if self.closed:
            return
        try:
            os.write(self._write, b"!")
        except (BlockingIOError, OSError):
            pass  # full (a ring is pending) or closed (nobody is listening any more)

    def ring_fd(self) -> int:
        """The pipe's write end, for a native thread to ring by writing one byte to a dup
        of it (-1 once closed). Not for writing from Python: use ``ring``."""
        return -1 if self.closed else self._write

    def drain(self) -> int:
        """Consume every pending ring (and an alarm that went off); returns the rings."""
        if self.closed:
            return 0
        if self._epoll is not None:  # one system call says which of the two to read
            ready = {fd for fd, _ in self._epoll.poll(0)}
            if self._alarm is not None and self._alarm.fd in ready:
                self._alarm.clear()
            if self._read not in ready:
                return 0
        count = 0
        while True:
            try:
                data = os.read(self._read, 4096)
            except (BlockingIOError, OSError):
                return count
            count += len(data)
            if len(data) < 4096:  # emptied (a ring landing since keeps it readable)
                return count

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
        """Close a deferred ring the driver never took, without ringing where libc allows
        (a ring from a failed arm would end every nap at once)."""
        libc = _libc()
        if libc is not None:
            if libc.fpurge is not None:
                libc.fpurge(handle)
            libc.fclose(handle)

    def close(self) -> None:
        """Close the pipe, the alarm and the epoll descriptor. Call once nothing can ring
        any more: backends let pending host functions run before their lanes close (a ring
        into a pipe nobody reads would be an EPIPE, or a SIGPIPE where that is not ignored)."""
        if not self.closed:
            self.closed = True
            if self._epoll is not None:
                self._epoll.close()
            if self._alarm is not None:
                os.close(self._alarm.fd)
            os.close(self._read)
            os.close(self._write)
