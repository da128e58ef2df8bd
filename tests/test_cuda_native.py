"""The native helper's one call per job (``_native.Table.enqueue``, through
``program.Recorder``) against a table of fake driver calls, no GPU: exactly which calls a
program makes, in what order and with what arguments; that the copy strategies make the
same calls on the native path as on the Python one; that a failing call stops the job,
joins what it enqueued into the main stream and raises the same typed errors as the
Python path; that bad input raises ``InvalidSpec`` with no call made; and that the call
holds the GIL throughout."""

from __future__ import annotations

import sys
import threading
from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from aiokv.backends.cuda import native
from aiokv.backends.cuda.dma import DmaCopy
from aiokv.backends.cuda.program import (
    OP_BATCH,
    OP_COPY,
    OP_LAUNCH,
    OP_PITCHED,
    OP_RECORD,
    OP_WAIT,
    Program,
    Recorder,
)
from aiokv.backends.cuda.staged import StagedCopy
from aiokv.backends.cuda.strategy import CopyContext
from aiokv.errors import CudaCallFailed, InvalidSpec, WorkerBroken
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import HostLayout, map_blocks, plan_copies

from .native_fakes import ATTRS, FakeTable
from .sim_device import SimDriver

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

MAIN, SIDE, RESCUE = 0x100, 0x200, 0x300
U64 = np.uint64
FOREIGN = np.dtype(U64).newbyteorder()  # 8-byte integers in the other byte order


def run(fake: FakeTable, program: Program, hold_gil: bool = True) -> tuple[int, int]:
    return fake.table.enqueue(array("Q", program.words), tuple(program.buffers), MAIN, RESCUE, hold_gil)


def test_each_row_makes_its_driver_call_with_its_arguments() -> None:
    fake = FakeTable()
    dst, src = np.array([10, 20, 30], dtype=U64), np.array([11, 21, 31], dtype=U64)
    sizes = np.array([4, 5, 6], dtype=np.int64)
    pitched = np.arange(28, dtype=U64).reshape(2, 14)
    blob = bytes(range(64))
    offsets = np.array([0, 8, 16, 24, 28, 32, 36, 40, 44], dtype=U64)
    p = Program()
    p.wait(SIDE, 0xE1)
    p.record(0xE2, SIDE)
    p.batch(dst, src, sizes, SIDE, flags=3, count=2, first=1)
    p.copy(0xD0, 0xD1, 4096, MAIN)
    p.pitched(pitched, SIDE)
    p.launch(0xF0, 7, 256, MAIN, blob, offsets)
    assert run(fake, p) == (6, 0)
    (w, r, b, c, pt, la) = fake.calls
    assert w == ("cuStreamWaitEvent", SIDE, 0xE1, 0)
    assert r == ("cuEventRecord", 0xE2, SIDE)
    assert b == ("cuMemcpyBatchAsync", [(20, 21, 5), (30, 31, 6)], ATTRS[3], [0], SIDE)
    assert c == ("cuMemcpyAsync", 0xD0, 0xD1, 4096, MAIN)
    assert pt == ("cuMemcpy3DBatchAsync", pitched.tolist(), 0, SIDE)
    name, function, grid, block, stream, extra, params = la
    assert (name, function, grid, block, stream, extra) == (
        "cuLaunchKernel", 0xF0, (7, 1, 1), (256, 1, 1), MAIN, 0)
    base = params[0]
    assert [a - base for a in params] == offsets.tolist()  # each parameter inside one copy of the blob


def test_without_a_batched_call_the_table_copies_one_descriptor_at_a_time() -> None:
    fake = FakeTable(missing=("cuMemcpyBatchAsync",))
    p = Program()
    p.batch(np.array([1, 2], dtype=U64), np.array([3, 4], dtype=U64), np.array([5, 6], dtype=U64), SIDE, 1, 2)
    assert run(fake, p) == (1, 0)
    assert fake.calls == [("cuMemcpyAsync", 1, 3, 5, SIDE), ("cuMemcpyAsync", 2, 4, 6, SIDE)]


# -- the strategies make the same calls on both paths -----------------------------------------


