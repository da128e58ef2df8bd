"""The native planner (``_native.Planner``) against the Python plan, no GPU: on random
layouts, jobs, strategies and directions, a lane that plans in C from the ids makes exactly
the driver calls, in the same order and with the same arguments (copy tables and kernel
parameters read as the driver reads them), as a lane that plans and records the same jobs in
Python; jobs it does not cover, and bad input, go to the Python plan, which raises what it
always raised; and the dependency is recorded on the caller's stream at submit, before
anything is queued."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokv.backends.cuda import dma, native, planner, staged
from aiokv.backends.cuda.lane import CudaLane, Dependency
from aiokv.errors import InvalidSpec
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import HostLayout, IdPlan
from aiokv.specs import Direction

from .native_fakes import FakeTable, release_while_caller_in_driver, until
from .sim_device import launch_values

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

HOST = 0x40000000  # the pool's device address
RING = 0x50000000  # the staging ring's


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Thresholds small enough that jobs of a few blocks split over streams and go staged."""
    for module in (dma, planner):
        monkeypatch.setattr(module, "MIN_SLICE_BYTES", 1024)
    for module in (dma, planner, staged):
        monkeypatch.setattr(module, "MIN_SLICE_DESCRIPTORS", 2)
    for module in (planner, staged):
        monkeypatch.setattr(module, "MIN_STAGED_PIECES", 8)
        monkeypatch.setattr(module, "DIRECT_PIECE_BYTES", 4096)
    yield


def logging_table() -> FakeTable:
    """A fake table whose launches log the kernel's parameter values (not their addresses,
    which differ between the two paths' copies of them)."""
    fake: FakeTable

    def launch(function: int | None, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
               stream: int | None, params: int | None, extra: int | None) -> int:
        values = launch_values((ctypes.c_void_p * 9).from_address(params or 0))
        return fake._log("cuLaunchKernel", function or 0, (gx, gy, gz), bx, stream or 0, values)

    fake = FakeTable(extra={"cuLaunchKernel": launch})
    return fake


def make_lane(kv: CanonicalKVCaches, layout: HostLayout, strategy: str, to_host: bool, streams: int,
              staging: int, chunks: int, in_c: bool) -> tuple[CudaLane, FakeTable]:
    from aiokv.bench.hostside import NoopCudaBackend

    backend = NoopCudaBackend(kv, {"native": True, "strategy": strategy, "staging_bytes": staging,
                                   "streams_per_direction": streams})
    fake = logging_table()
    backend.native_table = fake.table
    backend.fake = fake  # type: ignore[attr-defined]  # the table holds only its callbacks' addresses
    pool = SimpleNamespace(tensor=torch.empty(chunks * layout.chunk_bytes, dtype=torch.uint8),
                           device_ptr=HOST)
    direction = Direction.STORE if to_host else Direction.LOAD
    lane: Any = backend.open_lane(direction, kv, layout, pool)  # type: ignore[arg-type]
    if isinstance(lane._strategy, staged.StagedCopy):
        lane._strategy.staging = SimpleNamespace(data_ptr=lambda: RING)
    if not in_c:
        if lane.planner is not None and isinstance(lane._strategy, staged.StagedCopy):
            lane._strategy.planner = None
        lane.planner = None
    return lane, fake


def caches(page_sizes: list[int], blocks: int) -> tuple[CanonicalKVCaches, HostLayout]:
    """K and V page tensors per "layer", pages of the given bytes."""
    tensors = [torch.empty(2, blocks, size, dtype=torch.uint8) for size in page_sizes]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    return kv, HostLayout.build(kv, 1)


def run_jobs(lane: CudaLane, fake: FakeTable, layout: HostLayout, chunks: int, to_host: bool,
             jobs: list[tuple[list[int], list[int], int]]) -> list[list[tuple[Any, ...]]]:
    """Each job's driver calls (its dependency: an event, recorded already, or none)."""
    out = []
    for blocks, chunk_ids, dep in jobs:
        plan = IdPlan(np.array(blocks, dtype=np.int64), list(chunk_ids), len(blocks), layout, chunks,
                      not to_host, to_host)
        before = len(fake.calls)
        c = lane.launch(plan, Dependency(dep) if dep else None)
        assert c.wait(10) and c.error is None
        out.append(fake.calls[before:])
    lane.close()
    return out


