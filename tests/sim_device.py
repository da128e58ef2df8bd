"""A simulated CUDA device for CPU tests of stream protocols: streams are queues of
operations on one byte array, events and waits follow CUDA's rules (a wait is on the
event's latest record at the time of the call; an event never recorded is complete), and
``run`` executes the queued work in an order that respects only those waits."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from aiokv.backends.cuda.pieces import PAGE_COLUMNS, ROWS_PER_LAUNCH

# The piece kernel's scalar parameters, in order (pieces.PieceKernel.launch), then the
# launch's device rows.
ARG_TYPES = (ctypes.c_uint64,) * 3 + (ctypes.c_uint32,) * 5


def launch_values(params: ctypes.Array[ctypes.c_void_p]) -> tuple[tuple[int, ...], list[int]]:
    """The values a launch's argument block holds now (the driver copies them at launch):
    the scalars and the rows the launch uses (``total / (tiles * npages)`` of them)."""
    values = tuple(ctypes.cast(params[i], ctypes.POINTER(t)).contents.value  # type: ignore[arg-type]
                   for i, t in enumerate(ARG_TYPES))
    tiles, npages, total = values[5:8]
    rows = ctypes.cast(params[len(ARG_TYPES)], ctypes.POINTER(ctypes.c_uint32 * ROWS_PER_LAUNCH)).contents
    return values, list(rows[: total // (tiles * npages)])


def pitched_rows(ops: np.ndarray) -> list[tuple[int, int, int]]:
    """The (dst, src, nbytes) row copies of packed 2-D ops: words 1-2 the source's address
    and pitch, 6-7 the destination's, 10-11 the width and height (``Driver.pitched_ops``)."""
    rows = []
    for op in ops.reshape(-1, 14).tolist():
        src, spitch, dst, dpitch, width, height = op[1], op[2], op[6], op[7], op[10], op[11]
        assert spitch >= width and dpitch >= width, "a pitch under the width"
        rows += [(dst + r * dpitch, src + r * spitch, width) for r in range(height)]
    return rows


class SimDriver:
    """Streams as queues of operations on ``mem``; ``run`` executes them."""

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem
        self.streams: dict[int, list[tuple[Any, ...]]] = {}
        self.records: dict[int, int] = {}  # event -> records issued
        self.done: dict[int, int] = {}  # event -> records executed
        self.on_done: dict[int, Any] = {}  # event -> called when a record of it executes
        self.next = 0
        self.heads: dict[int, int] = {}

    def _handle(self) -> int:
        self.next += 1
        return self.next

    def ensure_context(self) -> None:
        pass

    def create_stream(self, high_priority: bool = False) -> int:
        s = self._handle()
        self.streams[s] = []
        return s

    def destroy_stream(self, stream: int) -> None:
        pass

    def create_event(self, timing: bool = False, blocking: bool = False) -> int:
        e = self._handle()
        self.records[e] = self.done[e] = 0
        return e

    def load_function(self, image: bytes, name: bytes) -> int:
        return 0xF00D  # a handle, as the driver's (the native path passes it on as a number)

    def record(self, event: int, stream: int) -> None:
        self.records[event] += 1
        self.streams[stream].append(("record", event, self.records[event]))

    def stream_wait(self, stream: int, event: int) -> None:
        self.streams[stream].append(("wait", event, self.records[event]))

    def query(self, event: int) -> bool:
        return self.done[event] >= self.records[event]

    def memcpy_batch(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int, **_: Any
    ) -> None:
        self.streams[stream].append(("copy", list(zip(dst.tolist(), src.tolist(), sizes.tolist()))))

    def memcpy_batch_at(self, dst: int, src: int, sizes: int, n: int, stream: int, **_: Any) -> None:
        """The driver reads the three tables during the call: so does this."""
        table = ctypes.c_uint64 * n
        d, s, k = (list(table.from_address(at)) for at in (dst, src, sizes))
        self.streams[stream].append(("copy", list(zip(d, s, k))))

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.streams[stream].append(("copy", [(dst, src, nbytes)]))

    def memcpy_pitched(self, ops: np.ndarray, stream: int, **_: Any) -> None:
        """Packed 2-D copies (``Driver.pitched_ops`` rows), as the row copies they make."""
        self.streams[stream].append(("copy", pitched_rows(np.asarray(ops, dtype=np.uint64))))

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: int,
               params: ctypes.Array[ctypes.c_void_p], packed: Any = None) -> None:
        self.streams[stream].append(("kernel", *launch_values(params)))

    def _kernel(self, values: tuple[int, ...], rows: list[int]) -> None:
        """What the PTX does, page by page (tiles only split the work)."""
        pages_at, image_at, image_step, first_page, to_device, _tiles, npages, _total = values
        pages = self.mem[pages_at:].view(np.uint64)
        for z, row in enumerate(rows):
            image = image_at + z * image_step
            for y in range(first_page, first_page + npages):
                row_of_page = pages[PAGE_COLUMNS * y : PAGE_COLUMNS * (y + 1)]
                base, stride, n, off = (int(v) for v in row_of_page)
                dev, stg = base + row * stride, image + off
                dst, src = (dev, stg) if to_device else (stg, dev)
                self.mem[dst : dst + n] = self.mem[src : src + n]

    def run(self, rng: np.random.Generator) -> None:
        """Execute every queued op, one at a time from a stream whose head may run: mostly
        the ready stream first in a random ranking drawn per run (so some runs starve a
        stream as long as the waits allow), else any ready one. The queues stay as they
        are, so the same work can run again in another order."""
        self.done = dict.fromkeys(self.done, 0)
        heads = self.heads = {s: 0 for s in self.streams}  # ops run so far, per stream
        rank = {s: r for r, s in enumerate(rng.permutation(list(self.streams)).tolist())}
        while True:
            ready = []
            for s, ops in self.streams.items():
                if heads[s] < len(ops):
                    op = ops[heads[s]]
                    if op[0] != "wait" or self.done[op[1]] >= op[2]:
                        ready.append(s)
            if not ready:
                break
            if rng.random() < 0.8:
                s = min(ready, key=rank.__getitem__)
            else:
                s = ready[int(rng.integers(len(ready)))]
            op = self.streams[s][heads[s]]
            heads[s] += 1
            if op[0] == "record":
                self.done[op[1]] = max(self.done[op[1]], op[2])
                if op[1] in self.on_done:
                    self.on_done[op[1]]()
            elif op[0] == "copy":
                for d, src, n in op[1]:
                    self.mem[d : d + n] = self.mem[src : src + n]
            elif op[0] == "kernel":
                self._kernel(op[1], op[2])
        assert all(heads[s] == len(ops) for s, ops in self.streams.items()), "a wait never became ready"
