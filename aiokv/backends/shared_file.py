"""Host memory under a file name, so another process can map the same chunks.

A worker's host pool is private memory unless ``WorkerOptions.host_pool_file`` names a
file: then the pool is that file (on a memory filesystem such as ``/dev/shm``), mapped
shared, and a second process (vLLM's scheduler, which moves blocks between the pool and
the lower tiers) maps it too. The file is made anew and allocated in full at once, so a
memory filesystem too small for it fails here, with a clear error, instead of killing
the process with SIGBUS on the first write to a page it cannot back.
"""

from __future__ import annotations

import contextlib
import mmap
import os

from ..errors import HostMemoryError, InvalidSpec

__all__ = ["SharedFile", "check_pool_file"]


def check_pool_file(path: object) -> str:
    """``path`` as an absolute file name whose directory exists (``InvalidSpec`` if not)."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise InvalidSpec(f"host_pool_file must be an absolute file name (e.g. under /dev/shm), got {path!r}")
    if not os.path.isdir(os.path.dirname(path)):
        raise InvalidSpec(f"host_pool_file {path!r}: its directory does not exist")
    return path


class SharedFile:
    """``nbytes`` (rounded up to a page) of memory under ``path``, mapped shared.

    Replaces a file of that name. ``unlink`` removes the name while the memory stays mapped
    (it is freed when the last mapping goes); it leaves alone a file someone made anew
    under the same name since.
    """

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = check_pool_file(path)
        self.nbytes = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise InvalidSpec(f"cannot create the host pool file {path!r}: {exc}") from exc
        try:
            self.inode = os.fstat(fd).st_ino
            try:
                os.posix_fallocate(fd, 0, self.nbytes)
                self.map = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
            except (OSError, OverflowError, ValueError) as exc:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise HostMemoryError(
                    f"could not allocate {self.nbytes} bytes ({self.nbytes / 2**30:.3g} GiB) of shared host "
                    f"memory in {os.path.dirname(path)!r} ({exc}); give that filesystem more room (a "
                    "container's --shm-size) or ask for fewer chunks"
                ) from exc
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the file name if it still names this memory."""
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)

    def close(self) -> None:
        """Remove the name and unmap (the mapping lives on while views of it do)."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self.map.close()