def job_lists(draw: Any, nblocks: int, chunks: int, to_host: bool) -> list[tuple[list[int], list[int], int]]:
    jobs = []
    for j in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, min(12, nblocks, chunks)))
        blocks = draw(st.permutations(range(nblocks)))[:n]
        if draw(st.booleans()):  # neighbouring chunks, in either order: runs merge
            first = draw(st.integers(0, chunks - n))
            chunk_ids = list(range(first, first + n))
            if draw(st.booleans()):
                chunk_ids.reverse()
        else:
            chunk_ids = draw(st.permutations(range(chunks)))[:n]
        if not to_host and draw(st.booleans()):  # a load may read a chunk twice
            chunk_ids = [chunk_ids[0]] + chunk_ids[1:-1] + [chunk_ids[0]] if n > 1 else chunk_ids
        jobs.append((blocks, chunk_ids, draw(st.sampled_from([0, 0xD0 + j]))))
    return jobs


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    aligned = draw(st.booleans())
    unit = 16 if aligned else 8
    page_sizes = [unit * draw(st.integers(1, 24)) for _ in range(draw(st.integers(1, 3)))]
    to_host = draw(st.booleans())
    nblocks, chunks = draw(st.integers(4, 24)), draw(st.integers(4, 24))
    return {
        "page_sizes": page_sizes, "to_host": to_host, "nblocks": nblocks, "chunks": chunks,
        "strategy": draw(st.sampled_from(["dma", "auto", "staged"])),
        "streams": draw(st.integers(1, 4)),
        "staging": 1024 * draw(st.integers(1, 8)),
        "jobs": job_lists(draw, nblocks, chunks, to_host),
    }


def both_paths(case: dict[str, Any]) -> tuple[list[Any], list[Any], CudaLane]:
    """The case's jobs' calls on a lane planning in C and on one planning in Python."""
    kv, layout = caches(case["page_sizes"], case["nblocks"])
    args = (kv, layout, case["strategy"], case["to_host"], case["streams"], case["staging"], case["chunks"])
    c_lane, c_fake = make_lane(*args, in_c=True)
    py_lane, py_fake = make_lane(*args, in_c=False)
    assert c_lane.planner is not None and py_lane.planner is None
    in_c = run_jobs(c_lane, c_fake, layout, case["chunks"], case["to_host"], case["jobs"])
    in_py = run_jobs(py_lane, py_fake, layout, case["chunks"], case["to_host"], case["jobs"])
    return in_c, in_py, c_lane


