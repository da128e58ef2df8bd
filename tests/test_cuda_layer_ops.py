"""A layerwise job folded into few driver operations a layer (``backends.cuda.layer_ops``):
the ops move exactly the bytes of the layer plan, each inside its own layer, a run of
blocks and chunks that advance together is one pitched op a page tensor, and short runs
stay plain descriptors. Pure numpy over host memory: no device needed."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.backends.cuda import layer_ops
from aiokv.backends.cuda.layer_ops import LayerOps, fold_ids, fold_layers, prefer_staged, worth_staging
from aiokv.layer_plan import LayerMap, plan_layers
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import HostLayout, map_blocks

from .conftest import make_two_groups

LAYERS, BLOCKS, NUM_CHUNKS = 3, 24, 24


def setup(bpc: int, seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches, HostLayout, np.ndarray]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (2, BLOCKS, 48), dtype=torch.uint8, generator=gen)
               for _ in range(LAYERS)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    layout = HostLayout.build(kv, bpc)
    host = np.random.default_rng(seed).integers(0, 256, NUM_CHUNKS * layout.chunk_bytes, dtype=np.uint8)
    return tensors, kv, layout, host


def run_ops(ops: LayerOps, layers: range | None = None) -> None:
    """What the driver does with them: each pitched op row by row, then the plain copies."""
    for layer in layers if layers is not None else range(ops.num_layers):
        p = ops.pitched
        for i in range(int(ops.pbounds[layer]), int(ops.pbounds[layer + 1])):
            for r in range(int(p.height[i])):
                dst, src = int(p.dst[i]) + r * int(p.dst_pitch[i]), int(p.src[i]) + r * int(p.src_pitch[i])
                ctypes.memmove(dst, src, int(p.width[i]))
        for i in range(int(ops.bounds[layer]), int(ops.bounds[layer + 1])):
            ctypes.memmove(int(ops.dst[i]), int(ops.src[i]), int(ops.sizes[i]))


def fold(kv: CanonicalKVCaches, layout: HostLayout, host: np.ndarray, gpu: list[int], chunks: list[int], *,
         to_host: bool, max_pitch: int = 1 << 20, min_height: int = 2, skip: int = 0) -> LayerOps:
    m = map_blocks(gpu, chunks, layout=layout, num_chunks=NUM_CHUNKS, block_indices=[skip],
                   unique_host=to_host, unique_gpu=not to_host)
    plan = plan_layers(m, layout, LayerMap.build(kv, layout))
    base = np.array([t.tensor.data_ptr() for t in kv.tensors], dtype=np.int64)
    return fold_layers(plan, plan.bounds, base, host.ctypes.data, to_host=to_host, max_pitch=max_pitch,
                       min_height=min_height)


@settings(max_examples=60, deadline=None)
@given(bpc=st.integers(1, 3), min_height=st.integers(2, 5), data=st.data())
def test_folded_ops_move_exactly_the_bytes_of_the_layer_plan(bpc: int, min_height: int, data) -> None:
    """Stores of random jobs (runs drawn in), folded and unfolded, fill the pool alike; a
    load of them back into other blocks, layer by layer, writes only that layer's pages."""
    tensors, kv, layout, host = setup(bpc, data.draw(st.integers(0, 9)))
    n = data.draw(st.integers(1, 10))
    skip = data.draw(st.integers(0, bpc - 1))
    first = data.draw(st.integers(0, BLOCKS - n))
    run = data.draw(st.booleans())
    gpu = list(range(first, first + n)) if run else data.draw(st.permutations(range(BLOCKS)))[:n]
    need = -(-(n + skip) // bpc)
    c0 = data.draw(st.integers(0, NUM_CHUNKS - need))
    chunks = list(range(c0, c0 + need)) if data.draw(st.booleans()) else \
        data.draw(st.permutations(range(NUM_CHUNKS)))[:need]
    expect = host.copy()
    run_ops(fold(kv, layout, expect, gpu, chunks, to_host=True, max_pitch=0, skip=skip))
    folded = fold(kv, layout, host, gpu, chunks, to_host=True, min_height=min_height, skip=skip)
    assert (folded.pitched.height >= min_height).all()
    assert (folded.pitched.dst_pitch >= folded.pitched.width).all()
    assert (folded.pitched.src_pitch >= folded.pitched.width).all()
    run_ops(folded)
    assert np.array_equal(host, expect)
    # Back into other blocks, layer by layer.
    dst = [(b + BLOCKS // 2) % BLOCKS for b in gpu] if run else list(reversed(gpu))
    before = [t.clone() for t in tensors]
    ops = fold(kv, layout, host, dst, chunks, to_host=False, min_height=min_height, skip=skip)
    for layer in range(LAYERS):
        run_ops(ops, range(layer, layer + 1))
        for other in range(layer + 1, LAYERS):
            assert torch.equal(tensors[other], before[other]), f"layer {layer}'s ops wrote layer {other}"
        assert torch.equal(tensors[layer][:, dst], before[layer][:, gpu])
        untouched = [b for b in range(BLOCKS) if b not in dst]
        assert torch.equal(tensors[layer][:, untouched], before[layer][:, untouched])


def same_ops(a: LayerOps, b: LayerOps) -> bool:
    pa, pb = a.pitched, b.pitched
    return all(np.array_equal(x, y) for x, y in (
        (a.dst, b.dst), (a.src, b.src), (a.sizes, b.sizes), (a.bounds, b.bounds), (a.pbounds, b.pbounds),
        (pa.dst, pb.dst), (pa.dst_pitch, pb.dst_pitch), (pa.src, pb.src), (pa.src_pitch, pb.src_pitch),
        (pa.width, pb.width), (pa.height, pb.height)))


@settings(max_examples=80, deadline=None)
@given(two_groups=st.booleans(), to_host=st.booleans(), min_height=st.integers(2, 5),
       max_pitch=st.sampled_from([1 << 20, 600, 300]), data=st.data())
def test_folding_from_the_ids_gives_the_ops_the_page_columns_give(
        two_groups: bool, to_host: bool, min_height: int, max_pitch: int, data) -> None:
    """``fold_ids`` (the submit's path: runs found once on the ids, given to every page
    tensor) against ``fold_layers`` over the layer plan's page columns: the same ops in the
    same order, for runs, scattered ids, repeated chunks (a load may read one twice), two
    groups of different page sizes and strides, and pitch limits that refuse some links."""
    if two_groups:
        kv = make_two_groups().kv
        kv.ref_layers = data.draw(st.sampled_from([None, [[0, 2, 4], [1, 3]], [[0, 1, 2], [0, 1]]]))
        counts = (40, 24)
    else:
        kv = setup(1, 0)[1]
        counts = (BLOCKS,)
    layout = HostLayout.build(kv, 1)
    lmap = LayerMap.build(kv, layout)
    gpu, sizes = [], []
    for limit in counts:
        n = data.draw(st.integers(0, min(limit, 10)))
        first = data.draw(st.integers(0, limit - n))
        gpu += data.draw(st.sampled_from([list(range(first, first + n)),
                                          data.draw(st.permutations(range(limit)))[:n]]))
        sizes.append(n)
    total = sum(sizes)
    if not total:
        return
    c0 = data.draw(st.integers(0, NUM_CHUNKS - total))
    if to_host or data.draw(st.booleans()):  # a store writes each chunk once
        chunks = data.draw(st.sampled_from([list(range(c0, c0 + total)),
                                            data.draw(st.permutations(range(NUM_CHUNKS)))[:total]]))
    else:
        chunks = [data.draw(st.integers(0, NUM_CHUNKS - 1)) for _ in range(total)]
    m = map_blocks(gpu, chunks, layout=layout, num_chunks=NUM_CHUNKS,
                   group_sizes=sizes if two_groups else None, unique_host=to_host, unique_gpu=not to_host)
    plan = plan_layers(m, layout, lmap)
    base = np.array([(1 << 24) * (i + 1) for i in range(len(kv.tensors))], dtype=np.int64)
    fast = fold_ids(plan, base, 1 << 40, to_host=to_host, max_pitch=max_pitch, min_height=min_height)
    assert plan._columns is None, "folding from the ids built the page columns"
    slow = fold_layers(plan, plan.bounds, base, 1 << 40, to_host=to_host, max_pitch=max_pitch,
                       min_height=min_height)
    assert fast is not None and same_ops(fast, slow)


def test_folding_from_the_ids_declines_layouts_it_does_not_cover() -> None:
    _, kv, layout, _ = setup(2, 0)  # two blocks a chunk
    m = map_blocks([1, 2, 3], [0, 1], layout=layout, num_chunks=NUM_CHUNKS)
    plan = plan_layers(m, layout, LayerMap.build(kv, layout))
    base = np.zeros(len(kv.tensors), dtype=np.int64)
    assert fold_ids(plan, base, 0, to_host=False, max_pitch=1 << 20) is None
    layout1 = HostLayout.build(kv, 1)
    plan1 = plan_layers(map_blocks([1, 2], [0, 1], layout=layout1, num_chunks=NUM_CHUNKS), layout1,
                        LayerMap.build(kv, layout1))
    assert fold_ids(plan1, base, 0, to_host=False, max_pitch=0) is None  # no 2-D copies: plain


def test_blocks_and_chunks_that_advance_together_are_one_op_a_page_tensor() -> None:
    """The issue's shape, small: a layer's K and V pages of 16 consecutive blocks in 16
    consecutive chunks are 32 descriptors unfolded and two 16-row pitched ops folded (the
    host pitch is the chunk, the device pitch the block row)."""
    _, kv, layout, host = setup(1, 0)
    gpu, chunks = list(range(4, 20)), list(range(2, 18))
    plain = fold(kv, layout, host, gpu, chunks, to_host=False, max_pitch=0)
    assert [plain.descriptors(i) for i in range(LAYERS)] == [32] * LAYERS
    folded = fold(kv, layout, host, gpu, chunks, to_host=False, min_height=4)
    assert [folded.descriptors(i) for i in range(LAYERS)] == [2] * LAYERS
    p = folded.pitched
    assert set(p.height.tolist()) == {16} and set(p.width.tolist()) == {48}
    assert set(p.src_pitch.tolist()) == {layout.chunk_bytes} and set(p.dst_pitch.tolist()) == {48}
    # A gap in the chunks cuts the run in two; a run shorter than min_height stays plain.
    cut = fold(kv, layout, host, gpu, chunks[:10] + [c + 1 for c in chunks[10:]], to_host=False, min_height=7)
    assert [cut.descriptors(i) for i in range(LAYERS)] == [2 + 12] * LAYERS
    assert set(cut.pitched.height.tolist()) == {10}


@pytest.mark.parametrize("pitch_limit", [48, 1 << 20])
def test_a_pitch_over_the_drivers_limit_folds_nothing(pitch_limit: int) -> None:
    _, kv, layout, host = setup(1, 1)
    folded = fold(kv, layout, host, list(range(8)), list(range(8)), to_host=True, max_pitch=pitch_limit)
    assert len(folded.pitched) == (0 if pitch_limit < layout.chunk_bytes else 2 * LAYERS)


class Through:
    """A stand-in for a job through the device slot, at a given cost a layer."""

    def __init__(self, us: float) -> None:
        self.us = us

    def costs_us(self) -> np.ndarray:
        return np.full(LAYERS, self.us)


def test_scattered_small_pages_go_through_the_slot_and_runs_straight_to_their_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The one rule: through the slot only where a layer straight to its pages takes
    longer to enqueue than STAGE_ABOVE_COPY times its copy and over STAGE_ABOVE_US (20 us
    here: this layout's jobs are small; its 48-byte pages copy in no time), and the slot
    takes at most half as long."""
    monkeypatch.setattr(layer_ops, "STAGE_ABOVE_US", 20.0)
    _, kv, layout, host = setup(1, 2)
    chunks = list(range(20))
    runs = fold(kv, layout, host, list(range(2, 22)), chunks, to_host=False, min_height=4)
    blocks = np.random.default_rng(0).permutation(BLOCKS)[:20].tolist()
    scattered = fold(kv, layout, host, blocks, chunks, to_host=False, min_height=4)
    nbytes = np.full(LAYERS, 20 * 96)
    assert [runs.descriptors(i) for i in range(LAYERS)] == [2] * LAYERS
    assert min(scattered.descriptors(i) for i in range(LAYERS)) > 30
    assert not worth_staging(runs, nbytes) and worth_staging(scattered, nbytes)
    cost = scattered.cost_us(0)
    assert cost > layer_ops.STAGE_ABOVE_US
    assert prefer_staged(scattered, Through(cost / 2), nbytes)
    assert not prefer_staged(scattered, Through(cost / 2 + 1), nbytes)
    assert not prefer_staged(runs, Through(0.0), nbytes)


def test_scattered_32_kib_pages_go_straight_as_their_enqueue_keeps_up_with_their_copy() -> None:
    """A 16k-token load of scattered blocks: 1,884 descriptors of 32 KiB a layer, about
    1.5 ms to enqueue and 1.2 ms to copy (64 MiB at 50 GB/s): straight to the pages, the
    copy engines doing it all, even though the slot would enqueue in a tenth of the time.
    The same blocks with 4 KiB pages (1.5 ms to enqueue, 0.15 ms to copy) go through it."""
    descriptors = 2 * 942
    cost = layer_ops.US_PER_CALL * 2 + layer_ops.US_PER_DESCRIPTOR * descriptors
    layer = np.full(32, 942 * (64 << 10))
    assert not worth_staging(Costs(cost), layer)  # type: ignore[arg-type]
    assert not prefer_staged(Costs(cost), Through(cost / 10), layer)  # type: ignore[arg-type]
    small = np.full(32, 942 * (8 << 10))
    assert worth_staging(Costs(cost), small) and prefer_staged(Costs(cost), Through(cost / 10), small)  # type: ignore[arg-type]


class Costs:
    """A stand-in for a job's ops: each layer at a given estimated driver cost."""

    def __init__(self, us: float, layers: int = 32) -> None:
        self.us, self.num_layers = us, layers

    def costs_us(self) -> np.ndarray:
        return np.full(self.num_layers, self.us)


def test_a_loads_submit_enqueues_layers_until_the_copy_engine_is_fed() -> None:
    """Cheap layers all go at once; a 16k-token prefix's (about 60 us and 64 MiB a layer)
    until about 5 ms of copies are queued, so the issuer thread may wait a GIL switch
    interval without the copy engine idling; layers of thousands of descriptors one only."""
    from aiokv.backends.cuda.layer_copies import head_layers

    assert head_layers(Costs(2.0), [1 << 20] * 32) == 32  # type: ignore[arg-type]
    assert head_layers(Costs(60.0), [64 << 20] * 32) == 4  # type: ignore[arg-type]
    assert head_layers(Costs(1640.0), [64 << 20] * 32) == 1  # type: ignore[arg-type]
    assert head_layers(Costs(60.0), [1 << 20] * 32) == 6  # type: ignore[arg-type]  # capped at 400 us


@settings(max_examples=80, deadline=None)
@given(to_host=st.booleans(), min_height=st.integers(2, 5),
       max_pitch=st.sampled_from([1 << 20, 600, 300, 40]),
       n=st.integers(0, 40), seed=st.integers(0, 1 << 30), runs=st.booleans(), by_host=st.booleans())
def test_the_one_kind_fold_gives_the_general_folds_ops(to_host: bool, min_height: int, max_pitch: int, n: int,
                                                       seed: int, runs: bool, by_host: bool) -> None:
    """``IdFolder``'s shortcut for one group of one kind (the common layout) against its
    general fold: the same ops, dtypes and cut points, for random and run-made ids,
    repeated chunks, and pitch limits that refuse some or every link."""
    kv = setup(1, 0)[1]
    layout = HostLayout.build(kv, 1)
    lmap = LayerMap.build(kv, layout)
    rng = np.random.default_rng(seed)
    chunks = rng.permutation(NUM_CHUNKS)[:min(n, NUM_CHUNKS)]
    n = chunks.size
    if runs and n:
        chunks = np.sort(chunks)
        gpu = (np.arange(n) + rng.integers(0, 3, n).cumsum()) % BLOCKS
        gpu = np.unique(gpu)
        chunks = chunks[:gpu.size]
    else:
        gpu = rng.permutation(BLOCKS)[:n]
    if not to_host and gpu.size > 2:
        chunks[-1] = chunks[0]  # a load may read a chunk twice
    m = map_blocks(gpu.tolist(), chunks.tolist(), layout=layout, num_chunks=NUM_CHUNKS, unique_host=to_host,
                   unique_gpu=not to_host)
    if not by_host:
        m = type(m)(m.gpu_blocks, m.host_slots)
    base = np.array([(1 << 24) * (i + 1) for i in range(len(kv.tensors))], dtype=np.int64)
    folder = layer_ops.IdFolder(layout, lmap, base, 1 << 40, to_host=to_host, max_pitch=max_pitch,
                                min_height=min_height)
    assert folder.usable and folder._one is not None
    fast = folder.fold(m)
    folder._one = None
    slow = folder.fold(m)
    assert same_ops(fast, slow)
    for x, y in ((fast.dst, slow.dst), (fast.sizes, slow.sizes), (fast.bounds, slow.bounds),
                 (fast.pbounds, slow.pbounds), (fast.pitched.dst, slow.pitched.dst),
                 (fast.pitched.width, slow.pitched.width), (fast.pitched.height, slow.pitched.height)):
        assert x.dtype == y.dtype
