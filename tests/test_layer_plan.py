"""What a layer is (``LayerMap``) and a layerwise job's copies (``plan_layers``): from
``from_tensors`` a tensor is a layer (K and V together), from a vLLM-shaped description
each ref is one; a cross-layer layout is refused; the layer plan moves exactly the bytes
``plan_copies`` moves, layer by layer, never merging across a layer's end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiokv import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, InvalidSpec
from aiokv.layer_plan import LayerMap, plan_layers
from aiokv.plan import HostLayout, map_blocks, plan_copies

from .conftest import make_layers, make_two_groups


def layer_map(kv: CanonicalKVCaches, bpc: int = 1) -> tuple[LayerMap, HostLayout]:
    layout = HostLayout.build(kv, bpc)
    return LayerMap.build(kv, layout), layout


def byte_pairs(t: np.ndarray, d: np.ndarray, h: np.ndarray, s: np.ndarray) -> set[tuple[int, int, int]]:
    """Every byte a set of copies moves, as (tensor, device offset, host offset)."""
    out = set()
    for ti, di, hi, si in zip(t.tolist(), d.tolist(), h.tolist(), s.tolist()):
        out.update((ti, di + k, hi + k) for k in range(si))
    return out


def test_from_tensors_makes_each_tensor_a_layer_with_its_k_and_v_pages() -> None:
    kv = make_layers(num_layers=3, num_blocks=8)  # (2, num_blocks, ...) each: K and V pages
    assert kv.kv.ref_layers == [[0, 0, 1, 1, 2, 2]]
    lmap, _ = layer_map(kv.kv)
    assert lmap.num_layers == 3 and lmap.refusal is None
    assert lmap.order_ref.tolist() == [0, 1, 2, 3, 4, 5]
    assert lmap.order_layer.tolist() == [0, 0, 1, 1, 2, 2]


def test_without_ref_layers_each_ref_is_a_layer_group_after_group() -> None:
    """vLLM's description: one ref per attention layer, listed group by group."""
    kv = make_two_groups()
    assert kv.kv.ref_layers is None
    lmap, _ = layer_map(kv.kv)
    assert lmap.num_layers == 5
    assert lmap.layer_groups == ((0,), (0,), (0,), (1,), (1,))


def test_an_engines_ref_layers_interleave_groups_in_forward_order() -> None:
    kv = make_two_groups()
    kv.kv.ref_layers = [[0, 2, 4], [1, 3]]
    lmap, _ = layer_map(kv.kv)
    assert lmap.order_group.tolist() == [0, 1, 0, 1, 0]
    assert lmap.order_ref.tolist() == [0, 0, 1, 1, 2]


def test_vllm_shaped_objects_carry_their_ref_layers_through_coerce() -> None:
    class Caches:  # an engine's own object with the same fields
        def __init__(self, kv: CanonicalKVCaches) -> None:
            self.tensors, self.group_data_refs = kv.tensors, kv.group_data_refs
            self.ref_layers = [np.array([0, 1, 2]), (3, 3)]

    kv = CanonicalKVCaches.coerce(Caches(make_two_groups().kv))
    assert kv.ref_layers == [[0, 1, 2], [3, 3]]


@pytest.mark.parametrize(("ref_layers", "match"), [
    ([[0, 1, 2]], "entries per group"),
    ([[0, 1, 2], [3]], "entries per group"),
    ([[0, 1, 2], [3, -1]], "negative"),
    ([[0, 1, 2], [5, 5]], "no ref belongs"),
    ([[0, 1, "2"], [3, 4]], "int layer indices"),
])
def test_a_ref_layers_that_does_not_match_the_refs_is_refused(ref_layers: list, match: str) -> None:
    kv = make_two_groups()
    kv.kv.ref_layers = ref_layers
    with pytest.raises(InvalidSpec, match=match):
        layer_map(kv.kv)


def test_a_cross_layer_layout_builds_but_refuses_layerwise_jobs() -> None:
    cross = torch.zeros(16, 4, 2, 8, dtype=torch.float16)  # (num_blocks, layers, ...): one page
    lmap, _ = layer_map(CanonicalKVCaches.from_tensors([cross]))
    assert lmap.num_layers == 1
    with pytest.raises(InvalidSpec, match="cross-layer"):
        lmap.check()
    # vLLM's packed layout: one tensor, one ref per group spanning every layer.
    packed = CanonicalKVCacheTensor(torch.zeros(16, 512, dtype=torch.int8), 512)
    refs = [[CanonicalKVCacheRef(0, 512)], [CanonicalKVCacheRef(0, 512)]]
    lmap, _ = layer_map(CanonicalKVCaches([packed], refs))
    assert lmap.num_layers == 2 and lmap.refusal is not None


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True, "0", None])
def test_a_layer_index_must_be_an_int_in_range(bad: object) -> None:
    lmap, _ = layer_map(make_layers(num_layers=4).kv)
    with pytest.raises(InvalidSpec, match="layer"):
        lmap.index(bad)
    assert lmap.index(np.int64(3)) == 3


