"""The sync adapter driven like an engine's step loop (no event loop anywhere)."""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import warnings

import anyio
import numpy as np
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    DuplicateJob,
    GPULoadStoreSpec,
    HostMemoryError,
    InvalidSpec,
    OffloadingWorker,
    SyncOffloadingWorker,
    WorkerClosed,
)
from tests.conftest import make_layers, same_bytes


class EngineSpec:
    """vLLM-like spec: numpy int32 block ids, read by attribute."""

    def __init__(self, ids: list[int]) -> None:
        self.block_ids = np.asarray(ids, dtype=np.int32)
        self.group_sizes = [len(ids)]
        self.block_indices = [0]


def stored_bytes(pages: list[torch.Tensor], block: int) -> torch.Tensor:
    """What a chunk holds once ``block`` was stored into it: every page of the block, in
    device-address order (the host layout's order)."""
    return torch.cat([p[block] for p in sorted(pages, key=lambda p: p.data_ptr())])


def host_chunk(worker: SyncOffloadingWorker, chunk: int) -> torch.Tensor:
    """The bytes of ``chunk`` that hold pages (a chunk may be padded past them)."""
    start = chunk * worker.chunk_bytes
    return worker.host_pool[start : start + sum(t.page_size_bytes for t in worker.kv_caches.tensors)]


def make_sync(num_blocks: int = 64, chunks: int = 64) -> tuple[SyncOffloadingWorker, list[torch.Tensor]]:
    kv = make_layers(num_layers=2, num_blocks=num_blocks, page_shape=(2, 2, 8))
    worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=chunks)
    return worker, [t.tensor for t in kv.kv.tensors]


def test_is_an_offloading_worker() -> None:
    worker, _ = make_sync()
    assert isinstance(worker, OffloadingWorker)
    worker.shutdown()


_BAD_CONSTRUCTIONS: list[tuple[type[Exception], str, dict]] = [
    (InvalidSpec, "exactly one of", {}),
    (InvalidSpec, "exactly one of", {"num_cpu_chunks": 4, "cpu_bytes": 1 << 20}),
    (InvalidSpec, "num_cpu_chunks must be", {"num_cpu_chunks": 0}),
    (InvalidSpec, "num_cpu_chunks must be", {"num_cpu_chunks": 2.5}),
    (InvalidSpec, "cpu_bytes must be", {"cpu_bytes": 1}),
    (InvalidSpec, "blocks_per_chunk", {"num_cpu_chunks": 4, "blocks_per_chunk": 0}),
    (InvalidSpec, "backend", {"num_cpu_chunks": 4, "backend": "tpu"}),
    (InvalidSpec, "strategy", {"num_cpu_chunks": 4, "strategy": "teleport"}),
    (InvalidSpec, "bogus", {"num_cpu_chunks": 4, "options": {"bogus": 1}}),
    (InvalidSpec, "max_in_flight", {"num_cpu_chunks": 4, "options": {"max_in_flight": -1}}),
    (HostMemoryError, "host memory is available", {"cpu_bytes": 1 << 62}),
]


@pytest.mark.parametrize(("error", "message", "kwargs"), _BAD_CONSTRUCTIONS)
def test_both_faces_refuse_the_same_bad_construction_with_the_same_error(
    error: type[Exception], message: str, kwargs: dict
) -> None:
    kv = make_layers(num_blocks=8)
    raised = []
    for face in (AsyncOffloadingWorker, SyncOffloadingWorker):
        with pytest.raises(error, match=message) as info:
            face(kv.kv, **kwargs)
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]


def test_kv_caches_that_are_not_kv_caches_are_refused_alike() -> None:
    for face in (AsyncOffloadingWorker, SyncOffloadingWorker):
        with pytest.raises(InvalidSpec):
            face("kv", num_cpu_chunks=4)  # type: ignore[arg-type]


