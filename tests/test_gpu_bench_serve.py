"""``aiokv bench serve`` on CUDA: the Llama-3-8B layer shapes in bf16 through the flash
kernels (cached prefixes included), greedy decode from restored KV, the layerwise arm's
loads gated on the compute stream, and the quick command on the CUDA backend. Runs on the
GPU machine (``pytest -m gpu``); skips cleanly elsewhere."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from aiokv.__main__ import main
from aiokv.backends import cuda_usable
from aiokv.bench.serve.config import ARMS
from aiokv.bench.serve.correctness import blocks_needed, decode_check
from aiokv.bench.serve.measure import Device
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel, ModelConfig
from aiokv.bench.serve.sources import LayerwiseSource

from .test_bench_serve import conversation_trace

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDA device and cuda-python"),
]


@pytest.mark.parametrize("split", [64, 512, 1000])
def test_8b_layers_prefill_over_a_cached_prefix_matches_one_go(split: int) -> None:
    """bf16, so close rather than equal: the cached path runs flash with a bottom-right
    causal mask, the one-go path the plain causal kernel."""
    model = LlamaModel(ModelConfig.llama3_8b(2), device="cuda", dtype=torch.bfloat16, seed=1)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab, 1100)
    blocks = -(-len(prompt) // BLOCK_TOKENS)
    kv_one, kv_two = model.new_kv_cache(2 * blocks), model.new_kv_cache(2 * blocks)
    one_table = list(range(blocks))
    two_table = list(range(2 * blocks - 1, blocks - 1, -1))
    whole = model.prefill(prompt, 0, one_table, kv_one)
    model.prefill(prompt[:split], 0, two_table, kv_two)
    parts = model.prefill(prompt[split:], split, two_table, kv_two)
    assert torch.nn.functional.cosine_similarity(whole, parts, dim=0) > 0.999
    assert (whole - parts).abs().max() < 0.05 * whole.abs().max()


@pytest.mark.anyio
async def test_8b_layers_decode_from_restored_kv_token_for_token(tmp_path: Path) -> None:
    model = LlamaModel(ModelConfig.llama3_8b(4), device="cuda", dtype=torch.bfloat16, seed=2)
    kv = model.new_kv_cache(blocks_needed(64, 32))
    rows = await decode_check(model, kv, Device("cuda"), prompt_blocks=64, decode_tokens=32,
                              tier_dir=str(tmp_path))
    assert [r.failed for r in rows] == [False, False], [r.note for r in rows]


@pytest.mark.anyio
async def test_layerwise_loads_gate_the_prefill_on_the_device(tmp_path: Path) -> None:
    """A prefix stored through the layerwise source comes back with one layerwise load
    whose layers the forward gates on its stream (no host wait): the same bytes, the same
    logits as over the KV as computed, and a stall sample per gate (``layer_stalls``)."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, WorkerOptions

    model = LlamaModel(ModelConfig.llama3_8b(4), device="cuda", dtype=torch.bfloat16, seed=3)
    kv = model.new_kv_cache(200)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab, 64 * BLOCK_TOKENS + 100)
    cached = 64 * BLOCK_TOKENS
    src, dst = list(range(70)), list(range(100, 170))
    model.prefill(prompt[:cached], 0, src, kv)
    reference = model.prefill(prompt[cached:], cached, src, kv)
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=80, backend="cuda",
                                     options=WorkerOptions(layer_stalls=True)) as worker:
        source = LayerwiseSource(worker, 80, "lru")
        keys = list(range(1, 65))
        await source.offload(keys, src[:64])
        for layer in kv:
            layer[:, dst] = 0
        torch.cuda.synchronize()
        got = await source.restore(keys, dst[:64])
        token, _ = await Device("cuda").prefill(model, prompt[cached:], cached, dst, kv, gate=got.gate)
        assert got.take_stalls is not None and len(got.take_stalls()) == 4 and not got.failed
        assert got.end is not None and await got.end()
    for layer in kv:
        assert torch.equal(layer[:, dst[:64]], layer[:, src[:64]])
    assert torch.equal(model.prefill(prompt[cached:], cached, dst, kv), reference)
    assert token == int(reference.argmax())


def test_quick_serve_on_the_cuda_backend(tmp_path: Path) -> None:
    trace = conversation_trace(tmp_path / "conversation_trace.jsonl")
    out = tmp_path / "serve.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["bench", "serve", "--quick", "--backend", "cuda", "--trace", str(trace),
                     "--requests", "48", "--warmup", "48", "--tier-dir", str(tmp_path), "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["extra"]["arm"] for r in rows if "ttft_ms" in r["extra"]} == set(ARMS)
    assert not any(r["failed"] for r in rows)
    stalls = [r for r in rows if r["name"] == "layer stall p50"]
    assert stalls and stalls[0]["extra"]["stalls_us"]  # measured on the device
