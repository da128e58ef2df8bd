"""The copy paths' stream protocols on a simulated device (``sim_device``, no GPU):
``StagedCopy.enqueue`` (the staging ring) and ``MultiStreamDma.issue`` (one job forked
over several DMA streams) drive a fake driver, and the enqueued work then runs in several
adversarial orders that respect only CUDA's waits. Jobs share the ring or the streams, so
slots and streams are reused within and across jobs, and the ring's page table reaches the
device by a queued copy. A missing or misplaced wait shows up as bytes that differ from the
plan, as a kernel that reads its table before it landed, or as a job's end event that
fires before its bytes landed, in some order.

Every test runs on both submit paths: the strategy's driver calls made one by one from
Python, and recorded into one program per job that the native helper runs against fake
driver calls forwarding to the same simulated device (``native_fakes``)."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from aiokv.backends.cuda import dma as dma_module
from aiokv.backends.cuda.dma import MultiStreamDma
from aiokv.backends.cuda.staged import StagedCopy, StagedJob
from aiokv.backends.cuda.strategy import CopyContext
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import HostLayout, map_blocks, plan_copies

from .native_fakes import native_enqueue, submit_paths
from .sim_device import SimDriver

DEVICE_AT, HOST_AT, STAGING_AT, TABLES_AT = 1 << 20, 8 << 20, 16 << 20, 24 << 20
SPACE = 32 << 20
PINNED_TABLES = 4 << 20  # from a table's device spot to the host bytes it is copied from
ORDERS = 8  # random orders each set of jobs runs in


@pytest.fixture(autouse=True, params=submit_paths())
def path(request: pytest.FixtureRequest) -> str:
    """The submit path every test here runs on ("python" or "native")."""
    global PATH
    PATH = request.param
    return PATH


PATH = "python"


def _setup(seed: int, to_host: bool, slot_blocks: int,
           blocks_per_chunk: int = 1) -> tuple[StagedCopy, SimDriver, HostLayout, Any]:
    """Three page tensors of 16-row blocks (pages of 1 KiB, 512 B and 1.5 KiB: 3 KiB a
    block, a whole number of 512-byte chunk units, so neighbouring chunks merge). With
    ``blocks_per_chunk`` > 1 jobs plan piece by piece, each uploading its own table."""
    mem = np.random.default_rng(seed).integers(1, 256, SPACE, dtype=np.uint8)
    drv = SimDriver(mem)
    rows = 16
    tensors = [torch.empty((rows, n), dtype=torch.uint8) for n in (1024, 512, 1536)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=0)
    layout = HostLayout.build(kv, blocks_per_chunk)
    device_base = DEVICE_AT + np.arange(3, dtype=np.int64) * (64 << 10)
    ctx = SimpleNamespace(
        driver=drv, device=None, to_host=to_host, streams=1, submit_threads=0, layout=layout,
        staging_bytes=2 * slot_blocks * layout.block_bytes[0], device_base=device_base,
        host_base=HOST_AT,
    )
    ctx.pointers = lambda plan: CopyContext.pointers(ctx, plan)  # type: ignore[arg-type]
    if PATH == "native":
        ctx.driver = native_enqueue(drv)
    strategy = StagedCopy(ctx)  # type: ignore[arg-type]
    if PATH == "native":
        native_enqueue(drv, strategy, ctx.driver)
    assert (strategy.shape is not None) is (blocks_per_chunk == 1), "by block iff one block a chunk"
    strategy.staging = SimpleNamespace(data_ptr=lambda: STAGING_AT)  # type: ignore[assignment]
    tables = {"at": TABLES_AT}
    uploads: list[bool] = []  # ``keep`` of each upload

    def upload(pages: np.ndarray, stream: int, keep: bool = False) -> int:
        """Fresh table space per upload, filled by a copy queued on ``stream`` from a
        "pinned" spot written now, so a kernel that is not behind it reads garbage (the
        real upload's buffer reuse is its own)."""
        at = tables["at"]
        raw = np.ascontiguousarray(pages, dtype=np.uint64).view(np.uint8).reshape(-1)
        mem[at + PINNED_TABLES : at + PINNED_TABLES + raw.size] = raw
        strategy.kernel.driver.memcpy(at, at + PINNED_TABLES, raw.size, stream)
        tables["at"] += raw.size
        uploads.append(keep)
        return at

    strategy.kernel.upload = upload  # type: ignore[method-assign]
    strategy.kernel.uploads = uploads  # type: ignore[attr-defined]
    return strategy, drv, layout, device_base


def _prepared(strategy: StagedCopy, layout: HostLayout, blocks: np.ndarray, chunks: np.ndarray,
              to_host: bool) -> Any:
    return strategy.prepare(_plan(layout, blocks, chunks, to_host))


def _plan(layout: HostLayout, blocks: np.ndarray, chunks: np.ndarray, to_host: bool) -> Any:
    mapping = map_blocks(blocks, chunks, layout=layout, num_chunks=24, unique_host=to_host,
                         unique_gpu=not to_host)
    return plan_copies(mapping, layout)


def _apply(want: np.ndarray, plan: Any, device_base: np.ndarray, to_host: bool) -> None:
    """What the job's plan copies (``plan_copies`` is checked against a naive loop in
    test_plan), applied to ``want`` in place."""
    for t, d, h, n in zip(plan.tensor_idx.tolist(), plan.device_offset.tolist(),
                          plan.host_offset.tolist(), plan.nbytes.tolist()):
        dev, host = int(device_base[t]) + d, HOST_AT + h
        dst, src = (host, dev) if to_host else (dev, host)
        want[dst : dst + n] = want[src : src + n]


def _destinations(layout: HostLayout, device_base: np.ndarray,
                  jobs: list[tuple[np.ndarray, np.ndarray]], to_host: bool) -> list[tuple[int, int]]:
    """(address, bytes) of every page the jobs write: host chunks for stores, device rows
    for loads."""
    out = []
    for blocks, chunks in jobs:
        for b, c in zip(blocks.tolist(), chunks.tolist()):
            for t, size, off in zip(layout.tensor_idx[0], layout.page_sizes[0], layout.page_offsets[0]):
                dev = int(device_base[t]) + b * layout.row_strides[t]
                out.append((HOST_AT + c * layout.chunk_bytes + off if to_host else dev, size))
    return out


def _landed(drv: SimDriver, want: np.ndarray, spans: list[tuple[int, int]]) -> Any:
    def check() -> None:
        for at, n in spans:
            assert np.array_equal(drv.mem[at : at + n], want[at : at + n]), "end event before the bytes"
    return check


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
    stops = []
    for b, c in jobs:
        prepared = _prepared(strategy, layout, b, c, to_host)
        assert isinstance(prepared, StagedJob) and prepared.slices >= 2
        start, stop = drv.create_event(), drv.create_event()
        strategy.enqueue(prepared, None, start, stop)
        stops.append(stop)
    assert strategy.staged_jobs == 3
    assert strategy.kernel.uploads == [True]  # type: ignore[attr-defined]  # the layout's table, kept, once
    before = drv.mem.copy()
    want = _expected(before, layout, device_base, jobs, to_host)
    for stop, job in zip(stops, jobs):  # a job's end event fires only once its bytes landed
        drv.on_done[stop] = _landed(drv, want, _destinations(layout, device_base, [job], to_host))
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem[:STAGING_AT], want[:STAGING_AT])  # device and host memory


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_jobs_writing_the_same_places_land_in_submission_order(
    seed: int, to_host: bool, blocks_per_chunk: int
) -> None:
    """Three jobs of one direction write the same host chunks (stores, from other blocks)
    or the same device blocks (loads, from other chunks), each over several slices: in
    every order the waits allow, the last job's bytes are what remains, and the jobs' end
    events fire in submission order (a lane completes in order)."""
    rng = np.random.default_rng(400 + seed)
    strategy, drv, layout, device_base = _setup(seed, to_host, slot_blocks=int(rng.integers(1, 3)),
                                                blocks_per_chunk=blocks_per_chunk)
    n = 6
    places = rng.permutation(24 if to_host else 16)[: n // blocks_per_chunk if to_host else n]
    plans, stops = [], []
    for _ in range(3):
        if to_host:
            blocks, chunks = rng.permutation(16)[:n], rng.permutation(places)
        else:
            blocks, chunks = rng.permutation(places), rng.permutation(24)[: n // blocks_per_chunk]
        plan = _plan(layout, blocks, chunks, to_host)
        prepared = strategy.prepare(plan)
        assert isinstance(prepared, StagedJob) and prepared.slices >= 2
        assert (prepared.pages is None) is (blocks_per_chunk == 1)
        start, stop = drv.create_event(), drv.create_event()
        strategy.enqueue(prepared, None, start, stop)
        plans.append(plan)
        stops.append(stop)
    before = drv.mem.copy()
    want = before.copy()
    for plan in plans:
        _apply(want, plan, device_base, to_host)
    for earlier, stop in itertools.pairwise(stops):
        def in_order(earlier: int = earlier) -> None:
            assert drv.done[earlier] >= 1, "a job ended before the one submitted before it"
        drv.on_done[stop] = in_order
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem[:STAGING_AT], want[:STAGING_AT])


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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threads", [0, 2])
def test_a_job_forked_over_dma_streams_ends_after_every_part(seed: int, threads: int) -> None:
    """Jobs cut between 4 streams that fork from and join back into the home stream (with
    the parts issued from a thread pool, or not), each behind compute still writing some of
    its source: every part copies after that write, and each job's end event, recorded on
    the home stream, fires only once all its parts have copied."""
    rng = np.random.default_rng(300 + seed)
    mem = rng.integers(1, 256, 64 << 20, dtype=np.uint8)
    drv = SimDriver(mem)
    if PATH == "native" and threads:
        pytest.skip("a native job goes in one call: no submit threads")
    ctx = SimpleNamespace(driver=native_enqueue(drv) if PATH == "native" else drv, to_host=True,
                          submit_threads=threads)
    home, compute = drv.create_stream(), drv.create_stream()
    fresh = 30 << 20  # where the compute's new bytes come from
    dma = MultiStreamDma(ctx, home, 4)  # type: ignore[arg-type]
    monkeypatch_min = pytest.MonkeyPatch()
    monkeypatch_min.setattr(dma_module, "MIN_THREADED_DESCRIPTORS", 16)
    pieces, size = 64, 128 << 10  # 8 MiB a job: four 2 MiB slices
    order = rng.permutation(pieces * 3).astype(np.uint64)
    jobs, stops = [], []
    try:
        for j in range(3):
            src = (1 << 20) + order[j * pieces : (j + 1) * pieces] * size
            dst = (40 << 20) + np.arange(j * pieces, (j + 1) * pieces, dtype=np.uint64) * size
            sizes = np.full(pieces, size, dtype=np.uint64)
            batch = dma.split(dst, src, sizes)
            assert len(batch.bounds) - 1 == 4
            hit = src[::16]  # one piece in each part of the job
            drv.memcpy_batch(hit, fresh + np.arange(hit.size, dtype=np.uint64) * size + j * (size << 3),
                             np.full(hit.size, size, dtype=np.uint64), compute)
            written, start, stop = drv.create_event(), drv.create_event(), drv.create_event()
            drv.record(written, compute)
            if PATH == "native":
                ctx.driver.bind(home, drv.create_event())
                ctx.driver.open()
            ctx.driver.stream_wait(home, written)  # as DmaCopy.enqueue waits on the dependency
            ctx.driver.record(start, home)
            dma.issue(batch, fork=start)
            ctx.driver.record(stop, home)
            if PATH == "native":
                ctx.driver.commit()
            jobs.append((dst, src, sizes))
            stops.append(stop)
    finally:
        monkeypatch_min.undo()
        dma.close()
    before = mem.copy()
    want = before.copy()
    for op in drv.streams[compute]:  # the compute first, then the jobs
        for d, s_, n in op[1] if op[0] == "copy" else ():
            want[d : d + n] = want[s_ : s_ + n]
    for dst, src, sizes in jobs:
        for d, s_, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            want[d : d + n] = want[s_ : s_ + n]
    for stop, (dst, _, sizes) in zip(stops, jobs):
        drv.on_done[stop] = _landed(drv, want, list(zip(dst.tolist(), sizes.tolist())))
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem, want)


