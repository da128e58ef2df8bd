"""The staging ring's stream protocol on a simulated device (no GPU): ``StagedCopy.enqueue``
drives a fake driver whose streams, events and waits follow CUDA's rules (a wait is on the
event's latest record at the time of the call; an event never recorded is complete), whose
copies and piece-kernel launches act on one byte array, and which runs the enqueued work
in several random orders that respect only those waits. Several jobs share the ring, so slots are
reused within and across jobs; any missing or misplaced wait shows up as bytes that differ
from the job's plan in some order."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from aiokv.copy.pieces import PAGE_COLUMNS
from aiokv.copy.staged import StagedCopy, StagedJob
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import HostLayout, map_blocks, plan_copies

DEVICE_AT, HOST_AT, STAGING_AT, TABLES_AT = 1 << 20, 8 << 20, 16 << 20, 24 << 20
SPACE = 32 << 20
ORDERS = 8  # random orders each set of jobs runs in
ARG_TYPES = (ctypes.c_uint64, ctypes.c_uint64) + (ctypes.c_uint32,) * 6


class SimDriver:
    """Streams as queues of operations on ``mem``; ``run`` executes them."""

    def __init__(self, mem: np.ndarray) -> None:
        self.mem = mem
        self.streams: dict[int, list[tuple[Any, ...]]] = {}
        self.records: dict[int, int] = {}  # event -> records issued
        self.done: dict[int, int] = {}  # event -> records executed
        self.next = 0

    def _handle(self) -> int:
        self.next += 1
        return self.next

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

    def load_function(self, image: bytes, name: bytes) -> str:
        return name.decode()

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

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: int,
               params: ctypes.Array[ctypes.c_void_p]) -> None:
        values = tuple(ctypes.cast(params[i], ctypes.POINTER(t)).contents.value
                       for i, t in enumerate(ARG_TYPES))
        self.streams[stream].append(("kernel", values))

    def _kernel(self, pages_at: int, blocks_at: int, first_page: int, first_block: int, to_device: int,
                tiles: int, npages: int, total: int) -> None:
        """What the PTX does, page by page (tiles only split the work)."""
        nblocks = total // (tiles * npages)
        pages = self.mem[pages_at:].view(np.uint64)
        blocks = self.mem[blocks_at:].view(np.uint64)
        for z in range(first_block, first_block + nblocks):
            row, image = int(blocks[2 * z]), int(blocks[2 * z + 1])
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
        heads = {s: 0 for s in self.streams}
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
            elif op[0] == "copy":
                for d, src, n in op[1]:
                    self.mem[d : d + n] = self.mem[src : src + n]
            elif op[0] == "kernel":
                self._kernel(*op[1])
        assert all(heads[s] == len(ops) for s, ops in self.streams.items()), "a wait never became ready"


def _setup(seed: int, to_host: bool, slot_blocks: int) -> tuple[StagedCopy, SimDriver, HostLayout, Any]:
    """Three page tensors of 16-row blocks (pages of 1 KiB, 512 B and 1.5 KiB: 3 KiB a
    block, a whole number of 512-byte chunk units, so neighbouring chunks merge)."""
    mem = np.random.default_rng(seed).integers(1, 256, SPACE, dtype=np.uint8)
    drv = SimDriver(mem)
    rows = 16
    tensors = [torch.empty((rows, n), dtype=torch.uint8) for n in (1024, 512, 1536)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=0)
    layout = HostLayout.build(kv, 1)
    device_base = DEVICE_AT + np.arange(3, dtype=np.int64) * (64 << 10)
    ctx = SimpleNamespace(
        driver=drv, device=None, to_host=to_host, streams=1, submit_threads=0, layout=layout,
        staging_bytes=2 * slot_blocks * layout.block_bytes[0], device_base=device_base,
        host_base=HOST_AT,
    )
    strategy = StagedCopy(ctx)  # type: ignore[arg-type]
    assert strategy.shape is not None, "the layout should plan by block"
    strategy.staging = SimpleNamespace(data_ptr=lambda: STAGING_AT)  # type: ignore[assignment]
    tables = {"at": TABLES_AT}

    def upload(pages: np.ndarray, blocks: np.ndarray, stream: int) -> tuple[int, int]:
        """Fresh table space per job, written at once (the real upload's reuse is its own)."""
        at = tables["at"]
        for arr in (pages, blocks):
            raw = np.ascontiguousarray(arr, dtype=np.uint64).view(np.uint8).reshape(-1)
            mem[tables["at"] : tables["at"] + raw.size] = raw
            tables["at"] += raw.size
        return at, at + pages.size * 8

    strategy.kernel.upload = upload  # type: ignore[method-assign]
    return strategy, drv, layout, device_base


def _prepared(strategy: StagedCopy, layout: HostLayout, blocks: np.ndarray, chunks: np.ndarray,
              to_host: bool) -> Any:
    mapping = map_blocks(blocks, chunks, layout=layout, num_chunks=24, unique_host=to_host,
                         unique_gpu=not to_host)
    return strategy.prepare(plan_copies(mapping, layout))


def _expected(mem: np.ndarray, layout: HostLayout, device_base: np.ndarray,
              jobs: list[tuple[np.ndarray, np.ndarray]], to_host: bool) -> np.ndarray:
    want = mem.copy()
    for blocks, chunks in jobs:
        for b, c in zip(blocks.tolist(), chunks.tolist()):
            for t, size, off in zip(layout.tensor_idx[0], layout.page_sizes[0], layout.page_offsets[0]):
                dev = int(device_base[t]) + b * layout.row_strides[t]
                host = HOST_AT + c * layout.chunk_bytes + off
                dst, src = (host, dev) if to_host else (dev, host)
                want[dst : dst + size] = want[src : src + size]
    return want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("to_host", [True, False])
def test_jobs_sharing_the_ring_move_their_bytes_in_any_valid_order(seed: int, to_host: bool) -> None:
    rng = np.random.default_rng(100 + seed)
    strategy, drv, layout, device_base = _setup(seed, to_host, slot_blocks=int(rng.integers(1, 4)))
    # Three jobs, each to distinct chunks and from distinct blocks, some chunks neighbours
    # listed in descending order: several slices each, so slots wrap within and across jobs.
    run = np.arange(10, 4, -1)
    others = rng.permutation(np.setdiff1d(np.arange(24), run))
    blocks, chunks = rng.permutation(16), np.concatenate([run, others])
    jobs = [(blocks[5 * j : 5 * j + 5], chunks[5 * j : 5 * j + 5]) for j in range(3)]
    for b, c in jobs:
        prepared = _prepared(strategy, layout, b, c, to_host)
        assert isinstance(prepared, StagedJob) and prepared.slices >= 2
        start, stop = drv.create_event(), drv.create_event()
        strategy.enqueue(prepared, None, start, stop)
    assert strategy.staged_jobs == 3
    before = drv.mem.copy()
    want = _expected(before, layout, device_base, jobs, to_host)
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem[:STAGING_AT], want[:STAGING_AT])  # device and host memory


