"""Layerwise jobs on the CPU backend through both faces: byte-exact round trips, gates that
really wait, a store layer that is not pushed never passing a gate, per-layer failures
reported as blocks to recompute (never raised from a gate), bad input refused with nothing
enqueued, and statistics. Ordering against other jobs, cancellation and shutdown are in
test_layers_order.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    DuplicateJob,
    GPULoadStoreSpec,
    InvalidSpec,
    LayerStatus,
    LayerwiseFuture,
    QueueFull,
    SyncOffloadingWorker,
    TransferFailed,
    UsageError,
)
from aiokv.backends.cpu import CpuLane

from .conftest import KV, make_layers, make_two_groups, same_bytes

READY, FAILED, PENDING = LayerStatus.READY, LayerStatus.FAILED, LayerStatus.PENDING


def sync_worker(kv: KV, chunks: int = 32, **kwargs: Any) -> SyncOffloadingWorker:
    return SyncOffloadingWorker(kv.kv, num_cpu_chunks=chunks, backend="cpu", **kwargs)


def pages_of(kv: KV, layer: int) -> list[tuple[int, int]]:
    """Layer ``layer``'s page tensors (their index), each with the bytes a job moves of a
    page: ``ref_layers`` says whose each ref is, else each ref is a layer, group by group."""
    desc = kv.kv
    owners, first = desc.ref_layers, 0
    if owners is None:
        owners = []
        for refs in desc.group_data_refs:
            owners.append(list(range(first, first + len(refs))))
            first += len(refs)
    return [(ref.tensor_idx, ref.page_size_bytes) for refs, layers in zip(desc.group_data_refs, owners)
            for ref, owner in zip(refs, layers) if owner == layer]


def same_layer(kv: KV, layer: int, dst: list[int], src: list[int],
               before: list[torch.Tensor] | None = None) -> bool:
    """Whether blocks ``dst`` hold, in layer ``layer``, the bytes blocks ``src`` held
    (``before``: a snapshot of the page tensors, else their bytes now)."""
    for t, used in pages_of(kv, layer):
        page = kv.kv.tensors[t].tensor
        ref = page if before is None else before[t]
        for d, s in zip(dst, src):
            if not same_bytes(page[d, :used], ref[s, :used]):
                return False
    return True


def snapshot(kv: KV) -> list[torch.Tensor]:
    return [t.tensor.clone() for t in kv.kv.tensors]


@pytest.fixture
def slow_layer(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[int]]]:
    """Hold the CPU lanes' ``n``-th copy item (set ``held[0] = n``) until the event is set."""
    release = threading.Event()
    held = [-1]
    seen = [0]
    copy = CpuLane._copy

    def slowed(self: CpuLane, plan: Any) -> None:
        seen[0] += 1
        if seen[0] == held[0]:
            assert release.wait(10)
        copy(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", slowed)
    yield release, held
    release.set()


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("bpc", [1, 2])
def test_a_layerwise_round_trip_is_byte_exact(bpc: int) -> None:
    kv = make_layers(num_layers=4, num_blocks=32, seed=3)
    before = snapshot(kv)
    w = sync_worker(kv, blocks_per_chunk=bpc)
    src, dst, chunks = [3, 9, 4, 20], [11, 12, 30, 0], [5, 1] if bpc == 2 else [5, 1, 7, 2]
    store = w.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(chunks), layerwise=True)
    assert store and store.num_layers == 4 and w.layers(1) is store
    for layer in range(4):
        assert store.push(layer) is True
    w.wait([1])
    load = w.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst), layerwise=True)
    for layer in range(4):
        assert load.gate(layer) is READY
        assert same_layer(kv, layer, dst, src, before)  # in place once its gate returned
    w.wait([2])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    assert load.failed_blocks() == set() and store.failed_blocks() == set()
    untouched = [b for b in range(32) if b not in dst]
    for t, b in zip(kv.kv.tensors, before):
        assert same_bytes(t.tensor[untouched], b[untouched])
    with pytest.raises(InvalidSpec):
        w.layers(1)  # reported: forgotten
    w.shutdown()


