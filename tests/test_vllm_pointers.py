"""The vLLM plug-in's ``PointerMap``: vLLM 0.34's device addresses read back as block ids,
and every address that is not exactly a block of the registered tensors refused (main
suite, no vLLM; the round trips through a worker are in test_gpu_vllm_shapes.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from aiokv.errors import InvalidSpec
from aiokv.integrations.vllm.pointers import PointerMap, is_device_pointers
from tests.test_gpu_vllm_shapes import (
    NB,
    CPULoadStoreSpecLike,
    DevicePointersLike,
    GPULoadStoreSpecLike,
    device_pointers,
    vllm_caches,
)


@pytest.fixture
def kv():
    return vllm_caches("cpu", seed=5)[0]


def spec(ids: list[int], sizes: list[int], starts: list[int]) -> GPULoadStoreSpecLike:
    return GPULoadStoreSpecLike(ids, sizes, starts)


def test_pointers_read_back_as_the_blocks_they_address(kv) -> None:
    src = spec([3, 4, 5, 0, 0, NB - 1, 7], [4, 3], [1, 2])
    out = PointerMap(kv).to_spec(device_pointers(kv, src))
    assert out.block_ids.tolist() == [3, 4, 5, 0, 0, NB - 1, 7]
    assert list(out.group_sizes) == [4, 3] and list(out.block_indices) == [1, 2]


def test_an_empty_group_carries_no_addresses(kv) -> None:
    out = PointerMap(kv).to_spec(device_pointers(kv, spec([9, 10], [0, 2], [0, 4])))
    assert out.block_ids.tolist() == [9, 10] and list(out.group_sizes) == [0, 2]
    empty = PointerMap(kv).to_spec(device_pointers(kv, spec([], [0, 0], [0, 0])))
    assert empty.block_ids.size == 0


def test_only_pointer_objects_are_read_as_pointers(kv) -> None:
    assert is_device_pointers(device_pointers(kv, spec([1], [1, 0], [0, 0])))
    assert not is_device_pointers(spec([1], [1, 0], [0, 0]))
    assert not is_device_pointers(CPULoadStoreSpecLike([1]))


def _shift(p: DevicePointersLike, index: int, delta: int) -> DevicePointersLike:
    ptrs = p.ptrs.copy()
    ptrs[index] = np.uint64(int(ptrs[index]) + delta)
    return replace(p, ptrs=ptrs)


@pytest.mark.parametrize(
    ("index", "delta", "match"),
    [
        (0, 1, "group 0, page 0, block 0: device address 0x[0-9a-f]+ does not start a block"),
        (3, -1280 * 5, "group 0, page 1, block 1: .* does not start a block"),  # below the tensor
        (2, 1280 * NB, "group 0, page 1, block 0: .* does not start a block"),  # past its end
        (5, 768 * NB * 4, "group 1, page 0, block 1: .* does not start a block"),
        (1, 1280, "group 0, block 1: page 0 points at block 5 but page 1 at block 4"),
    ],
)
def test_an_address_that_is_not_exactly_a_block_is_refused(kv, index, delta, match) -> None:
    good = device_pointers(kv, spec([3, 4, 8, 9], [2, 2], [0, 0]))
    # ptrs: group 0 page 0 blocks 3, 4; page 1 blocks 3, 4; group 1 page 0 blocks 8, 9.
    with pytest.raises(InvalidSpec, match=match):
        PointerMap(kv).to_spec(_shift(good, index, delta))


def test_an_address_in_another_pages_tensor_is_refused(kv) -> None:
    good = device_pointers(kv, spec([3, 8], [1, 1], [0, 0]))
    ptrs = good.ptrs.copy()
    ptrs[0] = ptrs[2]  # group 0's first page pointing into group 1's tensor
    with pytest.raises(InvalidSpec, match="group 0, page 0, block 0"):
        PointerMap(kv).to_spec(replace(good, ptrs=ptrs))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"sizes": np.array([1024, 1024, 1280], dtype=np.uint64)},
            "group 1, page 0, block 0: a copy of 1280 bytes, but the registered page is 768",
        ),
        ({"group_data_ref_counts": (1, 1)}, r"\[1, 1\] pages per group; the KV caches registered \[2, 1\]"),
        ({"group_block_counts": (1,), "block_indices": (0,)}, "name 1 groups"),
        ({"block_indices": (0,)}, r"block_indices: 1\)"),
        ({"group_block_counts": (2, 1)}, "carry 3 addresses and 3 sizes; .* need 5"),
        ({"ptrs": np.zeros((3, 1), dtype=np.uint64)}, "ptrs must be a 1-D integer array"),
        ({"ptrs": np.array([1.0, 2.0, 3.0])}, "ptrs must be a 1-D integer array"),
        ({"sizes": np.array([1024, -1, 768])}, "sizes holds a negative value"),
        ({"block_indices": (0, -1)}, "non-negative ints"),
        ({"group_block_counts": ("a", 1)}, "sequence of ints"),
    ],
)
def test_malformed_pointers_are_refused_naming_the_field(kv, change, match) -> None:
    good = device_pointers(kv, spec([3, 8], [1, 1], [0, 0]))
    with pytest.raises(InvalidSpec, match=match):
        PointerMap(kv).to_spec(replace(good, **change))


def test_an_object_without_the_fields_is_refused(kv) -> None:
    with pytest.raises(InvalidSpec, match=r"DevicePointers, got object without \['ptrs'"):
        PointerMap(kv).to_spec(object())
