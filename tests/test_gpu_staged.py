"""The staged strategy's ring: jobs through small slots that wrap many times, odd tile
tails, several jobs in flight sharing the ring, shutdown mid-ring, and what ``auto`` picks."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec, InvalidSpec, SyncOffloadingWorker
from aiokv.backends.cuda import pieces

from .gpu_support import check_same, describe, drain, gpu, layouts, random_like, run_jobs, sync_pair

pytestmark = gpu


def _staged(worker: SyncOffloadingWorker | AsyncOffloadingWorker) -> dict[str, int]:
    """Jobs each lane sent through its ring, by lane (store, load, expedited_load)."""
    return {direction: lane.staged_jobs for direction, lane in worker.statistics().lanes.items()}


@pytest.mark.parametrize("layout", ["kv_split", "kv_pages", "cross_layer"])
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("ctas", [None, 5])
def test_jobs_in_flight_through_a_small_ring_match_the_oracle(
    layout: str, bpc: int, ctas: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slots of 7 KiB (one block of 4-6 KiB each; planned by block) or, with 3 blocks a
    chunk, 32 KiB (planned piece by piece): each job is several slices, and the two slots
    wrap many times within a job and across the jobs in flight. ``ctas``: launches of one
    CTA per tile, or of 5 CTAs that each loop over many tiles."""
    monkeypatch.setattr(pieces, "MAX_CTAS", ctas)
    tensors, how = layouts("cuda", seed=20 + bpc)[layout]
    kv = describe(tensors, how)
    options = {"staging_bytes": 14 << 10 if bpc == 1 else 64 << 10}
    cuda_w, oracle, cpu_tensors = sync_pair(kv, tensors, 30, bpc, "staged", options=options)
    rng = np.random.default_rng(bpc)
    try:
        chunks, blocks, targets = rng.permutation(30), rng.permutation(40), rng.permutation(40)
        per = 2 * bpc  # blocks per job: two chunks

        def jobs(kind: str, first_id: int, gpu_blocks: np.ndarray) -> list:
            return [(kind, first_id + j, GPULoadStoreSpec(gpu_blocks[per * j : per * (j + 1)]),
                     CPULoadStoreSpec(chunks[2 * j : 2 * j + 2])) for j in range(4)]

        run_jobs([cuda_w, oracle], jobs("store", 0, blocks))
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        loads = jobs("load", 10, targets)
        run_jobs([cuda_w, oracle], loads)
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        assert _staged(cuda_w) == {"store": 4, "load": 4, "expedited_load": 0}
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


class _CountingLaunches:
    """A lane kernel's driver, counting its launches."""

    def __init__(self, driver: Any) -> None:
        self._driver, self.launches = driver, 0

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.launches += 1
        self._driver.launch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


def _one_store_one_load(tensors: list[torch.Tensor], job: int, strategy: str, seed: int,
                        by_block_launches: int | None = None) -> None:
    """Store ``job`` random blocks to random chunks, load them back to other blocks; both
    through the ring, checked byte for byte against the CPU oracle. With
    ``by_block_launches``: each job must be planned by block on the lane's one kept page
    table, in that many kernel launches."""
    blocks = tensors[0].shape[0]
    cuda_w, oracle, cpu_tensors = sync_pair(describe(tensors, 0), tensors, blocks, 1, strategy)
    lanes = {lane.direction.value: lane._strategy for lane in cuda_w._core.backend._lanes}
    counters = {}
    if by_block_launches is not None:
        for name in ("store", "load"):
            counters[name] = lanes[name].kernel.driver = _CountingLaunches(lanes[name].kernel.driver)
    rng = np.random.default_rng(seed)
    try:
        src, cids = rng.choice(blocks, job, replace=False), rng.choice(blocks, job, replace=False)
        run_jobs([cuda_w, oracle], [("store", 1, GPULoadStoreSpec(src), CPULoadStoreSpec(cids))])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        dst = rng.permutation(blocks)[:job]
        run_jobs([cuda_w, oracle], [("load", 2, GPULoadStoreSpec(dst), CPULoadStoreSpec(cids))])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        assert _staged(cuda_w) == {"store": 1, "load": 1, "expedited_load": 0}
        for name, counter in counters.items():
            ring = lanes[name]
            assert ring.shape is not None and ring.page_table is not None and len(ring.kernel._kept) == 1
            assert counter.launches == by_block_launches, name
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


