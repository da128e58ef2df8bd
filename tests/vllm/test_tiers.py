"""``aiokv_tiers`` behind vLLM: a prefix evicted from host memory comes back from a disk
or Redis tier through vLLM's own lookup.

vLLM's real Scheduler drives the manager (lookup -> HIT_PENDING while a block is read up
-> prepare_load) and the worker-role connector moves the bytes (tests/vllm/
connector_engine.py), with a host pool far smaller than the prompts' prefixes. Every block
of every running request, and every layer a forward reads, must hold its block hash's
bytes after each step, whether computed, found in the GPU cache, or loaded from host
memory after a trip down to a tier and back. The same workload runs with and without a
tier, so the hits the tier adds are measured, not assumed.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request

from aiokv.cache.tiers import DiskTier
from tests.redis_server import RedisServer, need_redis, running

from .connector_engine import ConnectorEngine
from .harness import DOC, Group, build_configs, write_tiny_model

pytestmark = pytest.mark.timeout(240)

HOST_CHUNKS = 12  # 24 blocks of host memory (2 per chunk) for 12 prefixes of 6 to 9 blocks
REQUESTS = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def shared_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The workers' shared pools in this test's directory; a fixed hash seed, so block
    hashes (and so the tiers' keys) are the same in every engine, as across a restart."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("AIOKV_SHM_DIR", str(shm))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    return shm


def serve(engine: ConnectorEngine, *, seed: int = 21, requests: int = REQUESTS, in_flight: int = 3,
          max_steps: int = 6000) -> None:
    """Serve ``requests`` whole documents plus a few tokens each, ``in_flight`` at a time,
    chosen by ``seed`` alone (so two engines serve the same requests in the same order)."""
    plan = np.random.default_rng(seed)
    order = [(int(plan.integers(len(engine.docs))), plan.integers(10, 900, 5).tolist(),
              int(plan.integers(1, 4))) for _ in range(requests)]
    sched = engine.scheduler
    added = 0
    for _ in range(max_steps):
        while added < requests and len(sched.requests) < in_flight:
            doc, tail, out = order[added]
            sched.add_request(Request(
                request_id=f"r{added}", prompt_token_ids=engine.docs[doc] + tail, pooling_params=None,
                block_hasher=engine.hasher,
                sampling_params=SamplingParams(max_tokens=out, ignore_eos=True)))
            added += 1
        if not sched.requests:
            break
        engine.step()
        time.sleep(0.0005)  # a forward's worth of time for the tiers' thread (a model releases the GIL)
    assert added == requests and not sched.requests, "requests left unfinished"


def disk_url(root: Path, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"capacity": "64MiB", **params}.items())
    return f"file://{root}/disk?{query}"


def engine(model_dir: Path, connector: str, tiers: list[str] | None, *, seed: int = 3) -> ConnectorEngine:
    extra: dict[str, Any] = {"aiokv_policy": "lru"}
    if tiers:
        extra["aiokv_tiers"] = tiers
    made = ConnectorEngine(model_dir, extra=extra, chunks=HOST_CHUNKS, seed=seed, connector=connector)
    made.strict = True
    return made


def figures(name: str, **values: Any) -> None:
    """Print a figure line (``pytest -s`` shows it) and append it to $AIOKV_TIER_FIGURES."""
    line = json.dumps({"test": name, **values})
    print(line)
    path = os.environ.get("AIOKV_TIER_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.mark.parametrize("connector", ["OffloadingConnector", "AiokvConnector"])
def test_a_disk_tier_brings_evicted_prefixes_back(model_dir: Path, tmp_path: Path, connector: str) -> None:
    base = engine(model_dir, connector, None)
    serve(base)
    host_only = base.tally.loaded_blocks / REQUESTS
    base.close()

    tiered = engine(model_dir, connector, [disk_url(tmp_path)])
    serve(tiered)
    with_disk = tiered.tally.loaded_blocks / REQUESTS
    counts = tiered.manager.tiers.counts[0]
    checked = tiered.tally.checked
    tiered.close()
    figures(f"disk/{connector}", host_only=host_only, with_disk=with_disk,
            rise=with_disk / max(host_only, 1e-9), promoted=counts.promoted, demoted=counts.demoted,
            dropped=counts.dropped, promote_ms=1e3 * counts.promote_seconds / max(1, counts.promoted),
            steps=tiered.tally.steps)
    assert counts.demoted > 20 and counts.promoted > 20 and counts.promote_failed == 0, counts
    assert with_disk >= 1.3 * host_only and with_disk > 0, (host_only, with_disk)
    assert checked > 500


def test_a_redis_tier_on_a_real_server_brings_evicted_prefixes_back(model_dir: Path, tmp_path: Path) -> None:
    need_redis()
    with running(RedisServer(tmp_path / "redis")) as server:
        base = engine(model_dir, "OffloadingConnector", None)
        serve(base)
        host_only = base.tally.loaded_blocks / REQUESTS
        base.close()

        tiered = engine(model_dir, "OffloadingConnector", [f"{server.url}?namespace=tiers-e2e&timeout=5"])
        serve(tiered)
        with_redis = tiered.tally.loaded_blocks / REQUESTS
        counts = tiered.manager.tiers.counts[0]
        tiered.close()
        keys = int(server.cli("DBSIZE"))
    figures("redis/OffloadingConnector", host_only=host_only, with_redis=with_redis,
            rise=with_redis / max(host_only, 1e-9), promoted=counts.promoted, demoted=counts.demoted,
            dropped=counts.dropped, promote_ms=1e3 * counts.promote_seconds / max(1, counts.promoted))
    assert counts.demoted > 20 and counts.promoted > 20 and counts.promote_failed == 0, counts
    assert keys > 20, "the blocks are in the server"
    assert with_redis >= 1.3 * host_only and with_redis > 0, (host_only, with_redis)


def test_a_tier_failing_mid_promotion_is_recomputed_never_served(model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every third read up lands its bytes, then fails: the block is a miss, its chunk is
    freed, and the request computes it (every byte checked as before)."""
    real = DiskTier.read
    calls = [0]

    async def flaky(self: DiskTier, keys: Any, out: Any) -> list[bool]:
        got = await real(self, keys, out)
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise OSError("injected: the disk went away mid-read")
        return got

    monkeypatch.setattr(DiskTier, "read", flaky)
    tiered = engine(model_dir, "AiokvConnector", [disk_url(tmp_path)])
    serve(tiered)
    host = tiered.manager.tiers
    deadline = time.monotonic() + 10
    while host.busy:  # reads the last lookups started (for requests served meanwhile)
        assert time.monotonic() < deadline
        time.sleep(0.01)
        host.poll()
    counts = host.counts[0]
    tiered.close()
    assert counts.promote_failed > 0 and counts.promoted > 0, counts
    assert host.promoting == 0  # every failed read freed its slot (checked byte by byte meanwhile)
    tiered.manager.chunks.check_invariants()


