"""The worker half of the vLLM plug-in with vLLM-shaped inputs, without vLLM.

vLLM cannot be installed on the GPU machine, so these objects copy the shapes its
connector hands a worker: per-layer int8 ``(num_blocks, page)`` views whose rows are padded
past the page the layer uses, two KV-cache groups, the device side of a job either as vLLM
0.33's spec (numpy int32 ``block_ids`` with ``group_sizes`` and ``block_indices``) or as
vLLM 0.34's ``DevicePointers`` (one device address and size per page of every block, read
back by the plug-in's ``PointerMap``), stores that carry the null block 0 as a placeholder,
and expedited loads. The same jobs run on the CPU backend (in CI) and on CUDA with every
strategy (the GPU suite).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from aiokv import SyncOffloadingWorker
from aiokv.integrations.vllm.pointers import PointerMap
from tests.gpu_support import STRATEGIES, gpu

BPC = 2  # blocks per chunk, as vLLM's blocks_per_chunk
NB = 32


@dataclass
class VllmTensor:  # vllm.v1.kv_offload.base.CanonicalKVCacheTensor
    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class VllmRef:  # CanonicalKVCacheRef: the un-padded page, and a mapping aiokv ignores
    tensor_idx: int
    page_size_bytes: int
    mapping: object = None


@dataclass
class VllmCaches:  # CanonicalKVCaches
    tensors: list[VllmTensor]
    group_data_refs: list[list[VllmRef]]


class GPULoadStoreSpecLike:
    def __init__(self, block_ids: list[int], group_sizes: list[int], block_indices: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int32)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


class CPULoadStoreSpecLike:
    def __init__(self, chunk_ids: list[int]) -> None:
        self.block_ids = np.array(chunk_ids, dtype=np.int32)


@dataclass
class DevicePointersLike:  # vllm.v1.kv_offload.base.DevicePointers (vLLM 0.34)
    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def device_pointers(kv: VllmCaches, spec: GPULoadStoreSpecLike) -> DevicePointersLike:
    """What vLLM 0.34's connector hands a worker for ``spec``: group by group, page by
    page, one address (row start) and size (the page's used bytes) per block."""
    ptrs: list[int] = []
    sizes: list[int] = []
    first = 0
    for refs, n in zip(kv.group_data_refs, spec.group_sizes):
        ids = spec.block_ids[first : first + n]
        first += n
        for ref in refs:
            t = kv.tensors[ref.tensor_idx].tensor
            ptrs += [t.data_ptr() + int(b) * t.stride(0) * t.element_size() for b in ids]
            sizes += [ref.page_size_bytes] * n
    return DevicePointersLike(
        np.array(ptrs, dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
        tuple(spec.group_sizes),
        tuple(len(refs) for refs in kv.group_data_refs),
        tuple(spec.block_indices),
    )


# (row bytes, used bytes) per layer: group 0 has two padded layers, group 1 one exact one.
LAYERS = [[(1280, 1024), (1280, 1024)], [(768, 768)]]


def vllm_caches(device: str, seed: int) -> tuple[VllmCaches, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tensors, refs, rows = [], [], []
    for group in LAYERS:
        group_refs = []
        for row, used in group:
            t = torch.randint(-128, 128, (NB, row), dtype=torch.int8, generator=gen).to(device)
            group_refs.append(VllmRef(len(tensors), used, mapping=object()))
            tensors.append(VllmTensor(t, row))
            rows.append(t)
        refs.append(group_refs)
    return VllmCaches(tensors, refs), rows


CASES = [pytest.param("cpu", "auto", id="cpu")] + [
    pytest.param("cuda", s, id=f"cuda-{s}", marks=gpu) for s in STRATEGIES
]


def sync_worker(kv: VllmCaches, device: str, strategy: str) -> SyncOffloadingWorker:
    return SyncOffloadingWorker(
        kv, num_cpu_chunks=12, blocks_per_chunk=BPC, backend=device, strategy=strategy
    )


# The device side of stores and of loads: vLLM 0.33's block ids or 0.34's pointers, mixed
# too, so a translation that misplaces blocks the same way both ways cannot cancel out.
FORMS = [("ids", "ids"), ("pointers", "ids"), ("ids", "pointers"), ("pointers", "pointers")]


@pytest.mark.parametrize(("store_form", "load_form"), FORMS)
@pytest.mark.parametrize(("device", "strategy"), CASES)
def test_vllm_shaped_round_trips_are_byte_exact(
    device: str, strategy: str, store_form: str, load_form: str
) -> None:
    kv, rows = vllm_caches(device, seed=11)
    worker = sync_worker(kv, device, strategy)
    pointer_map = PointerMap(kv)

    def gpu(ids: list[int], sizes: list[int], starts: list[int], form: str) -> object:
        spec = GPULoadStoreSpecLike(ids, sizes, starts)
        return spec if form == "ids" else pointer_map.to_spec(device_pointers(kv, spec))

    def src(*args: list[int]) -> object:
        return gpu(*args, form=store_form)

    def dst(*args: list[int]) -> object:
        return gpu(*args, form=load_form)

    try:
        before = [r.cpu().clone() for r in rows]
        # Aligned stores: group 0 blocks 3-6 -> chunks 0, 1; group 1 blocks 7, 8 -> chunk 2.
        worker.submit_store(1, src([3, 4, 5, 6, 7, 8], [4, 2], [0, 0]), CPULoadStoreSpecLike([0, 1, 2]))
        # Unaligned: group 0 starts at logical block 1 (skips chunk 3's first sub-block),
        # group 1 at block 3 (one sub-block of chunk 4, then chunk 5).
        worker.submit_store(2, src([9, 10, 11, 12], [1, 3], [1, 3]), CPULoadStoreSpecLike([3, 4, 5]))
        # The null block 0 as vLLM 0.34 places it: a placeholder that keeps the blocks after
        # it at their offsets in the chunk (group 0: 0, 23 -> chunk 6; group 1: 24, 0 -> 7).
        worker.submit_store(5, src([0, 23, 24, 0], [2, 2], [0, 0]), CPULoadStoreSpecLike([6, 7]))
        worker.wait({1, 2, 5})
        # Loads into other blocks, one expedited, both with vLLM's ids as they come.
        worker.submit_load(3, CPULoadStoreSpecLike([0, 1, 2]), dst([13, 14, 15, 16, 17, 18], [4, 2], [0, 0]))
        worker.submit_load(
            4, CPULoadStoreSpecLike([3, 4, 5]), dst([19, 20, 21, 22], [1, 3], [1, 3]), expedited=True
        )
        worker.submit_load(6, CPULoadStoreSpecLike([6, 7]), dst([25, 26, 27, 28], [2, 2], [0, 0]))
        worker.wait({3, 4, 6})
        results = worker.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(i, True) for i in range(1, 7)]
        assert worker.get_finished() == []
        moved = {
            0: {13: 3, 14: 4, 15: 5, 16: 6, 19: 9, 25: 0, 26: 23},
            1: {17: 7, 18: 8, 20: 10, 21: 11, 22: 12, 27: 24, 28: 0},
        }
        layer = 0
        for g, group in enumerate(LAYERS):
            for _, used in group:
                after = rows[layer].cpu()
                expected = before[layer].clone()
                for dst, src in moved[g].items():
                    expected[dst, :used] = before[layer][src, :used]  # the padding is not moved
                assert torch.equal(after, expected), f"group {g} layer {layer}"
                layer += 1
    finally:
        worker.shutdown()
