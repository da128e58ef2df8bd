"""One kernel launch that copies a whole table of pieces (source, destination, bytes).

Why: gathering a job's pages with torch index ops costs one or two launches per page
tensor (64 or more for a per-layer job), and beside a GEMM each launch waits for SMs. This
kernel moves every piece of a job in one launch. It is PTX written here and compiled by the
driver when the module loads, so nothing beyond the driver is needed at run time.

Each CTA of 256 threads copies one 16 KiB tile of one piece (4 x 16 bytes per thread);
``grid.y`` walks the pieces, ``grid.x`` the tiles of the longest one. Sources and
destinations must be 16-byte aligned and sizes multiples of 16 (``fits``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ..backends.cuda import Driver

__all__ = ["PieceKernel", "fits", "piece_table"]

THREADS = 256
TILE_BYTES = 16384  # THREADS x 4 vectors of 16 bytes
MAX_GRID_Y = 65535
ALIGN = 16
MIN_TABLE_BYTES = 64 << 10

PTX = r"""
.version 7.0
.target sm_75
.address_size 64

// table: pieces of 3 x u64 (source, destination, bytes); piece = first + ctaid.y.
.visible .entry aiokv_copy_pieces(.param .u64 table, .param .u32 first)
{
    .reg .pred %p<4>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<12>;
    .reg .b32 %v<16>;

    ld.param.u64 %rd1, [table];
    ld.param.u32 %r3, [first];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r1, %ctaid.y;
    add.u32 %r1, %r1, %r3;
    mul.wide.u32 %rd2, %r1, 24;
    add.s64 %rd2, %rd1, %rd2;
    ld.global.nc.u64 %rd3, [%rd2];
    ld.global.nc.u64 %rd4, [%rd2+8];
    ld.global.nc.u64 %rd5, [%rd2+16];
    // This CTA's tile starts TILE bytes per ctaid.x into the piece; past its end, nothing.
    mov.u32 %r2, %ctaid.x;
    mul.wide.u32 %rd6, %r2, 16384;
    setp.ge.u64 %p1, %rd6, %rd5;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd4, %rd4;
    sub.u64 %rd7, %rd5, %rd6;
    mov.u32 %r2, %tid.x;
    mul.wide.u32 %rd8, %r2, 16;
    add.s64 %rd9, %rd3, %rd6;
    add.s64 %rd9, %rd9, %rd8;
    add.s64 %rd10, %rd4, %rd6;
    add.s64 %rd10, %rd10, %rd8;
    setp.lt.u64 %p2, %rd7, 16384;
    @%p2 bra TAIL;
    // A whole tile: four loads in flight per thread, then four stores.
    ld.global.nc.v4.u32 {%v0, %v1, %v2, %v3}, [%rd9];
    ld.global.nc.v4.u32 {%v4, %v5, %v6, %v7}, [%rd9+4096];
    ld.global.nc.v4.u32 {%v8, %v9, %v10, %v11}, [%rd9+8192];
    ld.global.nc.v4.u32 {%v12, %v13, %v14, %v15}, [%rd9+12288];
    st.global.v4.u32 [%rd10], {%v0, %v1, %v2, %v3};
    st.global.v4.u32 [%rd10+4096], {%v4, %v5, %v6, %v7};
    st.global.v4.u32 [%rd10+8192], {%v8, %v9, %v10, %v11};
    st.global.v4.u32 [%rd10+12288], {%v12, %v13, %v14, %v15};
    bra.uni DONE;
TAIL:
    // The last, partial tile of a piece: one vector per thread per 4 KiB step.
    setp.ge.u64 %p3, %rd8, %rd7;
    @%p3 bra DONE;
    ld.global.nc.v4.u32 {%v0, %v1, %v2, %v3}, [%rd9];
    st.global.v4.u32 [%rd10], {%v0, %v1, %v2, %v3};
    add.s64 %rd8, %rd8, 4096;
    add.s64 %rd9, %rd9, 4096;
    add.s64 %rd10, %rd10, 4096;
    bra.uni TAIL;
DONE:
    ret;
}
"""


def fits(*arrays: np.ndarray) -> bool:
    """True when every address and size is a multiple of 16 bytes (the kernel's vectors)."""
    return all(not (np.asarray(a, dtype=np.uint64) % ALIGN).any() for a in arrays)


def piece_table(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """The kernel's table: one row of (source, destination, bytes) per piece, as uint64."""
    table = np.empty((src.shape[0], 3), dtype=np.uint64)
    table[:, 0] = src
    table[:, 1] = dst
    table[:, 2] = nbytes
    return table


@dataclass
class _TableSlot:
    host: torch.Tensor  # pinned
    device: torch.Tensor
    copied: Any  # event recorded once the device copy of ``host`` is done


class PieceKernel:
    """The loaded kernel and the tables it reads.

    ``upload`` puts a job's table on the device through a pinned buffer that is reused
    once the device has copied it (an event per buffer; a new buffer when all are busy),
    with driver calls that keep the GIL: torch's ``pin_memory().to()`` would drop it twice
    per job, and beside a busy Python thread each drop costs a switch interval.
    """

    def __init__(self, driver: Driver, device: torch.device) -> None:
        self.driver = driver
        self.device = device
        self.function = driver.load_function(PTX.encode() + b"\0", b"aiokv_copy_pieces")
        self._tables: list[_TableSlot] = []

    def upload(self, table: np.ndarray, stream: Any) -> int:
        """Copy ``table`` to the device on ``stream``; returns its device address there.

        Kernels reading it must run on ``stream`` too: device buffers are reused in its order.
        """
        raw = table.view(np.uint8).reshape(-1)
        nbytes = raw.shape[0]
        drv = self.driver
        slot = next((t for t in self._tables if t.host.numel() >= nbytes and drv.query(t.copied)), None)
        if slot is None:
            size = max(MIN_TABLE_BYTES, 1 << (nbytes - 1).bit_length())
            slot = _TableSlot(torch.empty(size, dtype=torch.uint8, pin_memory=True),
                              torch.empty(size, dtype=torch.uint8, device=self.device), drv.create_event())
            self._tables.append(slot)
        slot.host.numpy()[:nbytes] = raw
        drv.memcpy(slot.device.data_ptr(), slot.host.data_ptr(), nbytes, stream)
        drv.record(slot.copied, stream)
        return slot.device.data_ptr()

    def launch(self, table_ptr: int, pieces: int, longest: int, stream: Any, first: int = 0) -> None:
        """Copy pieces ``first .. first + pieces`` of the device-resident table at ``table_ptr``."""
        tiles = max(1, -(-longest // TILE_BYTES))
        done = 0
        while done < pieces:
            count = min(MAX_GRID_Y, pieces - done)
            args = (ctypes.c_uint64(table_ptr), ctypes.c_uint32(first + done))
            self.driver.launch(self.function, (tiles, count), THREADS, stream, args)
            done += count

    def close(self) -> None:
        """Drop the table buffers (the caller guarantees no kernel still reads them)."""
        self._tables = []