def test_a_restart_finds_the_disks_blocks_again(model_dir: Path, tmp_path: Path) -> None:
    """A second engine on the same directory and model (same fingerprint), with an empty
    host pool, serves the first engine's prefixes from disk, byte for byte."""
    first = engine(model_dir, "OffloadingConnector", [disk_url(tmp_path)])
    serve(first)
    demoted = first.manager.tiers.counts[0].demoted
    first.close()
    assert demoted > 20

    second = engine(model_dir, "OffloadingConnector", [disk_url(tmp_path)])
    io = second.manager.tier_io
    assert io is not None
    # The directory's index is rebuilt on the tiers' thread; a server answers misses until
    # then (it never waits for a tier), so the test lets it finish first.
    second.manager.on_schedule_end(None)
    assert io.wait_ready(30) and not io.disabled, io.errors
    serve(second, seed=99, requests=12)
    counts = second.manager.tiers.counts[0]
    second.close()
    figures("restart", found=counts.found, promoted=counts.promoted,
            loaded_blocks=second.tally.loaded_blocks)
    assert counts.promoted > 10 and counts.promote_failed == 0, counts
    assert second.tally.loaded_blocks > 10


def test_tier_stats_and_events_reach_vllm(model_dir: Path, tmp_path: Path) -> None:
    """What the scheduler takes from the manager each step (its stats and its events)
    carries the tiers' work: the tier counters reach vLLM's Prometheus metrics through the
    connector's own ``build_prom_metrics`` (the spec declares them), and the events
    announce the blocks the tier took, as STORAGE."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.v1.kv_offload.base import Locality, Medium

    tiered = engine(model_dir, "AiokvConnector", [disk_url(tmp_path)])
    manager = tiered.manager
    taken: list[Any] = []
    events: list[Any] = []
    real_stats, real_events = manager.get_stats, manager.take_events

    def stats_spy() -> Any:
        got = real_stats()
        if got is not None:
            taken.append(got)
        return got

    def events_spy() -> Any:
        for event in real_events():
            events.append(event)
            yield event

    manager.get_stats, manager.take_events = stats_spy, events_spy  # type: ignore[method-assign]
    serve(tiered, requests=30)
    counts = manager.tiers.counts[0]
    connector = tiered.scheduler.connector
    prom = type(connector).build_prom_metrics(
        tiered.vllm_config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram}, ["engine"], {0: ["0"]})
    tiered.close()
    assert taken, "the scheduler never read the tier counters"
    for stats in taken:
        prom.observe(stats.data, engine_idx=0)
    for name, want in (("promoted", counts.promoted), ("demoted", counts.demoted), ("found", counts.found)):
        seen = REGISTRY.get_sample_value(f"vllm:kv_offload_aiokv_tier_{name}_total",
                                         {"engine": "0", "tier": "0:disk"})
        assert seen == want > 0, (name, seen, want)
    stored = [k for e in events if e.medium is Medium.STORAGE and not e.removed for k in e.keys]
    assert len(stored) == counts.demoted
    assert all(e.locality is Locality.LOCAL and e.ownership == "aiokv:0:disk"
               for e in events if e.medium is Medium.STORAGE)
    promoted = [k for e in events if e.medium is Medium.CPU and not e.removed for k in e.keys]
    assert len(promoted) >= counts.promoted


def test_the_documented_tiers_build_through_vllms_factory(model_dir: Path, tmp_path: Path) -> None:
    """docs/vllm.md's aiokv_tiers line, its directory moved here: vLLM's factory builds the
    spec, a disk then a Redis tier, and nothing connects before the tiers open."""
    pytest.importorskip("redis")
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from aiokv.integrations.vllm.tier_urls import TierURL

    lines = re.findall(r"--kv-transfer-config '(\{.*?\})'", DOC.read_text(), re.S)
    [doc] = [json.loads(line) for line in lines if "aiokv_tiers" in line]
    extra = doc["kv_connector_extra_config"]
    extra["aiokv_tiers"] = [u.replace("/var/cache/aiokv", str(tmp_path / "kv")) for u in extra["aiokv_tiers"]]
    vc, kc = build_configs(model_dir, extra=extra, groups=[Group(("l0",))])
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config

    spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kc))
    tiers: tuple[TierURL, ...] = spec.options.tiers
    assert [t.kind for t in tiers] == ["disk", "redis"]
    assert tiers[0].options["capacity_bytes"] == 64 << 30 and tiers[1].write_through
    assert tiers[1].options["namespace"] == "llama8b"


def serve_to_disk(tiered: ConnectorEngine) -> list[Any]:
    """Serve 20 requests; the keys the disk tier then holds (the tiers idle)."""
    manager = tiered.manager
    io = manager.tier_io
    assert io is not None
    written: list[Any] = []
    submit = io.submit
    io.submit = lambda ops: (written.extend(op.key for op in ops if op.kind == "write"),  # type: ignore[method-assign]
                             submit(ops))
    serve(tiered, requests=20)
    deadline = time.monotonic() + 10
    while manager.tiers.busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        manager.tiers.poll()
    on_disk = [k for k in dict.fromkeys(written) if io.holds(k) >= 0]
    assert len(on_disk) > 5
    return on_disk


def test_reads_up_wait_for_vllms_reset_flush(model_dir: Path, tmp_path: Path) -> None:
    """vLLM frees every host chunk at reset_cache while workers' copies from before it may
    still write them, and calls on_reset_flushed once they have all been reported. A read
    up in between could land in a chunk such a late copy then overwrites: the manager
    answers MISS for blocks only a tier holds until vLLM's flush, then reads them up again."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    tiered = engine(model_dir, "OffloadingConnector", [disk_url(tmp_path)])
    manager = tiered.manager
    on_disk = serve_to_disk(tiered)
    ctx = ReqContext(req_id="probe")
    promoted = manager.tiers.counts[0].promoted
    try:
        with manager.lock:  # what vLLM's scheduler does first, its workers' copies still running
            manager.reset_cache()
            assert [manager.lookup(k, ctx) for k in on_disk] == [LookupResult.MISS] * len(on_disk)
            manager.on_schedule_end(None)
        assert manager.tiers.promoting == 0
        # vLLM's own reset: it calls on_reset_flushed once the workers reported every job
        # in flight (the engine steps meanwhile), and the block comes up again.
        tiered.scheduler.connector.reset_cache()
        deadline = time.monotonic() + 10
        while True:
            tiered.step()
            with manager.lock:
                got = manager.lookup(on_disk[0], ctx)
            if got is LookupResult.HIT:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.005)
        assert manager.tiers.counts[0].promoted == promoted + 1
    finally:
        tiered.close()


