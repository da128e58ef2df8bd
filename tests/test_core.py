"""The core under both faces, driven directly: one lifecycle, validation once, bookkeeping
across directions, and a close that never waits on a copy that will not end."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from aiokv import CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.core import OffloadCore
from aiokv.errors import DuplicateJob, InvalidSpec, QueueFull, UsageError, WorkerClosed
from aiokv.lifecycle import Face, State
from aiokv.specs import Direction
from tests.conftest import make_layers, same_bytes


def _core(num_blocks: int = 32, chunks: int = 16, **options) -> tuple[OffloadCore, list[torch.Tensor]]:
    kv = make_layers(num_layers=2, num_blocks=num_blocks, page_shape=(2, 2, 8), seed=5)
    core = OffloadCore(kv.kv, num_cpu_chunks=chunks, backend="cpu", options=options)
    core.lifecycle.open(Face.SYNC)
    return core, [t.tensor for t in kv.kv.tensors]


def _drain(core: OffloadCore) -> list:
    assert core.wait_all(10)
    return core.poll()


def test_the_lifecycle_says_entered_twice_owned_by_the_other_face_and_closed_apart() -> None:
    core, _ = _core()
    lifecycle = core.lifecycle
    with pytest.raises(UsageError, match="already owned by another SyncOffloadingWorker") as twice:
        lifecycle.open(Face.SYNC)
    with pytest.raises(UsageError, match="SyncOffloadingWorker owns this worker") as other:
        lifecycle.open(Face.ASYNC)
    with pytest.raises(UsageError, match="SyncOffloadingWorker owns this worker") as submit:
        lifecycle.check_open(Face.ASYNC)
    with pytest.raises(UsageError, match="call its shutdown"):
        lifecycle.begin_close(Face.ASYNC)
    lifecycle.check_open(Face.SYNC)
    assert not any(isinstance(e.value, WorkerClosed) for e in (twice, other, submit))
    assert str(twice.value) != str(other.value) == str(submit.value)
    assert lifecycle.begin_close(Face.SYNC) is State.OPEN
    assert lifecycle.begin_close(Face.SYNC) is State.CLOSING  # a second closer: not its drain
    with pytest.raises(WorkerClosed, match="closed") as closed:
        lifecycle.check_open(Face.SYNC)
    assert str(closed.value) not in (str(twice.value), str(other.value))
    core.close()
    assert core.closed and lifecycle.closed.is_set()
    with pytest.raises(WorkerClosed, match="closed"):
        lifecycle.open(Face.ASYNC)


def test_a_round_trip_through_the_core_is_byte_exact_per_direction_in_order() -> None:
    core, pages = _core()
    rng = np.random.default_rng(1)
    blocks = rng.choice(32, 10, replace=False).tolist()
    want = [p[blocks].clone() for p in pages]
    for i, (b, c) in enumerate(zip(blocks, range(10))):
        core.submit(Direction.STORE, i, GPULoadStoreSpec([b]), CPULoadStoreSpec([c]))
    assert core.in_flight == 10 and all(core.holds(i) for i in range(10))
    done = _drain(core)
    assert [j.job_id for j in done] == list(range(10)) and core.in_flight == 0 and not core.holds(3)
    for p in pages:
        p[blocks] = 0
    core.submit(Direction.LOAD, 20, CPULoadStoreSpec(list(range(5))), GPULoadStoreSpec(blocks[:5]))
    core.submit(Direction.EXPEDITED_LOAD, 21, CPULoadStoreSpec(list(range(5, 10))),
                GPULoadStoreSpec(blocks[5:]))
    done = _drain(core)
    assert sorted(j.job_id for j in done) == [20, 21]
    assert all(same_bytes(p[blocks], w) for p, w in zip(pages, want))
    stats = core.statistics()
    assert stats.completed == {"store": 10, "load": 1, "expedited_load": 1}
    assert stats.in_flight == {"store": 0, "load": 0, "expedited_load": 0}
    core.lifecycle.begin_close(Face.SYNC)
    assert core.close() == ([], [])
    assert core.pool.tensor.numel() == 0  # freed: nothing could still write it


def test_every_rejection_happens_before_anything_is_enqueued() -> None:
    core, _ = _core(max_in_flight=2)
    latch = threading.Event()
    core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), latch)
    bad = [
        (DuplicateJob, "still in flight", (1, GPULoadStoreSpec([2]), CPULoadStoreSpec([2])), {}),
        (DuplicateJob, "not resolved yet", (7, GPULoadStoreSpec([2]), CPULoadStoreSpec([2])),
         {"reserved": {7}}),
        (InvalidSpec, "swapped", (2, CPULoadStoreSpec([2]), GPULoadStoreSpec([2])), {}),
        (InvalidSpec, "job_id must be an int", ([2], GPULoadStoreSpec([2]), CPULoadStoreSpec([2])), {}),
        (InvalidSpec, r"\[0, 32\)", (2, GPULoadStoreSpec([40]), CPULoadStoreSpec([2])), {}),
        (InvalidSpec, "block_ids", (2, object(), CPULoadStoreSpec([2])), {}),
    ]
    for error, message, args, kwargs in bad:
        with pytest.raises(error, match=message):
            core.submit(Direction.STORE, *args, **kwargs)
        assert core.in_flight == 1
    core.submit(Direction.STORE, 2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]))
    assert not core.has_room()
    with pytest.raises(QueueFull, match="max_in_flight=2"):
        core.submit(Direction.LOAD, 3, CPULoadStoreSpec([2]), GPULoadStoreSpec([3]))
    assert core.in_flight == 2
    latch.set()
    assert [j.job_id for j in _drain(core)] == [1, 2] and core.has_room()
    core.close()


def test_wait_for_pops_nothing_and_ignores_unknown_ids() -> None:
    core, _ = _core()
    core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert core.wait_for([1, 999], timeout=10)
    assert core.holds(1) and [j.job_id for j in core.poll()] == [1]
    core.close()


def test_drain_gives_up_only_after_a_quiet_spell() -> None:
    """Jobs that keep ending keep the drain going; one that never ends stops it after the
    idle timeout, not at once and not never."""
    core, _ = _core()
    latches = [threading.Event() for _ in range(3)]
    for i, latch in enumerate(latches):
        core.submit(Direction.STORE, i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]), latch)
    for k, latch in enumerate(latches):
        threading.Timer(0.2 * (k + 1), latch.set).start()
    began = time.monotonic()
    assert core.drain(idle_timeout=0.45)  # 0.6 s in all, never 0.45 s without an end
    assert time.monotonic() - began >= 0.45
    never = threading.Event()
    core.submit(Direction.LOAD, 9, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]), never)
    began = time.monotonic()
    assert not core.drain(idle_timeout=0.1)
    assert 0.1 <= time.monotonic() - began < 5
    with pytest.warns(RuntimeWarning, match=r"1 job\(s\) still in flight \(a test\): load job 9"):
        finished, abandoned = core.close("a test")
    assert sorted(j.job_id for j in finished) == [0, 1, 2]
    assert [j.job_id for j in abandoned] == [9]
    (job,) = abandoned
    assert job.result is not None and not job.result.success and isinstance(job.error, WorkerClosed)
    assert core.pool.tensor.numel() > 0  # kept: the abandoned copy may still write it
    assert core.statistics().failed["load"] == 1
    never.set()


def test_drain_counts_jobs_that_end_in_other_directions() -> None:
    """The drain waited on the oldest job alone: loads ending every 0.1 s behind a store
    still waiting did not count, so it gave up after the idle timeout while jobs ended."""
    core, _ = _core()
    store_latch = threading.Event()
    core.submit(Direction.STORE, 0, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]), store_latch)
    load_latches = [threading.Event() for _ in range(8)]
    for i, latch in enumerate(load_latches):
        core.submit(Direction.LOAD, 10 + i, CPULoadStoreSpec([1 + i]), GPULoadStoreSpec([10 + i]), latch)
    timers = [threading.Timer(0.1 * (k + 1), latch.set) for k, latch in enumerate(load_latches)]
    timers.append(threading.Timer(0.1 * (len(load_latches) + 1), store_latch.set))
    for timer in timers:
        timer.start()
    assert core.drain(idle_timeout=0.45)  # 0.9 s in all, never 0.45 s without an end
    finished, abandoned = core.close()
    assert abandoned == [] and sorted(j.job_id for j in finished) == [0, *range(10, 18)]
    assert all(j.result is not None and j.result.success for j in finished)


def test_a_worker_whose_copies_all_ended_frees_its_pool_on_close() -> None:
    core, _ = _core()
    core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert core.wait_all(10)
    finished, abandoned = core.close()  # not polled yet: close reports it
    assert [j.job_id for j in finished] == [1] and abandoned == []
    assert core.pool.tensor.numel() == 0


def test_an_async_owned_worker_refuses_the_sync_face_and_a_second_entry() -> None:
    kv = make_layers(num_layers=1, num_blocks=8)
    core = OffloadCore(kv.kv, num_cpu_chunks=4, backend="cpu")
    with pytest.raises(WorkerClosed, match="not open yet"):
        core.lifecycle.check_open(Face.ASYNC)
    core.lifecycle.open(Face.ASYNC)
    with pytest.raises(UsageError, match="already open; enter it once"):
        core.lifecycle.open(Face.ASYNC)
    with pytest.raises(UsageError, match="open on an event loop"):
        core.lifecycle.open(Face.SYNC)
    with pytest.raises(UsageError, match="open on an event loop"):
        core.lifecycle.check_open(Face.SYNC)
    core.close()


def test_a_wait_with_a_timeout_bounds_the_whole_wait() -> None:
    """Three jobs ending 0.15 s apart: a 0.2 s wait for all of them must say not yet (a
    timeout applied to each job in turn would wait 0.45 s and say done)."""
    from types import SimpleNamespace

    from aiokv.core import _wait_jobs

    events = [threading.Event() for _ in range(3)]
    timers = [threading.Timer(0.15 * (i + 1), e.set) for i, e in enumerate(events)]
    for t in timers:
        t.start()
    try:
        jobs = [SimpleNamespace(completion=SimpleNamespace(wait=e.wait)) for e in events]
        assert _wait_jobs(jobs, 0.2) is False  # type: ignore[arg-type]
        assert _wait_jobs(jobs, None) is True  # type: ignore[arg-type]
    finally:
        for t in timers:
            t.cancel()