def _staged_setup(drv: Any, to_host: bool, slot_blocks: int) -> tuple[StagedCopy, Any]:
    tensors = [torch.empty((16, n), dtype=torch.uint8) for n in (1024, 512, 1536)]
    layout = HostLayout.build(CanonicalKVCaches.from_tensors(tensors, block_dim=0), 1)
    ctx = SimpleNamespace(
        driver=drv, device=None, to_host=to_host, streams=4, submit_threads=0, layout=layout,
        staging_bytes=2 * slot_blocks * layout.block_bytes[0],
        device_base=(1 << 20) + np.arange(3, dtype=np.int64) * (64 << 10), host_base=8 << 20,
    )
    ctx.pointers = lambda plan: CopyContext.pointers(ctx, plan)  # type: ignore[arg-type]
    strategy = StagedCopy(ctx)  # type: ignore[arg-type]
    strategy.staging = SimpleNamespace(data_ptr=lambda: 16 << 20)  # type: ignore[assignment]
    copied = drv.create_event()
    at = [24 << 20]

    def upload(pages: np.ndarray, stream: int, keep: bool = False) -> int:
        """As ``PieceKernel.upload`` does, through the strategy's driver: a copy of the
        table from a pinned spot, then a record."""
        nbytes = pages.size * 8
        at[0] += nbytes
        strategy.kernel.driver.memcpy(at[0], at[0] + (4 << 20), nbytes, stream)
        strategy.kernel.driver.record(copied, stream)
        return at[0]

    strategy.kernel.upload = upload  # type: ignore[method-assign]
    return strategy, layout


def _plan(layout: HostLayout, blocks: np.ndarray, chunks: np.ndarray, to_host: bool) -> Any:
    return plan_copies(map_blocks(blocks, chunks, layout=layout, num_chunks=24, unique_host=to_host,
                                  unique_gpu=not to_host), layout)


def _queues(native_path: bool, make: Any, jobs: Any) -> dict[int, list[Any]]:
    """Run ``jobs(strategy, driver)`` on a fresh simulated device; its streams' queues."""
    sim = SimDriver(np.zeros(32 << 20, dtype=np.uint8))
    drv: Any = sim
    if native_path:
        fake = FakeTable(target=sim)
        drv = fake.recorder(sim, 0, 0)
    strategy = make(drv)
    rescue = sim.create_event()  # on both paths, so that handles number alike
    if native_path:
        drv.bind(strategy.main_stream, rescue)
        plain = strategy.enqueue

        def enqueue(*args: Any, **kwargs: Any) -> None:
            drv.open()
            plain(*args, **kwargs)
            drv.commit()

        strategy.enqueue = enqueue
    jobs(strategy, sim)
    if native_path:
        assert drv.calls == 3, "one native call per job"
    return sim.streams


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("blocks_per_job", [3, 7])
def test_staged_jobs_make_the_same_calls_on_both_paths(to_host: bool, blocks_per_job: int) -> None:
    """Every stream's queue (records with their counts, waits on which record, copies,
    kernel launches with their parameters and rows) is the same on both paths."""
    rng = np.random.default_rng(blocks_per_job)
    specs = [(rng.permutation(16)[:blocks_per_job], rng.permutation(24)[:blocks_per_job]) for _ in range(3)]

    def make(drv: Any) -> StagedCopy:
        strategy, layout = _staged_setup(drv, to_host, slot_blocks=2)
        strategy.plan_layout = layout  # type: ignore[attr-defined]
        return strategy

    def jobs(strategy: Any, sim: SimDriver) -> None:
        dep = sim.create_event()
        for i, (blocks, chunks) in enumerate(specs):
            prepared = strategy.prepare(_plan(strategy.plan_layout, blocks, chunks, to_host))
            strategy.enqueue(prepared, dep if i == 1 else None, sim.create_event(), sim.create_event())

    assert _queues(True, make, jobs) == _queues(False, make, jobs)