def test_two_groups_move_each_groups_layers_exactly() -> None:
    kv = make_two_groups(seed=5)
    kv.kv.ref_layers = [[0, 2, 4], [1, 3]]  # interleaved, as a hybrid model's forward runs
    before = snapshot(kv)
    w = sync_worker(kv, chunks=16)
    spec = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[2, 2])
    store = w.submit_store(1, spec, CPULoadStoreSpec([0, 1, 2, 3]), layerwise=True)
    for layer in (0, 1, 2, 3, 4):
        store.push(layer)
    w.wait([1])  # loads do not wait behind stores: the chunks must hold the bytes first
    dst = GPULoadStoreSpec([7, 8, 9, 10], group_sizes=[2, 2])
    load = w.submit_load(2, CPULoadStoreSpec([0, 1, 2, 3]), dst, layerwise=True)
    for layer in range(5):
        assert load.wait_layer(layer, timeout=10) is READY
        group_one = layer in (1, 3)
        moved = ([9, 10], [3, 4]) if group_one else ([7, 8], [1, 2])
        assert same_layer(kv, layer, *moved, before)
    w.shutdown()


@pytest.mark.anyio
async def test_async_layers_resolve_in_order_each_with_its_bytes_in_place() -> None:
    kv = make_layers(num_layers=6, num_blocks=16, seed=7)
    before = snapshot(kv)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as w:
        store = w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([3, 4]), layerwise=True)
        assert isinstance(store, LayerwiseFuture)
        for layer in range(6):
            store.push(layer)
        assert (await store).success
        go = threading.Event()
        load = w.submit_load(2, CPULoadStoreSpec([3, 4]), GPULoadStoreSpec([9, 10]), layerwise=True, after=go)
        seen: list[int] = []

        async def awaits(layer: int) -> None:
            assert await load.layer(layer) is READY
            # Every layer up to this one is done, its bytes in place.
            assert all(load.layer_status(j) is READY for j in range(layer + 1))
            assert same_layer(kv, layer, [9, 10], [1, 2], before)
            seen.append(layer)

        async with anyio.create_task_group() as tg:
            for layer in np.random.default_rng(1).permutation(6).tolist():
                tg.start_soon(awaits, layer)
            await anyio.sleep(0.02)
            assert seen == [] and load.layer_status(0) is PENDING
            go.set()
        assert sorted(seen) == list(range(6))
        assert (await load).success and load.failed_blocks() == set()
        assert not w._watch.waiting  # no waiter left behind


@pytest.mark.anyio
async def test_a_layer_resolves_while_later_layers_still_copy(
        slow_layer: tuple[threading.Event, list[int]]) -> None:
    release, held = slow_layer
    kv = make_layers(num_layers=4, num_blocks=16, seed=2)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as w:
        held[0] = 3  # the load's third item: layer 2
        load = w.submit_load(1, CPULoadStoreSpec([1, 2]), GPULoadStoreSpec([5, 6]), layerwise=True)
        with anyio.fail_after(10):
            assert await load.layer(1) is READY
        assert load.layer_status(2) is PENDING and not load.done()
        release.set()
        with anyio.fail_after(10):
            assert await load.layer(3) is READY
            assert (await load).success


