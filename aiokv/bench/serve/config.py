"""What a serve run does: mode, model, workload, pools and arms, with the defaults of each
kind of run: the GPU run, and the run on the CPU backend (``--quick``, or any run without
CUDA), which has the tiny model and small sizes."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from .model import ModelConfig
from .workload import Workload, reuse_distances

__all__ = ["ARMS", "MODES", "ServeConfig"]

ARMS = ("recompute", "gpu", "host", "layerwise", "disk", "redis", "oracle")
"""Every arm (the oracle mirrors the deepest caching arm of the run)."""
DEFAULT_ARMS = tuple(a for a in ARMS if a != "redis")
"""The arms of a run without ``--arms``; the Redis arm joins them when a server is given."""
TIERED = ("host", "layerwise", "disk", "redis")
"""Arms with a host pool (an ``OffloadCache``, or the layerwise arm's own)."""
CACHING = ("gpu", *TIERED)
"""Arms that keep blocks between requests."""
MODES = ("trace", "prefix", "correctness")
SEGMENT_REQUESTS = 25
"""Measured requests per segment by default: short turns pair the arms closely in time,
long ones lose less to each segment starting with an empty queue."""

ARM_TEXT = {
    "recompute": "no reuse: every prompt is prefilled whole",
    "gpu": "GPU prefix cache only",
    "host": "GPU prefix cache + host tier (OffloadCache)",
    "layerwise": "GPU prefix cache + host pool restored with layerwise loads (the forward gates each layer)",
    "disk": "GPU prefix cache + host tier + disk tier (OffloadCache, DiskTier)",
    "redis": "GPU prefix cache + host tier + Redis tier (OffloadCache, RedisTier)",
    "oracle": "the same hits as the mirrored arm, moved in zero time",
}


@dataclass
class ServeConfig:
    """One run's settings; ``None`` sizes are chosen from the workload (``resolve``)."""

    backend: str = "cpu"
    mode: str = "trace"
    quick: bool = False
    model: str = "tiny"  # "tiny" or "llama3-8b"
    layers: int | None = None
    traces: list[str] | None = None
    requests: int | None = None
    warmup: int | None = None
    block_tokens: int | None = None
    max_tokens: int | None = None
    prefixes: int = 4
    prefix_tokens: int | None = None
    suffix_tokens: int | None = None
    compress: float | None = None
    load: float = 0.5
    gpu_blocks: int | None = None
    host_blocks: int | None = None
    disk_blocks: int | None = None
    redis_blocks: int | None = None
    staging_blocks: int | None = None
    tier_dir: str | None = None
    redis_url: str | None = None  # a server the Redis arm uses (the bench deletes its keys after)
    redis_server: str | None = None  # a redis-server binary the bench starts for the Redis arm
    policy: str | None = None
    arms: tuple[str, ...] = DEFAULT_ARMS
    segments: int | None = None  # None: one per SEGMENT_REQUESTS measured requests
    decode_tokens: int = 16
    seed: int = 0
    loop: str = "asyncio"

    @classmethod
    def defaults(cls, *, backend: str, quick: bool, **given: Any) -> ServeConfig:
        """A config for this kind of run; ``given`` values that are not None win."""
        big = backend == "cuda" and not quick
        prefix = given.get("mode") == "prefix"
        base = cls(
            backend=backend, quick=quick, model="llama3-8b" if big else "tiny",
            requests=100 if prefix else 400 if big else 200,
            warmup=0 if prefix else 400 if big else 200,
            block_tokens=32 if big else 16,
            max_tokens=16384 if big else 2048,
            prefix_tokens=4096 if big else 512,
            suffix_tokens=128 if big else 32,
            decode_tokens=32 if big else 16,
            # A shared CPU host can run the model at half speed for a while: room for that.
            load=0.5 if backend == "cuda" else 0.3,
        )
        cfg = replace(base, **{k: v for k, v in given.items() if v is not None})
        if given.get("arms") is None and (cfg.redis_url or cfg.redis_server):
            cfg.arms = ARMS  # a Redis server given: its arm joins the default ones
        return cfg

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.backend == "cuda" else torch.float32

    def model_config(self) -> ModelConfig:
        if self.model == "llama3-8b":
            return ModelConfig.llama3_8b(self.layers or 32)
        return ModelConfig.tiny(self.layers or 2)

    def resolve_pools(self, workload: Workload, block_bytes: int) -> None:
        """Pool sizes not given, from the workload's reuse distances (``reuse_distances``):
        the GPU pool holds what is reused soonest (15% of the reuse), the host what is
        reused within the median distance, the disk 95% of it; each within its memory
        budget (``_budgets``, shared by the arms open at once: each caching arm has a GPU
        pool of its own, recompute and the oracle share one, and each tiered arm pins a
        host pool) and the GPU pool never below the largest request."""
        need = workload.max_blocks() + 16
        dist = reuse_distances(workload)
        q = np.percentile(dist, [15, 50, 95]) if dist.size else np.array([0.0, 0.0, 0.0])
        gpu_pools = len(self.kv_owners())
        host_pools = max(1, sum(a in TIERED for a in self.arms))
        gpu_cap, host_cap, disk_cap = (b // block_bytes // n for b, n in
                                       zip(self._budgets(block_bytes), (gpu_pools, host_pools, 1)))
        # The Redis arm's server holds its blocks in this host's memory beside the pinned
        # pools (half of it): an eighth of it at most.
        redis_cap = self._budgets(block_bytes)[1] // 4 // block_bytes
        if self.gpu_blocks is None:
            self.gpu_blocks = max(need, min(gpu_cap, int(q[0]) + need))
        if self.host_blocks is None:
            self.host_blocks = min(host_cap, max(2 * self.gpu_blocks, int(q[1])))
        if self.disk_blocks is None:
            self.disk_blocks = min(disk_cap, max(2 * self.host_blocks, int(1.05 * q[2])))
        if self.redis_blocks is None:
            self.redis_blocks = max(1, min(redis_cap, self.disk_blocks))
        if self.staging_blocks is None:
            self.staging_blocks = max(1, min(64, self.host_blocks // 3))
        if self.gpu_blocks < need - 16:
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold the largest request "
                             f"({need - 16} blocks of 16 tokens); give more or lower --max-tokens")

    def check_pools(self, workload: Workload) -> None:
        """Refuse a ``--gpu-blocks`` that cannot hold the largest request, before the model
        is built (``resolve_pools`` sizes what was not given)."""
        if self.gpu_blocks is not None and self.gpu_blocks < workload.max_blocks():
            raise ValueError(f"--gpu-blocks {self.gpu_blocks} cannot hold the largest request "
                             f"({workload.max_blocks()} blocks of 16 tokens); give more or lower "
                             "--max-tokens")

    def _budgets(self, block_bytes: int) -> tuple[int, int, int]:
        """Bytes the GPU pools, the host pools and the disk tier may take by default, all
        arms together: half the device memory left after the weights, half the host's
        memory (pinned), half the free space where the disk tier writes."""
        if self.backend == "cuda":
            gpu = torch.cuda.mem_get_info()[0] // 2
        else:
            gpu = 1 << 30
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 << 30
        disk = shutil.disk_usage(self.tier_dir or tempfile.gettempdir()).free // 2
        return gpu, ram // 2, disk

    def check(self) -> None:
        """Refuse settings that cannot run, before anything is allocated."""
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"--arms takes names from {', '.join(ARMS)} (got {', '.join(self.arms)})")
        if self.model not in ("tiny", "llama3-8b"):
            raise ValueError(f"--model is tiny or llama3-8b, got {self.model!r}")
        if self.model == "llama3-8b" and self.backend != "cuda":
            raise ValueError("the llama3-8b shape runs on CUDA (its float32 weights alone would "
                             "take 30 GB here); the CPU backend runs --model tiny")
        if "oracle" in self.arms and not set(CACHING) & set(self.arms):
            raise ValueError("the oracle mirrors a caching arm: add gpu, host, layerwise, disk or redis "
                             "to --arms")
        if self.redis_url and self.redis_server:
            raise ValueError("give --redis-url (a server to use) or --redis-server (a binary the bench "
                             "starts), not both")
        if "redis" in self.arms and not (self.redis_url or self.redis_server):
            raise ValueError("the redis arm needs a server: --redis-url redis://host:port, or "
                             "--redis-server PATH to a redis-server binary the bench starts")
        if self.redis_server is not None and not (os.path.isfile(self.redis_server)
                                                  and os.access(self.redis_server, os.X_OK)):
            raise ValueError(f"--redis-server {self.redis_server} is not an executable file")
        if self.segments is not None and self.segments < 1:
            raise ValueError(f"--segments must be >= 1, got {self.segments}")
        if self.compress is not None and not self.compress > 0:
            raise ValueError(f"--compress must be > 0, got {self.compress}")
        if not 0 < self.load <= 4:
            raise ValueError(f"--load must be in (0, 4], got {self.load}")
        if self.decode_tokens < 1:
            raise ValueError(f"--decode-tokens must be >= 1, got {self.decode_tokens}")
        for name in ("requests", "block_tokens", "max_tokens", "gpu_blocks", "host_blocks", "disk_blocks",
                     "redis_blocks", "layers", "prefix_tokens", "suffix_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.tier_dir is not None and not os.path.isdir(self.tier_dir):
            raise ValueError(f"--tier-dir {self.tier_dir} is not a folder")

    def segment_count(self, measured: int) -> int:
        return self.segments or max(1, round(measured / SEGMENT_REQUESTS))

    def ordered_arms(self) -> list[str]:
        return [a for a in ARMS if a in self.arms]

    def kv_owners(self) -> list[str]:
        """The arms that get a GPU KV pool of their own: every caching arm, and recompute
        (or the oracle) for both of them, as neither keeps anything between requests."""
        owners = [a for a in self.ordered_arms() if a in CACHING]
        shared = [a for a in ("recompute", "oracle") if a in self.arms]
        return shared[:1] + owners

    def turns(self, segment: int) -> list[str]:
        """The order the arms serve segment ``segment`` in: rotated from one segment to the
        next, so no arm always runs first or after the same one, and each arm that is
        compared with another request by request runs right after it (the oracle after
        the arm it mirrors, layerwise after host), under the same machine load."""
        mirrored = self.mirrored_arm()
        units: list[list[str]] = []
        for arm in self.ordered_arms():
            if arm == "oracle" or (arm == "layerwise" and "host" in self.arms):
                continue
            unit = [arm]
            if arm == "host" and "layerwise" in self.arms:
                unit.append("layerwise")
            if arm == mirrored and "oracle" in self.arms:
                unit.append("oracle")
            units.append(unit)
        k = segment % len(units)
        return [a for unit in units[k:] + units[:k] for a in unit]

    def mirrored_arm(self) -> str | None:
        """The arm whose hits the oracle takes: the deepest caching arm of the run."""
        for name in ("disk", "redis", "host", "layerwise", "gpu"):
            if name in self.arms:
                return name
        return None

