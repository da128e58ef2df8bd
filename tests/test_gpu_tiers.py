"""The disk and Redis tiers under a CUDA worker: blocks of the 8B shape's size (2 MiB) go
down from pinned host chunks and come back through concurrent read batches straight into
pinned staging chunks (direct I/O where the filesystem takes it), byte-exact, with nothing
dropped while offers wait their turn for room.

Runs on the GPU machine (``pytest -m gpu``); skips cleanly elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, DiskTier, OffloadCache
from aiokv.backends import cuda_usable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDA device and cuda-python"),
    pytest.mark.anyio,
]

LAYERS, PAGE = 32, (16, 8, 128)  # Llama-3-8B: 32 KiB K/V pages, 2 MiB a block
BLOCKS = 96


def _truth(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, BLOCKS, *PAGE, 2), dtype=torch.uint8, generator=gen)
            .view(torch.bfloat16).squeeze(-1) for _ in range(LAYERS)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_disk_restores_of_2mib_blocks_on_cuda_are_byte_exact(tmp_path: Path) -> None:
    truth = _truth(seed=31)
    layers = [t.to("cuda") for t in truth]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    tier = DiskTier(tmp_path, capacity_bytes=BLOCKS * (2 << 20))
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=16 + 16, backend="cuda") as worker:
        # A queue of 8 blocks: the offers below wait their turn for room, none drops.
        async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=16,
                                queue_bytes=8 * (2 << 20)) as cache:
            for start in range(0, 64, 16):
                keys = [f"b{i}" for i in range(start, start + 16)]
                res = await cache.offload(keys, list(range(start, start + 16)))
                assert res.stored == 16
            await cache.drain()
            st = cache.stats().tiers[0]
            assert st.demoted == 48 and st.demotions_dropped == 0
            keys = [f"b{i}" for i in range(48)]  # evicted: only the disk has them
            dst = list(range(BLOCKS - 48, BLOCKS))
            for t in layers:
                t[:, dst] = 0
            result = await cache.restore(keys, dst)
            torch.cuda.synchronize()
            assert result and result.from_tiers == 48
            for t, want in zip(layers, truth):
                assert torch.equal(t[:, dst].cpu().view(torch.uint8), want[:, :48].view(torch.uint8))
            st = cache.stats()
            assert st.staging_free == st.staging_chunks and st.manager.pinned_keys == 0
            assert tier.statistics().corrupt == 0 and tier.statistics().read_hits == 48