@pytest.mark.parametrize("streams", [1, 4])
def test_dma_jobs_make_the_same_calls_on_both_paths(streams: int) -> None:
    pieces, size = 512, 32 << 10

    def make(drv: Any) -> DmaCopy:
        ctx = SimpleNamespace(driver=drv, to_host=True, streams=streams, submit_threads=0, runs=())
        return DmaCopy(ctx)  # type: ignore[arg-type]

    def jobs(strategy: Any, sim: SimDriver) -> None:
        rng = np.random.default_rng(streams)
        for j in range(3):
            src = (1 << 20) + rng.permutation(pieces).astype(U64) * size
            dst = (20 << 20) + np.arange(pieces, dtype=U64) * size
            batch = strategy.dma.split(dst, src, np.full(pieces, size, dtype=U64), min_descriptors=64)
            assert len(batch.bounds) - 1 == streams
            strategy.enqueue(batch, sim.create_event() if j else None, sim.create_event(), sim.create_event())

    assert _queues(True, make, jobs) == _queues(False, make, jobs)


# -- failures ---------------------------------------------------------------------------------


def _three_stream_program() -> Program:
    p = Program()
    p.wait(MAIN, 0xE0)
    p.record(0xE1, MAIN)
    p.wait(SIDE, 0xE1)
    p.copy(0xD0, 0xD1, 64, SIDE)
    p.wait(0x400, 0xE1)
    p.copy(0xD2, 0xD3, 64, 0x400)
    p.record(0xE2, MAIN)
    return p


@pytest.mark.parametrize(("code", "raised"), [(2, CudaCallFailed), (1, InvalidSpec), (700, WorkerBroken)])
def test_a_failing_call_stops_the_job_joins_its_streams_and_raises_the_typed_error(
        code: int, raised: type) -> None:
    """The second copy fails: nothing after it is called, both side streams the job used
    (the failing one too) are joined into main through the rescue event, and the code
    becomes the error the Python path raises (a sticky one marks the backend broken)."""
    fake = FakeTable()
    fake.fail["cuMemcpyAsync"] = (2, code)
    broken: list[BaseException] = []

    def fail(c: int, what: str) -> Exception:
        from aiokv.backends.cuda.driver import translate
        err = translate(c, what)
        if isinstance(err, WorkerBroken):
            broken.append(err)
        return err

    rec = Recorder(SimpleNamespace(), fake.table, MAIN, RESCUE, fail)
    program = rec.open()
    program.words[:] = _three_stream_program().words
    with pytest.raises(raised) as info:
        rec.commit()
    assert rec.ran and "cuMemcpyAsync" in str(info.value.__cause__)
    assert fake.calls[6:] == [("cuEventRecord", RESCUE, SIDE), ("cuStreamWaitEvent", MAIN, RESCUE, 0),
                              ("cuEventRecord", RESCUE, 0x400), ("cuStreamWaitEvent", MAIN, RESCUE, 0)]
    assert [c[0] for c in fake.calls[:6]] == ["cuStreamWaitEvent", "cuEventRecord", "cuStreamWaitEvent",
                                               "cuMemcpyAsync", "cuStreamWaitEvent", "cuMemcpyAsync"]
    assert bool(broken) is (raised is WorkerBroken)


@pytest.mark.parametrize("failing", ["cuStreamWaitEvent", "cuEventRecord", "cuMemcpyBatchAsync",
                                     "cuMemcpy3DBatchAsync", "cuLaunchKernel"])
def test_every_call_kind_reports_its_failure_by_name(failing: str) -> None:
    fake = FakeTable()
    fake.fail[failing] = (1, 2)
    p = Program()
    one = np.ones(1, dtype=U64)
    p.wait(SIDE, 0xE0)
    p.record(0xE1, SIDE)
    p.batch(one, one, one, SIDE, 1, 1)
    p.pitched(np.ones((1, 14), dtype=U64), SIDE)
    p.launch(0xF0, 1, 32, SIDE, b"\0" * 16, np.zeros(1, dtype=U64))
    rec = fake.recorder(SimpleNamespace(), MAIN, RESCUE)
    rec.open().words[:] = p.words
    rec.program.buffers[:] = p.buffers  # type: ignore[union-attr]
    with pytest.raises(CudaCallFailed, match=failing):
        rec.commit()


