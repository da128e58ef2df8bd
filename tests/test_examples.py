"""The examples run (small) on the CPU backend and do what they claim: bytes come back
equal, prefix hits match recomputation, the step loop verifies every request."""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (not a package) under a private module name."""
    mod_name = f"aiokv_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


# -- quickstart ----------------------------------------------------------------------------


def test_quickstart_restores_the_clobbered_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    quickstart = load_example("quickstart")
    moved = quickstart.main(num_layers=2, num_blocks=16, device="cpu")
    page = 16 * 8 * 64 * 2  # tokens * heads * head_dim * fp16
    assert moved == 2 * 2 * 4 * page  # layers * K/V * blocks * page
    assert "verified" in capsys.readouterr().out


# -- engine step loop ----------------------------------------------------------------------


def test_engine_step_loop_verifies_every_request() -> None:
    step_loop = load_example("engine_step_loop")
    report = step_loop.main(num_requests=12, num_layers=2, num_gpu_blocks=12, per_step=3, device="cpu")
    assert report.verified == 12 and report.recomputed == 0
    assert report.stores == 12
    assert report.expedited_loads == 6 and report.async_loads == 6
    # 12 GPU blocks for 30 blocks of KV: freed blocks are reused while their stores run.
    assert report.reuse_waits > 0
    # One counter for loads and stores: every id once, no gaps.
    assert sorted(report.job_ids) == list(range(len(report.job_ids))) == list(range(24))
    block_bytes = 2 * 2 * 16 * 4 * 32 * 4  # layers * K/V * tokens * heads * head_dim * fp32
    total_blocks = sum(1 + rid % 4 for rid in range(12))
    assert report.bytes_stored == report.bytes_loaded == total_blocks * block_bytes


# -- async server --------------------------------------------------------------------------


@pytest.fixture
def server_mod() -> ModuleType:
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    return load_example("async_server")


def _server(mod: ModuleType, **kwargs: Any) -> Any:
    """A small model, so each test stays well under a second of compute."""
    cfg = mod.ModelConfig(hidden=64, num_layers=2, heads=2, head_dim=32)
    return mod.PrefixCacheServer(cfg, device="cpu", **kwargs)


def _mismatches(server: Any, responses: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Prompts whose answer differs from computing the prompt from scratch."""
    bad = []
    for prompt, body in responses:
        ref = server.model.reference(prompt)
        if (body["digest"], body["next_token"]) != (ref["digest"], ref["next_token"]):
            bad.append(prompt)
    return bad


def test_async_server_restores_prefix_hits_that_match_recomputation(server_mod: ModuleType) -> None:
    server = _server(server_mod, num_gpu_blocks=64, num_cpu_chunks=256)
    report = anyio.run(partial(server_mod.simulate, 12, server, num_prefixes=3, concurrency=4))
    stats = report.stats
    assert stats["requests"] == len(report.responses) == 12
    # The first request of each prefix warms the cache; the other 9 restore its 8 blocks.
    assert stats["hit_blocks"] == 9 * 8
    assert sum(body["hit_blocks"] for _, body in report.responses) == 9 * 8
    assert stats["failed_loads"] == 0 and stats["hit_rate"] > 0.5
    assert _mismatches(server, report.responses) == []
    worker = stats["worker"]
    block_bytes = server.worker.chunk_bytes
    assert worker["bytes_moved"]["load"] == 9 * 8 * block_bytes
    assert worker["bytes_moved"]["store"] == stats["stored_blocks"] * block_bytes
    assert worker["in_flight"] == {"store": 0, "load": 0, "expedited_load": 0}


def test_async_server_restores_the_exact_bytes_it_offloaded(server_mod: ModuleType) -> None:
    """Byte-exact: a block restored through the cache holds the K/V its store took, in
    every layer, wherever on the device it lands."""
    import torch

    server = _server(server_mod, num_gpu_blocks=16, num_cpu_chunks=32)
    prompt = "You are a terse assistant. " * 6  # 162 tokens: 10 full blocks

    async def scenario() -> None:
        async with server:
            body, finished = await server.generate(prompt)
            stored = [layer[:, finished.blocks[: len(finished.hashes)]].clone() for layer in server.kv]
            await server.offload(finished)
            for layer in server.kv:  # scribble over every block the request owned
                layer[:, finished.blocks].copy_(torch.randn_like(layer[:, finished.blocks]))
            blocks = await server._allocate(3)  # the next request's blocks start elsewhere
            body, finished = await server.generate(prompt)
            await server._release(blocks)
            n = body["hit_blocks"]
            assert n == len(finished.hashes) == 10
            for layer, before in zip(server.kv, stored):
                assert torch.equal(layer[:, finished.blocks[:n]], before[:, :n])
            await server.offload(finished)

    anyio.run(scenario)


def test_async_server_evicts_when_the_host_pool_is_full(server_mod: ModuleType) -> None:
    server = _server(server_mod, num_gpu_blocks=32, num_cpu_chunks=12, policy="lru")
    report = anyio.run(partial(server_mod.simulate, 16, server, num_prefixes=2, concurrency=4))
    assert report.stats["evicted_blocks"] > 0
    assert _mismatches(server, report.responses) == []


def test_async_server_degrades_a_failed_load_to_a_miss(server_mod: ModuleType, monkeypatch) -> None:
    """Every load fails on the lane (after landing its bytes, as a fault reported late may):
    the cache reports a miss and the request recomputes, with answers unchanged."""
    from aiokv.backends.cpu import CpuLane

    server = _server(server_mod, num_gpu_blocks=64, num_cpu_chunks=256)
    real = CpuLane._copy

    def copy(lane: Any, plan: Any) -> None:
        real(lane, plan)
        if not lane.direction.to_host:
            raise OSError("injected by the test")

    monkeypatch.setattr(CpuLane, "_copy", copy)
    report = anyio.run(partial(server_mod.simulate, 6, server, num_prefixes=2))
    assert report.stats["failed_loads"] == 4 and report.stats["hit_blocks"] == 0
    assert report.stats["worker"]["failed"]["load"] == 4
    assert _mismatches(server, report.responses) == []