def test_a_worker_given_in_place_of_the_kv_caches_is_told_the_constructor() -> None:
    """The face used to wrap an async worker; it builds its own core now, and says how."""
    kv = make_layers(num_blocks=8)
    inner = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    told = r"not a worker \(got AsyncOffloadingWorker\).*SyncOffloadingWorker\(kv_caches, num_cpu_chunks="
    with pytest.raises(InvalidSpec, match=told):
        SyncOffloadingWorker(inner)  # type: ignore[arg-type]
    sync = SyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    with pytest.raises(InvalidSpec, match="got SyncOffloadingWorker"):
        SyncOffloadingWorker(sync)  # type: ignore[arg-type]
    sync.shutdown()

    async def close() -> None:
        await inner.aclose()  # never opened: freed at once

    anyio.run(close)
    assert inner.closed


def test_both_faces_report_the_same_facts_for_the_same_arguments() -> None:
    kv = make_layers(num_layers=3, num_blocks=12, page_shape=(2, 2, 8))
    args = {"num_cpu_chunks": 5, "blocks_per_chunk": 2, "backend": "cpu"}
    a, s = AsyncOffloadingWorker(kv.kv, **args), SyncOffloadingWorker(kv.kv, **args)
    for fact in ("num_cpu_chunks", "blocks_per_chunk", "num_gpu_blocks", "num_groups", "chunk_bytes",
                 "backend"):
        assert getattr(a, fact) == getattr(s, fact), fact
    assert a.host_layout == s.host_layout and a.kv_caches is s.kv_caches
    assert s.host_pool.numel() == a.host_pool.numel() == 5 * a.chunk_bytes
    assert (s.num_cpu_chunks, s.blocks_per_chunk, s.num_gpu_blocks) == (5, 2, 12)
    s.shutdown()

    async def close() -> None:
        await a.aclose()

    anyio.run(close)