def test_a_start_removes_the_pools_of_workers_that_died(model_dir: Path, tmp_path: Path) -> None:
    """An engine that died after its workers made their shared pools, before its scheduler
    mapped them (a failed start, a killed worker), left them on the memory filesystem,
    holding that memory: the next engine's workers remove them when they start."""
    from aiokv.integrations.vllm.shared_pool import pool_file
    from tests.test_vllm_shared_pool import die_after

    stale = [pool_file("died-at-start", 0), pool_file("died-at-start", 1)]
    die_after("published", stale[0])
    die_after("claimed", stale[1])
    assert all(os.path.exists(p) for p in stale)
    tiered = engine(model_dir, "AiokvConnector", [disk_url(tmp_path)])
    try:
        left = [p for p in stale for p in (p, f"{p}.json") if os.path.exists(p)]
        assert left == [], "left behind"
        serve(tiered, requests=6)
    finally:
        tiered.close()


def test_a_read_up_is_a_disk_hit_for_the_request_that_waited(model_dir: Path, tmp_path: Path) -> None:
    """get_load_source (vLLM's hits by source) says DISK for the load a read up served;
    the same block loaded later by another request is a host hit, as it was in host
    memory when that request asked."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    tiered = engine(model_dir, "OffloadingConnector", [disk_url(tmp_path)])
    manager = tiered.manager
    try:
        key = serve_to_disk(tiered)[0]
        first, later = ReqContext(req_id="first"), ReqContext(req_id="later")
        deadline = time.monotonic() + 10
        while True:
            with manager.lock:
                got = manager.lookup(key, first)
                manager.on_schedule_end(None)
            if got is LookupResult.HIT:
                break
            assert got is LookupResult.HIT_PENDING and time.monotonic() < deadline, got
            time.sleep(0.005)
        with manager.lock:
            manager.prepare_load([key], first)
            assert manager.get_load_source(key, first) is CacheHitSource.DISK
            manager.complete_load([key], first)
            assert manager.lookup(key, later) is LookupResult.HIT
            manager.prepare_load([key], later)
            assert manager.get_load_source(key, later) is CacheHitSource.HOST
            manager.complete_load([key], later)
            manager.on_request_finished(first)
            manager.on_request_finished(later)
    finally:
        tiered.close()


def test_each_data_parallel_engine_gets_its_own_disk_directory(model_dir: Path, tmp_path: Path) -> None:
    """vLLM builds every data-parallel engine from one kv_transfer_config: the spec gives
    each engine's manager a subdirectory of the disk tier's directory (one DiskTier per
    directory) and its share of the capacity."""
    from dataclasses import replace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = {"spec_name": "AiokvOffloadingSpec", "spec_module_path": "aiokv.integrations.vllm",
             "cpu_bytes_to_use": 1 << 24, "aiokv_backend": "cpu",
             "aiokv_tiers": [f"file://{tmp_path}/kv?capacity=64MiB"]}
    vc, kc = build_configs(model_dir, extra=extra, groups=[Group(("l0",))])
    base = build_offloading_config(vc, kc)
    paths, capacities = [], []
    for index in range(2):
        parallel = replace(base.parallel, data_parallel_index=index, data_parallel_size=2)
        config = replace(base, parallel=parallel, engine_id=f"dp-engine-{index}")
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
        io = manager.tier_io
        assert io is not None
        [disk] = io.tiers
        assert isinstance(disk, DiskTier)
        paths.append(disk.path)
        capacities.append(disk.capacity_bytes)
        manager.shutdown()
    assert paths == [str(tmp_path / "kv" / "dp0"), str(tmp_path / "kv" / "dp1")]
    assert capacities == [32 << 20, 32 << 20]


def test_a_worker_that_cannot_publish_its_pool_leaves_nothing_behind(model_dir: Path, tmp_path: Path,
                                                                    shared_pools: Path, monkeypatch) -> None:
    """A memory filesystem the pool just filled has no room for its description (ENOSPC):
    the worker fails to start, and neither the pool nor its claim is left there (with no
    description, nothing would ever remove a pool-sized file)."""
    import errno

    import aiokv.integrations.vllm.worker as worker_module

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(worker_module, "publish", full)
    with pytest.raises(OSError, match="No space left"):
        engine(model_dir, "AiokvConnector", [disk_url(tmp_path)])
    assert sorted(p.name for p in shared_pools.iterdir()) == []
