"""A CUDA worker's host pool in a shared file (``WorkerOptions.host_pool_file``, what the
vLLM plug-in uses with ``aiokv_tiers``): the driver pins the shared mapping, blocks the
device stores are what a second mapping of the file reads, and bytes written through that
mapping (a block read up from a tier) load to the device as written, every strategy."""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import pytest
import torch

from aiokv import CanonicalKVCaches, SyncOffloadingWorker, WorkerOptions
from aiokv.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tests.gpu_support import STRATEGIES, gpu

pytestmark = gpu


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_shared_pool_is_pinned_and_both_mappings_see_the_same_chunks(strategy: str) -> None:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp"
    path = os.path.join(base, f"aiokv-gpu-test-{uuid.uuid4().hex}.pool")
    gen = torch.Generator().manual_seed(4)
    layers = [torch.randint(0, 256, (2, 16, 8, 256), dtype=torch.uint8, generator=gen).cuda()
              for _ in range(3)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    worker = SyncOffloadingWorker(kv, num_cpu_chunks=8, strategy=strategy,
                                  options=WorkerOptions(host_pool_file=path))
    try:
        layout = worker.host_layout
        chunk = worker.chunk_bytes
        assert worker.submit_store(1, GPULoadStoreSpec([3, 9]), CPULoadStoreSpec([5, 1]))
        worker.wait({1})
        [stored] = worker.get_finished()
        assert stored.success
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as other:
            pool = np.frombuffer(other, dtype=np.uint8, count=8 * chunk).reshape(8, chunk)
            for block, c in ((3, 5), (9, 1)):
                for k, (size, off) in enumerate(zip(layout.page_sizes[0], layout.page_offsets[0])):
                    layer, half = divmod(k, 2)
                    want = layers[layer][half, block].cpu().numpy().reshape(-1)
                    assert bytes(pool[c, off: off + size]) == want.tobytes(), (block, k)
            fresh = np.random.default_rng(5).integers(0, 256, (chunk,), dtype=np.uint8)
            pool[6] = fresh
            del pool
        assert worker.submit_load(2, CPULoadStoreSpec([6]), GPULoadStoreSpec([0]))
        worker.wait({2})
        assert all(r.success for r in worker.get_finished())
        for k, (size, off) in enumerate(zip(layout.page_sizes[0], layout.page_offsets[0])):
            layer, half = divmod(k, 2)
            got = layers[layer][half, 0].cpu().numpy().reshape(-1)
            assert got.tobytes() == fresh[off: off + size].tobytes(), k
    finally:
        worker.shutdown()
    assert not os.path.exists(path)
