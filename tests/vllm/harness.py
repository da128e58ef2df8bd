"""Builds vLLM's own objects around the plug-in the way vLLM builds them (vLLM tests only).

The kv-transfer config comes from docs/vllm.md itself, so the page's configuration is the
one these tests run. Import only after ``pytest.importorskip("vllm")``. Where vLLM 0.33 and
0.34 differ in what a caller builds (``ModelRunnerOutput``, the device side of a job), the
helpers here build what the installed release builds, found by feature, not by version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_offload import base as kv_offload_base
from vllm.v1.outputs import ModelRunnerOutput

# vLLM 0.34 hands its workers device addresses (DevicePointers) instead of GPU block ids.
DEVICE_POINTERS = hasattr(kv_offload_base, "DevicePointers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"

# A tiny local model description: vLLM reads only its config, never weights or a tokenizer.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}


def documented_kv_transfer_config(connector: str = "OffloadingConnector") -> dict[str, Any]:
    """The JSON that docs/vllm.md gives to ``vllm serve --kv-transfer-config`` for
    ``connector`` (vLLM's ``OffloadingConnector`` with the spec, or ``AiokvConnector``)."""
    for match in re.finditer(r"--kv-transfer-config '(\{.*?\})'", DOC.read_text(), re.S):
        config = json.loads(match.group(1))
        if config.get("kv_connector") == connector:
            return config
    raise AssertionError(f"docs/vllm.md has no --kv-transfer-config '{{...}}' line for {connector}")


def write_tiny_model(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return path


@dataclass
class Group:
    """One KV-cache group: its layers and a page that may be padded past its content."""

    layers: tuple[str, ...]
    num_kv_heads: int = 2
    head_size: int = 8
    pad_bytes: int = 0

    def spec(self, block_size: int) -> FullAttentionSpec:
        unpadded = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=torch.float16,
        ).page_size_bytes
        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=torch.float16,
            page_size_padded=unpadded + self.pad_bytes if self.pad_bytes else None,
        )


def build_configs(
    model_dir: Path,
    *,
    extra: dict[str, Any],
    groups: list[Group],
    block_size: int = 16,
    num_gpu_blocks: int = 64,
    world_size: int = 1,
    events: bool = True,
    connector: str = "OffloadingConnector",
) -> tuple[VllmConfig, KVCacheConfig]:
    """A VllmConfig whose kv_transfer_config is the one documented for ``connector`` with
    ``extra`` merged into its extra config, and a KVCacheConfig with the given groups."""
    doc = documented_kv_transfer_config(connector)
    doc["kv_connector_extra_config"] = {**doc["kv_connector_extra_config"], **extra}
    model = ModelConfig(
        model=str(model_dir), dtype="float16", seed=0, max_model_len=4096, skip_tokenizer_init=True
    )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=1000, max_model_len=4096, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(**doc),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null"),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.parallel_config.world_size = world_size
    specs = [g.spec(block_size) for g in groups]
    widest = max(s.page_size_bytes * len(g.layers) for s, g in zip(specs, groups))
    tensors = [
        KVCacheTensor(
            size=widest * num_gpu_blocks,
            layers=list(g.layers),
            layer_stride=s.page_size_bytes * num_gpu_blocks,
            block_stride=s.page_size_bytes,
        )
        for s, g in zip(specs, groups)
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(g.layers), s) for s, g in zip(specs, groups)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    return vllm_config, kv_cache_config


def layer_caches(
    kv_cache_config: KVCacheConfig, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-layer caches shaped as FlashAttention's ``(blocks, 2, block_size, heads, head)``,
    each block a (possibly padded) page of its own buffer, filled with random bytes; and
    the same memory as ``(blocks, page_bytes)`` int8 rows."""
    gen = torch.Generator().manual_seed(seed)
    caches, rows = {}, {}
    nb = kv_cache_config.num_blocks
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        page = spec.page_size_bytes
        shape = (nb, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
        for name in group.layer_names:
            raw = torch.randint(-128, 128, (nb * page,), dtype=torch.int8, generator=gen)
            elems = raw.view(torch.float16)
            stride = (
                page // 2,
                spec.block_size * spec.num_kv_heads * spec.head_size,
                spec.num_kv_heads * spec.head_size,
                spec.head_size,
                1,
            )
            caches[name] = elems.as_strided(shape, stride)
            rows[name] = raw.view(nb, page)
    return caches, rows


def connectors(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, caches: dict[str, torch.Tensor]
) -> tuple[OffloadingConnector, OffloadingConnector]:
    """vLLM's connector in both roles, each building its own spec through vLLM's factory
    (as the scheduler process and a worker process would), the worker's over ``caches``."""
    scheduler = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    with set_current_vllm_config(vllm_config):
        worker.register_kv_caches(caches)
    return scheduler, worker


def device_side(connector_worker: Any, spec: Any) -> Any:
    """The device side of a job as this vLLM's connector hands it to its worker: 0.34
    resolves the GPU spec to addresses in the registered KV caches, 0.33 passes it on."""
    if not DEVICE_POINTERS:
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, connector_worker._kv_caches)


def model_runner_output(req_ids: list[str], **kw: Any) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for ``req_ids`` (0.33 also wants ``req_id_to_index``)."""
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **kw)
