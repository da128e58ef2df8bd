"""What a layerwise store pushed from the forward costs the forward: the same prefill timed
with and without one, back to back in the same run.

A layerwise store is submitted before the forward and each layer is pushed as soon as its
new K and V are written (``LlamaModel.prefill``'s ``after_layer``), so its copies run
beside the rest of the forward: they take copy engines and memory bandwidth the forward
also uses, and each push is host work between two layers: the row also gives each push's
host time on the forward's thread, so a slowdown reads as host time or device time. The
forwards alternate (with, without, then without, with, ...) so the machine's slow and fast
moments fall on both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ...layout import CanonicalKVCaches
from ...specs import CPULoadStoreSpec, GPULoadStoreSpec
from ...worker import AsyncOffloadingWorker
from ..report import BenchRow
from .measure import Device
from .model import BLOCK_TOKENS, LlamaModel
from .runner import ModelThread

__all__ = ["push_rows"]

SECTION = "serve: layerwise stores pushed from the forward"


async def push_rows(model: LlamaModel, kv: Sequence[torch.Tensor], device: Device, *, cached: int, new: int,
                    pairs: int = 6, seed: int = 0) -> list[BenchRow]:
    """Prefill ``new`` tokens over ``cached`` ones ``2 * pairs`` times, half of them pushing
    a layerwise store of the full blocks they write; the ratio of their median device times.
    Uses KV blocks from 0 of ``kv`` (a pool no request holds any more)."""
    cached -= cached % BLOCK_TOKENS
    total = cached + new
    blocks = -(-total // BLOCK_TOKENS)
    if blocks > kv[0].shape[1]:
        return []
    table = list(range(blocks))
    stored = table[cached // BLOCK_TOKENS: total // BLOCK_TOKENS]  # the new, full blocks
    if not stored:
        return []
    tokens = np.random.default_rng([seed, 11]).integers(0, model.config.vocab, total)
    if cached:
        device.prefill_sync(model, tokens[:cached], 0, table, kv)
    layout = CanonicalKVCaches.from_tensors(list(kv), block_dim=1)
    times: dict[bool, list[float]] = {False: [], True: []}
    push_s: list[float] = []  # host seconds of each push call, on the forward's thread
    ids = iter(range(1, 1 << 30))

    def timed(push: Callable[[int], object]) -> Callable[[int], None]:
        def call(layer: int) -> None:
            t0 = time.perf_counter()
            push(layer)
            push_s.append(time.perf_counter() - t0)

        return call

    async with AsyncOffloadingWorker(layout, num_cpu_chunks=len(stored), backend=device.kind) as worker, \
            ModelThread(device) as runner:  # the forwards run as the arms' do
        await runner.prefill(model, tokens[cached:], cached, table, kv)  # warm-up
        for rep in range(2 * pairs):
            push = (rep % 4) in (0, 3)  # with, without, without, with, ...
            fut = None
            if push:
                fut = worker.submit_store(next(ids), GPULoadStoreSpec(stored),
                                          CPULoadStoreSpec(range(len(stored))), layerwise=True)
            ran = await runner.prefill(model, tokens[cached:], cached, table, kv,
                                       after_layer=timed(fut.push) if fut is not None else None)
            if fut is not None:
                await fut
            times[push].append(ran.seconds)
    with_, without = float(np.median(times[True])), float(np.median(times[False]))
    mib = len(stored) * sum(t.tensor.shape[1] for t in layout.tensors) / 2**20
    ratio = with_ / without if without > 0 else float("nan")
    us = [t * 1e6 for t in push_s]
    return [BenchRow(SECTION, "forward with pushes / without", ratio, "x",
                     note=f"{pairs} forwards each of {new:,} tokens over {cached:,}, alternating; "
                          f"{with_ * 1e3:.2f} vs {without * 1e3:.2f} ms median "
                          f"({'device' if device.kind == 'cuda' else 'host'} time); pushing "
                          f"{len(stored)} blocks ({mib:.1f} MiB)",
                     extra={"with_ms": [t * 1e3 for t in times[True]],
                            "without_ms": [t * 1e3 for t in times[False]]}, target=("<=", 1.03)),
            BenchRow(SECTION, "push host time p50", float(np.median(us)), "us",
                     note=f"n={len(us)} pushes; p90 {np.percentile(us, 90):.1f} us; the push call on the "
                          "forward's thread, between two of its layers",
                     extra={"push_us": us})]