def test_a_missing_pitched_call_fails_as_not_supported() -> None:
    fake = FakeTable(missing=("cuMemcpy3DBatchAsync",))
    p = Program()
    p.pitched(np.ones((1, 14), dtype=U64), SIDE)
    assert run(fake, p) == (0, 801)


def test_abort_enqueues_what_was_recorded_and_joins_it_into_main() -> None:
    fake = FakeTable()
    rec = fake.recorder(SimpleNamespace(), MAIN, RESCUE)
    rec.open()
    rec.memcpy(0xD0, 0xD1, 64, SIDE)
    rec.record(0xE0, MAIN)
    rec.abort()
    assert rec.ran and rec.program is None
    assert fake.calls == [("cuMemcpyAsync", 0xD0, 0xD1, 64, SIDE), ("cuEventRecord", 0xE0, MAIN),
                          ("cuEventRecord", RESCUE, SIDE), ("cuStreamWaitEvent", MAIN, RESCUE, 0)]


# -- bad input --------------------------------------------------------------------------------


ONE = np.ones(4, dtype=U64)


@pytest.mark.parametrize(("words", "buffers", "match"), [
    ([99, 0, 0, 0, 0, 0, 0, 0], (), "unknown opcode"),
    ([OP_WAIT, MAIN, 0, 0, 0, 0, 0, 0], (), "null event"),
    ([OP_RECORD, 0, MAIN, 0, 0, 0, 0, 0], (), "null event"),
    ([OP_BATCH, MAIN, 0, 0, 5, 2, 1, 0], (ONE,), "not one of"),
    ([OP_BATCH, MAIN, 0, 0, 0, 5, 1, 0], (ONE,), "holds 4 values"),
    ([OP_BATCH, MAIN, 0, 0, 0, 3, 1, 2], (ONE,), "holds 4 values"),
    ([OP_BATCH, MAIN, 0, 0, 0, 0, 1, 0], (ONE,), "no copies"),
    ([OP_BATCH, MAIN, 0, 0, 0, 1, 7, 0], (ONE,), "flags"),
    ([OP_BATCH, MAIN, 0, 0, 0, 1, 1, 0], (np.ones(4, dtype=np.float64),), "8-byte integers"),
    ([OP_BATCH, MAIN, 0, 0, 0, 1, 1, 0], (np.ones(4, dtype=np.int32),), "8-byte integers"),
    ([OP_BATCH, MAIN, 0, 0, 0, 1, 1, 0], (np.ones(8, dtype=U64)[::2],), "contiguous"),
    ([OP_BATCH, MAIN, 0, 0, 0, 1, 1, 0], (np.ones(4, dtype=U64).astype(FOREIGN),), "8-byte integers"),
    ([OP_COPY, MAIN, 0, 1, 64, 0, 0, 0], (), "destination"),
    ([OP_COPY, MAIN, 1, 1, 0, 0, 0, 0], (), "size"),
    ([OP_PITCHED, MAIN, 0, 1, 0, 0, 0, 0], (ONE,), "holds 4 values"),
    ([OP_LAUNCH, MAIN, 0, 1, 32, 0, 1, 1], (b"x" * 8, ONE), "null function"),
    ([OP_LAUNCH, MAIN, 0xF0, 0, 32, 0, 1, 1], (b"x" * 8, ONE), "not a launch"),
    ([OP_LAUNCH, MAIN, 0xF0, 1, 2048, 0, 1, 1], (b"x" * 8, ONE), "not a launch"),
    ([OP_LAUNCH, MAIN, 0xF0, 1, 32, 0, 1, 0], (b"x" * 8, ONE), "parameters"),
    ([OP_LAUNCH, MAIN, 0xF0, 1, 32, 0, 1, 1], (b"x", ONE), "past the"),
    ([OP_LAUNCH, MAIN, 0xF0, 1, 32, 3, 1, 1], (b"x" * 8, ONE), "not one of"),
])
def test_bad_rows_raise_invalid_spec_and_call_nothing(words: list[int], buffers: tuple[Any, ...],
                                                      match: str) -> None:
    """A good row first: checking happens before the first call, so even it is not made."""
    fake = FakeTable()
    good = [OP_RECORD, 0xE0, MAIN, 0, 0, 0, 0, 0]
    with pytest.raises(InvalidSpec, match=match):
        fake.table.enqueue(array("Q", good + words), buffers, MAIN, RESCUE)
    assert fake.calls == []


