"""The core under both faces, driven directly: validation once, bookkeeping across
directions, the rules of waiting both faces share (room under the bound, the drain's idle
clock), and a close that never waits on a copy that will not end."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from aiokv import CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.core import Drain, OffloadCore
from aiokv.errors import DuplicateJob, InvalidSpec, QueueFull, WorkerClosed
from aiokv.specs import Direction
from tests.conftest import make_layers, same_bytes


def _core(num_blocks: int = 32, chunks: int = 16, **options) -> tuple[OffloadCore, list[torch.Tensor]]:
    kv = make_layers(num_layers=2, num_blocks=num_blocks, page_shape=(2, 2, 8), seed=5)
    core = OffloadCore(kv.kv, num_cpu_chunks=chunks, backend="cpu", options=options)
    core.lifecycle.open()
    return core, [t.tensor for t in kv.kv.tensors]


def _run(drain: Drain) -> bool:
    """Drive a drain the sync face's way (blocking on each wait); True if it ended by itself."""
    while (wait := drain.next()) is not None:
        wait.block()
    return drain.why == ""


def _drain(core: OffloadCore, idle_timeout: float = 10) -> list:
    """Every job in flight, popped once it ended."""
    done: list = []
    assert _run(core.drain(idle_timeout, lambda: done.extend(core.poll())))
    return done


def test_a_round_trip_through_the_core_is_byte_exact_per_direction_in_order() -> None:
    core, pages = _core()
    rng = np.random.default_rng(1)
    blocks = rng.choice(32, 10, replace=False).tolist()
    want = [p[blocks].clone() for p in pages]
    for i, (b, c) in enumerate(zip(blocks, range(10))):
        core.submit(Direction.STORE, i, GPULoadStoreSpec([b]), CPULoadStoreSpec([c]))
    assert core.in_flight == 10 and core.statistics().in_flight["store"] == 10
    with pytest.raises(DuplicateJob):  # each one in flight until popped
        core.check(Direction.STORE, 3, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    done = _drain(core)
    assert [j.job_id for j in done] == list(range(10)) and core.in_flight == 0
    core.check(Direction.STORE, 3, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))  # free again
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
    core.lifecycle.begin_close()
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
    assert core.in_flight == 1 and [j.job_id for j in core.poll()] == [1]
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
    assert _run(core.drain(0.45, core.poll))  # 0.6 s in all, never 0.45 s without an end
    assert time.monotonic() - began >= 0.45
    never = threading.Event()
    core.submit(Direction.LOAD, 9, CPULoadStoreSpec([1]), GPULoadStoreSpec([5]), never)
    began = time.monotonic()
    drain = core.drain(0.1, core.poll)
    assert not _run(drain)
    assert 0.1 <= time.monotonic() - began < 5
    assert drain.why == "no job ended for 0.1 s of the drain (drain_timeout)"
    with pytest.warns(RuntimeWarning, match=r"1 job\(s\) still in flight \(a test\): load job 9"):
        finished, abandoned = core.close("a test")
    assert finished == []  # the drain popped jobs 0-2 (its collect drops them here)
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
    popped: list = []
    assert _run(core.drain(0.45, lambda: popped.extend(core.poll())))  # 0.9 s in all, never 0.45 s idle
    finished, abandoned = core.close()
    assert abandoned == [] and finished == [] and sorted(j.job_id for j in popped) == [0, *range(10, 18)]
    assert all(j.result is not None and j.result.success for j in popped)


def test_a_worker_whose_copies_all_ended_frees_its_pool_on_close() -> None:
    core, _ = _core()
    core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    assert core.wait_for([1], 10)
    finished, abandoned = core.close()  # not polled yet: close reports it
    assert [j.job_id for j in finished] == [1] and abandoned == []
    assert core.pool.tensor.numel() == 0


def test_room_says_what_to_wait_on_at_the_bound_and_nothing_below_it() -> None:
    core, _ = _core(max_in_flight=2)
    latches = [threading.Event() for _ in range(2)]
    assert core.room() is None
    core.submit(Direction.LOAD, 1, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]), latches[0])
    assert core.room() is None
    core.submit(Direction.STORE, 2, GPULoadStoreSpec([2]), CPULoadStoreSpec([2]), latches[1])
    wait = core.room()
    # the oldest job, looked at again after a slice: two directions are busy, and a face
    # blocked here must see a shutdown meanwhile
    assert wait is not None and wait.job.job_id == 1 and wait.timeout is not None and 0 < wait.timeout <= 0.05
    assert not wait.block()  # the slice passed; job 1 still waits on its latch
    latches[1].set()  # the younger job, in the other direction, ends first
    assert core.wait_for([2], 10)
    assert core.room() is not None  # ended but not popped: no slot yet
    assert [j.job_id for j in core.poll()] == [2] and core.room() is None
    latches[0].set()
    assert [j.job_id for j in _drain(core)] == [1]
    core.close()


def test_next_end_waits_on_the_oldest_head_without_a_slice_when_one_direction_is_busy() -> None:
    core, _ = _core()
    assert core.next_end(5.0) is None
    latch = threading.Event()
    for i in range(3):
        core.submit(Direction.STORE, i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]), latch)
    wait = core.next_end(5.0)
    assert wait is not None and wait.job.job_id == 0 and wait.timeout == 5.0
    unbounded = core.next_end(math.inf)  # no bound: slices, so an interrupt lands (test_sync)
    assert unbounded is not None and unbounded.timeout is not None and 0 < unbounded.timeout <= 0.05
    latch.set()
    assert _drain(core) and core.close() == ([], [])


def test_a_drain_counts_jobs_that_someone_else_popped() -> None:
    """The async face's poller pops most ends while the drain naps: they are progress."""
    core, _ = _core()
    latches = [threading.Event() for _ in range(4)]
    for i, latch in enumerate(latches):
        core.submit(Direction.STORE, i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]), latch)
    drain = core.drain(0.3, lambda: None)  # pops nothing itself
    began = time.monotonic()
    for latch in latches:
        time.sleep(0.15)
        latch.set()
        assert core.wait_for([latches.index(latch)], 10)
        core.poll()  # someone else pops it
        assert drain.next() is not None or core.in_flight == 0
    assert drain.next() is None and drain.why == ""
    assert time.monotonic() - began >= 0.6  # longer than the idle bound: progress kept it going
    core.close()


def test_a_drain_interrupted_says_so() -> None:
    core, _ = _core()
    never = threading.Event()
    core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), never)
    drain = core.drain(60, core.poll)
    assert drain.why == "the drain was interrupted"  # until it ends by itself
    assert drain.next() is not None and drain.why == "the drain was interrupted"
    with pytest.warns(RuntimeWarning, match=r"\(the drain was interrupted\): store job 1"):
        core.close(drain.why)
    never.set()


def test_strategy_is_an_option_of_the_core() -> None:
    kv = make_layers(num_layers=1, num_blocks=8)
    with pytest.raises(InvalidSpec, match="strategy"):
        OffloadCore(kv.kv, num_cpu_chunks=4, backend="cpu", strategy="teleport")


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