def test_repr_and_in_flight_say_what_the_face_holds() -> None:
    """An adapter over an async worker used to leave that worker saying 0 in flight while
    the adapter had jobs; each face now reports its own jobs."""
    worker, _pages = make_sync(num_blocks=8, chunks=8)
    assert worker.in_flight == 0 and not worker.closed
    assert repr(worker) == ("<SyncOffloadingWorker open backend=cpu chunks=8 in_flight: store=0 load=0 "
                            "expedited_load=0 unreported=0>")
    latch = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
    worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([4]), expedited=True)
    worker.wait({2})
    assert worker.in_flight == 2  # job 2 is done but not reported yet
    assert "in_flight: store=1 load=0 expedited_load=1 unreported=0" in repr(worker)
    latch.set()
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    assert worker.in_flight == 0 and "store=0 load=0 expedited_load=0 unreported=0" in repr(worker)
    worker.submit_store(3, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
    worker.shutdown()
    assert worker.closed and repr(worker).startswith("<SyncOffloadingWorker closed")
    assert worker.in_flight == 1 and repr(worker).endswith("unreported=1>")  # drained, kept
    assert [r.job_id for r in worker.get_finished()] == [3] and worker.in_flight == 0


def test_the_sync_face_does_not_import_the_async_face() -> None:
    """Two peers over one core: neither is built from the other."""
    import ast
    from pathlib import Path

    import aiokv.sync

    tree = ast.parse(Path(aiokv.sync.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "worker" not in imported and "aiokv.worker" not in imported
    assert not any(isinstance(n, ast.Attribute) and n.attr == "_worker" for n in ast.walk(tree))


def test_engine_step_loop_reports_each_job_once_in_order_with_correct_bytes() -> None:
    worker, pages = make_sync()
    rng = random.Random(11)
    next_job = 0
    expected_host: dict[int, list[torch.Tensor]] = {}  # chunk -> page bytes it holds
    submitted: dict[int, str] = {}
    reported: list[int] = []
    deferred: list[tuple[int, int]] = []  # (block, chunk) stores queued for the next step
    pending_stores: dict[int, int] = {}  # block -> job id of a store still reading it
    pending_loads: dict[int, tuple[int, list[torch.Tensor], int]] = {}  # block -> (job, bytes, chunk)
    storing: dict[int, tuple[int, list[torch.Tensor]]] = {}  # store job -> (chunk, bytes)
    for _step in range(60):
        # 1. flush: submit the previous step's stores
        for block, chunk in deferred:
            job = next_job
            next_job += 1
            assert worker.submit_store(job, EngineSpec([block]), CPULoadStoreSpec([chunk]))
            submitted[job] = "store"
            pending_stores[block] = job
            # the chunk is loadable once the store is reported, as a manager would do
            storing[job] = (chunk, [p[block].clone() for p in pages])
            expected_host.pop(chunk, None)
        deferred = []
        # a block about to be rewritten must not be read by a pending store: wait on it
        busy = set(pending_loads)
        victim = rng.choice([b for b in range(64) if b not in busy])
        if victim in pending_stores:
            worker.wait({pending_stores.pop(victim), 10_000})  # unknown ids are ignored
        for p in pages:
            p[victim] = torch.randint(0, 256, (p.shape[1],), dtype=torch.uint8)
        # 2. loads of chunks known to be on the host, into blocks nothing else touches
        being_stored = {c for c, _ in storing.values()}
        loadable = sorted(c for c in expected_host if c not in being_stored)
        if loadable:
            chunk = rng.choice(loadable)
            block = rng.choice([b for b in range(64) if b not in pending_stores and b not in busy])
            job = next_job
            next_job += 1
            expedited = rng.random() < 0.5
            spec = EngineSpec([block])
            assert worker.submit_load(job, CPULoadStoreSpec([chunk]), spec, expedited=expedited)
            submitted[job] = "expedited_load" if expedited else "load"
            if expedited:  # waited on within the step, before the forward
                worker.wait({job})
                assert all(same_bytes(p[block], want) for p, want in zip(pages, expected_host[chunk]))
            else:  # checked when reported
                pending_loads[block] = (job, expected_host[chunk], chunk)
        # 3. this step's stores are queued for the next one (not from blocks being loaded)
        # chunks a pending load reads (several loads may read one): no store may overwrite them
        reading = {c for _, _, c in pending_loads.values()}
        free_chunks = [c for c in range(64) if c not in reading]
        deferred = [(rng.choice([b for b in range(64) if b not in pending_loads]), rng.choice(free_chunks))
                    for _ in range(rng.randint(0, 3))]
        deferred = list({c: (b, c) for b, c in deferred}.values())
        # 4. after the forward
        finished = worker.get_finished()
        reported += [r.job_id for r in finished]
        assert all(r.success for r in finished)
        for r in finished:  # vLLM's (source, destination) medium names
            want_type = ("GPU", "CPU") if submitted[r.job_id] == "store" else ("CPU", "GPU")
            assert r.transfer_type == want_type, (r, submitted[r.job_id])
        done = {r.job_id for r in finished}
        for b, j in list(pending_stores.items()):
            if j in done:
                del pending_stores[b]
        for b, (j, want, _chunk) in list(pending_loads.items()):
            if j in done:
                assert all(same_bytes(p[b], w) for p, w in zip(pages, want))
                del pending_loads[b]
        for j in sorted(done & set(storing)):  # two stores to one chunk: the later one wins
            chunk, content = storing.pop(j)
            expected_host[chunk] = content
    worker.wait(set(submitted))
    reported += [r.job_id for r in worker.get_finished()]
    assert sorted(reported) == sorted(submitted), "every job reported exactly once"
    assert worker.get_finished() == []
    for direction in ("store", "load", "expedited_load"):
        ids = [j for j in reported if submitted[j] == direction]
        assert ids == sorted(ids), f"{direction} jobs reported out of submission order"
    worker.shutdown()


def test_wait_consumes_nothing_and_results_carry_sizes() -> None:
    worker, pages = make_sync()
    worker.submit_store(1, GPULoadStoreSpec([1, 2, 3]), CPULoadStoreSpec([4, 5, 6]))
    worker.wait({1})
    worker.wait({1})  # done and not yet reported: still fine
    (result,) = worker.get_finished()
    assert result.job_id == 1 and result.success
    assert result.transfer_size == 3 * sum(p.shape[1] for p in pages)
    assert result.transfer_time is not None and result.transfer_time >= 0
    worker.wait({1})  # already reported: ignored
    worker.shutdown()


def test_wait_refuses_what_is_not_a_collection_of_ids_with_a_typed_error() -> None:
    """``wait(5)`` or ``wait(None)`` raised a bare TypeError and ``wait({"7"})`` passed as
    if "7" were an unknown id; numpy ids are ids (as in submits)."""
    worker, pages = make_sync()
    latch = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
    for bad in (5, None, [[1]], {"1"}, "1", [True], [1.0]):
        with pytest.raises(InvalidSpec, match="job"):
            worker.wait(bad)  # type: ignore[arg-type]
    threading.Timer(0.05, latch.set).start()
    worker.wait(np.array([1, 999], dtype=np.int32))  # unknown 999 is ignored
    # waited for (the chunk holds the block's bytes now), not reported yet
    assert same_bytes(host_chunk(worker, 1), stored_bytes(pages, 1))
    assert worker.in_flight == 1
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()


def test_wait_with_a_timeout_returns_false_and_leaves_the_jobs_in_flight() -> None:
    """The trap: a plain store queued behind an open layerwise store waits for that store's
    last push. ``wait(ids, timeout=)`` returns False instead of hanging, consumes nothing,
    and the jobs are reported once they end; without a timeout it still blocks (True)."""
    kv = make_layers(num_layers=2, num_blocks=16)
    worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu")
    layers = worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([5]), layerwise=True)
    layers.push(0)
    assert worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([6])) is True
    assert worker.wait({2}, timeout=0.05) is False
    assert worker.wait([2], timeout=0) is False
    assert worker.in_flight == 2 and worker.get_finished() == []
    threading.Timer(0.05, layers.push, (1,)).start()
    assert worker.wait({1, 2}) is True  # no timeout: blocks until the last push landed
    assert worker.wait({2}, timeout=0) is True  # done, not reported: True at once
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
    assert worker.wait({1, 2, 99}, timeout=1.5) is True  # reported or unknown: ignored
    assert worker.wait(set(), timeout=float("inf")) is True
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidSpec, match="timeout"):
            worker.wait({2}, timeout=bad)  # type: ignore[arg-type]
    worker.shutdown()


