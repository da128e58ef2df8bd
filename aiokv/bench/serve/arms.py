"""Each arm's stack on the one model, all open at once so that the arms can take turns.

recompute and the oracle have a GPU pool without prefix caching (one KV pool between them:
neither keeps anything between requests); gpu adds the pool's prefix cache; host adds an
``OffloadCache`` on an ``AsyncOffloadingWorker``; layerwise a host pool of its own restored
with layerwise loads (``sources.LayerwiseSource``); disk gives an ``OffloadCache`` a
``DiskTier`` in a temporary directory (whose read ceiling is measured before it closes).
Every caching arm has its own KV pool, so its GPU prefix cache survives the other arms'
turns. The host, layerwise and disk arms hold the same number of host chunks for keys: the
disk arm's worker has ``staging_blocks`` more, which its cache keeps aside for the tier.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import torch

from ...cache.offload import OffloadCache, OffloadCacheStats
from ...cache.tiers.disk import DiskTier
from ...errors import AiokvError
from ...layout import CanonicalKVCaches
from ...options import WorkerOptions
from ...worker import AsyncOffloadingWorker
from ..ceilings import disk_read_ceiling
from .config import ServeConfig
from .measure import Device
from .model import LlamaModel
from .pool import BlockPool
from .server import Served, Server
from .sources import CacheSource, LayerwiseSource

__all__ = ["Arm", "ArmResult", "open_arms", "oracle_hits"]

Progress = Callable[[str], None]
CACHING = ("gpu", "host", "layerwise", "disk")


@dataclass
class ArmResult:
    """One arm's requests and what its caches counted."""

    name: str
    served: list[Served]
    gpu_evictions: int
    cache: OffloadCacheStats | None = None
    disk_ceiling: float | None = None
    disk_ceiling_error: str = ""
    stalls: list[float] = field(default_factory=list)


@dataclass
class Arm:
    """One open arm: its server and what it has served so far."""

    name: str
    server: Server
    cache: OffloadCache | None = None
    tier: DiskTier | None = None
    served: list[Served] = field(default_factory=list)

    @property
    def warms(self) -> bool:
        """Whether the warm-up requests go through it (recompute and the oracle keep nothing)."""
        return self.name in CACHING

    async def result(self) -> ArmResult:
        """What it served and counted; the disk arm measures its tier's read ceiling here."""
        out = ArmResult(self.name, self.served, self.server.pool.evictions,
                        self.cache.stats() if self.cache is not None else None,
                        stalls=list(self.server.stalls))
        if self.tier is not None:
            try:
                out.disk_ceiling = float(await disk_read_ceiling(self.tier, 64))
            except AiokvError as exc:  # nothing reached the disk: no bound to give
                out.disk_ceiling_error = str(exc)
        return out


def new_kv_pools(cfg: ServeConfig, model: LlamaModel) -> dict[str, list[torch.Tensor]]:
    """One KV pool per arm that owns one (``ServeConfig.kv_owners``); the others' by name."""
    assert cfg.gpu_blocks is not None
    owners = cfg.kv_owners()
    pools = {name: model.new_kv_cache(cfg.gpu_blocks) for name in owners}
    for name in ("recompute", "oracle"):
        if name in cfg.arms:
            pools[name] = pools[owners[0]]
    return pools


async def open_arms(cfg: ServeConfig, model: LlamaModel, kv: dict[str, list[torch.Tensor]], device: Device,
                    stack: AsyncExitStack, *, block_bytes: int, progress: Progress) -> dict[str, Arm]:
    """Enter every arm's worker, cache and tier on ``stack``; the arms by name."""
    assert cfg.gpu_blocks is not None and cfg.host_blocks is not None
    assert cfg.disk_blocks is not None and cfg.staging_blocks is not None
    arms: dict[str, Arm] = {}
    epoch = time.perf_counter()
    for name in cfg.ordered_arms():
        pool = BlockPool(cfg.gpu_blocks, caching=name in CACHING)
        server = Server(model, kv[name], device, pool, progress=progress,
                        oracle={} if name == "oracle" else None, epoch=epoch)
        arm = arms[name] = Arm(name, server)
        if name not in ("host", "layerwise", "disk"):
            continue
        layout = CanonicalKVCaches.from_tensors(list(kv[name]), block_dim=1)
        chunks = cfg.host_blocks + (cfg.staging_blocks if name == "disk" else 0)
        # Stalls are measured on the device only when asked (two events per gate).
        options = WorkerOptions(layer_stalls=True) if name == "layerwise" else None
        worker = await stack.enter_async_context(
            AsyncOffloadingWorker(layout, num_cpu_chunks=chunks, backend=device.kind, options=options))
        if name == "layerwise":
            server.source = LayerwiseSource(worker, cfg.host_blocks, cfg.policy)
            continue
        tiers: Sequence[DiskTier] = ()
        if name == "disk":
            folder = tempfile.TemporaryDirectory(dir=cfg.tier_dir, prefix="aiokv-serve-")
            directory = stack.enter_context(folder)
            arm.tier = DiskTier(directory, capacity_bytes=cfg.disk_blocks * block_bytes)
            tiers = [arm.tier]
        arm.cache = await stack.enter_async_context(
            OffloadCache(worker, policy=cfg.policy, tiers=tiers,
                         staging_chunks=cfg.staging_blocks if tiers else None))
        server.source = CacheSource(arm.cache)
    return arms


def oracle_hits(served: Sequence[Served]) -> dict[int, tuple[int, int, int]]:
    """Per request, the tokens an arm served from its GPU cache, host and disk."""
    return {s.index: (s.gpu_tokens, s.host_tokens, s.disk_tokens) for s in served}
