"""The correctness mode: greedy decode from restored KV equals greedy decode from recomputed KV.

A prompt's full blocks are prefilled into fresh GPU blocks and N tokens are decoded greedily
from them (the reference: recomputed KV). The same blocks then go to the host through an
``OffloadCache`` and come back into other GPU blocks (their first pages scrambled before),
and, through a second cache whose small host pool pushes them down, from a ``DiskTier``;
each restored prefix must hold the very bytes computed, and decoding from it must give the
reference's tokens, one for one.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence

import numpy as np
import torch

from ...cache.offload import OffloadCache
from ...cache.tiers.disk import DiskTier
from ...layout import CanonicalKVCaches
from ...worker import AsyncOffloadingWorker
from ..report import BenchRow
from .measure import Device
from .model import BLOCK_TOKENS, LlamaModel
from .workload import block_keys

__all__ = ["blocks_needed", "decode_check"]

DISK_HOST_CHUNKS, DISK_STAGING = 12, 4
"""The disk path's host pool: small, so the prefix is evicted to the disk tier."""


def blocks_needed(prompt_blocks: int, decode_tokens: int) -> int:
    """GPU blocks the check uses: three tables (reference, host, disk) of the whole sequence."""
    return 3 * -(-(prompt_blocks * BLOCK_TOKENS + 5 + decode_tokens) // BLOCK_TOKENS)


def _decode(model: LlamaModel, device: Device, kv: Sequence[torch.Tensor], prompt: np.ndarray,
            cached: int, table: list[int], n: int) -> list[int]:
    """Prefill the prompt after its first ``cached`` tokens, then decode greedily: n tokens."""
    token, _ = device.prefill_sync(model, prompt[cached:], cached, table, kv)
    out = [token]
    for pos in range(len(prompt), len(prompt) + n - 1):
        token, _ = device.prefill_sync(model, np.array([token]), pos, table, kv)
        out.append(token)
    return out


def _pages(kv: Sequence[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    return [layer[:, blocks].clone() for layer in kv]


def _scramble(kv: Sequence[torch.Tensor], blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in kv:
        noise = torch.randn(layer[:, blocks].shape, generator=gen).to(layer.dtype)
        layer[:, blocks] = noise.to(layer.device)


async def decode_check(model: LlamaModel, kv: Sequence[torch.Tensor], device: Device, *,
                       prompt_blocks: int, decode_tokens: int, tier_dir: str | None = None,
                       seed: int = 0) -> list[BenchRow]:
    """Rows saying whether decoding from host- and disk-restored KV matched recompute."""
    n = decode_tokens
    prompt = np.random.default_rng([seed, 7]).integers(0, model.config.vocab,
                                                       prompt_blocks * BLOCK_TOKENS + 5)
    keys = block_keys(prompt)[:prompt_blocks]
    span = blocks_needed(prompt_blocks, n) // 3
    if span * 3 > kv[0].shape[1]:
        raise ValueError(f"the correctness check needs {3 * span} GPU blocks, the cache has {kv[0].shape[1]}")
    ref_t, host_t, disk_t = (list(range(i * span, (i + 1) * span)) for i in range(3))
    prefix = prompt_blocks * BLOCK_TOKENS
    device.prefill_sync(model, prompt[:prefix], 0, ref_t, kv)  # the recomputed prefix KV
    computed = _pages(kv, ref_t[:prompt_blocks])
    reference = _decode(model, device, kv, prompt, prefix, ref_t, n)
    layout = CanonicalKVCaches.from_tensors(list(kv), block_dim=1)
    section = f"serve correctness: greedy decode of {n} tokens, restored KV vs recomputed KV"
    rows = []

    def row(where: str, table: list[int], moved: str) -> BenchRow:
        same_bytes = all(torch.equal(a, b) for a, b in zip(_pages(kv, table[:prompt_blocks]), computed))
        tokens = _decode(model, device, kv, prompt, prefix, table, n) if same_bytes else []
        agree = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
        ok = same_bytes and agree == n
        note = (f"{prompt_blocks} blocks ({prefix} tokens) {moved}; "
                + ("bytes equal, tokens equal" if ok else "BYTES DIFFER" if not same_bytes
                   else f"TOKENS DIFFER from token {agree}"))
        return BenchRow(section, f"{where}: tokens equal to recompute", float(agree), "tokens", float(n),
                        note=note, failed=not ok, extra={"reference": reference, "tokens": tokens})

    async with AsyncOffloadingWorker(layout, num_cpu_chunks=prompt_blocks + 4, backend=device.kind) as worker:
        async with OffloadCache(worker, policy="lru") as cache:
            await cache.offload(keys, ref_t[:prompt_blocks])
            _scramble(kv, host_t[:prompt_blocks], seed + 1)
            result = await cache.restore(keys, host_t[:prompt_blocks])
            rows.append(row("host restore", host_t, f"restored {result.restored} from the host"))
    chunks = DISK_HOST_CHUNKS + DISK_STAGING
    with tempfile.TemporaryDirectory(dir=tier_dir, prefix="aiokv-serve-check-") as directory:
        tier = DiskTier(directory, capacity_bytes=4 * (prompt_blocks + chunks)
                        * model.config.block_bytes(model.dtype))
        async with AsyncOffloadingWorker(layout, num_cpu_chunks=chunks, backend=device.kind) as worker:
            async with OffloadCache(worker, policy="lru", tiers=[tier], staging_chunks=DISK_STAGING) as cache:
                for i in range(0, prompt_blocks, DISK_HOST_CHUNKS):  # each group evicts the one before
                    end = min(i + DISK_HOST_CHUNKS, prompt_blocks)
                    await cache.offload(keys[i:end], ref_t[i:end])
                fillers = list(range(1, DISK_HOST_CHUNKS + 1))  # push the last group down too
                for i in range(0, len(fillers), span):
                    part = fillers[i:i + span]
                    await cache.offload(part, disk_t[:len(part)])
                await cache.drain()
                _scramble(kv, disk_t[:prompt_blocks], seed + 2)
                result = await cache.restore(keys, disk_t[:prompt_blocks])
                disk_row = row("disk restore", disk_t, f"restored {result.restored}, "
                                                       f"{result.from_tiers} of them from the disk tier")
                if result.from_tiers == 0 and not disk_row.failed:
                    disk_row.failed = True
                    disk_row.note += "; NOTHING CAME FROM THE DISK"
                rows.append(disk_row)
    return rows
