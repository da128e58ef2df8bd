"""The CPU backend on its own: lanes copy byte-exact, in launch order, after their
dependency; failures are reported, never fatal to the lane; the pool and the bell."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from aiokv.backends.cpu import CpuBackend, CpuCompletion, CpuHostPool, CpuLane
from aiokv.doorbell import Doorbell
from aiokv.errors import HostMemoryError, InvalidSpec
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import CopyPlan, HostLayout, map_blocks, plan_copies
from aiokv.specs import Direction
from tests.conftest import make_layers, make_two_groups, random_bytes_, same_bytes


def _plan(layout: HostLayout, blocks: list[int], chunks: list[int], num_chunks: int,
          direction: Direction, **groups) -> CopyPlan:
    mapping = map_blocks(blocks, chunks, layout=layout, num_chunks=num_chunks,
                         unique_gpu=not direction.to_host, unique_host=direction.to_host, **groups)
    return plan_copies(mapping, layout)


class _Rig:
    """A KV cache, a pool and the store and load lanes over them."""

    def __init__(self, kv: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int = 1) -> None:
        self.kv = kv
        self.layout = HostLayout.build(kv, blocks_per_chunk)
        self.num_chunks = num_chunks
        self.pool = CpuHostPool(num_chunks * self.layout.chunk_bytes)
        random_bytes_(self.pool.tensor, torch.Generator().manual_seed(99))
        self.store = CpuLane(Direction.STORE, kv, self.pool)
        self.load = CpuLane(Direction.LOAD, kv, self.pool)

    def plan(self, direction: Direction, blocks: list[int], chunks: list[int], **groups) -> CopyPlan:
        return _plan(self.layout, blocks, chunks, self.num_chunks, direction, **groups)

    def close(self) -> None:
        self.store.close()
        self.load.close()
        self.pool.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.bool,
                                   getattr(torch, "float8_e4m3fn", torch.uint8)])
@pytest.mark.parametrize("bpc", [1, 4])
def test_store_then_load_is_byte_exact_on_random_data_of_every_dtype(dtype: torch.dtype, bpc: int) -> None:
    kv = make_layers(num_layers=3, num_blocks=60, page_shape=(2, 4, 8), dtype=dtype, seed=bpc)
    rig = _Rig(kv.kv, num_chunks=12, blocks_per_chunk=bpc)
    rng = np.random.default_rng(7)
    nblocks = 6 * bpc
    blocks = rng.choice(60, nblocks, replace=False).tolist()
    chunks = rng.choice(12, 6, replace=False).tolist()
    want = [t.tensor[blocks].clone() for t in kv.kv.tensors]
    done = rig.store.launch(rig.plan(Direction.STORE, blocks, chunks), None)
    assert done.wait(10) and done.error is None and done.elapsed is not None
    # Each chunk holds blocks_per_chunk consecutive blocks of every page tensor, page-major
    # in device address order: check the pool bytes directly.
    order = sorted(range(len(kv.kv.tensors)), key=lambda i: kv.kv.tensors[i].tensor.data_ptr())
    pool = rig.pool.tensor
    for c, chunk in enumerate(chunks):
        base = chunk * rig.layout.chunk_bytes
        offset = 0
        for i in order:
            page = kv.kv.tensors[i].page_size_bytes
            for s in range(bpc):
                got = pool[base + offset + s * page : base + offset + (s + 1) * page]
                assert same_bytes(got, want[i][c * bpc + s]), (chunk, i, s)
            offset += page * bpc
    # Load into other blocks: byte-exact, and no block outside them changes.
    targets = [b for b in range(60) if b not in blocks][:nblocks]
    before = [t.tensor.clone() for t in kv.kv.tensors]
    done = rig.load.launch(rig.plan(Direction.LOAD, targets, chunks), None)
    assert done.wait(10) and done.error is None
    others = [b for b in range(60) if b not in targets]
    for t, w, b in zip(kv.kv.tensors, want, before):
        assert same_bytes(t.tensor[targets], w)
        assert same_bytes(t.tensor[others], b[others])
    rig.close()


def test_two_groups_with_partial_pages_move_only_their_bytes() -> None:
    kv = make_two_groups()
    rig = _Rig(kv.kv, num_chunks=6)
    spec = dict(group_sizes=[2, 2])
    done = rig.store.launch(rig.plan(Direction.STORE, [5, 9, 3, 4], [0, 1, 2, 3], **spec), None)
    assert done.wait(10) and done.error is None
    wide = kv.kv.tensors[4].tensor[[3, 4]].clone()  # group 1 moves 64 of 96 bytes here
    kv.kv.tensors[4].tensor[[10, 11]] = 0
    done = rig.load.launch(rig.plan(Direction.LOAD, [7, 8, 10, 11], [0, 1, 2, 3], **spec), None)
    assert done.wait(10) and done.error is None
    got = kv.kv.tensors[4].tensor[[10, 11]]
    assert same_bytes(got[:, :64], wide[:, :64]) and not got[:, 64:].any()
    for i in range(3):
        t = kv.kv.tensors[i].tensor
        assert same_bytes(t[[7, 8]], t[[5, 9]])
    rig.close()


def test_a_lane_runs_jobs_in_launch_order_each_after_its_dependency() -> None:
    kv = make_layers(num_layers=1, num_blocks=16)
    rig = _Rig(kv.kv, num_chunks=16)
    latch = threading.Event()
    first = rig.store.launch(rig.plan(Direction.STORE, [1], [1]), latch)
    later = [rig.store.launch(rig.plan(Direction.STORE, [b], [b]), None) for b in range(2, 10)]
    other_lane = rig.load.launch(rig.plan(Direction.LOAD, [12], [12]), None)
    assert other_lane.wait(10), "a held store lane held up the load lane"
    time.sleep(0.05)
    assert not first.query() and not any(c.query() for c in later)
    assert first.started_at is None
    latch.set()
    assert all(c.wait(10) for c in later)
    starts = [first.started_at] + [c.started_at for c in later]
    assert all(s is not None for s in starts) and starts == sorted(starts)
    rig.close()


def test_a_failed_copy_is_reported_and_the_lane_goes_on(monkeypatch) -> None:
    kv = make_layers(num_layers=1, num_blocks=8)
    rig = _Rig(kv.kv, num_chunks=8)
    real_copy = CpuLane._copy
    calls = []

    def flaky(self, plan):
        calls.append(plan)
        if len(calls) == 1:
            raise OSError("simulated copy failure")
        real_copy(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", flaky)
    bad = rig.store.launch(rig.plan(Direction.STORE, [1], [1]), None)
    good = rig.store.launch(rig.plan(Direction.STORE, [2], [2]), None)
    assert bad.wait(10) and good.wait(10)
    assert isinstance(bad.error, OSError) and bad.elapsed is None
    assert good.error is None and good.elapsed is not None
    rig.close()


def test_capture_takes_none_or_a_threading_event() -> None:
    backend = CpuBackend()
    latch = threading.Event()
    assert backend.capture(None) is None and backend.capture(latch) is latch
    for bad in (object(), 1, "stream"):
        with pytest.raises(InvalidSpec, match=r"threading\.Event"):
            backend.capture(bad)
        with pytest.raises(InvalidSpec, match=r"threading\.Event"):
            backend.check_after(bad)


def test_check_caches_refuses_tensors_off_the_cpu() -> None:
    meta = CanonicalKVCaches.from_tensors([torch.empty(8, 64, device="meta")])
    with pytest.raises(InvalidSpec, match="needs CPU tensors"):
        CpuBackend().check_caches(meta)
    CpuBackend().check_caches(make_layers(num_layers=1).kv)


def test_a_pool_that_cannot_be_allocated_is_a_host_memory_error() -> None:
    with pytest.raises(HostMemoryError, match="could not allocate a host pool of"):
        CpuHostPool(1 << 62)
    pool = CpuHostPool(4096)
    assert pool.tensor.numel() == 4096
    pool.close()
    assert pool.tensor.numel() == 0


def test_a_completion_rings_its_bells_when_done_or_at_once_if_done() -> None:
    bell = Doorbell()
    try:
        completion = CpuCompletion()
        assert completion.ring_when_done(bell) and not bell.drain()
        completion._finish(None, 1e-3)
        assert bell.drain() and completion.query() and completion.elapsed == 1e-3
        assert completion.ring_when_done(bell) and bell.drain()  # done already: rung at once
    finally:
        bell.close()


def test_abandoning_a_lane_stuck_on_an_unset_event_returns_at_once() -> None:
    kv = make_layers(num_layers=1, num_blocks=8)
    rig = _Rig(kv.kv, num_chunks=8)
    never = threading.Event()
    stuck = rig.store.launch(rig.plan(Direction.STORE, [1], [1]), never)
    while rig.store._waiting_on is None:
        time.sleep(0.001)
    began = time.monotonic()
    rig.store.abandon()
    assert time.monotonic() - began < 1.0 and rig.store._thread.is_alive()
    never.set()  # the copy still lands in the pool the lane kept, and the thread ends
    rig.store._thread.join(10)
    assert stuck.query() and stuck.error is None and not rig.store._thread.is_alive()
    rig.load.close()
