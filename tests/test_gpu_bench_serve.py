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
from aiokv.bench.serve.config import DEFAULT_ARMS
from aiokv.bench.serve.correctness import blocks_needed, decode_check
from aiokv.bench.serve.measure import Device
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel, ModelConfig

from .layerwise_prefill import layerwise_prefill, table_blocks
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
async def test_the_model_thread_launches_queued_forwards_and_times_each_on_the_device() -> None:
    """Forwards handed to a server's model thread at once (the launcher does not wait for
    an end; its waiter thread does, in launch order): each gives the token of the same
    prefill run alone and a device time, and they began in the order handed over."""
    import anyio

    from aiokv.bench.serve.runner import ModelThread

    model = LlamaModel(ModelConfig.llama3_8b(2), device="cuda", dtype=torch.bfloat16, seed=6)
    kv = model.new_kv_cache(128)
    device = Device("cuda")
    gen = np.random.default_rng(6)
    prompts = [gen.integers(0, model.config.vocab, 200 + 37 * i) for i in range(5)]
    tables = [list(range(24 * i, 24 * i + 24)) for i in range(5)]  # 24 blocks hold 384 tokens
    alone = [device.prefill_sync(model, p, 0, t, kv) for p, t in zip(prompts, tables)]
    got: dict[int, object] = {}
    handed: list[int] = []
    async with ModelThread(device) as runner:
        async def one(i: int) -> None:
            handed.append(i)  # the hand-over is synchronous up to the first await
            got[i] = await runner.prefill(model, prompts[i], 0, tables[i], kv)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(one, i)
    assert [got[i].token for i in range(5)] == [t for t, _ in alone]  # type: ignore[attr-defined]
    began = [got[i].began for i in handed]  # type: ignore[attr-defined]
    assert began == sorted(began) and all(got[i].seconds > 0 for i in range(5))  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_layerwise_loads_gate_the_prefill_on_the_device() -> None:
    """A prefix stored through the layerwise source comes back with one layerwise load
    whose layers the forward gates on its stream (no host wait): the same bytes, the same
    logits as over the KV as computed, a stall sample per gate (``layer_stalls``), and each
    layer's start after its copy's end in device time (``tests/layerwise_prefill.py``; its
    CPU twin runs the same block counts)."""
    model = LlamaModel(ModelConfig.llama3_8b(4), device="cuda", dtype=torch.bfloat16, seed=3)
    kv = model.new_kv_cache(160)
    timeline = await layerwise_prefill(model, kv, Device("cuda"), cached_blocks=64, new_tokens=100)
    assert timeline.clock == "device"


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})])
@pytest.mark.anyio
async def test_the_forward_starts_while_a_16k_prefix_is_still_arriving() -> None:
    """Llama-3-8B's 32 layers, a 16,384-token prefix (1,024 blocks, 2 GiB) restored by one
    layerwise load, 1,638 new tokens: the forward reaches its first gate before the last
    layer's copy ends and computes (not only waits at gates) before it ends, in device
    timestamps; every layer starts after its own copy ends (``layerwise_prefill``); and the
    logits are those of the KV as computed. That is the overlap. No gate need wait: with
    this many new tokens a layer's forward is slower than its copy, so each layer has
    landed by the time the forward reaches it."""
    model = LlamaModel(ModelConfig.llama3_8b(32), device="cuda", dtype=torch.bfloat16, seed=4)
    kv = model.new_kv_cache(2 * table_blocks(16384 + 1638) + 8)
    timeline = await layerwise_prefill(model, kv, Device("cuda"), cached_blocks=1024, new_tokens=1638)
    first, last = timeline.first_reached, timeline.last_copy_done
    assert first is not None and last is not None
    assert first < last, f"the forward reached layer 0 at {first * 1e3:.2f} ms, after the last copy " \
                         f"ended at {last * 1e3:.2f} ms: no overlap"
    computing = timeline.overlap_computing
    assert computing is not None and computing > 0, \
        f"the forward only waited at its gates until the last copy ended ({timeline})"
    del model, kv
    torch.cuda.empty_cache()


def test_quick_serve_on_the_cuda_backend(tmp_path: Path) -> None:
    trace = conversation_trace(tmp_path / "conversation_trace.jsonl")
    out = tmp_path / "serve.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["bench", "serve", "--quick", "--backend", "cuda", "--trace", str(trace),
                     "--requests", "48", "--warmup", "48", "--tier-dir", str(tmp_path), "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    # The redis arm runs only where a server is named.
    assert {r["extra"]["arm"] for r in rows if "ttft_ms" in r["extra"]} == set(DEFAULT_ARMS)
    assert not any(r["failed"] for r in rows)
    stalls = [r for r in rows if r["name"] == "layer stall p50"]
    assert stalls and stalls[0]["extra"]["stalls_us"]  # measured on the device
