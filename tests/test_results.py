"""TransferResult as a value, and when finished jobs are settled (device time read, events
pooled): after the awaiting task has run, never before, and always before the worker closes."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import threading

import anyio
import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SyncOffloadingWorker,
    TransferResult,
)
from aiokv.backends.cpu import CpuCompletion
from tests.conftest import KV


def test_a_result_is_an_immutable_value() -> None:
    a = TransferResult(3, True, 4096, 0.5)
    assert a == TransferResult(3, True, 4096, 0.5) and hash(a) == hash(TransferResult(3, True, 4096, 0.5))
    assert a != TransferResult(3, True, 4096, 0.25) and a != (3, True, 4096, 0.5)
    assert repr(a) == ("TransferResult(job_id=3, success=True, transfer_size=4096, transfer_time=0.5, "
                       "transfer_type=None)")
    assert TransferResult(4, False).transfer_time is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.job_id = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del a.success
    assert copy.copy(a) == a and pickle.loads(pickle.dumps(a)) == a
    fields = {"job_id": 3, "success": True, "transfer_size": 4096, "transfer_time": 0.5,
              "transfer_type": None}
    assert dataclasses.asdict(a) == fields
    assert dataclasses.replace(a, job_id=9) == TransferResult(9, True, 4096, 0.5)
    match a:
        case TransferResult(job_id, ok, size, seconds):
            assert (job_id, ok, size, seconds) == (3, True, 4096, 0.5)


def test_a_later_timed_result_reads_its_timer_once() -> None:
    calls: list[int] = []

    def timer() -> float:
        calls.append(1)
        return 0.125

    r = TransferResult.timed_later(5, 64, timer)
    assert calls == []  # nothing read until asked
    assert (r.job_id, r.success, r.transfer_size) == (5, True, 64) and calls == []
    assert r.transfer_time == 0.125 and r.transfer_time == 0.125 and calls == [1]
    assert r == TransferResult(5, True, 64, 0.125)
    assert dataclasses.asdict(TransferResult.timed_later(7, 2, timer))["transfer_time"] == 0.125
    later = TransferResult.timed_later(6, 1, timer)
    assert pickle.loads(pickle.dumps(later)) == TransferResult(6, True, 1, 0.125)


def _record_settles(monkeypatch: pytest.MonkeyPatch, log: list[tuple[str, int]]) -> None:
    def settle(self: CpuCompletion) -> None:
        log.append(("settle", id(self)))

    monkeypatch.setattr(CpuCompletion, "settle", settle, raising=False)


@pytest.mark.anyio
async def test_jobs_settle_after_the_awaiting_task_ran(
    kv4: KV, monkeypatch: pytest.MonkeyPatch, anyio_backend_name: str
) -> None:
    from aiokv.backends.cpu import CpuLane

    log: list[tuple[str, int]] = []
    _record_settles(monkeypatch, log)
    launched: list[CpuCompletion] = []  # each job's completion, as its lane hands it out
    launch = CpuLane.launch
    monkeypatch.setattr(CpuLane, "launch", lambda self, *a: launched.append(launch(self, *a)) or launched[-1])
    results, completions = [], []
    async with AsyncOffloadingWorker(kv4.kv, num_cpu_chunks=8) as worker:
        for i in range(12):
            src, dst = GPULoadStoreSpec([i % 4, 4 + i % 4]), CPULoadStoreSpec([i % 8, 7 - i % 8])
            fut = worker.submit_store(i, src, dst)
            completion = launched[-1]
            results.append(await fut)
            log.append(("woke", id(completion)))
            completions.append(completion)
        last = worker.submit_load(99, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]))
        completions.append(launched[-1])
        results.append(await last)
        await anyio.sleep(0.01)
        settled_open = {key for kind, key in log if kind == "settle"}
    # The poller settled the jobs while the worker was open, the last one included (no
    # poll followed it), not only the close.
    assert all(id(c) in settled_open for c in completions), (len(settled_open), len(completions))
    # Closing settled the last job, even if the poller never turned after its wake-up.
    for c in completions:
        assert ("settle", id(c)) in log
    if anyio_backend_name != "trio":  # trio may run the woken task and the poller in either order
        for c in completions[:-1]:
            assert log.index(("woke", id(c))) < log.index(("settle", id(c)))
    monkeypatch.undo()
    for c, r in zip(completions, results):
        assert r.success and r.transfer_time == c.elapsed and r.transfer_time > 0


def test_results_read_on_another_thread_carry_device_times(kv4: KV) -> None:
    """The sync face's contract on any backend (the CUDA read from a thread without a
    current context is tested in the GPU suite)."""
    w = SyncOffloadingWorker(kv4.kv, num_cpu_chunks=8)
    try:
        for i in range(6):
            w.submit_store(i, GPULoadStoreSpec([i]), CPULoadStoreSpec([i]))
        w.wait(set(range(6)))
        got: list = []
        while len(got) < 6:
            got.extend(w.get_finished())
        times: list = []
        reader = threading.Thread(target=lambda: times.extend(r.transfer_time for r in got))
        reader.start()
        reader.join()
        assert len(times) == 6 and all(t is not None and t > 0 for t in times)
    finally:
        w.shutdown()
