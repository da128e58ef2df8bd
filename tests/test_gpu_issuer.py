"""Jobs enqueued by a lane's issuer thread after ``submit`` returned: byte-exact, ordered
against compute as at submit time (even when the caller's event is recorded again), and
waited for correctly by both faces and by shutdown. On the native path (``AIOKV_NATIVE``)
every lane has its native issuer thread whatever ``issue_thread`` says; elsewhere the
option starts the Python one."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
import torch

import aiokv.backends.cuda.lane as cuda_lane
from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SyncOffloadingWorker,
)

from .gpu_support import (
    STRATEGIES,
    check_same,
    describe,
    drain,
    gpu,
    layouts,
    ones_kv,
    run_jobs,
    slow_fill,
    sync_pair,
)

pytestmark = gpu

ISSUER = {"issue_thread": True}  # off by default


@pytest.fixture
def issue_everything_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job, however small, goes through the lane's issuer thread."""
    monkeypatch.setattr(cuda_lane, "ISSUE_THREAD_BYTES", 0)


def _lanes(worker: SyncOffloadingWorker, to_host: bool) -> list[cuda_lane.CudaLane]:
    return [lane for lane in worker._core.backend._lanes if lane.direction.to_host == to_host]


class _Resume:
    """The gate of a held native issuer: ``set`` lets it issue again."""

    def __init__(self, lane: cuda_lane.CudaLane) -> None:
        self._lane = lane

    def set(self) -> None:
        assert self._lane.native is not None
        self._lane.native.resume()


def hold_issuer(worker: SyncOffloadingWorker, to_host: bool = True) -> threading.Event | _Resume:
    """Keep the direction's issuer thread from issuing until the returned gate is set."""
    lane = _lanes(worker, to_host)[0]
    if lane.native is not None:
        lane.native.pause()
        return _Resume(lane)
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        gate.wait(30)

    assert lane._issuer is not None
    lane._issuer.run(hold, defer=True)
    assert held.wait(10)
    return gate


@pytest.mark.usefixtures("issue_everything_later")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", ["kv_split", "kv_pages", "cross_layer", "odd_pages"])
def test_round_trip_issued_later_matches_oracle(strategy: str, layout: str) -> None:
    tensors, how = layouts("cuda", seed=11)[layout]
    kv = describe(tensors, how)
    cuda_w, oracle, cpu_tensors = sync_pair(kv, tensors, 30, 3, strategy, options=ISSUER)
    rng = np.random.default_rng(5)
    try:
        stores = [("store", j, GPULoadStoreSpec(rng.choice(40, 6, replace=False)),
                   CPULoadStoreSpec(rng.choice(30, 2, replace=False) if j == 0 else [10 + 2 * j, 11 + 2 * j]))
                  for j in range(4)]
        run_jobs([cuda_w, oracle], stores)
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        loads = [("load" if j % 2 else "expedited", 10 + j,
                  GPULoadStoreSpec(rng.choice(40, 6, replace=False)),
                  CPULoadStoreSpec([10 + 2 * j, 11 + 2 * j])) for j in range(1, 4)]
        for job in loads:
            run_jobs([cuda_w, oracle], [job])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        jobs = len(stores) + len(loads)
        natives = [lane.native for lane in cuda_w._core.backend._lanes if lane.native is not None]
        if natives:  # every job through the native issuers (a tiny one on an idle lane at submit)
            assert sum(int(n.stats()["issued"]) for n in natives) == jobs
        else:
            later = sum(lane.issued_later for lane in cuda_w.statistics().lanes.values())
            assert later == jobs, "jobs were not issued from the lanes' threads"
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


def _stored(w: SyncOffloadingWorker, chunk: int) -> torch.Tensor:
    return w.host_pool[chunk * w.chunk_bytes :][: 4 * 8 * 256 * 2].view(torch.bfloat16)