@pytest.mark.parametrize("rows, by_block", [(1 << 32, True), ((1 << 32) + 1, False)])
def test_device_rows_past_32_bits_plan_piece_by_piece(rows: int, by_block: bool) -> None:
    """The kernel takes a launch's device rows as 32-bit values: a layout with more rows
    than that plans its jobs piece by piece (full addresses) instead of by block."""
    strategy, _, layout, _ = _setup(0, True, slot_blocks=1)
    ctx = SimpleNamespace(**vars(strategy.ctx))
    ctx.layout = dataclasses.replace(layout, num_gpu_blocks=(rows,))
    assert (StagedCopy(ctx).shape is not None) is by_block  # type: ignore[arg-type]


@pytest.mark.parametrize("to_host", [True, False])
def test_a_failure_after_the_table_copy_is_queued_ends_behind_it(to_host: bool) -> None:
    """The lane records a failed job's end on the main stream: it must cover a table copy
    already queued on the kernel stream (a store's main stream is the DMA stream). A job
    planned piece by piece uploads its own table as it is enqueued (the layout's table of
    by-block jobs goes up in ``prepare``)."""
    strategy, drv, layout, _ = _setup(0, to_host, slot_blocks=2, blocks_per_chunk=2)
    copied = drv.create_event()

    def upload(pages: np.ndarray, stream: int, keep: bool = False) -> int:
        strategy.kernel.driver.memcpy(TABLES_AT, TABLES_AT + PINNED_TABLES, 64, stream)
        strategy.kernel.driver.record(copied, stream)
        raise RuntimeError("the driver failed after queueing the copy")

    strategy.kernel.upload = upload  # type: ignore[method-assign]
    job = _prepared(strategy, layout, np.arange(6), np.arange(3), to_host)
    assert isinstance(job, StagedJob) and job.pages is not None
    start, stop = drv.create_event(), drv.create_event()
    with pytest.raises(RuntimeError, match="after queueing"):
        strategy.enqueue(job, None, start, stop)
    drv.record(stop, strategy.main_stream)  # what CudaLane._issue does then
    rng = np.random.default_rng(5)
    for _ in range(ORDERS * 4):
        seen: dict[str, int] = {}
        drv.on_done[stop] = lambda seen=seen: seen.setdefault("copied", drv.done[copied])
        drv.run(rng)
        assert seen["copied"] == 1, "the failed job's end fired before its table copy"


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("failing_launch", [2, 3])
def test_a_failure_mid_job_ends_behind_what_every_stream_holds(to_host: bool, failing_launch: int) -> None:
    """A launch that fails on a job's second or third slice leaves the slices before it
    queued on both streams. The lane records the failed job's end on the main stream: it
    fires only once every operation the job queued before the failure has run."""
    strategy, drv, layout, _ = _setup(3, to_host, slot_blocks=1)
    head = _prepared(strategy, layout, np.arange(3), np.arange(3), to_host)
    strategy.enqueue(head, None, drv.create_event(), drv.create_event())  # the ring in use
    job = _prepared(strategy, layout, np.arange(3, 6), np.arange(10, 13), to_host)
    assert job.slices == 3
    launch, calls = strategy.kernel.launch, []

    def failing(*args: Any) -> None:
        calls.append(args)
        if len(calls) == failing_launch:
            raise RuntimeError("the launch failed")
        launch(*args)

    strategy.kernel.launch = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="launch failed"):
        strategy.enqueue(job, None, drv.create_event(), stop := drv.create_event())
    queued = {s: len(ops) for s, ops in drv.streams.items()}
    drv.record(stop, strategy.main_stream)  # what CudaLane._issue does then
    seen: list[bool] = []

    def behind() -> None:
        late = [s for s, n in queued.items() if drv.heads[s] < n]
        assert not late, f"the failed job's end fired before streams {late} ran what it queued"
        seen.append(True)

    drv.on_done[stop] = behind
    rng = np.random.default_rng(6)
    for _ in range(ORDERS * 4):
        drv.run(rng)
    assert len(seen) == ORDERS * 4


