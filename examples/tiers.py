"""Tiers: an offload cache with a disk tier (and optionally Redis) under the host pool.

A host pool of eight blocks takes sixteen: the eight it evicts go to the disk tier, a
restore brings them back from there, and the cache writes what the host still holds to the
disk as it closes (``persist_on_close``), so a new cache on the same directory (the next
process, after a restart) finds every block. Runs on a GPU when there is one and on the CPU
backend otherwise. ``python examples/tiers.py [--dir DIR] [--redis-url redis://host:port]``
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass

import anyio
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, DiskTier, OffloadCache, RedisTier, Tier


@dataclass
class Report:
    from_tiers: int  # blocks the first cache restored from below the host
    after_restart: int  # blocks a new cache on the same directory found
    verified: bool  # every restored block held the bytes offloaded under its key


def tiers_under(directory: str, redis_url: str | None) -> list[Tier]:
    """A disk tier, nearest first, and a shared Redis written through when a URL is given.
    One directory serves one cache at a time (its tier locks it)."""
    tiers: list[Tier] = [DiskTier(directory, capacity_bytes=1 << 30)]
    if redis_url:
        tiers.append(RedisTier(redis_url, namespace="aiokv-example", write_through=True))
    return tiers


async def run(directory: str, redis_url: str | None = None, num_layers: int = 4,
              device: str | None = None) -> Report:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = (2, 32, 16, 8, 64)  # K/V, 32 GPU blocks, tokens per block, heads, head_dim
    layers = [torch.randn(shape, dtype=torch.float16, device=device) for _ in range(num_layers)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    requests = [[(r, i) for i in range(4)] for r in range(4)]  # four prefixes of four block hashes
    expected: dict[tuple[int, int], list[torch.Tensor]] = {}

    def same(key: tuple[int, int], block: int) -> bool:
        return all(torch.equal(layer[:, block], want) for layer, want in zip(layers, expected[key]))

    # Ten host chunks: eight hold blocks, two (the default staging) carry blocks to the tiers.
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=10) as worker:
        async with OffloadCache(worker, policy="lru", tiers=tiers_under(directory, redis_url),
                                persist_on_close=True) as cache:
            for keys in requests:
                for layer in layers:  # a request's KV, computed in GPU blocks 0..3
                    layer[:, :4] = torch.randn_like(layer[:, :4])
                for i, key in enumerate(keys):
                    expected[key] = [layer[:, i].clone() for layer in layers]
                await cache.offload(keys, range(4))
            first = requests[0]  # evicted by the host long ago: only the disk has it
            n = cache.lookup(first)
            result = await cache.restore(first[:n], range(8, 8 + n))
            verified = bool(result) and all(same(key, 8 + i) for i, key in enumerate(first))
            print(f"{worker.backend}: restored {result.restored} blocks, {result.from_tiers} from the tiers")

    # A new worker and cache on the same directory, as the next process would open them.
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=10) as worker:
        async with OffloadCache(worker, policy="lru", tiers=tiers_under(directory, redis_url)) as cache:
            everything = [key for keys in requests for key in keys]
            found = cache.lookup(everything)
            again = await cache.restore(everything[:found], range(16, 16 + found))
            verified = verified and bool(again) and all(same(k, 16 + i) for i, k in enumerate(everything))
            print(f"after a restart: {found} of {len(everything)} blocks found on disk, "
                  f"{'verified' if verified else 'WRONG BYTES'}")
    return Report(result.from_tiers, found, verified)


def main(directory: str | None = None, redis_url: str | None = None, num_layers: int = 4,
         device: str | None = None) -> Report:
    if directory is not None:
        return anyio.run(run, directory, redis_url, num_layers, device)
    with tempfile.TemporaryDirectory(prefix="aiokv-tiers-") as temporary:
        return anyio.run(run, temporary, redis_url, num_layers, device)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--redis-url", help="a Redis/Valkey server for a shared tier")
    args = parser.parse_args()
    main(args.dir, args.redis_url)