@pytest.mark.anyio
async def test_a_layer_awaited_while_the_poller_naps_resolves_when_it_lands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The poller naps armed on its heads' ends only; an await that begins then must wake
    it, or its layer is seen only when the nap ends (here: never, before the job does)."""
    from aiokv.poller import Poller

    monkeypatch.setitem(Poller.__init__.__kwdefaults__, "max_nap", 60.0)
    kv = make_layers(num_layers=4, num_blocks=16, seed=21)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as w:
        store = w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1]), layerwise=True)
        go = threading.Event()
        store.push(0, after=go)
        await anyio.sleep(0.05)  # the poller naps now, on the store's end (layers 1-3 to come)
        landing = threading.Timer(0.02, go.set)
        landing.start()
        try:
            with anyio.fail_after(10):
                assert await store.layer(0) is READY
            assert not store.done()
        finally:
            landing.cancel()
            go.set()
            for layer in range(1, 4):
                store.push(layer)
        assert (await store).success


# -- gates ------------------------------------------------------------------------------------


def test_a_gate_before_its_layer_is_done_blocks_until_it_is() -> None:
    kv = make_layers(num_layers=3, num_blocks=16, seed=4)
    before = snapshot(kv)
    w = sync_worker(kv, chunks=8)
    w.submit_store(1, GPULoadStoreSpec([2, 3]), CPULoadStoreSpec([0, 1]))
    w.wait([1])
    go = threading.Event()
    load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([7, 8]), layerwise=True, after=go)
    got: list[Any] = []

    def consumer() -> None:
        status = load.gate(1)
        got.append((status, same_layer(kv, 1, [7, 8], [2, 3], before)))

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(0.05)
    assert thread.is_alive() and load.layer_status(1) is PENDING, "the gate passed a layer not done"
    go.set()
    thread.join(10)
    assert got == [(READY, True)]
    stats = w.statistics().layers
    assert stats.gates == 1 and stats.stalls_measured == 1 and stats.stalls[-1] > 0
    w.shutdown()


def test_the_timeline_places_each_layers_copy_before_its_start(slow_layer) -> None:
    """A load gated layer by layer while its layer 1 copies late: the timeline (host clock
    on the CPU) has every layer's copy end, and each gated layer's start after it; the gate
    on layer 1 arrived before the copy ended and waited for it (the forward ran while the
    prefix was still arriving: a positive overlap)."""
    release, held = slow_layer
    kv = make_layers(num_layers=3, num_blocks=16, seed=6)
    w = sync_worker(kv, chunks=8)
    w.submit_store(1, GPULoadStoreSpec([2, 3]), CPULoadStoreSpec([0, 1]))
    w.wait([1])
    held[0] = 3  # the third copy item: the store, the load's layer 0, its layer 1
    load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([7, 8]), layerwise=True)
    assert load.timeline() is None  # not done yet
    assert load.gate(0) is READY
    threading.Timer(0.05, release.set).start()
    assert load.gate(1) is READY and load.gate(2) is READY
    w.wait([2])
    tl = load.timeline()
    assert tl is not None and tl.clock == "host" and tl.num_layers == 3
    assert all(t is not None for t in tl.copy_done + tl.reached + tl.started)
    slack = tl.slack()
    assert all(x is not None and x >= 0 for x in slack), "a layer started before its copy ended"
    assert tl.reached[1] < tl.copy_done[1] <= tl.started[1]  # type: ignore[operator]
    assert tl.stalls()[1] >= 0.03 and tl.overlap is not None and tl.overlap > 0
    assert all(t is not None and t < 0.01 for t in tl.issued) and tl.blocked == (0.0,) * 3  # at submit
    w.shutdown()


def test_a_gate_on_a_store_layer_not_pushed_never_passes() -> None:
    kv = make_layers(num_layers=3, num_blocks=16)
    w = sync_worker(kv, chunks=8)
    store = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
    with pytest.raises(UsageError, match="not pushed"):
        store.gate(0)
    assert store.wait_layer(0, timeout=0.02) is PENDING and store.layer_status(0) is PENDING
    store.push(0)
    assert store.wait_layer(0, timeout=10) is READY and store.gate(0) is READY
    # A push another thread makes ends a wait that began before it.
    waited: list[LayerStatus] = []
    thread = threading.Thread(target=lambda: waited.append(store.wait_layer(2, timeout=10)))
    thread.start()
    store.push(1)
    store.push(2)
    thread.join(10)
    assert waited == [READY]
    w.wait([1])
    assert [r.success for r in w.get_finished()] == [True]
    w.shutdown()


def test_a_cpu_gate_takes_no_stream() -> None:
    w = sync_worker(make_layers(num_layers=2))
    load = w.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]), layerwise=True)
    with pytest.raises(InvalidSpec, match="stream=None"):
        load.gate(0, stream=7)
    w.shutdown()


# -- failures ---------------------------------------------------------------------------------


def failing_copy(monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """The CPU lanes' ``nth`` copy item (counted from the patch on) raises."""
    seen = [0]
    copy = CpuLane._copy

    def broken(self: CpuLane, plan: Any) -> None:
        seen[0] += 1
        if seen[0] == nth:
            raise OSError("injected copy failure")
        copy(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", broken)


def test_a_failed_layer_reports_its_blocks_and_never_raises_from_a_gate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_layers(num_layers=4, num_blocks=16, seed=8)
    before = snapshot(kv)
    w = sync_worker(kv, chunks=8)
    w.submit_store(1, GPULoadStoreSpec([1, 2, 3]), CPULoadStoreSpec([0, 1, 2]))
    w.wait([1])
    failing_copy(monkeypatch, 3)  # the load's layer 2
    load = w.submit_load(2, CPULoadStoreSpec([0, 1, 2]), GPULoadStoreSpec([9, 10, 11]), layerwise=True)
    assert [load.gate(layer) for layer in range(4)] == [READY, READY, FAILED, READY]
    assert load.wait_layer(2) is FAILED and load.layer_status(2) is FAILED
    w.wait([2])
    (result,) = w.get_finished()[-1:]
    assert result.job_id == 2 and not result.success
    assert load.failed_blocks() == {9, 10, 11}
    assert same_layer(kv, 3, [9, 10, 11], [1, 2, 3], before)  # the other layers landed
    assert w.statistics().layers.failed_layers == 1
    w.shutdown()


def test_a_failed_layer_of_one_group_fails_only_that_groups_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make_two_groups(seed=9)  # layers 0-2 in group 0, 3-4 in group 1
    w = sync_worker(kv, chunks=16)
    failing_copy(monkeypatch, 4)  # layer 3
    dst = GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[2, 2])
    load = w.submit_load(1, CPULoadStoreSpec([0, 1, 2, 3]), dst, layerwise=True)
    assert [load.wait_layer(layer, timeout=10) for layer in range(5)] == [READY, READY, READY, FAILED, READY]
    w.wait([1])
    assert load.failed_blocks() == {3, 4}
    w.shutdown()