@pytest.mark.parametrize("strategy", ["dma", "staged"])
def test_event_recorded_again_after_submit_is_waited_as_it_was(strategy: str) -> None:
    """``after=`` an event: the copy waits for the record current at submit, not a later one."""
    tensors, kv = ones_kv()
    w = SyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", strategy=strategy, options=ISSUER)
    side, idle = torch.cuda.Stream(), torch.cuda.Stream()
    try:
        torch.cuda.synchronize()
        gate = hold_issuer(w)
        ev = slow_fill(tensors, 1, 3.0, side)
        w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([4]), after=ev)
        ev.record(idle)  # the engine reuses its event before the issuer got to the job
        gate.set()
        (res,) = drain(w, {1})
        assert res.success
        assert torch.all(_stored(w, 4) == 3.0), "the store waited on the event's later record"
    finally:
        w.shutdown()


@pytest.mark.usefixtures("issue_everything_later")
def test_sync_face_waits_for_jobs_the_issuer_has_not_enqueued() -> None:
    tensors, kv = ones_kv()
    for b in range(16):
        for t in tensors:
            t[:, b].fill_(float(b + 1))
    w = SyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", strategy="auto", options=ISSUER)
    try:
        gate = hold_issuer(w)
        for j in range(5):
            w.submit_store(j, GPULoadStoreSpec([j + 2]), CPULoadStoreSpec([j]))
        assert w.get_finished() == [], "a job reported done before its copies were enqueued"
        assert not w._core.wait_for({0}, timeout=0.05)
        threading.Timer(0.05, gate.set).start()
        results = drain(w, set(range(5)))
        assert [r.job_id for r in results] == list(range(5)) and all(r.success for r in results)
        for j in range(5):
            assert torch.all(_stored(w, j) == float(j + 3))
    finally:
        w.shutdown()


@pytest.mark.usefixtures("issue_everything_later")
def test_shutdown_waits_for_jobs_still_queued_for_the_issuer() -> None:
    tensors, how = layouts("cuda", seed=13)["kv_split"]
    cuda_w, oracle, _ = sync_pair(describe(tensors, how), tensors, 30, 1, "staged", options=ISSUER)
    jobs = [("store", j, GPULoadStoreSpec(range(j * 5, j * 5 + 5)), CPULoadStoreSpec(range(j * 5, j * 5 + 5)))
            for j in range(6)]
    try:
        run_jobs([oracle], jobs)
        gate = hold_issuer(cuda_w)
        for _, j, gspec, cspec in jobs:
            cuda_w.submit_store(j, gspec, cspec)
        pool, want = cuda_w.host_pool, oracle.host_pool.clone()
        threading.Timer(0.1, gate.set).start()
    finally:
        cuda_w.shutdown()
        oracle.shutdown()
    results = cuda_w.get_finished()
    assert sorted(r.job_id for r in results) == list(range(6)) and all(r.success for r in results)
    assert torch.equal(pool, want)


@pytest.mark.usefixtures("issue_everything_later")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_awaited_job_wakes_when_issued_late(backend: str) -> None:
    """The poller naps on the doorbell while the job waits for the issuer: the bell asked
    for before the enqueue must still ring."""
    tensors, kv = ones_kv()
    for t in tensors:
        t[:, 5].fill_(4.0)

    async def main() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", options=ISSUER) as w:
            driver = w._core.backend.driver
            rings: list[object] = []
            ring_after = driver.ring_after

            def counted(stream: object, event: object, bell: object) -> bool:
                rings.append(event)
                return ring_after(stream, event, bell)

            driver.ring_after = counted
            lane = _lanes(w, True)[0]
            gate = hold_issuer(w)
            fut = w.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([6]))
            await anyio.sleep(0.05)  # long enough for the poller to nap on the doorbell
            assert not fut.done()
            gate.set()
            with anyio.fail_after(10):
                res = await fut
            assert res.success
            # A lane with a native waiter rings through it (armed by the native issuer
            # thread once it issued the job); the others through a host function.
            armed = lane.waiter.stats()["armed"] if lane.waiter is not None else 0
            assert rings or armed, "the doorbell asked for before the enqueue was never armed"
            assert torch.all(_stored(w, 6) == 4.0)

    anyio.run(main, backend=backend)
