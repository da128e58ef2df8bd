"""Pinned host memory for the chunks: an exact-size mapping, page-locked with cuMemHostRegister.

torch's pinned allocator rounds every request up to a power of two (a 40 GiB pool would
pin 64 GiB), so the pool is an anonymous mapping of exactly the bytes asked for (rounded
to a page) that the driver registers. It is built under an undo stack, so a failure
part-way unregisters and unmaps what was done, and it is released only by ``close``,
which the worker calls after every copy that may touch it has completed. A pool whose
worker was dropped unclosed, or whose context died, stays registered and mapped for the
rest of the process. A mapping or a registration that fails for lack of memory raises
``HostMemoryError``. With ``file`` the mapping is that shared file instead
(``backends/shared_file.py``), which the driver pins the same way.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import HostMemoryError, InvalidSpec
from ..base import HostPool
from ..shared_file import SharedFile

if TYPE_CHECKING:
    from .driver import Driver

__all__ = ["PinnedHostPool"]

# Mappings never unmapped: still registered with the driver (a dropped worker's, whose
# copies may still run, or one of a context that died). Unmapped, a later mapping at the
# same address would alias memory the device may write (and fail to register).
_KEPT: list[mmap.mmap] = []


class PinnedHostPool(HostPool):
    """``tensor`` is a flat uint8 CPU tensor over the registered memory (tests inspect it);
    ``device_ptr`` is the same memory's device (UVA) address, which copies use."""

    def __init__(self, nbytes: int, driver: Driver, file: str | None = None) -> None:
        if nbytes <= 0:
            raise InvalidSpec(f"the host pool needs a positive size, got {nbytes} bytes")
        self._driver = driver
        self.nbytes = nbytes
        mapped = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        driver.ensure_context()
        self._shared: SharedFile | None = None
        with contextlib.ExitStack() as undo:
            if file is not None:
                self._shared = SharedFile(file, nbytes)
                self._map = self._shared.map
                undo.callback(self._shared.unlink)
            else:
                try:
                    self._map = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                except (OSError, OverflowError) as exc:
                    raise HostMemoryError(
                        f"could not map {nbytes} bytes of host memory ({exc}): ask for fewer chunks "
                        "(num_cpu_chunks= or cpu_bytes=)"
                    ) from exc
            undo.callback(self._close_map)
            array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
            self.address = int(array.ctypes.data)
            self.device_ptr = driver.host_register(self.address, mapped)
            undo.callback(driver.host_unregister, self.address)
            self.tensor = torch.from_numpy(array)
            undo.pop_all()
        self._registered = True

    def _close_map(self) -> None:
        # The mapping stays alive while tensors or arrays view it; unmapping happens when
        # the last of them is gone (mmap.close refuses while views exist).
        with contextlib.suppress(BufferError):
            self._map.close()

    def close(self) -> None:
        if not self._registered:
            return
        self._registered = False
        if self._shared is not None:
            self._shared.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._driver.broken is None:
            self._driver.ensure_context()
            self._driver.host_unregister(self.address)
            self._close_map()
        else:
            _KEPT.append(self._map)  # a dead context cannot unregister it

    def abandon(self) -> None:
        """Dropped with copies perhaps in flight: registered and mapped for good."""
        if self._registered:
            self._registered = False
            _KEPT.append(self._map)

    def __repr__(self) -> str:
        state = "registered" if self._registered else "closed"
        return f"<PinnedHostPool {self.nbytes} bytes {state}>"
