"""Replaying a request trace through the real ``OffloadCache``, with real tiers below it.

Each request is served the way a server serves it, at full speed (no ``drain()`` between
requests): look up its keys (``alookup`` when a remote tier is configured), restore the
leading hits into GPU blocks and check every restored block's stamp, then offload the
whole request. Hits are the keys restored; the per-tier split is what ``lookup`` counted.
Blocks are small (4 KiB by default) so a whole trace replays in seconds on the CPU backend.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..cache.offload import OffloadCache
from ..cache.protocol import default_staging
from ..cache.tiers.base import Tier
from ..layout import CanonicalKVCaches
from ..worker import AsyncOffloadingWorker
from .trace import Request

__all__ = ["BLOCK_BYTES", "ReplayResult", "TierSpec", "host_chunks_for", "replay_cache"]

BLOCK_BYTES = 4 << 10
"""Bytes of one replayed block (one layer's K and V pages of 2 KiB each)."""

TierSpec = tuple[str, int]
"""A lower tier by name (``"disk"`` or ``"redis"``) and capacity in blocks."""


@dataclass
class ReplayResult:
    """What one replay counted; rates are over all block references of the trace."""

    requests: int
    references: int
    hits: int
    host_hits: int
    tier_hits: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    wrong_blocks: int = 0
    seconds: float = 0.0
    evictions: int = 0
    rejected_by_admission: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.references if self.references else 0.0

    def rate(self, tier: str) -> float:
        """The share of references ``tier`` (``"host"`` or a lower tier's name) served."""
        hits = self.host_hits if tier == "host" else self.tier_hits.get(tier, 0)
        return hits / self.references if self.references else 0.0


def host_chunks_for(host: int) -> int:
    """The pool size whose default staging leaves ``host`` chunks to the host tier."""
    staging = 1
    while default_staging(host + staging) != staging:  # ends: the default grows slower
        staging += 1
    return host + staging


def make_tier(name: str, blocks: int, *, directory: str, redis_url: str | None, namespace: str,
              block_bytes: int) -> Tier:
    """A real tier of ``blocks`` capacity: a ``DiskTier`` under ``directory``, or a
    ``RedisTier`` (written through, as a store shared by servers is) at ``redis_url``."""
    if name == "disk":
        from ..cache.tiers.disk import DiskTier

        return DiskTier(directory, capacity_bytes=blocks * block_bytes)
    if name == "redis" and redis_url:
        from ..cache.tiers.redis import RedisTier

        return RedisTier(redis_url, namespace=namespace, capacity_bytes=blocks * block_bytes,
                         write_through=True)
    raise ValueError(f"no tier {name!r} (disk, or redis with a URL)")


async def replay_cache(
    trace: Sequence[Request],
    host: int,
    lower: Sequence[TierSpec] = (),
    *,
    policy: str | None = None,
    tier_dir: str | None = None,
    redis_url: str | None = None,
    namespace: str | None = None,
    on_tiers: Callable[[list[Tier]], Any] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through an ``OffloadCache`` of ``host`` blocks on the CPU backend,
    over fresh tiers (a temporary directory under ``tier_dir`` for the disk). Default cache
    settings but the policy. ``on_tiers`` sees the open tiers just before they close (the
    bench cleans its Redis keys there)."""
    width = max((len(r.hash_ids) for r in trace), default=1) or 1
    layer = torch.zeros(2, width, BLOCK_BYTES // 2, dtype=torch.uint8)
    stamps = layer[0, :, :8].view(torch.int64).view(-1)  # each block's first 8 bytes: its key
    kv = CanonicalKVCaches.from_tensors([layer], block_dim=1)
    result = ReplayResult(len(trace), 0, 0, 0)
    namespace = namespace or f"aiokv-bench-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory(dir=tier_dir, prefix="aiokv-replay-") as directory:
        tiers = [make_tier(name, blocks, directory=directory, redis_url=redis_url, namespace=namespace,
                           block_bytes=BLOCK_BYTES) for name, blocks in lower]
        remote = any(t.remote for t in tiers)
        chunks = host_chunks_for(host) if tiers else host
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=chunks, backend="cpu") as worker:
            cache = OffloadCache(worker, policy=policy, tiers=tiers)
            async with cache:
                began = time.perf_counter()
                for req in trace:
                    keys = list(req.hash_ids)
                    result.references += len(keys)
                    n = await cache.alookup(keys) if remote else cache.lookup(keys)
                    restored = 0
                    if n:
                        restored = (await cache.restore(keys[:n], list(range(n)))).restored
                        got = stamps[:restored].numpy()
                        result.wrong_blocks += int(np.count_nonzero(got != np.asarray(keys[:restored])))
                    result.hits += restored
                    stamps[restored : len(keys)] = torch.tensor(keys[restored:], dtype=torch.int64)
                    await cache.offload(keys, list(range(len(keys))))
                result.seconds = time.perf_counter() - began
                await cache.drain()
                if on_tiers is not None:
                    await on_tiers(tiers)
            st = cache.stats()
    result.host_hits = st.host_hits
    result.evictions = st.manager.evictions
    result.rejected_by_admission = st.manager.rejected_by_admission
    for t in st.tiers:
        result.tier_hits[t.name] = t.hits
        result.dropped[t.name] = t.demotions_dropped
        result.written[t.name] = t.demoted + t.write_throughs
    return result