def test_unreported_job_id_cannot_be_reused() -> None:
    worker, _ = make_sync()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.wait({1})
    with pytest.raises(DuplicateJob):
        worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
    worker.shutdown()


def test_bad_input_raises_typed_errors_and_nothing_is_enqueued() -> None:
    worker, _ = make_sync()
    with pytest.raises(InvalidSpec):
        worker.submit_store(1, GPULoadStoreSpec([999]), CPULoadStoreSpec([0]))
    with pytest.raises(InvalidSpec):
        worker.submit_load(1, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0]))
    with pytest.raises(InvalidSpec, match="expedited must be a bool"):
        worker.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([0]), "no")
    with pytest.raises(InvalidSpec, match="job_id must be an int"):
        worker.submit_store([1], GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
    assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}
    assert worker.get_finished() == []
    assert worker.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))
    worker.shutdown()


def test_shutdown_drains_in_flight_jobs_and_keeps_their_results() -> None:
    worker, pages = make_sync()
    pool = worker.host_pool
    chunk_bytes = worker.chunk_bytes
    latch = threading.Event()
    # chunk 9 holds every page of block 9, in device-address order (the host layout's order)
    want = torch.cat([p[9] for p in sorted(pages, key=lambda p: p.data_ptr())])
    worker.submit_store(1, GPULoadStoreSpec([9]), CPULoadStoreSpec([9]), after=latch)
    for j in range(2, 40):
        worker.submit_store(j, GPULoadStoreSpec([j]), CPULoadStoreSpec([j]))
    threading.Timer(0.05, latch.set).start()
    worker.shutdown()
    results = worker.get_finished()
    assert [r.job_id for r in results] == list(range(1, 40)) and all(r.success for r in results)
    assert same_bytes(pool[9 * chunk_bytes : 9 * chunk_bytes + want.numel()], want)
    with pytest.raises(WorkerClosed):
        worker.submit_store(100, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    with pytest.raises(WorkerClosed):  # also with the id of a drained, unreported job
        worker.submit_store(5, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.shutdown()  # idempotent


def test_a_failed_copy_is_reported_and_its_cause_logged(monkeypatch, caplog) -> None:
    from aiokv.backends.cpu import CpuLane

    def fail(self, plan):
        raise MemoryError("simulated copy failure")

    worker, _pages = make_sync(num_blocks=8, chunks=8)
    monkeypatch.setattr(CpuLane, "_copy", fail)
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.wait({1})
    results = [(r.job_id, r.success, r.transfer_type) for r in worker.get_finished()]
    assert results == [(1, False, ("GPU", "CPU"))]
    worker.shutdown()
    assert "store job 1 failed: MemoryError('simulated copy failure')" in caplog.text


def test_get_finished_does_not_block_while_shutdown_drains() -> None:
    worker, _pages = make_sync(num_blocks=8, chunks=8)
    latch = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([2]))
    worker.wait({1})
    worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]), after=latch)
    closer = threading.Thread(target=worker.shutdown)
    closer.start()
    while "<SyncOffloadingWorker open" in repr(worker):  # until the drain begins (job 2 waits)
        closer.join(0.001)
    with pytest.raises(WorkerClosed):
        worker.submit_store(3, GPULoadStoreSpec([3]), CPULoadStoreSpec([4]))
    reaper_got: list[list[int]] = []
    reaper = threading.Thread(target=lambda: reaper_got.append([r.job_id for r in worker.get_finished()]))
    reaper.start()
    reaper.join(10)
    assert not reaper.is_alive(), "get_finished() blocked behind shutdown's drain"
    assert reaper_got == [[1]] and closer.is_alive()
    latch.set()
    closer.join(10)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_shutdown_frees_the_host_pool() -> None:
    """shutdown() gives the pool's memory back (the CPU lanes held numpy views of it until
    the worker itself was dropped)."""
    kv = make_layers(num_layers=2, num_blocks=64, page_shape=(2, 2, 8))
    worker = SyncOffloadingWorker(kv.kv, cpu_bytes=192 << 20)
    worker.host_pool.fill_(7)  # fault the pages in
    worker.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([5]))
    before = _resident_bytes()
    worker.shutdown()
    gc.collect()
    freed = before - _resident_bytes()
    assert freed > 128 << 20, f"shutdown() freed {freed >> 20} MiB of a 192 MiB pool"
    assert [r.job_id for r in worker.get_finished()] == [1]