@pytest.mark.parametrize("to_host", [True, False])
def test_a_first_job_failing_before_its_table_copy_leaves_no_table_unfilled(to_host: bool) -> None:
    """The first by-block job fails on a driver call before the layout's page table is
    copied to the device (its start record, say an invalid handle): the next job must not
    launch on that table's never-filled spot. On the native path the whole job is recorded
    before any call runs, so the strategy cannot learn from a raise where the calls stop."""
    from aiokv.errors import CudaCallFailed

    strategy, drv, layout, device_base = _setup(7, to_host, slot_blocks=2)
    failed_start = drv.create_event()
    if PATH == "native":
        strategy.ctx.driver.fake.fail["cuEventRecord"] = (2, 2)  # after the ring's join
    else:
        record = drv.record

        def failing(event: int, stream: int) -> None:
            if event == failed_start:
                raise CudaCallFailed("cuEventRecord failed", 2)
            record(event, stream)

        drv.record = failing  # type: ignore[method-assign]
    first = _prepared(strategy, layout, np.arange(5), np.arange(5), to_host)
    with pytest.raises(CudaCallFailed):
        strategy.enqueue(first, None, failed_start, stop := drv.create_event())
    drv.record(stop, strategy.main_stream)  # what CudaLane._issue does then
    blocks, chunks = np.arange(5, 10), np.arange(12, 17)
    job = _prepared(strategy, layout, blocks, chunks, to_host)
    strategy.enqueue(job, None, drv.create_event(), drv.create_event())
    before = drv.mem.copy()
    want = _expected(before, layout, device_base, [(blocks, chunks)], to_host)
    rng = np.random.default_rng(8)
    for _ in range(ORDERS):
        drv.mem[:] = before
        drv.run(rng)
        assert np.array_equal(drv.mem[:STAGING_AT], want[:STAGING_AT])