@pytest.mark.parametrize("strategy", ["staged", "auto"])
@pytest.mark.parametrize("ctas", [None, 3])
def test_pages_with_a_partial_tile_round_trip(
    strategy: str, ctas: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 KiB + 48-byte pages: one whole 16 KiB tile and a tail per page (80 pieces a job,
    so ``auto`` stages them too), with one CTA per tile or 3 CTAs looping over them."""
    monkeypatch.setattr(pieces, "MAX_CTAS", ctas)
    g = torch.Generator().manual_seed(3)
    tensors = [random_like((40, 20 * 1024 + 48), torch.uint8, "cuda", g) for _ in range(2)]
    _one_store_one_load(tensors, 40, strategy, seed=8)


@pytest.mark.parametrize("ctas", [None, 3])
def test_pages_of_different_sizes_skip_the_tiles_past_their_end(
    ctas: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 KiB and 40 KiB + 16-byte pages in one block: a launch spans the longest page's 3
    tiles for every page, so the short pages' CTAs (or loop steps, with 3 CTAs) must skip
    tiles 1 and 2 without touching a byte."""
    monkeypatch.setattr(pieces, "MAX_CTAS", ctas)
    g = torch.Generator().manual_seed(11)
    tensors = [random_like((24, n), torch.uint8, "cuda", g) for n in (4096, 40 * 1024 + 16, 4096)]
    _one_store_one_load(tensors, 20, "staged", seed=12)


def test_a_slice_of_more_blocks_than_one_launch_holds_round_trips() -> None:
    """600 blocks of 3 small pages in one slice: their device rows go in the launches'
    parameters, at most ``ROWS_PER_LAUNCH`` a launch, so the slice takes 3 launches whose
    images start further into the slot."""
    assert 600 > 2 * pieces.ROWS_PER_LAUNCH
    g = torch.Generator().manual_seed(13)
    tensors = [random_like((640, n), torch.uint8, "cuda", g) for n in (256, 512, 48)]
    _one_store_one_load(tensors, 600, "staged", seed=14, by_block_launches=3)


def test_auto_stages_small_pages_and_sends_large_ones_straight_to_dma() -> None:
    g = torch.Generator().manual_seed(4)
    small = [random_like((2, 64, 16, 8, 128), torch.bfloat16, "cuda", g) for _ in range(4)]  # 32 KiB
    large = [random_like((16, 32, 2, 16, 8, 128), torch.bfloat16, "cuda", g)]  # 2 MiB pages

    async def run(tensors, how, blocks: int) -> dict[str, int]:
        want = [t.clone() for t in tensors]
        async with AsyncOffloadingWorker(describe(tensors, how), num_cpu_chunks=blocks, backend="cuda") as w:
            ids = list(range(blocks))
            assert (await w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))).success
            for t in tensors:
                t.fill_(0.5)
            assert (await w.submit_load(2, CPULoadStoreSpec(ids), GPULoadStoreSpec(ids))).success
            staged = _staged(w)
        torch.cuda.synchronize()
        for t, e in zip(tensors, want):
            assert torch.equal(t.view(torch.uint8), e.view(torch.uint8))
        return staged

    assert anyio.run(run, small, 1, 64) == {"store": 1, "load": 1, "expedited_load": 0}  # 512 x 32 KiB
    assert anyio.run(run, large, 0, 16) == {"store": 0, "load": 0, "expedited_load": 0}  # 16 x 2 MiB


def test_shutdown_drains_staged_jobs_in_flight() -> None:
    g = torch.Generator().manual_seed(6)
    tensors = [random_like((2, 64, 4, 2, 64), torch.bfloat16, "cuda", g) for _ in range(3)]
    kv = describe(tensors, 1)
    cuda_w, oracle, _ = sync_pair(kv, tensors, 64, 1, "staged", options={"staging_bytes": 16 << 10})
    jobs = [("store", j, GPULoadStoreSpec(range(j * 8, j * 8 + 8)), CPULoadStoreSpec(range(j * 8, j * 8 + 8)))
            for j in range(6)]
    try:
        run_jobs([oracle], jobs)
        torch.cuda._sleep(300_000_000)  # every job below waits behind this
        for _, j, gspec, cspec in jobs:
            cuda_w.submit_store(j, gspec, cspec)
        pool, want = cuda_w.host_pool, oracle.host_pool.clone()
        staged = _staged(cuda_w)
    finally:
        cuda_w.shutdown()
        oracle.shutdown()
    results = cuda_w.get_finished()
    assert staged["store"] == 6
    assert sorted(r.job_id for r in results) == list(range(6)) and all(r.success for r in results)
    assert torch.equal(pool, want)


