"""OffloadCache end to end on CUDA: offload, evict, restore, bytes compared after restore.

Runs on the GPU machine (``pytest -m gpu``); skips cleanly elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, OffloadCache
from aiokv.backends import cuda_usable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDA device and cuda-python"),
    pytest.mark.anyio,
]


def _pattern(num_layers: int, num_blocks: int, page: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Random bytes (as bf16 bit patterns) per layer, made on the host so the check is independent."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (2, num_blocks, *page, 2), dtype=torch.uint8, generator=gen)
        .view(torch.bfloat16).squeeze(-1)
        for _ in range(num_layers)
    ]


async def test_cuda_prefix_cache_round_trip_is_byte_exact() -> None:
    num_layers, num_blocks, page = 4, 64, (16, 8, 64)
    host_truth = _pattern(num_layers, num_blocks, page, seed=11)
    layers = [t.to("cuda") for t in host_truth]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda") as worker:
        cache = OffloadCache(worker, policy="lru")
        # Three "requests" of 8 blocks; the cache holds 16, so the first is evicted.
        requests = {r: ([f"r{r}b{i}" for i in range(8)], list(range(r * 8, r * 8 + 8))) for r in range(3)}
        for keys, blocks in requests.values():
            res = await cache.offload(keys, blocks)  # waits on the current stream (the writes above)
            assert res.stored == 8 and not res.failed
        assert cache.lookup(requests[0][0]) == 0
        assert cache.lookup(requests[1][0]) == 8 and cache.lookup(requests[2][0]) == 8
        # Wipe the destination on the current stream; the load is ordered after the wipe.
        dst = list(range(40, 56))
        for t in layers:
            t[:, dst] = 0
        keys = requests[1][0] + requests[2][0]
        assert await cache.restore(keys, dst)
        torch.cuda.synchronize()
        src = requests[1][1] + requests[2][1]
        for t, truth in zip(layers, host_truth):
            got = t[:, dst].cpu().view(torch.uint8)
            want = truth[:, src].view(torch.uint8)
            assert torch.equal(got, want)
        st = cache.stats()
        assert st.restored_keys == 16 and st.failed_loads == st.failed_stores == 0
        assert st.load_gbps > 0 and st.store_gbps > 0
        cache.manager.check_invariants()
        assert st.manager.pinned_keys == 0 and st.manager.pending_keys == 0