@pytest.mark.usefixtures("small_slices")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(cases())
def test_the_c_plan_makes_the_calls_the_python_plan_makes(case: dict[str, Any]) -> None:
    in_c, in_py, _ = both_paths(case)
    assert in_c == in_py


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize(("staging", "blocks"), [(2048, 3), (4096, 9), (1 << 16, 40)])
@pytest.mark.parametrize("ctas", [None, 3])
def test_jobs_through_the_ring_make_the_same_calls_on_both_paths(to_host: bool, staging: int, blocks: int,
                                                                 ctas: int | None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the staging ring, one slice or several (and launches of more than 256 blocks
    where a slot holds them), neighbouring chunks merged into runs or not, with and without
    a dependency, one CTA per tile or fewer (``pieces.MAX_CTAS``): after the ring's first
    job (set up in Python) the C plan takes them all."""
    from aiokv.backends.cuda import pieces

    monkeypatch.setattr(pieces, "MAX_CTAS", ctas)
    rng = np.random.default_rng(blocks)
    jobs = []
    for j in range(5):
        chunk_ids = rng.permutation(300)[:blocks].tolist() if j % 2 else list(range(20 + blocks, 20, -1))
        jobs.append((rng.permutation(300)[:blocks].tolist(), chunk_ids, 0xD0 if j == 2 else 0))
    case = {"page_sizes": [32, 48, 16], "to_host": to_host, "nblocks": 300, "chunks": 300,
            "strategy": "staged", "streams": 2, "staging": staging, "jobs": jobs}
    in_c, in_py, c_lane = both_paths(case)
    assert in_c == in_py
    assert c_lane._strategy.staged_jobs == 5  # type: ignore[attr-defined]
    assert all("cuLaunchKernel" in {c[0] for c in calls} for calls in in_c)


def test_the_c_plan_covers_the_per_layer_jobs() -> None:
    """A per-layer job of 32 KiB pages on the default strategy goes through the ring, and a
    1-block job as one plain copy, both planned in C after the ring's first job."""
    kv, layout = caches([32 << 10] * 2, 64)
    lane, fake = make_lane(kv, layout, "auto", True, 0, 64 << 20, 64, in_c=True)
    rng = np.random.default_rng(3)
    blocks = [rng.permutation(64)[:32].tolist() for _ in range(3)]
    chunks = [rng.permutation(64)[:32].tolist() for _ in range(3)]
    calls = []
    for b, c in zip(blocks, chunks):
        before = len(fake.calls)
        job = lane.launch(IdPlan(b, c, 32, layout, 64, False, True), None)
        assert job.wait(10) and job.error is None
        calls.append([x[0] for x in fake.calls[before:]])
        assert lane.planner.last_staged is (len(calls) > 1)  # the first sets the ring up in Python
    assert calls[1].count("cuLaunchKernel") == 1 and "cuMemcpyBatchAsync" in calls[1]
    assert lane._strategy.staged_jobs == 3 and lane._strategy.next_slot == 1
    before = len(fake.calls)
    job = lane.launch(IdPlan([5], [9], 1, layout, 64, False, True), None)  # 4 pages: 4 copies
    assert job.wait(10)
    assert [x[0] for x in fake.calls[before:]] == ["cuEventRecord", "cuMemcpyBatchAsync", "cuEventRecord"]
    assert len(fake.calls[before + 1][1]) == 4 and lane.planner.last_staged is False
    lane.close()
    one = CanonicalKVCaches.from_tensors([torch.empty(64, 4096, dtype=torch.uint8)])
    lane, fake = make_lane(one, HostLayout.build(one, 1), "auto", True, 0, 64 << 20, 64, in_c=True)
    job = lane.launch(IdPlan([5], [9], 1, HostLayout.build(one, 1), 64, False, True), None)
    assert job.wait(10) and job.error is None
    ticket_ran_here = lane.last_ticket.inline
    assert fake.calls == [("cuEventRecord", job._events is None or 0, lane.stream)][:0] or [
        c[0] for c in fake.calls] == ["cuEventRecord", "cuMemcpyAsync", "cuEventRecord"]
    assert fake.calls[1][1:4] == (HOST + 9 * 4096, lane._strategy.ctx.device_base[0] + 5 * 4096, 4096)
    assert ticket_ran_here, "a 1-block job on an idle lane runs at submit"
    lane.close()


@pytest.mark.parametrize(("blocks", "chunks", "match"), [
    ([0, 99], [0, 1], "GPU block ids must lie in"),
    ([0, 1], [0, 99], "chunk ids must lie in"),
    ([0, -1], [0, 1], "GPU block ids must lie in"),
    ([0, 1], [3, 3], "appears twice"),
    ([0, 1], [0, 1, 2], "chunk ids given but"),
    (np.array([0.5, 1.0]), [0, 1], "integers"),
])
def test_bad_ids_raise_what_the_python_plan_raises_with_nothing_enqueued(blocks: Any, chunks: Any,
                                                                        match: str) -> None:
    kv, layout = caches([256], 16)
    lane, fake = make_lane(kv, layout, "dma", True, 1, 0, 16, in_c=True)
    plan = IdPlan(blocks, chunks, len(blocks), layout, 16, False, True)
    with pytest.raises(InvalidSpec, match=match):
        lane.launch(plan, Dependency(0xD1, stream=0x5))
    assert fake.calls == []
    lane.close()


def test_the_dependency_is_recorded_on_the_callers_stream_before_anything_is_queued() -> None:
    kv, layout = caches([256, 512], 16)
    lane, fake = make_lane(kv, layout, "dma", True, 1, 0, 16, in_c=True)
    assert lane.native is not None
    lane.native.pause()
    dep = Dependency(0xD1, stream=0x5, source=0xE9)  # ``after=`` an event: waited on, then ours
    job = lane.launch(IdPlan([1, 2, 3], [4, 5, 6], 3, layout, 16, False, True), dep)
    assert fake.calls == [("cuStreamWaitEvent", 0x5, 0xE9, 0), ("cuEventRecord", 0xD1, 0x5)]
    assert not dep.pending and not job.query()
    lane.native.resume()
    assert job.wait(10) and job.error is None
    assert fake.calls[2] == ("cuStreamWaitEvent", lane.stream, 0xD1, 0)
    lane.close()


def test_a_failing_dependency_call_raises_its_error_and_queues_nothing() -> None:
    from aiokv.errors import CudaCallFailed

    kv, layout = caches([256], 16)
    lane, fake = make_lane(kv, layout, "dma", True, 1, 0, 16, in_c=True)
    fake.fail["cuEventRecord"] = (1, 2)
    driver: Any = lane._driver
    with pytest.raises(CudaCallFailed, match="cuEventRecord"):
        lane.launch(IdPlan([1], [4], 1, layout, 16, False, True), Dependency(0xD1, stream=0x5))
    assert fake.calls == [("cuEventRecord", 0xD1, 0x5)]
    assert driver._event_pool and 0xD1 in driver._sync_pool  # the job's events went back
    assert lane.native is not None and lane.native.stats()["issued"] == 0
    lane.close()


def test_a_native_submit_never_lets_the_gil_go() -> None:
    """Counted, not inferred: a child process runs CUDA workers whose driver calls are C
    no-ops with a shim in ``LD_PRELOAD`` that counts the submitting thread's GIL releases
    (``PyEval_SaveThread``). The native path's submits, per-layer (staged) and 1-block,
    release it never; the Python path's per-layer submit does (its batched calls through
    ctypes), which shows the count counts."""
    from aiokv.bench.hostside import gil_releases

    counts = gil_releases(reps=10)
    if counts is None:
        pytest.skip("no C compiler here to build the counting shim")
    assert counts["native"] == {"per-layer GIL releases per submit": 0.0,
                                "1-block GIL releases per submit": 0.0}
    assert counts["python"]["per-layer GIL releases per submit"] > 0


def test_a_lane_of_more_dma_streams_than_the_planner_takes_plans_in_python() -> None:
    kv, layout = caches([256], 16)
    lane, fake = make_lane(kv, layout, "dma", True, planner.MAX_STREAMS + 1, 0, 16, in_c=True)
    assert lane.planner is None
    job = lane.launch(IdPlan([1, 2], [3, 4], 2, layout, 16, False, True), None)
    assert job.wait(10) and job.error is None and fake.calls
    lane.close()


def test_a_planner_never_initialised_refuses_jobs_instead_of_crashing() -> None:
    """A ``_native.Planner`` made by ``__new__`` alone (or whose ``__init__`` raised part way)
    has no issuer, pages or scratch: ``submit`` raises, in a child process so that a crash
    fails this test rather than the run."""
    import subprocess
    import sys

    code = ("from aiokv.backends.cuda import native\n"
            "ext = native.helper()\n"
            "p = ext.Planner.__new__(ext.Planner)\n"
            "try:\n"
            "    p.submit([1, 2], [3, 4], 1, 2)\n"
            "except RuntimeError as exc:\n"
            "    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the child died ({out.returncode}): {out.stderr[-500:]}"
    assert out.stdout.startswith("refused:") and "initialised" in out.stdout


def test_a_dependency_on_the_legacy_default_stream_is_recorded_there() -> None:
    """Stream handle 0 is CUDA's legacy default stream, where torch runs by default: the
    caller's pending work there must be waited for like on any other stream (the GPU suite
    caught a store reading its source before a kernel on it had written it)."""
    kv, layout = caches([256, 512], 16)
    lane, fake = make_lane(kv, layout, "dma", True, 1, 0, 16, in_c=True)
    assert lane.native is not None
    lane.native.pause()
    dep = Dependency(0xD1, stream=0)
    job = lane.launch(IdPlan([1, 2, 3], [4, 5, 6], 3, layout, 16, False, True), dep)
    assert fake.calls == [("cuEventRecord", 0xD1, 0)]
    assert not dep.pending
    lane.native.resume()
    assert job.wait(10) and job.error is None
    assert fake.calls[1] == ("cuStreamWaitEvent", lane.stream, 0xD1, 0)
    lane.close()


def test_the_issuer_holds_its_next_call_while_a_caller_records_a_dependency() -> None:
    """The caller's one driver call at submit must not wait behind a run of the issuer's
    (on an H100 it waited 15.9 us p50 against 0.8 us idle): while it is in the driver, the
    issuer thread, mid-program, makes no call; it goes on once the record returns."""
    import threading

    kv, layout = caches([256, 512], 16)
    lane, fake = make_lane(kv, layout, "dma", True, 1, 0, 16, in_c=True)
    batch_go, record_go = threading.Event(), threading.Event()
    fake.hold["cuMemcpyBatchAsync"] = (1, batch_go)
    first = lane.launch(IdPlan([1, 2, 3], [4, 5, 6], 3, layout, 16, False, True), None)
    assert until(lambda: "cuMemcpyBatchAsync" in fake.names()), "the issuer never reached its batch"
    records = fake.names().count("cuEventRecord")
    fake.hold["cuEventRecord"] = (records + 1, record_go)  # the caller's record, next
    helper, seen = release_while_caller_in_driver(lambda: ("cuEventRecord", 0xD1, 0x5) in fake.calls,
                                                  batch_go, record_go, fake.calls)
    helper.start()
    second = lane.launch(IdPlan([7, 8], [9, 10], 2, layout, 16, False, True), Dependency(0xD1, stream=0x5))
    helper.join(10)
    assert first.wait(10) and first.error is None and second.wait(10) and second.error is None
    assert seen and seen[0][-1] == ("cuEventRecord", 0xD1, 0x5), f"the issuer called {seen[0][-2:]} then"
    assert len(fake.calls) > len(seen[0]), "the issuer never went on after the record"
    lane.close()
