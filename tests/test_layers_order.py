"""Layerwise stores beside other jobs of their direction (later stores wait behind one with
layers still to come, so jobs land and report in submission order), cancellation of a
layer's await, and closing with a store half pushed (bounded, reported, nothing lost)."""

from __future__ import annotations

import threading
import time
import warnings

import anyio
import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LayerStatus,
    SyncOffloadingWorker,
    TransferFailed,
    UsageError,
)
from aiokv.backends.cpu import CpuBackend, CpuLane
from aiokv.errors import CudaCallFailed, WorkerBroken

from .conftest import make_layers
from .test_layers import same_layer, snapshot, sync_worker

READY, FAILED, PENDING = LayerStatus.READY, LayerStatus.FAILED, LayerStatus.PENDING
LAYERS = 4


def chunk_holds(w: SyncOffloadingWorker, kv: object, chunk: int, block: int, spare: int, job_id: int) -> bool:
    """Load ``chunk`` into block ``spare`` and say whether it held ``block``'s bytes."""
    before = snapshot(kv)  # type: ignore[arg-type]
    w.submit_load(job_id, CPULoadStoreSpec([chunk]), GPULoadStoreSpec([spare]))
    w.wait([job_id])
    return all(same_layer(kv, layer, [spare], [block], before) for layer in range(LAYERS))  # type: ignore[arg-type]


def test_a_later_store_waits_behind_an_open_layerwise_store_and_lands_after_it() -> None:
    """Three stores into chunk 5: A layerwise, B plain, C layerwise (pushed in full while A
    is still open). The chunk ends with C's block, and results come A, B, C."""
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=11)
    w = sync_worker(kv, chunks=8)
    a = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([5]), layerwise=True)
    a.push(0)
    assert w.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([5])) is True
    c = w.submit_store(3, GPULoadStoreSpec([3]), CPULoadStoreSpec([5]), layerwise=True)
    for layer in range(LAYERS):
        assert c.push(layer) is True  # accepted; enqueued once A has all its layers
    with pytest.raises(UsageError, match="behind"):
        c.gate(0)
    assert c.wait_layer(0, timeout=0.02) is PENDING
    # A load (another direction) is not held.
    w.submit_load(9, CPULoadStoreSpec([0]), GPULoadStoreSpec([10]))
    w.wait([9])
    assert [r.job_id for r in w.get_finished()] == [9]
    for layer in range(1, LAYERS):
        a.push(layer)
    w.wait([1, 2, 3])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True), (3, True)]
    assert c.gate(0) is READY
    assert chunk_holds(w, kv, chunk=5, block=3, spare=12, job_id=4)
    w.shutdown()


def test_a_plain_store_behind_an_open_one_lands_last_in_its_chunk() -> None:
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=12)
    w = sync_worker(kv, chunks=8)
    a = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([5]), layerwise=True)
    a.push(0)
    w.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([5]))
    time.sleep(0.05)  # had B gone to the lane, it would be done now, and A's later layers land over it
    for layer in range(1, LAYERS):
        a.push(layer)
    w.wait([1, 2])
    assert [r.job_id for r in w.get_finished()] == [1, 2]
    assert chunk_holds(w, kv, chunk=5, block=2, spare=12, job_id=3)
    w.shutdown()


def test_a_layerwise_load_runs_and_reports_in_order_with_plain_loads() -> None:
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=16)
    w = sync_worker(kv, chunks=8)
    w.submit_store(1, GPULoadStoreSpec([1, 2, 3]), CPULoadStoreSpec([0, 1, 2]))
    w.wait([1])
    go = threading.Event()
    w.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([8]), after=go)
    job = w.submit_load(3, CPULoadStoreSpec([1]), GPULoadStoreSpec([9]), layerwise=True)
    w.submit_load(4, CPULoadStoreSpec([2]), GPULoadStoreSpec([10]))
    assert job.wait_layer(0, timeout=0.05) is PENDING  # behind load 2, which waits on go
    go.set()
    w.wait([2, 3, 4])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True), (3, True), (4, True)]
    assert job.layer_status(LAYERS - 1) is READY
    w.shutdown()