@pytest.mark.anyio
async def test_an_awaited_failed_layer_returns_failed_and_the_job_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    failing_copy(monkeypatch, 2)  # layer 1
    async with AsyncOffloadingWorker(make_layers(num_layers=3).kv, num_cpu_chunks=8, backend="cpu") as w:
        load = w.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([4]), layerwise=True)
        with anyio.fail_after(10):
            assert [await load.layer(i) for i in range(3)] == [READY, FAILED, READY]
            with pytest.raises(TransferFailed):
                await load
        assert load.failed_blocks() == {4}


# -- bad input ----------------------------------------------------------------------------------


def test_layerwise_on_a_cross_layer_layout_is_refused_with_nothing_enqueued() -> None:
    cross = torch.randint(0, 255, (16, 4, 2, 8), dtype=torch.uint8)  # (num_blocks, layers, ...)
    w = SyncOffloadingWorker(CanonicalKVCaches.from_tensors([cross]), num_cpu_chunks=4, backend="cpu")
    with pytest.raises(InvalidSpec, match="cross-layer"):
        w.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]), layerwise=True)
    with pytest.raises(InvalidSpec, match="cross-layer"):
        w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
    assert w.in_flight == 0 and w.statistics().layers.jobs == 0
    assert w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0])) is True  # still usable
    w.shutdown()


def test_bad_layer_indices_pushes_and_arguments_raise_typed_errors() -> None:
    w = sync_worker(make_layers(num_layers=4), chunks=8)
    store = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
    load = w.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), layerwise=True)
    for call in (lambda: store.push(4), lambda: store.push(-1), lambda: load.gate(9),
                 lambda: load.wait_layer(True), lambda: load.layer_status(1.0)):
        with pytest.raises(InvalidSpec, match="layer"):
            call()
    with pytest.raises(InvalidSpec, match="after"):
        store.push(0, after=42)  # not a threading.Event
    assert store.layers_pushed == 0  # nothing was taken
    store.push(0)
    with pytest.raises(UsageError, match="pushed already"):
        store.push(0)
    with pytest.raises(UsageError, match="load"):
        load.push(0)
    with pytest.raises(InvalidSpec, match="push"):
        w.submit_store(3, GPULoadStoreSpec([5]), CPULoadStoreSpec([3]), after=threading.Event(),
                       layerwise=True)
    with pytest.raises(DuplicateJob):
        w.submit_load(1, CPULoadStoreSpec([4]), GPULoadStoreSpec([6]), layerwise=True)
    with pytest.raises(InvalidSpec):
        w.layers(99)
    for layer in (1, 2, 3):
        store.push(layer)
    w.wait([1, 2])
    assert [r.success for r in w.get_finished()] == [True, True]
    w.shutdown()