def _lane_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The CPU lane threads started since ``before`` (one per direction)."""
    threads = [t for t in threading.enumerate() if t not in before and t.name.startswith("aiokv-cpu-")]
    assert len(threads) == 3 and all(t.is_alive() for t in threads)  # store, load, expedited
    return threads


def _ended(threads: list[threading.Thread]) -> bool:
    for t in threads:
        t.join(timeout=2.0)
    return not any(t.is_alive() for t in threads)


def test_a_worker_dropped_without_shutdown_warns_and_its_threads_end() -> None:
    gc.collect()  # workers other tests left in cycles go now, not inside the check below
    before = set(threading.enumerate())
    worker, _pages = make_sync()
    worker.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([5]))
    worker.wait({1})
    threads = _lane_threads(before)
    with pytest.warns(ResourceWarning, match="aiokv worker .* dropped without shutdown"):
        del worker
        gc.collect()
    assert _ended(threads), "lane threads outlived their dropped worker"


def test_a_dropped_worker_ends_its_threads_even_when_warnings_are_errors(monkeypatch) -> None:
    gc.collect()
    raised: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: raised.append(u.exc_value))
    before = set(threading.enumerate())
    worker, _pages = make_sync()
    threads = _lane_threads(before)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del worker
        gc.collect()
    assert _ended(threads), "a raising warning kept the lane threads alive"
    assert any(isinstance(e, ResourceWarning) for e in raised)


_DROP_AND_EXIT = """
import gc
import torch
from aiokv import AsyncOffloadingWorker, CanonicalKVCaches
kv = CanonicalKVCaches.from_tensors([torch.randn(2, 64, 16, 8, 32) for _ in range(4)], block_dim=1)
worker = AsyncOffloadingWorker(kv, num_cpu_chunks=8, backend="cpu")
del worker
gc.collect()
"""


def test_a_script_that_exits_right_after_dropping_a_worker_exits_cleanly() -> None:
    """The lane threads used to end during interpreter shutdown, dropping torch-backed
    arrays then: the process aborted ("terminate called without an active exception") in
    about half the runs, so six run side by side."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.Popen([sys.executable, "-W", "always::ResourceWarning", "-c", _DROP_AND_EXIT],
                             cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(6)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        assert "dropped without shutdown" in err


