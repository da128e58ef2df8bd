"""A layerwise store's ``transfer_time`` on a real GPU is its layers' copy time, not the
time the lane's stream waited for the forward between pushes."""

from __future__ import annotations

import torch

from aiokv import CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec, SyncOffloadingWorker

from .gpu_support import gpu, slow_fill

pytestmark = gpu


def test_a_layerwise_stores_time_leaves_out_the_compute_between_pushes() -> None:
    """Each layer is written behind ~0.1 s of device sleep before its push, so the stream
    waits ~0.1 s between layer 0's copies and layer 1's: a store timed from its start to
    its end took over 0.1 s; its copies (one 8 KiB page per K and V) take microseconds.
    The bytes land as pushed, and a plain store of the same blocks is timed alike."""
    tensors = [torch.full((2, 16, 8, 256), 1.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    w = SyncOffloadingWorker(kv, num_cpu_chunks=8)
    try:
        store = w.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([2]), layerwise=True)
        for layer, t in enumerate(tensors):
            slow_fill([t], 5, 3.0 + layer)
            assert store.push(layer)
        assert w.wait([1], timeout=30)
        w.submit_store(2, GPULoadStoreSpec([5]), CPULoadStoreSpec([3]))
        assert w.wait([2], timeout=30)
        layered, plain = w.get_finished()
        assert layered.success and plain.success
        assert layered.transfer_time is not None and plain.transfer_time is not None
        assert 0 < layered.transfer_time < 0.05, layered.transfer_time  # not the ~0.1 s wait
        assert layered.transfer_size == plain.transfer_size
        load = w.submit_load(3, CPULoadStoreSpec([2]), GPULoadStoreSpec([9]))
        assert load and w.wait([3], timeout=30)
        for layer, t in enumerate(tensors):
            assert bool((t[:, 9] == 3.0 + layer).all())
    finally:
        w.shutdown()