def test_staged_needs_staging_memory() -> None:
    tensors, how = layouts("cuda")["kv_split"]
    with pytest.raises(InvalidSpec, match="staging_bytes"):
        AsyncOffloadingWorker(describe(tensors, how), num_cpu_chunks=4, backend="cuda",
                              strategy="staged", options={"staging_bytes": 0})


def test_auto_falls_back_to_dma_where_the_kernel_cannot_load(monkeypatch, caplog) -> None:
    import aiokv.backends.cuda.staged as staged
    from aiokv.errors import CudaCallFailed

    def refuse(self, driver, device) -> None:
        raise CudaCallFailed("CUDA call failed: CUDA_ERROR_NO_BINARY_FOR_GPU (cuModuleLoadData)", 209)

    monkeypatch.setattr(staged.PieceKernel, "__init__", refuse)
    g = torch.Generator().manual_seed(9)
    tensors = [random_like((2, 64, 16, 8, 128), torch.bfloat16, "cuda", g) for _ in range(2)]
    want = [t.clone() for t in tensors]

    async def main() -> None:
        async with AsyncOffloadingWorker(describe(tensors, 1), num_cpu_chunks=64, backend="cuda") as w:
            lanes = w.statistics().lanes
            assert {d: lane.strategy for d, lane in lanes.items()} == {"store": "dma", "load": "dma",
                                                                       "expedited_load": "dma"}
            ids = list(range(64))
            assert (await w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))).success
            for t in tensors:
                t.fill_(0.25)
            assert (await w.submit_load(2, CPULoadStoreSpec(ids), GPULoadStoreSpec(ids))).success

    anyio.run(main)
    torch.cuda.synchronize()
    assert all(torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip(tensors, want))
    assert "staged copies unavailable" in caplog.text
    with pytest.raises(CudaCallFailed):
        AsyncOffloadingWorker(describe(tensors, 1), num_cpu_chunks=4, backend="cuda", strategy="staged")


def test_a_ring_that_cannot_be_allocated_falls_back_to_dma(caplog) -> None:
    """4 TiB of staging cannot be had: the first job goes as plain DMA, with a warning."""
    g = torch.Generator().manual_seed(10)
    tensors = [random_like((2, 64, 16, 8, 128), torch.bfloat16, "cuda", g) for _ in range(2)]
    want = [t.clone() for t in tensors]

    async def main() -> dict[str, int]:
        options = {"staging_bytes": 1 << 42}
        async with AsyncOffloadingWorker(describe(tensors, 1), num_cpu_chunks=64, backend="cuda",
                                         options=options) as w:
            ids = list(range(64))
            assert (await w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))).success
            for t in tensors:
                t.fill_(0.75)
            assert (await w.submit_load(2, CPULoadStoreSpec(ids), GPULoadStoreSpec(ids))).success
            return _staged(w)

    assert anyio.run(main) == {"store": 0, "load": 0, "expedited_load": 0}
    torch.cuda.synchronize()
    assert all(torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip(tensors, want))
    assert "no device memory" in caplog.text


def test_staging_never_takes_memory_the_submitting_stream_still_uses() -> None:
    """The ring is allocated on the lane's first staged job. A block just freed on the
    submitting thread's stream, with a write to it still queued there, must not become the
    ring: the load's DMA would land first and that write would clobber the staged bytes."""
    g = torch.Generator().manual_seed(12)
    tensors = [random_like((2, 64, 16, 8, 128), torch.bfloat16, "cuda", g) for _ in range(2)]
    want = [t.clone() for t in tensors]
    w = SyncOffloadingWorker(describe(tensors, 1), num_cpu_chunks=64, backend="cuda",
                             options={"staging_bytes": 64 << 20})
    try:
        ids = list(range(64))
        w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))
        assert drain(w, {1})[0].success
        for t in tensors:
            t.fill_(0.5)
        busy = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the load ring's size
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        busy.fill_(7)  # queued behind the sleep
        del busy  # its block goes back to this stream's pool, the write still pending
        w.submit_load(2, CPULoadStoreSpec(ids), GPULoadStoreSpec(ids))
        assert drain(w, {2})[0].success
        assert _staged(w)["load"] == 1
        torch.cuda.synchronize()
        assert all(torch.equal(t.view(torch.uint8), e.view(torch.uint8)) for t, e in zip(tensors, want))
    finally:
        w.shutdown()