def test_a_worker_shut_down_does_not_warn() -> None:
    gc.collect()  # other tests' leftovers warn here, outside the record below
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worker, _ = make_sync()
        worker.shutdown()
        del worker
        gc.collect()
    assert not [w for w in seen if "aiokv worker" in str(w.message)]


def test_with_max_in_flight_a_submit_blocks_until_a_job_ends_and_keeps_its_result() -> None:
    kv = make_layers(num_layers=2, num_blocks=16, page_shape=(2, 2, 8))
    worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=16, options={"max_in_flight": 2})
    latch = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
    worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
    returned = threading.Event()
    submitter = threading.Thread(target=lambda: returned.set() if worker.submit_load(
        3, CPULoadStoreSpec([2]), GPULoadStoreSpec([9])) else None)
    submitter.start()
    assert not returned.wait(0.1), "a submit past the bound did not wait"
    assert worker.statistics().in_flight == {"store": 2, "load": 0, "expedited_load": 0}
    latch.set()
    assert returned.wait(10)
    submitter.join()
    worker.wait({3})
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [1, 2, 3] and all(r.success for r in results)
    pages = [t.tensor for t in kv.kv.tensors]
    assert all(same_bytes(p[9], p[2]) for p in pages)
    worker.shutdown()


def test_a_shutdown_whose_drain_never_ends_gives_up_and_reports_the_job_failed() -> None:
    worker, _pages = make_sync(num_blocks=8, chunks=8)
    never = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.submit_load(4, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), after=never)
    worker.wait({1})  # on a busy host it might otherwise outlast the short drain below
    with pytest.warns(RuntimeWarning, match=r"1 job\(s\) still in flight \(no job ended for 0.1 s.*"
                                            r"load job 4"):
        worker.shutdown(drain_timeout=0.1)
    assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [(1, True), (4, False)]
    with pytest.raises(WorkerClosed):
        worker.submit_store(5, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    never.set()


def test_a_keyboard_interrupt_in_shutdown_abandons_the_drain(monkeypatch) -> None:
    """Ctrl-C where it lands in an engine thread's drain: in the wait on a job's end."""
    from aiokv.backends.cpu import CpuCompletion

    worker, _pages = make_sync(num_blocks=8, chunks=8)
    never = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)
    waits: list[float | None] = []

    def interrupted(self, timeout: float | None = None) -> bool:
        waits.append(timeout)
        raise KeyboardInterrupt

    monkeypatch.setattr(CpuCompletion, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="interrupted.*store job 1"):
        worker.shutdown(drain_timeout=60)
    monkeypatch.undo()
    assert len(waits) == 1 and worker.closed and "closed" in repr(worker)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    worker.shutdown()  # closed: returns at once
    never.set()


@pytest.mark.parametrize("use", ["never opened", "opened, nothing submitted"])
def test_a_dropped_worker_says_what_is_true(use: str) -> None:
    """A worker that never ran a copy used to warn that nothing waited for its copies."""
    gc.collect()
    kv = make_layers(num_blocks=8)
    worker: AsyncOffloadingWorker | SyncOffloadingWorker = (
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) if use == "never opened"
        else SyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    )
    with pytest.warns(ResourceWarning) as seen:
        del worker
        gc.collect()
    (message,) = [str(w.message) for w in seen if "aiokv worker" in str(w.message)]
    assert "copies" not in message.replace("no copies", "") and "freed" in message
    assert ("never opened" in message) == (use == "never opened")