@pytest.mark.parametrize(("ops", "match"), [
    (np.zeros(8, dtype=np.float64), "8-byte integers"),
    (array("Q", [OP_RECORD, 1, 1]), "rows of 8"),
    (np.zeros((2, 8), dtype=np.int32), "8-byte integers"),
])
def test_malformed_programs_raise_invalid_spec(ops: Any, match: str) -> None:
    fake = FakeTable()
    with pytest.raises(InvalidSpec, match=match):
        fake.table.enqueue(ops, (), MAIN, RESCUE)
    with pytest.raises(TypeError):
        fake.table.enqueue(array("Q"), [ONE], MAIN, RESCUE)  # buffers must be a tuple
    with pytest.raises(InvalidSpec, match="rescue"):
        fake.table.enqueue(array("Q"), (), MAIN, 0)
    assert fake.calls == []


def test_a_row_needing_an_entry_point_the_table_lacks_raises_before_any_call() -> None:
    fake = FakeTable(missing=("cuLaunchKernel",))
    p = Program()
    p.record(0xE0, MAIN)
    p.launch(0xF0, 1, 32, MAIN, b"x" * 8, np.zeros(1, dtype=U64))
    with pytest.raises(InvalidSpec, match="no cuLaunchKernel"):
        run(fake, p)
    assert fake.calls == []


@pytest.mark.parametrize(("procs", "attrs", "match"), [
    ((1, 2), ATTRS, "10 addresses"), ((0,) * 10, (1,), "4 addresses"), (("x",) * 10, ATTRS, "integer"),
])
def test_a_table_of_the_wrong_shape_is_refused(procs: Any, attrs: Any, match: str) -> None:
    with pytest.raises((InvalidSpec, TypeError), match=match):
        native.helper().Table(procs, 13000, attrs, 0)


def test_a_recorded_launch_needs_its_packed_parameters() -> None:
    rec = FakeTable().recorder(SimpleNamespace(), MAIN, RESCUE)
    rec.open()
    with pytest.raises(InvalidSpec, match="packed"):
        rec.launch(0xF0, (1, 1, 1), 32, MAIN, None)
    with pytest.raises(InvalidSpec, match="1-D grid"):
        rec.launch(0xF0, (1, 2, 1), 32, MAIN, None, packed=(b"x", np.zeros(1, dtype=U64)))


def test_outside_a_program_the_recorder_is_the_driver() -> None:
    calls: list[Any] = []
    drv = SimpleNamespace(record=lambda e, s: calls.append(("record", e, s)), broken=None)
    rec = FakeTable().recorder(drv, MAIN, RESCUE)
    rec.record(0xE0, MAIN)
    assert calls == [("record", 0xE0, MAIN)] and rec.broken is None


# -- the GIL ----------------------------------------------------------------------------------


def test_the_call_holds_the_gil_through_every_driver_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure-Python thread counts while the job's 60 driver calls run: with the switch
    interval far longer than the call, it can only run if the call lets the GIL go, and
    every call sees the same count."""
    seen: list[int] = []
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    fake = FakeTable(extra={"cuEventRecord": lambda e, s: seen.append(count[0]) or 0})
    p = Program()
    for i in range(60):
        p.record(0xE0 + i, MAIN)
    monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)
    old = sys.getswitchinterval()
    busy = threading.Thread(target=spin, daemon=True)
    sys.setswitchinterval(0.5)
    try:
        busy.start()
        while count[0] == 0:  # the busy thread has run: it wants the GIL from now on
            threading.Event().wait(0.001)
        assert run(fake, p, hold_gil=True) == (60, 0)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        busy.join()
    assert len(seen) == 60 and len(set(seen)) == 1, "another thread ran during the call"


def test_releasing_the_gil_once_still_runs_every_call() -> None:
    fake = FakeTable()
    p = Program()
    for i in range(5):
        p.record(0xE0 + i, MAIN)
    assert run(fake, p, hold_gil=False) == (5, 0)
    assert len(fake.calls) == 5
