"""Shared helpers of the GPU suite: KV layouts with random bytes, and a CPU oracle.

The oracle runs the same jobs through the CPU backend on CPU copies of the same bytes,
so every CUDA strategy is checked byte for byte against an independent implementation,
over the whole host pool and every device tensor (untouched bytes included).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from aiokv import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    SyncOffloadingWorker,
)
from aiokv.backends import cuda_usable

STRATEGIES = ["dma", "kernel", "staged", "auto"]

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDA device and cuda-python"),
]


SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: far longer than submitting takes


def ones_kv(nb: int = 16) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Two per-layer (K, V) tensors of 1.0, 8 KiB pages; tests write their own values into
    the blocks they move, so a copy that ran too early shows as the old value."""
    tensors = [torch.full((2, nb, 8, 256), 1.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    return tensors, CanonicalKVCaches.from_tensors(tensors, block_dim=1)


def slow_fill(tensors: list[torch.Tensor], block: int, value: float,
              stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """Write ``value`` into ``block`` of each (K, V) tensor behind ~0.1 s of device sleep on
    ``stream`` (default: the current one), so a copy that does not wait for the write sees
    the old bytes. Returns an event recorded after the write, on that stream."""
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in tensors:
            t[:, block].fill_(value)
        done = torch.cuda.Event()
        done.record()
    return done


def random_like(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    """Random bytes (never zeros) viewed as ``dtype``; NaN bit patterns are fine for copies."""
    nbytes = 1
    for s in shape:
        nbytes *= s
    nbytes *= torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def layouts(device: str, seed: int = 0) -> dict[str, tuple[list[torch.Tensor], Any]]:
    """name -> (tensors, how to describe them): the layouts users have."""
    g = torch.Generator().manual_seed(seed)
    nb = 40
    out: dict[str, tuple[list[torch.Tensor], Any]] = {}
    out["kv_split"] = ([random_like((2, nb, 4, 2, 64), torch.bfloat16, device, g) for _ in range(3)], 1)
    out["kv_pages"] = ([random_like((nb, 8, 64), torch.float16, device, g) for _ in range(4)], 0)
    out["cross_layer"] = ([random_like((nb, 3, 2, 4, 128), torch.bfloat16, device, g)], 0)
    out["odd_pages"] = ([random_like((nb, 3, 20), torch.uint8, device, g) for _ in range(2)], 0)
    return out


def describe(tensors: list[torch.Tensor], how: Any) -> CanonicalKVCaches:
    return CanonicalKVCaches.from_tensors(tensors, block_dim=how)


def two_groups(tensors: list[torch.Tensor]) -> CanonicalKVCaches:
    """Two KV-cache groups over (nb, page) byte views: group 0 owns tensors 0-1, group 1 the rest;
    group 1 copies only part of each row."""
    views = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
    canon = [CanonicalKVCacheTensor(v, v.shape[1]) for v in views]
    g0 = [CanonicalKVCacheRef(0, views[0].shape[1]), CanonicalKVCacheRef(1, views[1].shape[1])]
    g1 = [CanonicalKVCacheRef(i, views[i].shape[1] // 2) for i in range(2, len(views))]
    return CanonicalKVCaches(canon, [g0, g1])


def clone_kv(
    kv: CanonicalKVCaches, tensors: list[torch.Tensor]
) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """The same description over CPU copies of ``tensors`` (the oracle's side).

    The copies sit in one arena in the device tensors' address order, so the oracle's host
    layout (which orders pages by address) matches the CUDA worker's byte for byte.
    """
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    sizes = [t.numel() * t.element_size() for t in tensors]
    aligned = [-(-n // 512) * 512 for n in sizes]
    arena = torch.empty(sum(aligned), dtype=torch.uint8)
    cpu: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    off = 0
    for i in order:
        t = tensors[i]
        cpu[i] = arena[off : off + sizes[i]].view(t.dtype).view(t.shape)
        cpu[i].copy_(t.detach().cpu())
        off += aligned[i]
    by_ptr = {t.untyped_storage().data_ptr(): i for i, t in enumerate(tensors)}
    new = []
    for ct in kv.tensors:
        src = ct.tensor
        i = by_ptr[src.untyped_storage().data_ptr()]
        base = cpu[i].view(-1).view(torch.uint8)
        view = torch.as_strided(base, src.shape, src.stride(), base.storage_offset() + src.storage_offset())
        new.append(CanonicalKVCacheTensor(view, ct.page_size_bytes))
    return CanonicalKVCaches(new, kv.group_data_refs), cpu


def pitched_jobs(worker: SyncOffloadingWorker) -> int:
    """Jobs a CUDA worker's lanes sent as pitched (2D) copies (to see which path a job took)."""
    return sum(lane.pitched_jobs for lane in worker.statistics().lanes.values())


def sync_pair(
    kv: CanonicalKVCaches, tensors: list[torch.Tensor], chunks: int, bpc: int, strategy: str, seed: int = 7,
    options: dict[str, Any] | None = None,
) -> tuple[SyncOffloadingWorker, SyncOffloadingWorker, list[torch.Tensor]]:
    """A CUDA worker (with ``options``) and its CPU oracle with identical random host pools."""
    cuda_w = SyncOffloadingWorker(
        kv, num_cpu_chunks=chunks, blocks_per_chunk=bpc, backend="cuda", strategy=strategy, options=options)
    kv_cpu, cpu_tensors = clone_kv(kv, tensors)
    oracle = SyncOffloadingWorker(kv_cpu, num_cpu_chunks=chunks, blocks_per_chunk=bpc, backend="cpu")
    fill = torch.randint(1, 256, (cuda_w.host_pool.numel(),), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    cuda_w.host_pool.copy_(fill)
    oracle.host_pool.copy_(fill)
    return cuda_w, oracle, cpu_tensors


def drain(worker: SyncOffloadingWorker, ids: set[int]) -> list[Any]:
    worker.wait(ids)
    out = []
    while len(out) < len(ids):
        out += worker.get_finished()
    return out


def check_same(cuda_w, oracle, tensors: list[torch.Tensor], cpu_tensors: list[torch.Tensor]) -> None:
    """The CUDA worker's host pool and device tensors equal the oracle's, byte for byte."""
    torch.cuda.synchronize()
    assert torch.equal(cuda_w.host_pool, oracle.host_pool), "host pools differ"
    for i, (t, c) in enumerate(zip(tensors, cpu_tensors)):
        assert torch.equal(t.cpu().view(torch.uint8), c.view(torch.uint8)), f"device tensor {i} differs"


def run_jobs(workers, jobs) -> None:
    """jobs: (kind, job_id, gpu_spec, cpu_spec), kind store, load or expedited. All go in
    flight at once on each worker, then are drained; every result must be a success."""
    for w in workers:
        for kind, jid, gspec, cspec in jobs:
            if kind == "store":
                assert w.submit_store(jid, gspec, cspec)
            else:
                assert w.submit_load(jid, cspec, gspec, expedited=kind == "expedited")
        results = drain(w, {j[1] for j in jobs})
        assert all(r.success for r in results), results
