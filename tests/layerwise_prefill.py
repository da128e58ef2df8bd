"""One prefill over a prefix restored by one layerwise load, gated layer by layer: the check
the serve bench's layerwise arm rests on, on the CPU backend (tiny model) and on CUDA (the
Llama-3-8B shape), with the same block counts on both."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, LayerTimeline, WorkerOptions
from aiokv.bench.serve.measure import Device
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel
from aiokv.bench.serve.runner import ModelThread
from aiokv.bench.serve.sources import LayerwiseSource

# Events time the device to about half a microsecond.
CLOCK_SLACK = 2e-6


def table_blocks(tokens: int) -> int:
    """Blocks a block table needs to cover ``tokens`` positions (a last, partial block too)."""
    return -(-tokens // BLOCK_TOKENS)


async def layerwise_prefill(model: LlamaModel, kv: Sequence[torch.Tensor], device: Device, *,
                            cached_blocks: int, new_tokens: int, seed: int = 1) -> LayerTimeline:
    """Prefill ``cached_blocks`` blocks of a prompt into one block table, store them through
    the layerwise source, zero another table and restore them into it with one layerwise
    load whose layers the forward gates (with ``layer_stalls``, so stalls and the timeline
    are measured on the device on CUDA); then check: the same bytes, the same logits as
    over the KV as computed, a stall sample per gate, every layer started after its copy
    ended. The load is submitted as the serve bench's server submits it (``plan``, the
    inputs prepared, the submit, the forward). Returns the load's timeline."""
    cached = cached_blocks * BLOCK_TOKENS
    prompt = np.random.default_rng(seed).integers(0, model.config.vocab, cached + new_tokens)
    n = table_blocks(len(prompt))
    src, dst = list(range(n)), list(range(n + 8, 2 * n + 8))
    assert kv[0].shape[1] >= 2 * n + 8, "the KV cache is too small for two tables"
    model.prefill(prompt[:cached], 0, src, kv)
    reference = model.prefill(prompt[cached:], cached, src, kv)
    layout = CanonicalKVCaches.from_tensors(list(kv), block_dim=1)
    chunks = cached_blocks + 8
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=chunks, backend=device.kind,
                                     options=WorkerOptions(layer_stalls=True)) as worker:
        source = LayerwiseSource(worker, chunks, "lru")
        keys = list(range(1, cached_blocks + 1))
        await source.offload(keys, src[:cached_blocks])
        for layer in kv:
            layer[:, dst] = 0
        device.synchronize()
        # As the bench's server: planned, the inputs prepared, then the submit and at once
        # the forward on the model's thread.
        planned = source.plan(keys, dst[:cached_blocks])
        assert planned is not None
        got = planned.restored
        prepared = device.prepare(model, prompt[cached:], cached, dst)
        gate = planned.submit()
        async with ModelThread(device) as runner:
            ran = await runner.prefill(model, prompt[cached:], cached, dst, kv, gate=gate, prepared=prepared)
        token = ran.token
        assert got.host == cached_blocks and got.submit_s > 0
        assert got.forward_start_s is not None and got.forward_start_s >= got.submit_s
        assert got.submitted_at + got.submit_s <= ran.began <= got.submitted_at + got.forward_start_s
        assert got.take_stalls is not None and len(got.take_stalls()) == len(kv) and not got.failed
        assert got.end is not None and await got.end()
        assert got.timeline is not None
        timeline = got.timeline()
    for layer in kv:
        assert torch.equal(layer[:, dst[:cached_blocks]], layer[:, src[:cached_blocks]])
    assert torch.equal(model.prefill(prompt[cached:], cached, dst, kv), reference)
    assert token == int(reference.argmax())
    assert timeline is not None and timeline.num_layers == len(kv)
    assert all(t is not None for t in timeline.copy_done + timeline.reached + timeline.started)
    assert all(x is not None and x >= -CLOCK_SLACK for x in timeline.slack()), \
        f"a layer started before its copy ended: {timeline}"
    return timeline