def _pages(layout: HostLayout, device_base: np.ndarray, blocks: np.ndarray) -> list[tuple[int, int]]:
    """(address, bytes) of every device page of ``blocks``."""
    return [(int(device_base[t]) + b * layout.row_strides[t], size)
            for b in blocks.tolist() for t, size in zip(layout.tensor_idx[0], layout.page_sizes[0])]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("to_host", [True, False])
def test_a_job_waits_for_the_dependency_it_was_given(seed: int, to_host: bool) -> None:
    """Compute still writing a store's source, or still reading a load's destination, when
    the job is enqueued: the job must see the write, and must not overwrite before the read."""
    rng = np.random.default_rng(200 + seed)
    strategy, drv, layout, device_base = _setup(seed, to_host, slot_blocks=2)
    blocks, chunks = rng.permutation(16)[:6], rng.permutation(24)[:6]
    compute = drv.create_stream()
    scratch = SPACE - (1 << 20)
    pending = []
    for i, (addr, n) in enumerate(_pages(layout, device_base, blocks)):
        # store: fresh bytes from elsewhere into the source; load: the old destination out
        fresh = scratch + 4096 * i
        pending.append((addr, fresh, n) if to_host else (fresh, addr, n))
    ops = np.array(pending, dtype=np.uint64)
    drv.memcpy_batch(ops[:, 0], ops[:, 1], ops[:, 2], compute)
    written = drv.create_event()
    drv.record(written, compute)
    prepared = _prepared(strategy, layout, blocks, chunks, to_host)
    strategy.enqueue(prepared, written, drv.create_event(), drv.create_event())
    before = drv.mem.copy()
    want = before.copy()
    for d, s, n in pending:  # the compute first, then the job
        want[d : d + n] = want[s : s + n]
    want = _expected(want, layout, device_base, [(blocks, chunks)], to_host)
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem[:STAGING_AT], want[:STAGING_AT])
        assert np.array_equal(drv.mem[scratch:], want[scratch:])  # what the compute read