def test_a_ref_layers_that_does_not_fit_the_refs_fails_the_worker_build() -> None:
    kv = make_layers(num_layers=2)
    kv.kv.ref_layers = [[0, 1]]  # four refs (K and V of two layers)
    with pytest.raises(InvalidSpec, match="ref_layers"):
        sync_worker(kv)


@pytest.mark.anyio
async def test_async_bad_input_and_the_bound() -> None:
    kv = make_layers(num_layers=3)
    go = threading.Event()
    opts = {"max_in_flight": 1}
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu", options=opts) as w:
        load = w.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]), layerwise=True, after=go)
        with pytest.raises(InvalidSpec, match="layer"):
            load.layer(3)
        with pytest.raises(QueueFull):
            w.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), layerwise=True)
        go.set()
        assert (await load).success
        await w.wait_for_room()
        assert (await w.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), layerwise=True)).success


def test_statistics_count_jobs_pushes_gates_and_waits() -> None:
    w = sync_worker(make_layers(num_layers=2), chunks=8)
    store = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
    store.push(0)
    store.push(1)
    store.wait_layer(1, timeout=10)
    load = w.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([2]), layerwise=True)
    load.gate(0)
    load.gate(1)
    w.wait([1, 2])
    stats = w.statistics().layers
    assert (stats.jobs, stats.pushed, stats.gates, stats.waits, stats.failed_layers) == (2, 2, 2, 1, 0)
    # The gates' stalls (the forward's) apart from the wait's host time: one figure from
    # two clocks (a CUDA gate's is device time) would answer neither question.
    assert stats.stalls_measured == 2 and len(stats.stalls) == 2 and min(stats.stalls) >= 0
    assert len(stats.waited) == 1 and stats.waited[0] >= 0
    w.shutdown()


@pytest.mark.anyio
async def test_awaited_layers_count_as_waits_not_as_gate_stalls() -> None:
    kv = make_layers(num_layers=2, num_blocks=16, seed=22)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8, backend="cpu") as w:
        await w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
        go = threading.Event()
        load = w.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([2]), layerwise=True, after=go)
        threading.Timer(0.01, go.set).start()
        assert await load.layer(0) is READY and await load.layer(1) is READY
        await load
        stats = w.statistics().layers
        assert stats.waits == 2 and len(stats.waited) == 2
        assert stats.stalls == () and stats.stalls_measured == 0


def test_closing_lets_go_of_stall_samples_not_read_yet() -> None:
    """A measured CUDA gate's sample is read once its consumer stream passed it; one still
    pending at close is read or let go then, never through a driver already closed."""
    w = sync_worker(make_layers(num_layers=2), chunks=8)
    closed, reads, dropped = [False], [], []

    def read() -> tuple[bool, float | None]:
        reads.append(closed[0])
        return False, None  # the consumer stream has not passed it yet

    w._core.layerwise.meter.later(read, lambda: dropped.append(closed[0]))
    w.shutdown()
    closed[0] = True
    assert w.statistics().layers.stalls == ()
    assert True not in reads, "a pending sample was read after the worker closed"
    assert dropped == [False]


def test_the_sync_face_blocks_a_layerwise_submit_at_the_bound() -> None:
    w = sync_worker(make_layers(num_layers=2), chunks=8, options={"max_in_flight": 1})
    go = threading.Event()
    w.submit_load(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([1]), after=go)
    threading.Timer(0.02, go.set).start()
    job = w.submit_load(2, CPULoadStoreSpec([1]), GPULoadStoreSpec([2]), layerwise=True)  # blocks, then goes
    assert job.wait_layer(1, timeout=10) is READY
    w.shutdown()
