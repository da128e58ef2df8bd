"""One kernel launch that copies a job's pages between their device rows and staging.

Why: gathering a job's pages with torch index ops costs one or two launches per page
tensor (64 or more for a per-layer job), and beside a GEMM each launch waits for SMs. This
kernel moves a whole slice of a job in one launch (one per 256 blocks). It is PTX written
here and compiled by the driver when the module loads, so nothing beyond the driver is
needed at run time.

A launch copies pages of a few blocks. ``pages`` is a device table, one row per page of a
block (device base, row stride, bytes, offset in the block's staging image); the blocks
are the launch's own parameters (each block's device row; block ``z``'s image is at
``image + z * image_step``). Page ``y`` of block ``z`` lives at ``base + row * stride`` on
the device and at ``image + z * image_step + offset`` in staging. A layout's page table
never changes, so a staging lane uploads it once and a job of 128 blocks x 64 pages
uploads nothing. A job that does not fit that shape is one block per slice whose "pages"
are its pieces (stride 0, base = address), uploaded per job.

A launch covers (tiles of the longest page) x pages x blocks tiles of 16 KiB; each CTA of
256 threads copies one tile at a time (4 x 16 bytes per thread), tiles i, i + CTAs, ...,
so the grid can be smaller than the job. Addresses and sizes must be multiples of 16
bytes (``fits``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .driver import Driver

__all__ = ["PAGE_COLUMNS", "PARAM_OFFSETS", "PieceKernel", "fits"]

THREADS = 256
TILE_BYTES = 16384  # THREADS x 4 vectors of 16 bytes
MAX_TILES = (1 << 31) - 1
# CTAs per launch (>= 1); None launches one per tile. Fewer CTAs, each looping over tiles,
# were meant to leave a GEMM beside the copy more SMs, but did not: they slowed both the
# copies under the GEMMs and the GEMMs themselves (docs/performance.md, "Copy strategies").
MAX_CTAS: int | None = None
ALIGN = 16
MIN_TABLE_BYTES = 64 << 10
PAGE_COLUMNS = 4  # device base, row stride, bytes, offset in the block image
# Device rows per launch, passed in the launch's parameters (4 bytes each; the parameters
# may hold 4 KiB). A slice of more blocks takes several launches.
ROWS_PER_LAUNCH = 256
# Where each parameter starts in the kernel's parameter block (8-byte ints): three u64,
# five u32, then the rows (aligned to 4), as the PTX declares them.
PARAM_OFFSETS = np.array([0, 8, 16, 24, 28, 32, 36, 40, 44], dtype=np.uint64)

PTX = r"""
.version 7.0
.target sm_75
.address_size 64

