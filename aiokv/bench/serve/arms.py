"""Each arm's stack, built fresh on the one model and replayed through its own server.

recompute and oracle have a GPU pool without prefix caching; gpu adds the pool's prefix
cache; host adds an ``OffloadCache`` on an ``AsyncOffloadingWorker``; disk gives that cache
a ``DiskTier`` in a temporary directory (whose read ceiling is measured before it closes).
The host and disk arms hold the same host chunks for keys: the disk arm's worker has
``staging_blocks`` more, which the cache keeps aside for restores from the tier.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...cache.offload import OffloadCache, OffloadCacheStats
from ...cache.tiers.disk import DiskTier
from ...errors import AiokvError
from ...layout import CanonicalKVCaches
from ...worker import AsyncOffloadingWorker
from ..ceilings import disk_read_ceiling
from .config import ServeConfig
from .measure import Device
from .model import LlamaModel
from .pool import BlockPool
from .server import Served, Server
from .workload import Workload

__all__ = ["ArmResult", "run_arm"]

Progress = Callable[[str], None]


@dataclass
class ArmResult:
    """One arm's requests and what its caches counted."""

    name: str
    served: list[Served]
    gpu_evictions: int
    cache: OffloadCacheStats | None = None
    disk_ceiling: float | None = None
    disk_ceiling_error: str = ""


async def run_arm(name: str, cfg: ServeConfig, model: LlamaModel, kv: Sequence[torch.Tensor],
                  device: Device, workload: Workload, *, block_bytes: int,
                  oracle: dict[int, tuple[int, int, int]] | None = None,
                  progress: Progress) -> ArmResult:
    """Replay the workload through a fresh stack of arm ``name``."""
    assert cfg.gpu_blocks is not None and cfg.host_blocks is not None
    assert cfg.disk_blocks is not None and cfg.staging_blocks is not None
    pool = BlockPool(cfg.gpu_blocks, caching=name in ("gpu", "host", "disk"))
    server = Server(model, kv, device, pool, progress=progress,
                    oracle=oracle if name == "oracle" else None)
    if name in ("recompute", "gpu", "oracle"):
        # Nothing below the GPU to warm for recompute and the oracle (which is handed its hits).
        served = await server.run(workload, warm=name == "gpu")
        return ArmResult(name, served, pool.evictions)
    layout = CanonicalKVCaches.from_tensors(list(kv), block_dim=1)
    chunks = cfg.host_blocks + (cfg.staging_blocks if name == "disk" else 0)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=chunks, backend=device.kind) as worker:
        if name == "host":
            async with OffloadCache(worker, policy=cfg.policy) as cache:
                server.cache = cache
                served = await server.run(workload)
                return ArmResult(name, served, pool.evictions, cache.stats())
        with tempfile.TemporaryDirectory(dir=cfg.tier_dir, prefix="aiokv-serve-") as directory:
            tier = DiskTier(directory, capacity_bytes=cfg.disk_blocks * block_bytes)
            async with OffloadCache(worker, policy=cfg.policy, tiers=[tier],
                                    staging_chunks=cfg.staging_blocks) as cache:
                server.cache = cache
                served = await server.run(workload)
                result = ArmResult(name, served, pool.evictions, cache.stats())
                try:
                    result.disk_ceiling = await _disk_ceiling(tier)
                except AiokvError as exc:  # nothing reached the disk: no bound to give
                    result.disk_ceiling_error = str(exc)
                return result


async def _disk_ceiling(tier: DiskTier) -> float:
    """GB/s of plain reads of 64 of the tier's own block files (the disk bound)."""
    return float(await disk_read_ceiling(tier, 64))


def oracle_hits(arm: ArmResult) -> dict[int, tuple[int, int, int]]:
    """Per request, the tokens ``arm`` served from its GPU cache, host and disk."""
    return {s.index: (s.gpu_tokens, s.host_tokens, s.disk_tokens) for s in arm.served}
