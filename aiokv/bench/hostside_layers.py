"""The host side of layerwise jobs on the no-op driver (``hostside``): what a layerwise
load's submit and a layerwise store's push cost the calling thread, on either submit path
(``python -m aiokv.bench.hostside_layers``; docs/layerwise.md, "Host time").

The shapes are the issue's (docs/layerwise.md): Llama-3-8B's 32 layers of K and V pages
of 32 KiB, a load of 942 blocks (a 16k-token prefix less the GPU's share) or 242 (4k),
its chunk ids in 3 runs and its GPU block ids in 8, as the serve bench's loads are; and a
push of the 25 blocks a 4k-token request's new tokens fill, the forward's thread's cost
between two layers. The driver has 2-D batches, so layers fold into pitched runs. Every
driver call is a no-op, so the figures are aiokv's own work: a real driver adds its calls
on the Python path; on the native path they are the issuer thread's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from .. import CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec, SyncOffloadingWorker
from ..backends.cuda import native
from .hostside import noop_cuda

__all__ = ["layer_figures"]

LAYERS, BLOCKS, CHUNKS = 32, 2048, 1100
PUSH_BLOCKS = 25


def _kv() -> CanonicalKVCaches:
    """32 layers of (2, blocks, 16 tokens, 8 heads, 128) bf16: K and V pages of 32 KiB (the
    memory is only reserved, never touched)."""
    tensors = [torch.empty(2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return CanonicalKVCaches.from_tensors(tensors, block_dim=1)


def load_ids(n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """A load's (GPU blocks, chunks): chunks in 3 runs, blocks in 8 runs placed apart."""
    c0 = int(rng.integers(0, CHUNKS - n - 8))
    chunks = np.arange(c0, c0 + n)
    chunks[n // 3:] += 3
    chunks[2 * n // 3:] += 4
    pieces = np.split(np.arange(n), np.sort(rng.choice(np.arange(1, n), 7, replace=False)))
    starts, at = [0] * len(pieces), 0
    for k in rng.permutation(len(pieces)).tolist():
        starts[k], at = at, at + len(pieces[k]) + 5
    blocks = np.concatenate([s + np.arange(len(p)) for s, p in zip(starts, pieces)])
    return blocks.tolist(), chunks.tolist()


def _loads(w: SyncOffloadingWorker, n: int, reps: int) -> list[float]:
    rng = np.random.default_rng(n)
    jobs = [load_ids(n, rng) for _ in range(4)]
    out = []
    for i in range(reps):
        blocks, chunks = jobs[i % len(jobs)]
        src, dst = CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks)
        t0 = time.perf_counter()
        job = w.submit_load(i, src, dst, layerwise=True)
        out.append(time.perf_counter() - t0)
        for layer in range(LAYERS):
            job.gate(layer)
        w.wait([i])
        w.get_finished()
    return out


def _pushes(w: SyncOffloadingWorker, reps: int) -> list[float]:
    out = []
    blocks, chunks = list(range(100, 100 + PUSH_BLOCKS)), list(range(10, 10 + PUSH_BLOCKS))
    for i in range(reps):
        job = w.submit_store(10_000 + i, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks), layerwise=True)
        for layer in range(LAYERS):
            t0 = time.perf_counter()
            job.push(layer)
            out.append(time.perf_counter() - t0)
        w.wait([10_000 + i])
        w.get_finished()
    return out


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e6


def layer_figures(reps: int = 60) -> dict[str, dict[str, float]]:
    """Per path ("python", "native"): the layerwise load submit at 942 and 242 blocks and
    the push of 25 blocks, p50 and p90 in microseconds, after a warm-up."""
    kv = _kv()
    out: dict[str, dict[str, float]] = {}
    paths = [("python", False)] + ([("native", True)] if native.helper() is not None else [])
    with noop_cuda(pitched=True):
        for name, flag in paths:
            figures: dict[str, Any] = {}
            w = SyncOffloadingWorker(kv, num_cpu_chunks=CHUNKS, backend="cuda", options={"native": flag})
            try:
                for n in (942, 242):
                    times = _loads(w, n, reps + 10)[10:]
                    figures[f"layerwise load submit, {n} blocks p50 us"] = statistics.median(times) * 1e6
                    figures[f"layerwise load submit, {n} blocks p90 us"] = _p(times, 90)
                times = _pushes(w, reps // 4 + 4)[4 * LAYERS:]
                figures[f"layerwise push, {PUSH_BLOCKS} blocks p50 us"] = statistics.median(times) * 1e6
                figures[f"layerwise push, {PUSH_BLOCKS} blocks p90 us"] = _p(times, 90)
            finally:
                w.shutdown()
            out[name] = figures
    return out


if __name__ == "__main__":
    for path, figures in layer_figures().items():
        for key, value in figures.items():
            print(f"{path:<7} {key:<44} {value:10.2f}")