def test_bad_input_at_the_bound_raises_at_once_instead_of_waiting_for_room() -> None:
    """A full worker checked input only once a slot was free: behind a job that never
    ends, a duplicate id or a bad spec blocked the engine thread for good."""
    kv = make_layers(num_layers=1, num_blocks=8)
    worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"max_in_flight": 1})
    latch = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=latch)
    bad = [
        (DuplicateJob, (1, GPULoadStoreSpec([2]), CPULoadStoreSpec([2])), {}),
        (InvalidSpec, (2, GPULoadStoreSpec([99]), CPULoadStoreSpec([2])), {}),
        (InvalidSpec, (2, CPULoadStoreSpec([2]), GPULoadStoreSpec([2])), {}),  # swapped
        (InvalidSpec, (2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2])), {"after": "now"}),
    ]
    for error, args, kwargs in bad:
        caught: list[BaseException] = []

        def submit(args=args, kwargs=kwargs, caught=caught) -> None:
            try:
                worker.submit_store(*args, **kwargs)
            except BaseException as exc:
                caught.append(exc)

        thread = threading.Thread(target=submit, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive() and len(caught) == 1 and isinstance(caught[0], error)
    assert worker.statistics().in_flight["store"] == 1  # nothing else was enqueued
    threading.Timer(0.05, latch.set).start()
    assert worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))  # waits for room
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
    worker.shutdown()


def test_a_submit_blocked_at_the_bound_is_told_when_the_worker_shuts_down() -> None:
    kv = make_layers(num_layers=1, num_blocks=8)
    worker = SyncOffloadingWorker(kv.kv, num_cpu_chunks=8, options={"max_in_flight": 1, "drain_timeout": 0.1})
    never = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)
    caught: list[BaseException] = []

    def submit() -> None:
        try:
            worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
        except BaseException as exc:
            caught.append(exc)

    blocked = threading.Thread(target=submit)
    blocked.start()
    blocked.join(0.1)
    assert blocked.is_alive()
    with pytest.warns(RuntimeWarning, match="store job 1"):
        worker.shutdown()
    blocked.join(10)
    assert not blocked.is_alive() and len(caught) == 1 and isinstance(caught[0], WorkerClosed)
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    never.set()


def test_an_interrupt_while_memory_is_freed_loses_no_result(monkeypatch) -> None:
    """A second Ctrl-C (or a teardown error) while shutdown() let lanes and memory go
    lost the results the core had just popped: get_finished() never reported them."""
    worker, _pages = make_sync(num_blocks=8, chunks=8)
    from aiokv.backends.cpu import CpuBackend

    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.wait({1})  # done, not polled: the close pops it
    close = CpuBackend.close

    def interrupted(self) -> None:
        close(self)  # let go of what it holds, then be interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(CpuBackend, "close", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    monkeypatch.undo()
    assert worker.closed
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()  # closed: returns at once


def test_an_unbounded_drain_waits_in_slices_so_an_interrupt_lands(monkeypatch) -> None:
    """``drain_timeout=math.inf``: a wait with no timeout is, on CUDA, one blocking
    cuEventSynchronize, where a Ctrl-C is not acted on until the job ends (never, for a
    job that hangs). The drain must wait in bounded slices, so the interrupt lands."""
    import math

    from aiokv.backends.cpu import CpuCompletion

    worker, _pages = make_sync(num_blocks=8, chunks=8)
    never = threading.Event()
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=never)
    waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        waits.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait: a Ctrl-C lands only once the job ends")
        raise KeyboardInterrupt  # the Ctrl-C, seen when the slice comes back

    monkeypatch.setattr(CpuCompletion, "wait", wait)
    with pytest.raises(KeyboardInterrupt), pytest.warns(RuntimeWarning, match="interrupted.*store job 1"):
        worker.shutdown(drain_timeout=math.inf)
    monkeypatch.undo()
    assert waits and None not in waits
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    never.set()
