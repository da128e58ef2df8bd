"""A pytest plugin that points vLLM's own manager tests at AiokvOffloadingSpec.

vLLM's test code is not part of this repository. To rerun what docs/vllm.md reports, unpack
the vLLM 0.33.0 sdist (it ships ``tests/``) and run, from its root, in the vLLM venv::

    PYTHONPATH=<aiokv>/tests/vllm python -m pytest -p upstream_shim \\
        --confcutdir=tests/v1/kv_offload tests/v1/kv_offload/cpu/test_manager.py

and for the connector's scheduler and event tests (offline: a directory with a small
model's config.json stands in for the Hub model they name)::

    HF_HUB_OFFLINE=1 AIOKV_OFFLINE_MODEL=<dir> PYTHONPATH=<aiokv>/tests/vllm \
        python -m pytest -p upstream_shim \
        --confcutdir=tests/v1/kv_connector/unit/offloading_connector \
        tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py \
        tests/v1/kv_connector/unit/offloading_connector/test_events.py

``AIOKV_SHIM_KEEP_CPU_MANAGER=1`` keeps vLLM's own manager (the baseline run).

Every ``CPUOffloadingManager(...)`` those modules build becomes the manager of a spec that
vLLM's ``OffloadingSpecFactory`` creates by name from an ``OffloadingConfig``, with the same
chunk count, policy and events; a store threshold of 2 or more maps to aiokv's
second-offer admission, anything less admits everything (vLLM's default).
"""

from __future__ import annotations

from typing import Any

import pytest

CHUNK = 512  # bytes of one chunk of the synthetic config below


def aiokv_manager(
    num_chunks: int,
    cache_policy: str = "lru",
    cache_policy_module_path: str | None = None,
    enable_events: bool = False,
    store_threshold: int = 1,
    max_tracker_size: int = 64_000,
    info: Any = None,
) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=CHUNK,
        enable_kv_cache_events=enable_events,
        extra_config={
            "spec_name": "AiokvOffloadingSpec",
            "spec_module_path": "aiokv.integrations.vllm",
            "cpu_bytes_to_use": num_chunks * CHUNK,
            "aiokv_policy": cache_policy,
            "aiokv_admission": "second-offer" if store_threshold >= 2 else "all",
        },
        engine_id="upstream-tests",
        model=OffloadingModelConfig(name="none", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()


@pytest.fixture(autouse=True)
def _aiokv_manager_everywhere(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    module = request.module
    if os.environ.get("AIOKV_SHIM_KEEP_CPU_MANAGER"):  # a baseline run of vLLM's manager
        return
    if hasattr(module, "CPUOffloadingManager"):
        monkeypatch.setattr(module, "CPUOffloadingManager", aiokv_manager)


@pytest.fixture(autouse=True)
def _offline_model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's connector tests name a Hub model for its config only; with AIOKV_OFFLINE_MODEL
    set to a local directory holding a config.json, they read that instead (no network)."""
    import os

    local = os.environ.get("AIOKV_OFFLINE_MODEL")
    utils = __import__("sys").modules.get("tests.v1.kv_connector.unit.utils")
    if not local or utils is None or not hasattr(utils, "ModelConfig"):
        return
    real = utils.ModelConfig

    def offline(*args: Any, **kwargs: Any) -> Any:
        kwargs["model"] = local
        kwargs.setdefault("skip_tokenizer_init", True)
        return real(*args, **kwargs)

    monkeypatch.setattr(utils, "ModelConfig", offline)
