import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv import InvalidSpec
from aiokv.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from aiokv.plan import (
    HostLayout,
    _plan_numpy,
    _plan_small,
    map_blocks,
    plan_copies,
)
from tests.conftest import make_layers, make_two_groups


def layout_for(bpc: int, groups: int = 1) -> HostLayout:
    kv = make_layers(num_layers=2, num_blocks=16).kv if groups == 1 else make_two_groups().kv
    return HostLayout.build(kv, bpc)


def test_contract_example_skips_into_the_first_chunk() -> None:
    # blocks_per_chunk = 3, i = 5, GPU blocks [a, b, c, d], chunks [X, Y]: X.2, Y.0, Y.1, Y.2
    m = map_blocks([10, 11, 12, 13], [7, 4], layout=layout_for(3), num_chunks=8, block_indices=[5])
    assert m.gpu_blocks[0].tolist() == [10, 11, 12, 13]
    assert m.host_slots[0].tolist() == [7 * 3 + 2, 4 * 3 + 0, 4 * 3 + 1, 4 * 3 + 2]


def test_runs_contiguous_on_both_sides_coalesce() -> None:
    layout = layout_for(1)
    page = layout.page_sizes[0][0]
    m = map_blocks([3, 4, 9], [0, 1, 2], layout=layout, num_chunks=4)
    plan = plan_copies(m, layout)
    # 4 page tensors (2 layers x K/V); chunks 0,1 are adjacent but other pages sit between
    # them, so page-major inside a chunk means one copy per page and block here...
    assert plan.total_bytes == 3 * sum(layout.page_sizes[0])
    assert len(plan) == 12
    # ...while blocks_per_chunk=4 keeps a layer's sub-blocks together: blocks 3,4 -> one copy.
    layout4 = layout_for(4)
    plan4 = plan_copies(map_blocks([3, 4, 9], [1], layout=layout4, num_chunks=2), layout4)
    assert len(plan4) == 8 and sorted(set(plan4.nbytes.tolist())) == [page, 2 * page]


def test_two_groups_use_their_own_chunks_and_pages() -> None:
    layout = layout_for(2, groups=2)
    assert layout.num_groups == 2 and layout.num_gpu_blocks == (40, 24)
    m = map_blocks(
        [1, 2, 3, 20], [0, 1, 5], layout=layout, num_chunks=6, group_sizes=[3, 1], block_indices=[0, 3]
    )
    assert m.host_slots[0].tolist() == [0, 1, 2]
    assert m.host_slots[1].tolist() == [5 * 2 + 1]
    plan = plan_copies(m, layout)
    assert plan.total_bytes == 3 * (3 * 256) + 1 * (96 + 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_ids=[1, 2], chunk_ids=[0]), "chunk ids given but 2 are needed"),
        (dict(block_ids=[1, 99], chunk_ids=[0, 1]), r"\[0, 16\)"),
        (dict(block_ids=[1, -1], chunk_ids=[0, 1]), r"\[0, 16\)"),
        (dict(block_ids=[1, 2], chunk_ids=[0, 8]), r"\[0, 8\)"),
        (dict(block_ids=[1.5, 2], chunk_ids=[0, 1]), "integers"),
        (dict(block_ids=[[1, 2]], chunk_ids=[0, 1]), "1-D"),
        (dict(block_ids=[1, 2], chunk_ids=[0, 1], group_sizes=[1]), "add up"),
        (dict(block_ids=[1, 2], chunk_ids=[0, 1], group_sizes=[1, 1]), "groups"),
        (dict(block_ids=[1, 2], chunk_ids=[0, 1], block_indices=[-1]), "non-negative"),
        (dict(block_ids=[1, 1], chunk_ids=[0, 1], unique_gpu=True), "twice"),
        (dict(block_ids=[1, 2], chunk_ids=[3, 3], unique_host=True), "twice"),
        (dict(block_ids=np.array([1, 2**63], dtype=np.uint64), chunk_ids=[0, 1]), "9223372036854775808"),
        (dict(block_ids=np.array([1, 2], dtype="m8[s]"), chunk_ids=[0, 1]), "integers"),
    ],
)
def test_bad_specs_are_rejected(kwargs, message) -> None:
    with pytest.raises(InvalidSpec, match=message):
        map_blocks(layout=layout_for(1), num_chunks=8, **kwargs)


def test_a_chunk_shared_by_two_groups_of_one_store_is_rejected() -> None:
    with pytest.raises(InvalidSpec, match="twice"):
        map_blocks([1, 2], [4, 4], layout=layout_for(1, groups=2), num_chunks=8, group_sizes=[1, 1],
                   unique_host=True)


def test_numpy_int32_ids_are_accepted() -> None:
    m = map_blocks(np.array([5, 6], dtype=np.int32), np.array([1, 0], dtype=np.int32),
                   layout=layout_for(1), num_chunks=2)
    assert m.host_slots[0].tolist() == [1, 0]


