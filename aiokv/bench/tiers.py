"""``aiokv bench cache --tiers host=N,disk=M[,redis=K]``: hit rates and restore rates per tier.

Per trace it replays the requests through the real ``OffloadCache`` over real tiers (a
``DiskTier`` in a temporary directory, a ``RedisTier`` at ``--redis-url``, written through),
at full speed, beside the same host without tiers and LRU over the same total capacity, both
replayed through the cache as well (``replay.py``). Then it restores blocks that live only in
each tier through a real cache and sets the GB/s beside that tier's ceiling measured in the
same run: a plain read of the same bytes with the same I/O size from the same directory,
and redis-py GETs of values of the same size from the same server. Then how fast a cache
writes its host out as it closes (``persist_on_close``), and last, a host-tier hit's
latency with and without tiers. What it writes to Redis it deletes again.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import numpy as np
import torch

from ..cache.offload import DEFAULT_POLICY, OffloadCache
from ..cache.policies import make_policy
from ..cache.tiers.base import Tier
from ..layout import CanonicalKVCaches
from ..worker import AsyncOffloadingWorker
from .ceilings import disk_read_ceiling
from .redis_tools import clear_namespace
from .replay import host_chunks_for, replay_cache
from .report import BenchRow
from .trace import Request, load_trace

__all__ = ["check_tier_options", "parse_tiers", "run_tier_bench"]

Progress = Callable[[str], None]
QUICK_REQUESTS = 3000
PAGE_BYTES, LAYERS = 64 << 10, 8
"""Restore blocks: 8 layers of 64 KiB K and V pages, 1 MiB a block."""
HIT_PAGE_BYTES = 4 << 10
"""Host-hit latency blocks: 8 layers of 4 KiB pages (64 KiB a block), as the face bench uses."""


def parse_tiers(spec: str) -> list[tuple[str, int]]:
    """``"host=2000,disk=32000"`` as ``[("host", 2000), ("disk", 32000)]``: host first, then
    ``disk`` and/or ``redis`` once each, capacities in blocks."""
    out: list[tuple[str, int]] = []
    for part in spec.split(","):
        name, _, value = part.strip().partition("=")
        name = name.strip().lower()
        try:
            blocks = int(value)
        except ValueError:
            raise ValueError(f"--tiers: {part!r} is not NAME=BLOCKS") from None
        if name not in ("host", "disk", "redis") or blocks < 1:
            raise ValueError(f"--tiers: {part!r}: names are host, disk and redis, with positive block counts")
        if any(name == n for n, _ in out):
            raise ValueError(f"--tiers: {name} appears twice")
        out.append((name, blocks))
    if not out or out[0][0] != "host" or len(out) < 2:
        raise ValueError("--tiers starts with host=BLOCKS and names at least one lower tier, "
                         "e.g. host=2000,disk=32000")
    return out


def check_tier_options(tiers: Sequence[tuple[str, int]], *, redis_url: str | None,
                       tier_dir: str | None) -> None:
    """Refuse, before any replay, options that cannot work: a ``tier_dir`` that is no
    folder this user can write to, ``redis`` without a URL or a URL without ``redis``, a
    Redis server that does not answer. Raises ValueError saying what to pass."""
    names = [name for name, _ in tiers]
    if tier_dir is not None and not (os.path.isdir(tier_dir) and os.access(tier_dir, os.W_OK | os.X_OK)):
        raise ValueError(f"--tier-dir {tier_dir}: not a folder this user can write to")
    if "redis" in names and not redis_url:
        raise ValueError("--tiers names redis: pass --redis-url redis://host:port")
    if redis_url and "redis" not in names:
        raise ValueError("--redis-url is used by a redis tier: add redis=BLOCKS to --tiers "
                         "(e.g. host=2000,disk=32000,redis=8000)")
    if redis_url:
        from .redis_tools import ping

        ping(redis_url)


def run_tier_bench(
    paths: Sequence[os.PathLike[str] | str],
    tiers: Sequence[tuple[str, int]],
    *,
    policy: str | None = None,
    redis_url: str | None = None,
    quick: bool = False,
    tier_dir: str | None = None,
    restore_blocks: int | None = None,
    progress: Progress | None = None,
) -> list[BenchRow]:
    """Hit rates per tier on each trace (replayed through the real cache), then each
    tier's restore GB/s beside its ceiling, then a host hit's latency with and without."""
    say = progress or (lambda _msg: None)
    check_tier_options(tiers, redis_url=redis_url, tier_dir=tier_dir)
    name = DEFAULT_POLICY if policy is None else policy
    make_policy(name, 1)  # unknown names fail now, with the list of known ones
    rows: list[BenchRow] = []
    for path in paths:
        trace = load_trace(path, QUICK_REQUESTS if quick else None)
        if not trace:
            raise ValueError(f"trace {path} has no requests")
        label = os.path.basename(os.fspath(path)).removesuffix(".jsonl").removesuffix("_trace")
        rows += _hit_rows(trace, label, tiers, name, redis_url, tier_dir, say)
    count = restore_blocks or (64 if quick else 256)
    for tier_name, _ in tiers[1:]:
        rows += anyio.run(_restore_rows, tier_name, count, redis_url, tier_dir, say)
    if any(tier_name == "disk" for tier_name, _ in tiers):
        rows += anyio.run(_persist_rows, count, tier_dir, say)
    rows += anyio.run(_host_hit_rows, tier_dir, 50 if quick else 400, say)
    return rows


def _hit_rows(trace: list[Request], label: str, tiers: Sequence[tuple[str, int]], policy: str,
              redis_url: str | None, tier_dir: str | None, say: Progress) -> list[BenchRow]:
    host, lower = tiers[0][1], list(tiers[1:])
    total = sum(c for _, c in tiers)
    say(f"{label}: {len(trace):,} requests through OffloadCache({policy}) over {_spec(tiers)}")
    clear = partial(clear_namespace, redis_url) if redis_url else None
    tiered = anyio.run(partial(replay_cache, trace, host, lower, policy=policy, tier_dir=tier_dir,
                               redis_url=redis_url, on_tiers=clear))
    alone = anyio.run(partial(replay_cache, trace, host, policy=policy))
    lru = anyio.run(partial(replay_cache, trace, total, policy="lru"))
    dropped = sum(tiered.dropped.values())
    wrong = tiered.wrong_blocks + alone.wrong_blocks + lru.wrong_blocks
    check = "bytes verified" if wrong == 0 else f"WRONG BYTES in {wrong} blocks"
    section = f"tier hit rate: {label}, {policy} host, {_spec(tiers)} (blocks of 4 KiB), real cache"
    rows = [
        BenchRow(section, "all tiers", tiered.hit_rate * 100, "%", lru.hit_rate * 100,
                 note=f"ceiling: LRU over {total:,} blocks in one tier; {check}; "
                      f"{len(trace) / tiered.seconds:.0f} requests/s", failed=wrong > 0,
                 extra={"dropped": dropped, "seconds": tiered.seconds}),
        BenchRow(section, "host tier, with tiers below", tiered.rate("host") * 100, "%", alone.hit_rate * 100,
                 note="ceiling: the same host without tiers"),
    ]
    rows += [BenchRow(section, f"{name} tier", tiered.rate(name) * 100, "%",
                      note=f"{tiered.written.get(name, 0):,} blocks written, "
                           f"{tiered.dropped.get(name, 0):,} dropped") for name, _ in lower]
    rows += [
        BenchRow(section, f"host only ({policy}) @ {host:,}", alone.hit_rate * 100, "%"),
        BenchRow(section, f"lru @ {total:,}", lru.hit_rate * 100, "%"),
        BenchRow(section, "blocks dropped on their way down", float(dropped), "blocks"),
    ]
    say(f"{label}: tiers {tiered.hit_rate:.4f} (host {tiered.rate('host'):.4f}), host only "
        f"{alone.hit_rate:.4f}, lru @ {total:,} {lru.hit_rate:.4f}; {dropped} dropped; {check} "
        f"({tiered.seconds:.1f}s)")
    return rows


def _spec(tiers: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{n}={c}" for n, c in tiers)


# -- restores from each tier on a real cache ------------------------------------------------


def _layers(num_blocks: int, page_bytes: int, seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randint(0, 256, (2, num_blocks, page_bytes), dtype=torch.uint8, generator=gen)
              for _ in range(LAYERS)]
    return layers, CanonicalKVCaches.from_tensors(layers, block_dim=1)


def _make_tier(name: str, redis_url: str | None, directory: str, capacity_bytes: int) -> Tier:
    if name == "disk":
        from ..cache.tiers.disk import DiskTier

        return DiskTier(directory, capacity_bytes=capacity_bytes)
    from ..cache.tiers.redis import RedisTier

    assert redis_url is not None
    return RedisTier(redis_url, namespace=f"aiokv-bench-{os.getpid()}-{time.monotonic_ns()}",
                     capacity_bytes=capacity_bytes)


@dataclass
class _Restored:
    gbps: float
    wrong: int


async def _restore_rows(name: str, count: int, redis_url: str | None, tier_dir: str | None,
                        say: Progress) -> list[BenchRow]:
    host, staging = 8, 64
    layers, kv = _layers(count + host, PAGE_BYTES, seed=7)
    block_bytes = 2 * LAYERS * PAGE_BYTES
    with tempfile.TemporaryDirectory(dir=tier_dir, prefix="aiokv-tier-bench-") as directory:
        tier = _make_tier(name, redis_url, directory, capacity_bytes=(count + host) * block_bytes * 2)
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=host + staging, backend="cpu") as worker:
            async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=staging) as cache:
                keys = [f"{name}-{os.getpid()}-{i}" for i in range(count + host)]
                originals = [torch.cat([t[:, i].reshape(-1) for t in layers]) for i in range(count)]
                for start in range(0, count + host, host):
                    part = list(range(start, min(start + host, count + host)))
                    await cache.offload([keys[i] for i in part], part)
                await cache.drain()
                lower = keys[:count]  # evicted from the host: only the tier has them
                st = cache.stats().tiers[0]
                if st.demoted < count:
                    say(f"{name}: only {st.demoted} of {count} blocks reached the tier")
                best = _Restored(0.0, 0)
                ceiling = 0.0
                for _round in range(3):  # interleaved, best of each: the host's noise hits both
                    ceiling = max(ceiling, await _ceiling(name, tier, redis_url, block_bytes, count))
                    for t in layers:
                        t[:, :count].zero_()
                    t0 = time.perf_counter()
                    result = await cache.restore(lower, list(range(count)))
                    seconds = time.perf_counter() - t0
                    wrong = sum(
                        1 for i in range(result.restored)
                        if not torch.equal(torch.cat([t[:, i].reshape(-1) for t in layers]), originals[i])
                    ) + (count - result.restored)
                    gbps = result.restored * block_bytes / seconds / 1e9
                    best = _Restored(max(gbps, best.gbps), max(wrong, best.wrong))
                if redis_url and name == "redis":
                    await clear_namespace(redis_url, [tier])
    section = f"tier restore: {name}, {count} blocks of {block_bytes >> 20} MiB through the cache (cpu)"
    ceiling_note = ("ceiling: plain reads of the same files, same I/O size and threads"
                    if name == "disk" else "ceiling: redis-py GET of values of the same size, same server")
    check = "bytes verified" if best.wrong == 0 else f"WRONG OR MISSING BYTES in {best.wrong} blocks"
    say(f"{name}: restore {best.gbps:.2f} GB/s, ceiling {ceiling:.2f} GB/s; {check}")
    return [BenchRow(section, f"restore from {name}", best.gbps, "GB/s", ceiling,
                     note=f"{ceiling_note}; {check}", failed=best.wrong > 0)]


async def _ceiling(name: str, tier: Any, redis_url: str | None, block_bytes: int, count: int) -> float:
    if name == "disk":
        return float(await disk_read_ceiling(tier, count))
    from .ceilings import redis_get_ceiling as raw_get_ceiling

    assert redis_url is not None
    return float(await raw_get_ceiling(redis_url, block_bytes, count))


# -- the host written out as the cache closes -----------------------------------------------


async def _persist_rows(count: int, tier_dir: str | None, say: Progress) -> list[BenchRow]:
    """Leave a cache whose host holds ``count`` blocks of 1 MiB with ``persist_on_close``,
    then check that a new cache on the same directory finds and restores them all."""
    from ..cache.tiers.disk import DiskTier

    layers, kv = _layers(count, PAGE_BYTES, seed=11)
    block_bytes = 2 * LAYERS * PAGE_BYTES
    keys = [f"persist-{i}" for i in range(count)]
    originals = [torch.cat([t[:, i].reshape(-1) for t in layers]) for i in range(count)]
    with tempfile.TemporaryDirectory(dir=tier_dir, prefix="aiokv-tier-bench-") as directory:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=host_chunks_for(count), backend="cpu") as worker:
            cache = OffloadCache(worker, policy="lru", persist_on_close=True,
                                 tiers=[DiskTier(directory, capacity_bytes=2 * count * block_bytes)])
            async with cache:
                await cache.offload(keys, list(range(count)))
                await cache.drain()
                began = time.perf_counter()
            seconds = time.perf_counter() - began
        persisted = cache.stats().tiers[0].persisted
        for t in layers:
            t.zero_()
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=host_chunks_for(count), backend="cpu") as worker:
            tier = DiskTier(directory, capacity_bytes=2 * count * block_bytes)
            async with OffloadCache(worker, policy="lru", tiers=[tier]) as again:
                found = again.lookup(keys)
                restored = (await again.restore(keys[:found], list(range(found)))).restored
        wrong = count - restored + sum(
            1 for i in range(restored)
            if not torch.equal(torch.cat([t[:, i].reshape(-1) for t in layers]), originals[i]))
    check = "bytes verified" if wrong == 0 else f"WRONG OR MISSING BYTES in {wrong} blocks"
    section = f"persist on close: {count} blocks of {block_bytes >> 20} MiB from the host to disk (cpu)"
    say(f"persist: {persisted} blocks in {seconds:.2f} s; a new cache found {found}; {check}")
    gbps = persisted * block_bytes / seconds / 1e9
    return [BenchRow(section, "host written out as the cache closes", gbps, "GB/s",
                     note=f"{persisted} blocks in {seconds:.2f} s; a new cache found {found}; {check}",
                     failed=wrong > 0, extra={"seconds": seconds, "persisted": persisted, "found": found})]


# -- a host-tier hit, with and without tiers -------------------------------------------------


async def _host_hit_rows(tier_dir: str | None, rounds: int, say: Progress) -> list[BenchRow]:
    from ..cache.tiers.disk import DiskTier

    hits = 8
    lat: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(dir=tier_dir, prefix="aiokv-tier-bench-") as directory:
        _, kv_a = _layers(2 * hits, HIT_PAGE_BYTES, seed=1)
        _, kv_b = _layers(2 * hits, HIT_PAGE_BYTES, seed=2)
        async with AsyncOffloadingWorker(kv_a, num_cpu_chunks=4 * hits, backend="cpu") as wa, \
                AsyncOffloadingWorker(kv_b, num_cpu_chunks=4 * hits, backend="cpu") as wb:
            plain = OffloadCache(wa, policy="lru")
            tier = DiskTier(directory, capacity_bytes=64 * wb.chunk_bytes)
            async with OffloadCache(wb, policy="lru", tiers=[tier], staging_chunks=hits) as tiered:
                keys = list(range(hits))
                for cache in (plain, tiered):
                    await cache.offload(keys, keys)
                targets = list(range(hits, 2 * hits))
                for i in range(rounds):
                    for with_tiers in ((False, True) if i % 2 else (True, False)):
                        cache = tiered if with_tiers else plain
                        t0 = time.perf_counter()
                        ok = await cache.restore(keys, targets)
                        lat[with_tiers].append(time.perf_counter() - t0)
                        if not ok:
                            raise RuntimeError("a host hit missed in the bench")
    p50 = {k: float(np.percentile(v, 50)) * 1e6 for k, v in lat.items()}
    section = f"host-tier hit: restore of {hits} blocks of 64 KiB held in the host (cpu), {rounds} each"
    say(f"host hit p50: {p50[True]:.0f} us with tiers, {p50[False]:.0f} us without")
    return [BenchRow(section, "p50 with a disk tier configured", p50[True], "us", p50[False],
                     note="ceiling: p50 without tiers, interleaved")]
