"""The worker half of the vLLM plug-in with vLLM-shaped inputs, without vLLM.

vLLM cannot be installed on the GPU machine, so these objects copy the shapes its
connector hands a worker: per-layer int8 ``(num_blocks, page)`` views whose rows are padded
past the page the layer uses, two KV-cache groups, spec objects whose ``block_ids`` are
numpy int32 arrays with ``group_sizes`` and ``block_indices``, and expedited loads. The same
jobs run on the CPU backend (in CI) and on CUDA with every strategy (the GPU suite).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from aiokv import SyncOffloadingWorker
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


@pytest.mark.parametrize(("device", "strategy"), CASES)
def test_vllm_shaped_round_trips_are_byte_exact(device: str, strategy: str) -> None:
    kv, rows = vllm_caches(device, seed=11)
    worker = SyncOffloadingWorker(
        kv, num_cpu_chunks=12, blocks_per_chunk=BPC, backend=device, strategy=strategy
    )
    try:
        before = [r.cpu().clone() for r in rows]
        # Aligned stores: group 0 blocks 3-6 -> chunks 0, 1; group 1 blocks 7, 8 -> chunk 2.
        worker.submit_store(
            1, GPULoadStoreSpecLike([3, 4, 5, 6, 7, 8], [4, 2], [0, 0]), CPULoadStoreSpecLike([0, 1, 2])
        )
        # Unaligned: group 0 starts at logical block 1 (skips chunk 3's first sub-block),
        # group 1 at block 3 (one sub-block of chunk 4, then chunk 5).
        worker.submit_store(
            2, GPULoadStoreSpecLike([9, 10, 11, 12], [1, 3], [1, 3]), CPULoadStoreSpecLike([3, 4, 5])
        )
        worker.wait({1, 2})
        # Loads into other blocks, one expedited, both with vLLM's ids as they come.
        worker.submit_load(
            3, CPULoadStoreSpecLike([0, 1, 2]), GPULoadStoreSpecLike([13, 14, 15, 16, 17, 18], [4, 2], [0, 0])
        )
        worker.submit_load(
            4,
            CPULoadStoreSpecLike([3, 4, 5]),
            GPULoadStoreSpecLike([19, 20, 21, 22], [1, 3], [1, 3]),
            expedited=True,
        )
        worker.wait({3, 4})
        results = worker.get_finished()
        assert sorted((r.job_id, r.success) for r in results) == [(1, True), (2, True), (3, True), (4, True)]
        assert worker.get_finished() == []
        moved = {0: {13: 3, 14: 4, 15: 5, 16: 6, 19: 9}, 1: {17: 7, 18: 8, 20: 10, 21: 11, 22: 12}}
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