// Tiles are numbered x fastest (16 KiB tiles of a page), then pages, then blocks; CTA i
// copies tiles i, i + gridDim.x, ... below total, so a launch may use fewer CTAs than
// tiles. Tile (x, y, z): tile x of page first_page + y of block z, between the block's
// device row rows[z] and its image at image + z * image_step in staging. pages: a device
// table of rows of 4 x u64 (device base, row stride, bytes, offset in the block image).
// rows: the launch's device rows, in the parameters themselves (read through the
// constant cache), so a job needs no per-job table when its page table is the lane's.
.visible .entry aiokv_copy_blocks(.param .u64 pages, .param .u64 image, .param .u64 image_step,
                                  .param .u32 first_page, .param .u32 to_device,
                                  .param .u32 tiles, .param .u32 npages, .param .u32 total,
                                  .param .align 4 .b8 rows[ROWS_BYTES])
{
    .reg .pred %p<5>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<20>;
    .reg .b32 %v<16>;

    ld.param.u64 %rd11, [pages];
    ld.param.u64 %rd12, [image];
    ld.param.u64 %rd15, [image_step];
    ld.param.u32 %r1, [first_page];
    ld.param.u32 %r3, [to_device];
    ld.param.u32 %r8, [tiles];
    ld.param.u32 %r9, [npages];
    ld.param.u32 %r10, [total];
    mov.u64 %rd16, rows;
    cvta.to.global.u64 %rd11, %rd11;
    setp.ne.u32 %p3, %r3, 0;
    mov.u32 %r11, %ctaid.x;
    mov.u32 %r12, %nctaid.x;
    mov.u32 %r7, %tid.x;
    mul.wide.u32 %rd13, %r7, 16;
TILE:
    setp.ge.u32 %p0, %r11, %r10;
    @%p0 bra DONE;
    // x = i % tiles, y = (i / tiles) % npages, z = i / tiles / npages
    div.u32 %r13, %r11, %r8;
    mul.lo.u32 %r14, %r13, %r8;
    sub.u32 %r6, %r11, %r14;
    div.u32 %r5, %r13, %r9;
    mul.lo.u32 %r14, %r5, %r9;
    sub.u32 %r4, %r13, %r14;
    add.u32 %r4, %r4, %r1;
    mul.wide.u32 %rd3, %r4, 32;
    add.s64 %rd1, %rd11, %rd3;
    mul.wide.u32 %rd3, %r5, 4;
    add.s64 %rd2, %rd16, %rd3;
    ld.param.u32 %r15, [%rd2];
    ld.global.nc.u64 %rd3, [%rd1];
    ld.global.nc.u64 %rd4, [%rd1+8];
    ld.global.nc.u64 %rd5, [%rd1+16];
    ld.global.nc.u64 %rd6, [%rd1+24];
    cvt.u64.u32 %rd7, %r15;
    cvt.u64.u32 %rd8, %r5;
    mad.lo.u64 %rd9, %rd7, %rd4, %rd3;
    mad.lo.u64 %rd10, %rd8, %rd15, %rd12;
    add.s64 %rd10, %rd10, %rd6;
    selp.b64 %rd3, %rd10, %rd9, %p3;
    selp.b64 %rd4, %rd9, %rd10, %p3;
    // The tile starts 16 KiB per x into the page; past the page's end, nothing.
    mul.wide.u32 %rd6, %r6, 16384;
    setp.ge.u64 %p1, %rd6, %rd5;
    @%p1 bra NEXT;
    cvta.to.global.u64 %rd3, %rd3;
    cvta.to.global.u64 %rd4, %rd4;
    sub.u64 %rd7, %rd5, %rd6;
    add.s64 %rd9, %rd3, %rd6;
    add.s64 %rd9, %rd9, %rd13;
    add.s64 %rd10, %rd4, %rd6;
    add.s64 %rd10, %rd10, %rd13;
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
    bra.uni NEXT;
TAIL:
    // The last, partial tile of a page: one vector per thread per 4 KiB step.
    mov.u64 %rd14, %rd13;
TAIL_STEP:
    setp.ge.u64 %p4, %rd14, %rd7;
    @%p4 bra NEXT;
    ld.global.nc.v4.u32 {%v0, %v1, %v2, %v3}, [%rd9];
    st.global.v4.u32 [%rd10], {%v0, %v1, %v2, %v3};
    add.s64 %rd14, %rd14, 4096;
    add.s64 %rd9, %rd9, 4096;
    add.s64 %rd10, %rd10, 4096;
    bra TAIL_STEP;
NEXT:
    add.u32 %r11, %r11, %r12;
    bra TILE;
DONE:
    ret;
}
""".replace("ROWS_BYTES", str(4 * ROWS_PER_LAUNCH))


def fits(*arrays: np.ndarray | int) -> bool:
    """True when every address and size is a multiple of 16 bytes (the kernel's vectors)."""
    return all(not (np.asarray(a, dtype=np.uint64) % ALIGN).any() for a in arrays)


@dataclass
class _TableSlot:
    host: torch.Tensor  # pinned
    device: torch.Tensor
    copied: Any  # event recorded once the device copy of ``host`` is done
    # The program whose rows copy out of ``host`` and record ``copied`` (a native lane's),
    # until its issuer has issued it: before that ``copied`` says nothing of this copy.
    program: Any = None

    def free(self, driver: Any) -> bool:
        program = self.program
        if program is not None and not program.settled:
            return False
        return bool(driver.query(self.copied))


# Table slots of kernels whose worker was dropped unclosed (``PieceKernel.abandon``).
_KEPT_TABLES: list[_TableSlot] = []


class PieceKernel:
    """The loaded kernel and the page tables it reads.

    ``upload`` puts a page table on the device through a pinned buffer that is reused
    once the device has copied it (an event per buffer; a new buffer when all are busy),
    with driver calls that keep the GIL: torch's ``pin_memory().to()`` would drop it twice
    per job, and beside a busy Python thread each drop costs a switch interval.
    """

    def __init__(self, driver: Driver, device: torch.device) -> None:
        self.driver = driver
        self.device = device
        self.function = driver.load_function(PTX.encode() + b"\0", b"aiokv_copy_blocks")
        # One argument block, rewritten per launch: building the ctypes values and their
        # pointer array anew cost host time on every launch. Launches of one kernel never
        # overlap (a lane issues from one thread at a time) and the driver copies the values
        # at launch. The values live in one blob laid out as the kernel's parameters, so a
        # launch recorded for the native helper copies them at once (``packed``).
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        self._blob = bytearray(PARAM_OFFSETS[-1] + 4 * ROWS_PER_LAUNCH)
        kinds = (u64, u64, u64, u32, u32, u32, u32, u32)
        self._args = tuple(kind.from_buffer(self._blob, int(at)) for kind, at in zip(kinds, PARAM_OFFSETS))
        self._rows = (u32 * ROWS_PER_LAUNCH).from_buffer(self._blob, int(PARAM_OFFSETS[-1]))
        self._row_values = np.ctypeslib.as_array(self._rows)  # a view, to fill it
        self._params = (ctypes.c_void_p * (len(self._args) + 1))(
            *(ctypes.addressof(a) for a in self._args), ctypes.addressof(self._rows))
        self._packed = (self._blob, PARAM_OFFSETS)
        self._tables: list[_TableSlot] = []
        self._kept: list[_TableSlot] = []
        self._streams: dict[int, torch.cuda.ExternalStream] = {}

    def upload(self, pages: np.ndarray, stream: Any, keep: bool = False) -> int:
        """Copy a page table (uint64) to the device on ``stream``; its device address.

        Kernels reading it must run on ``stream`` too: device buffers are reused in its
        order, except a ``keep`` table's, which stays until ``close``.
        """
        nbytes = pages.size * 8
        drv = self.driver
        slot = None if keep else next(
            (t for t in self._tables if t.host.numel() >= nbytes and t.free(drv)), None)
        if slot is None:  # one per job in flight at most (and a kept one), until close
            size = max(MIN_TABLE_BYTES, 1 << (nbytes - 1).bit_length())
            # On ``stream``, where it is used: from another stream the caching allocator
            # could hand back a block that stream's queued kernels still use.
            with torch.cuda.stream(self.torch_stream(stream)):
                device = torch.empty(size, dtype=torch.uint8, device=self.device)
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            slot = _TableSlot(host, device, drv.create_event())
            # A kept table's pinned buffer stays too: the copy out of it is still queued.
            (self._kept if keep else self._tables).append(slot)
        slot.host.numpy()[:nbytes] = pages.view(np.uint8).reshape(-1)
        slot.program = getattr(drv, "program", None)  # a ``program.Recorder``'s open program
        drv.memcpy(slot.device.data_ptr(), slot.host.data_ptr(), nbytes, stream)
        drv.record(slot.copied, stream)
        return int(slot.device.data_ptr())

    def torch_stream(self, stream: Any) -> torch.cuda.ExternalStream:
        """``stream`` as torch sees it (cached), to allocate device memory on it."""
        key = int(stream)
        wrapped = self._streams.get(key)
        if wrapped is None:
            wrapped = self._streams[key] = torch.cuda.ExternalStream(key, device=self.device)
        return wrapped

    def launch(self, table: int, pages: tuple[int, int], rows: np.ndarray, image: int, image_step: int,
               longest: int, to_device: bool, stream: Any, driver: Any = None) -> None:
        """Copy pages ``[pages[0], pages[1])`` of the blocks at device ``rows`` (uint32),
        block ``z``'s image at ``image + z * image_step``, on at most ``MAX_CTAS`` CTAs
        (None: one CTA per tile). ``driver``: where the launches go (default the kernel's;
        a lane's recorder records them into its open program)."""
        launch_on = (driver if driver is not None else self.driver).launch
        tiles = max(1, -(-longest // TILE_BYTES))
        a_table, a_image, a_step, a_page, a_to_device, a_tiles, a_npages, a_total = self._args
        a_table.value, a_step.value, a_to_device.value, a_tiles.value = table, image_step, to_device, tiles
        n = int(rows.shape[0])
        total = tiles * (pages[1] - pages[0]) * n
        if 0 < total <= MAX_TILES and n <= ROWS_PER_LAUNCH:  # a staged slice: one launch
            self._row_values[:n] = rows
            a_image.value, a_page.value, a_total.value = image, pages[0], total
            a_npages.value = pages[1] - pages[0]
            ctas = total if MAX_CTAS is None else max(1, min(total, MAX_CTAS))
            launch_on(self.function, (ctas, 1, 1), THREADS, stream, self._params, packed=self._packed)
            return
        # Launches small enough that the rows fit the parameters and tile numbers 31 bits:
        # blocks, then pages, per launch.
        block_step = max(1, min(ROWS_PER_LAUNCH, MAX_TILES // tiles))
        for b in range(0, n, block_step):
            nb = min(block_step, n - b)
            self._row_values[:nb] = rows[b : b + nb]
            a_image.value = image + b * image_step
            page_step = max(1, MAX_TILES // (tiles * nb))
            for p in range(pages[0], pages[1], page_step):
                np_ = min(page_step, pages[1] - p)
                total = tiles * np_ * nb
                a_page.value, a_npages.value, a_total.value = p, np_, total
                ctas = total if MAX_CTAS is None else max(1, min(total, MAX_CTAS))
                launch_on(self.function, (ctas, 1, 1), THREADS, stream, self._params, packed=self._packed)

    def close(self) -> None:
        """Drop the table buffers (the caller guarantees no kernel still reads them)."""
        self._tables = []
        self._kept = []
        self._streams = {}

    def abandon(self) -> None:
        """Keep every table buffer for good (the worker was dropped unclosed): a copy out
        of one may still be queued, and torch's host allocator, which never saw that copy,
        would hand a freed pinned buffer to the next ``pin_memory`` allocation."""
        _KEPT_TABLES.extend(self._tables + self._kept)
