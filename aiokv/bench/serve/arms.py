"""Each arm's stack on the one model, all open at once so that the arms can take turns.

recompute and the oracle have a GPU pool without prefix caching (one KV pool between them:
neither keeps anything between requests); gpu adds the pool's prefix cache; host adds an
``OffloadCache`` on an ``AsyncOffloadingWorker``; layerwise a host pool of its own restored
with layerwise loads (``sources.LayerwiseSource``); disk gives an ``OffloadCache`` a
``DiskTier`` in a temporary directory, and redis a ``RedisTier`` (a namespace of its own on
the given server, or on a loopback server the bench starts), each tier's ceiling measured
before it closes. Every caching arm has its own KV pool, so its GPU prefix cache survives
the other arms' turns. The tiered arms hold the same number of host chunks for keys: the
disk and Redis arms' workers have ``staging_blocks`` more, which their caches keep aside
for the tier.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import torch

from ...cache.offload import OffloadCache, OffloadCacheStats
from ...cache.tiers.base import Tier
from ...cache.tiers.disk import DiskTier
from ...errors import AiokvError
from ...layout import CanonicalKVCaches
from ...options import WorkerOptions
from ...worker import AsyncOffloadingWorker
from ..ceilings import disk_read_ceiling, redis_get_ceiling
from ..redis_tools import clear_namespace, local_server
from .config import CACHING, ServeConfig
from .loopwatch import LoopWatch
from .measure import Device
from .model import LlamaModel
from .pool import BlockPool
from .served import Served
from .server import Server
from .sources import CacheSource, LayerwiseSource

__all__ = ["Arm", "ArmResult", "open_arms", "oracle_hits"]

Progress = Callable[[str], None]
CEILING_BLOCKS = 64
"""Blocks a tier's ceiling reads (files of the disk tier, values from the Redis server)."""


@dataclass
class ArmResult:
    """One arm's requests and what its caches counted; a tiered arm's tier ceiling (disk:
    plain reads of its files; Redis: redis-py GETs from its server), GB/s."""

    name: str
    served: list[Served]
    gpu_evictions: int
    cache: OffloadCacheStats | None = None
    disk_ceiling: float | None = None
    disk_ceiling_error: str = ""
    stalls: list[float] = field(default_factory=list)
    loop: LoopWatch = field(default_factory=LoopWatch)
    ceiling_name: str = ""


@dataclass
class Arm:
    """One open arm: its server and what it has served so far."""

    name: str
    server: Server
    cache: OffloadCache | None = None
    tier: Tier | None = None
    served: list[Served] = field(default_factory=list)
    redis_url: str | None = None

    @property
    def warms(self) -> bool:
        """Whether the warm-up requests go through it (recompute and the oracle keep nothing)."""
        return self.name in CACHING

    async def result(self, block_bytes: int) -> ArmResult:
        """What it served and counted; a tiered arm measures its tier's ceiling here."""
        out = ArmResult(self.name, self.served, self.server.pool.evictions,
                        self.cache.stats() if self.cache is not None else None,
                        stalls=list(self.server.stalls), loop=self.server.loop)
        try:
            if isinstance(self.tier, DiskTier):
                out.ceiling_name = "plain reads of its own files, with its mode, I/O size and threads"
                out.disk_ceiling = float(await disk_read_ceiling(self.tier, CEILING_BLOCKS))
            elif self.tier is not None and self.redis_url is not None:
                out.ceiling_name = "redis-py GETs of values of one block from its server"
                out.disk_ceiling = float(await redis_get_ceiling(self.redis_url, block_bytes, CEILING_BLOCKS))
        except AiokvError as exc:  # nothing reached the disk, the server went away: no bound
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
        stack.push_async_callback(server.aclose)  # its model thread ends with the arms, always
        arm = arms[name] = Arm(name, server)
        if name not in ("host", "layerwise", "disk", "redis"):
            continue
        layout = CanonicalKVCaches.from_tensors(list(kv[name]), block_dim=1)
        chunks = cfg.host_blocks + (cfg.staging_blocks if name in ("disk", "redis") else 0)
        # Stalls are measured on the device only when asked (two events per gate).
        options = WorkerOptions(layer_stalls=True) if name == "layerwise" else None
        worker = await stack.enter_async_context(
            AsyncOffloadingWorker(layout, num_cpu_chunks=chunks, backend=device.kind, options=options))
        if name == "layerwise":
            server.source = LayerwiseSource(worker, cfg.host_blocks, cfg.policy)
            continue
        tiers: Sequence[Tier] = ()
        if name == "disk":
            folder = tempfile.TemporaryDirectory(dir=cfg.tier_dir, prefix="aiokv-serve-")
            directory = stack.enter_context(folder)
            arm.tier = DiskTier(directory, capacity_bytes=cfg.disk_blocks * block_bytes)
            tiers = [arm.tier]
        elif name == "redis":
            arm.tier = redis_tier(cfg, arm, stack, block_bytes, progress)
            tiers = [arm.tier]
        arm.cache = await stack.enter_async_context(
            OffloadCache(worker, policy=cfg.policy, tiers=tiers,
                         staging_chunks=cfg.staging_blocks if tiers else None))
        if name == "redis" and cfg.redis_url is not None:
            # Runs before the cache closes its tier (the stack unwinds in reverse order).
            stack.push_async_callback(clear_namespace, cfg.redis_url, tiers)
        server.source = CacheSource(arm.cache)
    return arms


def redis_tier(cfg: ServeConfig, arm: Arm, stack: AsyncExitStack, block_bytes: int,
               progress: Progress) -> Tier:
    """The Redis arm's tier: a namespace of its own on ``--redis-url``, or on a loopback
    server started from ``--redis-server`` for the run (bounded to the tier's capacity and
    a little more), holding ``redis_blocks`` blocks at most (its oldest deleted first)."""
    from ...cache.tiers.redis import RedisTier

    assert cfg.redis_blocks is not None
    capacity = cfg.redis_blocks * block_bytes
    if cfg.redis_url is None:
        assert cfg.redis_server is not None
        bound = capacity + capacity // 4 + (256 << 20)  # values, their headers and the server's own
        url = stack.enter_context(local_server(cfg.redis_server, maxmemory=bound))
        progress(f"arm redis: started {cfg.redis_server} at {url} (loopback, no persistence)")
    else:
        url = cfg.redis_url
    arm.redis_url = url
    namespace = f"aiokv-serve-{os.getpid()}-{secrets.token_hex(4)}"
    return RedisTier(url, namespace=namespace, capacity_bytes=capacity, check=True)


def oracle_hits(served: Sequence[Served]) -> dict[int, tuple[int, int, int]]:
    """Per request, the tokens an arm served from its GPU cache, host and disk."""
    return {s.index: (s.gpu_tokens, s.host_tokens, s.disk_tokens) for s in served}