def test_a_push_behind_an_open_store_whose_dependency_fails_returns_false(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A push to a store held behind another pins its dependency at once (on CUDA, a
    record on the caller's stream, which can fail). A failure there must not raise inside
    the forward: the push returns False, and that layer alone reports failed."""
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=17)
    before = snapshot(kv)
    w = sync_worker(kv, chunks=8)
    a = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([5]), layerwise=True)
    b = w.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([6]), layerwise=True)  # held behind A

    def failing_fix(self: CpuLane, dependency: object) -> None:
        raise CudaCallFailed("cuEventRecord failed (injected)", 700)

    with monkeypatch.context() as patch:
        patch.setattr(CpuLane, "fix", failing_fix)
        assert b.push(1) is False
    for layer in (0, 2, 3):
        assert b.push(layer) is True
    for layer in range(LAYERS):
        a.push(layer)
    w.wait([1, 2])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, False)]
    assert [b.layer_status(i) for i in range(LAYERS)] == [READY, FAILED, READY, READY]
    assert b.failed_blocks() == {2}
    w.submit_load(3, CPULoadStoreSpec([6]), GPULoadStoreSpec([12]))
    w.wait([3])
    assert all(same_layer(kv, layer, [12], [2], before) for layer in (0, 2, 3))
    w.shutdown()


@pytest.mark.parametrize("error", [WorkerBroken("the device failed (injected)"),
                                   CudaCallFailed("cuEventCreate failed (injected)", 2)])
def test_a_push_whose_dependency_cannot_be_taken_fails_its_layer(
        monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """Taking a push's dependency can fail on the device (CUDA: no event, or a dead
    context). The push returns False, never raises, and the layer counts as pushed and
    failed: the store ends once the rest are pushed, and the store held behind it goes."""
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=18)
    w = sync_worker(kv, chunks=8)
    a = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([5]), layerwise=True)
    w.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([6]))  # held behind A
    capture = CpuBackend.capture

    def failing(self: CpuBackend, after: object) -> object:
        raise error

    monkeypatch.setattr(CpuBackend, "capture", failing)
    assert a.push(0) is False
    monkeypatch.setattr(CpuBackend, "capture", capture)
    for layer in range(1, LAYERS):
        assert a.push(layer) is True
    results: list[tuple[int, bool]] = []
    deadline = time.monotonic() + 10
    while len(results) < 2 and time.monotonic() < deadline:
        results += [(r.job_id, r.success) for r in w.get_finished()]
        time.sleep(0.005)
    assert results == [(1, False), (2, True)], "the store short of a failed push held the next one"
    assert [a.layer_status(i) for i in range(LAYERS)] == [FAILED, READY, READY, READY]
    assert a.failed_blocks() == {1}
    w.shutdown()


@pytest.mark.anyio
async def test_cancelling_a_layer_await_cancels_the_wait_not_the_copy() -> None:
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=13)
    before = snapshot(kv)
    go = threading.Event()
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as w:
        (await w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1])))
        load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([8, 9]), layerwise=True, after=go)
        other: list[LayerStatus] = []

        async def patient() -> None:
            other.append(await load.layer(2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(patient)
            with anyio.move_on_after(0.02) as scope:
                await load.layer(2)
            assert scope.cancelled_caught
            go.set()
        assert other == [READY]
        assert (await load).success
        assert all(same_layer(kv, layer, [8, 9], [1, 2], before) for layer in range(LAYERS))
        assert not w._watch.waiting


def test_shutdown_with_a_store_half_pushed_is_bounded_and_reports_everything() -> None:
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=14)
    w = sync_worker(kv, chunks=8)
    a = w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1]), layerwise=True)
    a.push(0)
    a.push(1)
    w.submit_store(2, GPULoadStoreSpec([3]), CPULoadStoreSpec([2]))  # held behind A
    c = w.submit_store(3, GPULoadStoreSpec([4]), CPULoadStoreSpec([3]), layerwise=True)
    c.push(0)  # behind A too
    waited: list[LayerStatus] = []
    waiter = threading.Thread(target=lambda: waited.append(a.wait_layer(3)))  # no timeout
    waiter.start()
    closer = threading.Thread(target=w.shutdown)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an abandoned job would warn
        closer.start()
        closer.join(10)
    assert not closer.is_alive(), "shutdown waited for layers nobody will push"
    waiter.join(10)
    assert waited == [FAILED]
    results = {r.job_id: r.success for r in w.get_finished()}
    assert results == {1: False, 2: True, 3: False}
    assert [a.layer_status(i) for i in range(LAYERS)] == [READY, READY, FAILED, FAILED]
    assert a.failed_blocks() == {1, 2} and c.failed_blocks() == {4}
    assert a.push(2) is False  # closed: refused, not raised
    stats = w.statistics()
    assert stats.failed["store"] == 2 and stats.completed["store"] == 1 and stats.layers.failed_layers == 5


@pytest.mark.anyio
async def test_aclose_with_a_store_half_pushed_resolves_every_future() -> None:
    kv = make_layers(num_layers=LAYERS, num_blocks=16, seed=15)
    w = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu")
    statuses: list[LayerStatus] = []
    async with w:
        a = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
        a.push(0)
        b = w.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))

        async def awaits_unpushed() -> None:
            statuses.append(await a.layer(3))

        w._task_group.start_soon(awaits_unpushed)  # type: ignore[union-attr]
        await anyio.sleep(0.01)
    with pytest.raises(TransferFailed):
        await a
    assert (await b).success
    assert statuses == [FAILED] and a.failed_blocks() == {1}