def test_async_server_exports_prometheus_metrics(server_mod: ModuleType) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    server = _server(server_mod, num_gpu_blocks=64, num_cpu_chunks=256, metrics_registry=registry)
    report = anyio.run(partial(server_mod.simulate, 6, server, num_prefixes=2))
    hits = report.stats["hit_blocks"]
    assert hits == 4 * 8
    loaded = registry.get_sample_value("aiokv_transferred_bytes_total", {"direction": "load"})
    assert loaded == hits * server.worker.chunk_bytes
    assert registry.get_sample_value("aiokv_transfers_total", {"direction": "load"}) == 4


def test_async_server_http_endpoints(server_mod: ModuleType) -> None:
    import httpx

    server = _server(server_mod, num_gpu_blocks=16, num_cpu_chunks=32)
    app = server_mod.create_app(server)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                prompt = "You are a terse assistant. " * 3
                first = (await client.post("/generate", json={"prompt": prompt})).json()
                second = (await client.post("/generate", json={"prompt": prompt})).json()
                assert first["hit_blocks"] == 0 and second["hit_blocks"] == (len(prompt) - 1) // 16
                assert first["digest"] == second["digest"] == server.model.reference(prompt)["digest"]
                assert (await client.post("/generate", json={"prompt": ""})).status_code == 400
                assert (await client.post("/generate", json={"prompt": "x" * 16 * 17})).status_code == 413
                assert (await client.get("/metrics")).status_code == 404
                stats = (await client.get("/stats")).json()
                assert stats["requests"] == 2 and stats["worker"]["backend"] == "cpu"

    anyio.run(scenario)


# -- tiers ---------------------------------------------------------------------------------


def test_tiers_example_restores_from_disk_and_after_a_restart(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    tiers = load_example("tiers")
    report = tiers.main(directory=str(tmp_path), num_layers=2, device="cpu")
    assert report.verified and report.from_tiers == 4 and report.after_restart == 16
    assert "16 of 16 blocks found on disk, verified" in capsys.readouterr().out


def test_the_tiers_page_quickstart_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/tiers.md's first program runs as printed (no undefined names) and restores from
    the disk what the host let go."""
    import re

    page = (EXAMPLES.parent / "docs" / "tiers.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S)
    assert code is not None
    exec(compile(code.group(1), "docs/tiers.md", "exec"), {"__name__": "docs_tiers"})
    assert "restored 8 of 8, 8 from the disk" in capsys.readouterr().out


def test_tiers_example_with_a_shared_redis(tmp_path: Path) -> None:
    from tests.redis_server import RedisServer, need_redis, running

    need_redis()
    tiers = load_example("tiers")
    with running(RedisServer(tmp_path / "redis")) as server:
        assert isinstance(server, RedisServer)
        report = tiers.main(directory=str(tmp_path / "disk"), redis_url=server.url, num_layers=2,
                            device="cpu")
    assert report.verified and report.after_restart == 16


# -- on the GPU (pytest -m gpu) ------------------------------------------------------------


def _cuda_usable() -> bool:
    from aiokv.backends import cuda_usable

    return cuda_usable()


needs_gpu = pytest.mark.skipif(not _cuda_usable(), reason="needs a usable CUDA device and cuda-python")


def test_engine_step_loop_admits_no_more_than_its_free_chunks_in_one_step() -> None:
    """Three 4-block requests a step against 6 host chunks: admission counts the chunks
    this step's requests take (it once let two through, and step 5 ran out of chunks)."""
    import torch

    from aiokv import CanonicalKVCaches, SyncOffloadingWorker

    step_loop = load_example("engine_step_loop")
    layers = [torch.randn(2, 24, *step_loop.KV_PAGE) for _ in range(2)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    worker = SyncOffloadingWorker(kv, num_cpu_chunks=6, backend="cpu")
    try:
        requests = [step_loop.Request(rid, num_blocks=4, expedited=False) for rid in range(6)]
        report = step_loop.Engine(worker, layers, 6).run(requests, per_step=3, timeout=30)
        assert report.verified == 6 and report.recomputed == 0
    finally:
        worker.shutdown()


@pytest.mark.gpu
@needs_gpu
def test_quickstart_and_step_loop_on_the_gpu() -> None:
    assert load_example("quickstart").main(num_layers=2, num_blocks=16, device="cuda") > 0
    step_loop = load_example("engine_step_loop")
    report = step_loop.main(num_requests=12, num_layers=2, num_gpu_blocks=12, device="cuda")
    assert report.verified == 12 and report.recomputed == 0 and report.reuse_waits > 0


@pytest.mark.gpu
@needs_gpu
def test_async_server_on_the_gpu(server_mod: ModuleType) -> None:
    cfg = server_mod.ModelConfig(hidden=64, num_layers=2, heads=2, head_dim=32)
    server = server_mod.PrefixCacheServer(cfg, num_gpu_blocks=32, num_cpu_chunks=24, device="cuda")
    report = anyio.run(partial(server_mod.simulate, 12, server, num_prefixes=2, concurrency=4))
    assert report.stats["worker"]["backend"] == "cuda" and report.stats["hit_blocks"] > 0
    for prompt, body in report.responses:
        assert body["digest"] == server.model.reference(prompt, "cuda")["digest"]