def naive_copy(layout: HostLayout, m, device: list[np.ndarray], host: np.ndarray) -> None:
    """The obvious per-page loop the plan must agree with."""
    bpc = layout.blocks_per_chunk
    for g, (blocks, slots) in enumerate(zip(m.gpu_blocks, m.host_slots)):
        for b, slot in zip(blocks.tolist(), slots.tolist()):
            chunk, sub = divmod(slot, bpc)
            for k, t in enumerate(layout.tensor_idx[g]):
                size = layout.page_sizes[g][k]
                h = chunk * layout.chunk_bytes + layout.page_offsets[g][k] + sub * size
                d = b * layout.row_strides[t]
                host[h : h + size] = device[t][d : d + size]


@settings(max_examples=60, deadline=None)
@given(
    bpc=st.integers(1, 4),
    groups=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_plan_moves_exactly_the_bytes_a_naive_loop_moves(bpc: int, groups: int, data) -> None:
    layout = layout_for(bpc, groups)
    num_chunks = 24
    sizes, starts, gpu, chunks = [], [], [], []
    free_chunks = list(range(num_chunks))
    for g in range(layout.num_groups):
        n = data.draw(st.integers(0, 6))
        start = data.draw(st.integers(0, 11))
        need = -(-(n + start % bpc) // bpc) if n else 0
        gpu += data.draw(st.lists(st.integers(0, layout.num_gpu_blocks[g] - 1), min_size=n, max_size=n))
        picked = data.draw(st.permutations(free_chunks))[:need]
        free_chunks = [c for c in free_chunks if c not in picked]
        chunks += picked
        sizes.append(n)
        starts.append(start)
    m = map_blocks(gpu, chunks, layout=layout, num_chunks=num_chunks, group_sizes=sizes,
                   block_indices=starts, unique_host=True)
    rng = np.random.default_rng(len(gpu))
    device = [rng.integers(0, 256, layout.row_strides[t] * 40, dtype=np.uint8)
              for t in range(max(max(ti) for ti in layout.tensor_idx) + 1)]
    expect = rng.integers(0, 256, num_chunks * layout.chunk_bytes, dtype=np.uint8)
    got = expect.copy()
    naive_copy(layout, m, device, expect)
    plan = plan_copies(m, layout)
    for t, d, h, n in zip(plan.tensor_idx, plan.device_offset, plan.host_offset, plan.nbytes):
        got[h : h + n] = device[t][d : d + n]
    assert np.array_equal(got, expect)
    assert plan.total_bytes == sum(int(n) for n in plan.nbytes)
    # coalescing never leaves two copies that could have been one
    for i in range(1, len(plan)):
        assert not (plan.tensor_idx[i] == plan.tensor_idx[i - 1]
                    and plan.device_offset[i] == plan.device_offset[i - 1] + plan.nbytes[i - 1]
                    and plan.host_offset[i] == plan.host_offset[i - 1] + plan.nbytes[i - 1])


def carved(starts: list[int], page: int = 64, stride: int = 96, num_blocks: int = 8):
    """Page tensors cut out of one byte arena at ``starts`` (listed in ref order)."""
    size = max(starts) + num_blocks * stride
    arena = torch.from_numpy(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    tensors = [
        CanonicalKVCacheTensor(arena[o : o + num_blocks * stride].view(num_blocks, stride)[:, :page], page)
        for o in starts
    ]
    kv = CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(i, page) for i in range(len(starts))]])
    base = np.array([t.tensor.data_ptr() - arena.data_ptr() for t in tensors], dtype=np.int64)
    return arena.numpy(), kv, base


def test_host_pages_follow_device_addresses() -> None:
    # Layers listed in descending address order (as back-to-back allocations often come out).
    _, kv, _ = carved([3 * 768, 2 * 768, 768, 0])
    layout = HostLayout.build(kv, 1)
    assert layout.page_offsets[0] == (3 * 64, 2 * 64, 64, 0)