def check_plan(kv: CanonicalKVCaches, bpc: int, gpu: list[int], chunks: list[int], **spec: object) -> None:
    lmap, layout = layer_map(kv, bpc)
    mapping = map_blocks(gpu, chunks, layout=layout, num_chunks=64, **spec)  # type: ignore[arg-type]
    plain = plan_copies(mapping, layout)
    layered = plan_layers(mapping, layout, lmap)
    cols = (layered.tensor_idx, layered.device_offset, layered.host_offset, layered.nbytes)
    # The same bytes move, each once.
    assert byte_pairs(*cols) == byte_pairs(plain.tensor_idx, plain.device_offset, plain.host_offset,
                                           plain.nbytes)
    assert layered.total_bytes == plain.total_bytes
    bounds = layered.bounds.tolist()
    assert bounds[0] == 0 and bounds[-1] == len(layered) and bounds == sorted(bounds)
    # Layer l's copies touch exactly layer l's page tensors.
    for layer in range(lmap.num_layers):
        want = {kv.group_data_refs[g][k].tensor_idx
                for g, k, lay in zip(lmap.order_group, lmap.order_ref, lmap.order_layer) if lay == layer}
        got = set(layered.layer(layer).tensor_idx.tolist())
        assert got <= want
        groups_with_blocks = {g for g in lmap.layer_groups[layer] if mapping.gpu_blocks[g].size}
        assert bool(got) == bool(groups_with_blocks)


def test_a_layer_plan_moves_the_same_bytes_layer_by_layer() -> None:
    check_plan(make_layers(num_layers=4, num_blocks=32).kv, 1, [3, 4, 5, 9, 1], [7, 8, 9, 2, 0])


def test_two_groups_several_blocks_a_chunk_and_an_offset_start() -> None:
    kv = make_two_groups().kv
    check_plan(kv, 2, [3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4], group_sizes=[4, 3], block_indices=[1, 0])
    kv.ref_layers = [[0, 2, 4], [1, 3]]
    check_plan(kv, 2, [3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4], group_sizes=[4, 3], block_indices=[1, 0])


def test_a_group_without_blocks_leaves_its_layers_empty() -> None:
    kv = make_two_groups().kv
    lmap, layout = layer_map(kv)
    mapping = map_blocks([3, 4], [0, 1], layout=layout, num_chunks=8, group_sizes=[2, 0])
    layered = plan_layers(mapping, layout, lmap)
    sizes = [len(layered.layer(layer)) for layer in range(5)]
    assert sizes[3:] == [0, 0] and all(sizes[:3])
    assert layered.blocks([3, 4]) == set() and layered.blocks([0]) == {3, 4}


def test_contiguous_runs_merge_inside_a_layer_but_never_across_one() -> None:
    """Two groups whose layers overlay one tensor (vLLM's aliased groups): one layer's page
    ends where the next layer's starts on both sides, so the plain plan merges them."""
    t0, t1 = (CanonicalKVCacheTensor(torch.zeros(16, 512, dtype=torch.uint8), 512) for _ in range(2))
    refs = [[CanonicalKVCacheRef(0, 512)], [CanonicalKVCacheRef(0, 512)], [CanonicalKVCacheRef(1, 512)]]
    kv = CanonicalKVCaches([t0, t1], refs)
    lmap, layout = layer_map(kv)
    mapping = map_blocks([3, 4], [4, 5], layout=layout, num_chunks=8, group_sizes=[1, 1, 0])
    assert plan_copies(mapping, layout).nbytes.tolist() == [1024]  # one run across both layers
    layered = plan_layers(mapping, layout, lmap)
    assert layered.bounds.tolist() == [0, 1, 2, 2]
    assert layered.nbytes.tolist() == [512, 512]
    # Inside a layer, a run of blocks that is contiguous on both sides is one copy.
    kv = CanonicalKVCaches.from_tensors([torch.zeros(16, 256, dtype=torch.uint8) for _ in range(4)])
    lmap, layout = layer_map(kv, bpc=4)
    layered = plan_layers(map_blocks([0, 1, 2, 3], [0], layout=layout, num_chunks=4), layout, lmap)
    assert layered.bounds.tolist() == [0, 1, 2, 3, 4]
    assert layered.nbytes.tolist() == [1024] * 4