@settings(max_examples=80, deadline=None)
@given(
    bpc=st.integers(1, 3),
    gpu=st.lists(st.integers(-1, 17), max_size=8),
    chunks=st.lists(st.integers(-1, 9), max_size=8),
    start=st.integers(0, 5),
    store=st.booleans(),
    exact=st.booleans(),
)
def test_small_job_fast_path_agrees_with_numpy(bpc: int, gpu, chunks, start: int, store: bool, exact) -> None:
    """Short Python-list jobs take a plain-Python path; it must map, plan and fail alike."""
    layout = layout_for(bpc)
    if exact:  # the right number of chunks, so most examples are valid jobs
        need = -(-(len(gpu) + start % bpc) // bpc) if gpu else 0
        chunks = (chunks + list(range(8)))[:need]
    kwargs = dict(layout=layout, num_chunks=8, block_indices=[start], unique_gpu=not store, unique_host=store)

    def outcome(g, c):
        try:
            return map_blocks(g, c, **kwargs)
        except InvalidSpec as exc:
            return str(exc)

    fast = outcome(gpu, chunks)
    slow = outcome(np.array(gpu, dtype=np.int64), np.array(chunks, dtype=np.int64))
    if isinstance(slow, str):
        assert fast == slow
        return
    assert not isinstance(fast, str)
    assert [a.tolist() for a in fast.gpu_blocks] == [a.tolist() for a in slow.gpu_blocks]
    assert [a.tolist() for a in fast.host_slots] == [a.tolist() for a in slow.host_slots]
    small, vectorised = _plan_small(fast, layout), _plan_numpy(fast, layout)
    for a, b in zip(small, vectorised):  # tensor, device offset, host offset, bytes
        assert a.tolist() == b.tolist()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("how", ["plain", "with group_sizes and block_indices", "load, chunks repeat"])
def test_one_block_per_chunk_pairs_come_sorted_by_host_too(seed: int, how: str) -> None:
    """``by_host`` holds the job's own (GPU block, slot) pairs, slots ascending, ties in the
    order given (a load may read one chunk into several blocks), as numpy or list input."""
    rng = np.random.default_rng(seed)
    load = how.startswith("load")
    if load:  # each block once (a load writes it), chunks may repeat
        blocks, chunks = rng.permutation(16), rng.integers(0, 8, 16)
    else:  # past the plain-Python path for short jobs; a store may read a block twice
        n = int(rng.integers(17, 40))
        blocks, chunks = rng.integers(0, 16, n), rng.choice(64, n, replace=False)
    n = blocks.size
    extra = {"group_sizes": [n], "block_indices": [int(rng.integers(0, 9))]} if how.startswith("with") else {}
    m = map_blocks(blocks.tolist() if seed % 2 else blocks, chunks, layout=layout_for(1), num_chunks=64,
                   unique_gpu=load, unique_host=not load, **extra)
    assert m.by_host is not None
    rows, slots = m.by_host
    assert np.all(np.diff(slots) >= 0)
    order = np.argsort(chunks, kind="stable")
    assert rows.tolist() == blocks[order].tolist() and slots.tolist() == chunks[order].tolist()
    assert m.gpu_blocks[0].tolist() == blocks.tolist() and m.host_slots[0].tolist() == chunks.tolist()


# -- IdPlan: a job handed to a native planner as its ids ---------------------------------------


def _one_group_layout(blocks: int = 8) -> HostLayout:
    kv = CanonicalKVCaches.from_tensors([torch.zeros(blocks, 64, dtype=torch.uint8)])
    return HostLayout.build(kv, 1)


def test_plan_ids_takes_only_plain_one_group_jobs() -> None:
    from aiokv.plan import IdPlan, plan_ids

    layout = _one_group_layout()
    plan = plan_ids([1, 2], [3, 4], layout=layout, num_chunks=8, unique_host=True)
    assert isinstance(plan, IdPlan) and plan.total_bytes == 2 * 64 and plan.num_pages == 2
    assert plan_ids([1, 2], [3, 4], layout=layout, num_chunks=8, group_sizes=(2,), block_indices=[5])
    for kwargs in ({"group_sizes": [1]}, {"block_indices": [-1]}, {"block_indices": [0, 1]}):
        assert plan_ids([1, 2], [3, 4], layout=layout, num_chunks=8, **kwargs) is None
    assert plan_ids([1, 2], [3], layout=layout, num_chunks=8) is None  # map_blocks says why
    assert plan_ids([], [], layout=layout, num_chunks=8) is None
    two = CanonicalKVCaches.from_tensors([torch.zeros(8, 64, dtype=torch.uint8)])
    assert plan_ids([1], [1], layout=HostLayout.build(two, 2), num_chunks=8) is None  # 2 blocks a chunk


def test_an_id_plan_checks_as_map_blocks_does_and_then_keeps_its_own_ids() -> None:
    """Checked, the plan no longer reads the caller's ids: a job planned later (held
    behind an open layerwise store) sees them as they were at submit."""
    from aiokv.plan import plan_ids

    layout = _one_group_layout()
    bad = plan_ids([1, 99], [3, 4], layout=layout, num_chunks=8)
    assert bad is not None
    with pytest.raises(InvalidSpec, match="GPU block ids must lie in"):
        bad.check()
    blocks, chunks = [1, 2], np.array([3, 4])
    plan = plan_ids(blocks, chunks, layout=layout, num_chunks=8, unique_host=True)
    assert plan is not None
    plan.check()
    blocks[0], chunks[0] = 7, 7  # the caller reuses its buffers
    assert list(plan.block_ids) == [1, 2] and list(plan.chunk_ids) == [3, 4]
    assert plan.tensor_idx.tolist() == [0, 0] and plan.host_offset.tolist() == [3 * layout.chunk_bytes,
                                                                                  4 * layout.chunk_bytes]
