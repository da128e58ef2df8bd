"""Byte-exact round trips on random data for every strategy and layout, against the CPU oracle."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec

from .gpu_support import (
    STRATEGIES,
    check_same,
    describe,
    drain,
    gpu,
    layouts,
    pitched_jobs,
    random_like,
    run_jobs,
    sync_pair,
    two_groups,
)

pytestmark = gpu


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", ["kv_split", "kv_pages", "cross_layer", "odd_pages"])
@pytest.mark.parametrize("bpc", [1, 3])
def test_round_trip_matches_oracle(strategy: str, layout: str, bpc: int) -> None:
    tensors, how = layouts("cuda", seed=hash((layout, bpc)) % 1000)[layout]
    kv = describe(tensors, how)
    chunks = 30
    cuda_w, oracle, cpu_tensors = sync_pair(kv, tensors, chunks, bpc, strategy)
    rng = np.random.default_rng(3)
    try:
        # Stores with a skip at the start (block_indices), then loads into other blocks.
        blocks = rng.choice(40, 7, replace=False)
        skip = 2 if bpc > 1 else 0
        nchunks = -(-(7 + skip) // bpc)
        chunk_ids = rng.choice(chunks, nchunks, replace=False)
        gspec = GPULoadStoreSpec(blocks, block_indices=[skip + 3 * bpc])
        store = ("store", 1, gspec, CPULoadStoreSpec(chunk_ids))
        blocks2 = rng.choice(40, 9, replace=False)
        chunk_ids2 = rng.choice(chunks, -(-9 // bpc), replace=False)
        other = ("store", 2, GPULoadStoreSpec(blocks2), CPULoadStoreSpec(chunk_ids2))
        run_jobs([cuda_w, oracle], [store, other])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        dst = rng.choice(40, 7, replace=False)
        load = ("load", 3, GPULoadStoreSpec(dst, block_indices=[skip]), CPULoadStoreSpec(chunk_ids))
        dst2 = rng.choice(40, 9, replace=False)
        exp = ("expedited", 4, GPULoadStoreSpec(dst2), CPULoadStoreSpec(chunk_ids2))
        run_jobs([cuda_w, oracle], [load])
        run_jobs([cuda_w, oracle], [exp])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_several_groups(strategy: str) -> None:
    tensors, _ = layouts("cuda", seed=5)["kv_pages"]
    kv = two_groups(tensors)
    cuda_w, oracle, cpu_tensors = sync_pair(kv, tensors, 16, 2, strategy)
    try:
        gspec = GPULoadStoreSpec([3, 9, 4, 11, 12, 30], group_sizes=[2, 4], block_indices=[1, 0])
        cspec = CPULoadStoreSpec([5, 0, 7, 2])  # group 0: ceil(3/2)=2 chunks; group 1: 2
        run_jobs([cuda_w, oracle], [("store", 1, gspec, cspec)])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
        gload = GPULoadStoreSpec([1, 2, 5, 6, 7, 8], group_sizes=[2, 4], block_indices=[1, 0])
        run_jobs([cuda_w, oracle], [("load", 2, gload, cspec)])
        check_same(cuda_w, oracle, tensors, cpu_tensors)
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_realistic_job_round_trip(strategy: str) -> None:
    """32 KiB pages, (2, N, 16, 8, 128) bf16 per layer: store 64 random blocks, load them back."""
    g = torch.Generator(device="cuda").manual_seed(11)
    shape = (2, 256, 16, 8, 128)
    tensors = [torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(4)]
    kv = describe(tensors, 1)
    w = _sync_worker(kv, strategy)
    try:
        rng = np.random.default_rng(1)
        src = rng.choice(256, 64, replace=False)
        chunks = rng.choice(128, 64, replace=False)
        expect = [t[:, src].clone() for t in tensors]
        w.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(chunks))
        drain(w, {1})
        for t in tensors:
            t.normal_()
        dst = rng.permutation(256)[:64]
        w.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst))
        (res,) = drain(w, {2})
        assert res.success and res.transfer_size == 64 * 8 * 32768 and res.transfer_time > 0
        for t, e in zip(tensors, expect):
            assert torch.equal(t[:, dst], e)
    finally:
        w.shutdown()


def _sync_worker(kv, strategy):
    from aiokv import SyncOffloadingWorker

    return SyncOffloadingWorker(
        AsyncOffloadingWorker(kv, num_cpu_chunks=128, backend="cuda", strategy=strategy)
    )


def test_host_pool_is_exact_size_cpu_tensor() -> None:
    tensors, how = layouts("cuda")["kv_split"]
    kv = describe(tensors, how)
    w = AsyncOffloadingWorker(kv, num_cpu_chunks=7, backend="cuda")
    try:
        pool = w.host_pool
        assert pool.device.type == "cpu" and pool.dtype == torch.uint8
        assert pool.numel() == 7 * w.chunk_bytes
        assert w.statistics().backend == "cuda"
    finally:
        anyio.run(w.aclose)


async def _async_round_trip(strategy: str) -> None:
    tensors, how = layouts("cuda", seed=9)["kv_split"]
    kv = describe(tensors, how)
    expect = [t.clone() for t in tensors]
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=40, backend="cuda", strategy=strategy) as w:
        ids = list(range(40))
        await w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))
        for t in tensors:
            t.zero_()
        res = await w.submit_load(2, CPULoadStoreSpec(ids[::-1]), GPULoadStoreSpec(ids))
        assert res.success
    for t, e in zip(tensors, expect):  # compare bytes: random bit patterns include NaNs
        assert torch.equal(t.view(torch.uint8), e.flip(1).view(torch.uint8))


@pytest.mark.parametrize("strategy", ["dma", "kernel", "staged"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_round_trip(strategy: str, backend: str) -> None:
    anyio.run(_async_round_trip, strategy, backend=backend)


async def _permuted_round_trip(strategy: str) -> None:
    """An HND allocation seen as NHD: every block's page is one dense range, moved as bytes."""
    g = torch.Generator().manual_seed(11)
    physical = [random_like((2, 40, 4, 16, 64), torch.bfloat16, "cuda", g) for _ in range(2)]
    kv = describe([p.permute(0, 1, 3, 2, 4) for p in physical], 1)
    expect = [p.view(torch.uint8).clone() for p in physical]
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=40, backend="cuda", strategy=strategy) as w:
        ids = list(range(40))
        await w.submit_store(1, GPULoadStoreSpec(ids), CPULoadStoreSpec(ids))
        for p in physical:
            p.view(torch.uint8).fill_(0)
        assert (await w.submit_load(2, CPULoadStoreSpec(ids[::-1]), GPULoadStoreSpec(ids))).success
    for p, e in zip(physical, expect):
        assert torch.equal(p.view(torch.uint8), e.flip(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_permuted_dense_layout_round_trips_byte_exact(strategy: str) -> None:
    anyio.run(_permuted_round_trip, strategy)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("bpc", [1, 3])
def test_pitched_dma_round_trip_matches_oracle(descending: bool, bpc: int) -> None:
    """Layers as views of one allocation: one pitched copy per block (16 rows of 1 KiB)."""
    base = random_like((8, 2, 40, 4, 2, 64), torch.bfloat16, "cuda", torch.Generator().manual_seed(bpc))
    layers = list(base.unbind(0))
    if descending:  # back-to-back allocations often come out in descending address order
        layers.reverse()
    kv = describe(layers, 1)
    cuda_w, oracle, cpu_tensors = sync_pair(kv, [base], 30, bpc, "dma")
    rng = np.random.default_rng(bpc)
    try:
        skip = 1 if bpc > 1 else 0
        blocks = rng.choice(40, 11, replace=False)
        chunk_ids = rng.choice(30, -(-(11 + skip) // bpc), replace=False)
        store = ("store", 1, GPULoadStoreSpec(blocks, block_indices=[skip]), CPULoadStoreSpec(chunk_ids))
        run_jobs([cuda_w, oracle], [store])
        check_same(cuda_w, oracle, [base], cpu_tensors)
        dst = rng.choice(40, 11, replace=False)
        load = ("expedited", 2, GPULoadStoreSpec(dst, block_indices=[skip]), CPULoadStoreSpec(chunk_ids))
        run_jobs([cuda_w, oracle], [load])
        check_same(cuda_w, oracle, [base], cpu_tensors)
        assert pitched_jobs(cuda_w) == 2
    finally:
        cuda_w.shutdown()
        oracle.shutdown()


def test_threaded_dma_submission_is_byte_exact() -> None:
    """Many small pages (>= 1024 descriptors) issued from 4 host threads over 16 streams.

    Layers sit at uneven distances, so no pitched copy applies (one descriptor per page).
    """
    gen = torch.Generator(device="cuda").manual_seed(5)
    layer_bytes = 2 * 512 * 4096
    arena = torch.randint(0, 256, (8 * layer_bytes + 8 * 8 * 4096,), dtype=torch.uint8, device="cuda",
                          generator=gen)
    starts = [i * layer_bytes + i * (i + 1) // 2 * 4096 for i in range(8)]
    layers = [arena[s : s + layer_bytes].view(2, 512, 4096) for s in starts]
    kv = describe(layers, 1)
    rng = np.random.default_rng(9)
    blocks = rng.choice(512, 128, replace=False)  # 128 blocks x 16 pages = 2048 descriptors
    targets = rng.choice(512, 128, replace=False)
    want = [t[:, blocks].clone() for t in layers]

    async def main() -> None:
        worker = AsyncOffloadingWorker(kv, num_cpu_chunks=128, options={"submit_threads": 4})
        async with worker:
            chunks = CPULoadStoreSpec(range(128))
            assert (await worker.submit_store(1, GPULoadStoreSpec(blocks), chunks)).success
            for t in layers:  # clobber after the store; the load waits on this stream
                t[:, targets] = 0
            assert (await worker.submit_load(2, chunks, GPULoadStoreSpec(targets))).success
        torch.cuda.synchronize()
        for t, w in zip(layers, want):
            assert torch.equal(t[:, targets], w)

    anyio.run(main)


def test_pitched_copies_never_span_two_allocations() -> None:
    """Layers that are separate cudaMallocs, even back to back, go one page per copy."""
    torch.cuda.empty_cache()  # so each 24 MiB layer below is its own allocation
    gen = torch.Generator(device="cuda").manual_seed(11)
    layers = [torch.randint(1, 256, (2, 192, 65536), dtype=torch.uint8, device="cuda", generator=gen)
              for _ in range(8)]
    kv = describe(layers, 1)
    rng = np.random.default_rng(4)
    blocks, targets = rng.choice(192, 24, replace=False), rng.choice(192, 24, replace=False)
    want = [t[:, blocks].clone() for t in layers]

    async def main() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=32) as worker:
            lanes = worker._core.backend._lanes
            driver = worker._core.backend.driver
            for lane in lanes:
                ctx = lane._strategy.ctx
                for run in ctx.runs:  # every run lies inside one allocation
                    tensors = [ctx.layout.tensor_idx[run.group][k] for k in run.refs]
                    assert len({driver.allocation_base(int(ctx.device_base[t])) for t in tensors}) == 1
            chunks = CPULoadStoreSpec(range(24))
            assert (await worker.submit_store(1, GPULoadStoreSpec(blocks), chunks)).success
            assert (await worker.submit_load(2, chunks, GPULoadStoreSpec(targets))).success
            assert sum(getattr(lane._strategy, "pitched_jobs", 0) for lane in lanes) == 0
        torch.cuda.synchronize()
        for t, w in zip(layers, want):
            assert torch.equal(t[:, targets], w)

    anyio.run(main)


def test_round_trip_through_cuda_python_records_and_waits() -> None:
    """Where ctypes cannot bind cuEventRecord / cuStreamWaitEvent, cuda-python's wrappers
    carry every dependency, fork, join and completion edge instead."""
    g = torch.Generator(device="cuda").manual_seed(12)
    tensors = [torch.randn((2, 256, 16, 8, 128), dtype=torch.bfloat16, device="cuda", generator=g)
               for _ in range(4)]
    w = _sync_worker(describe(tensors, 1), "dma")
    try:
        drv = w._worker._core.backend.driver
        drv._record_fn = drv._wait_fn = None
        rng = np.random.default_rng(2)
        src = rng.choice(256, 64, replace=False)
        chunks = rng.choice(128, 64, replace=False)
        expect = [t[:, src].clone() for t in tensors]
        w.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(chunks))
        (stored,) = drain(w, {1})
        for t in tensors:
            t.normal_()
        dst = rng.permutation(256)[:64]
        w.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst))
        (loaded,) = drain(w, {2})
        assert stored.success and loaded.success and loaded.transfer_time > 0
        for t, e in zip(tensors, expect):
            assert torch.equal(t[:, dst], e)
    finally:
        w.shutdown()


def test_a_steady_stream_of_jobs_reuses_its_events() -> None:
    """Finished jobs' timing pairs go back to the pool once settled: after a warm-up, a
    steady stream of awaited jobs creates no new events, and every result has a time."""
    import threading

    tensors, how = layouts("cuda", seed=4)["kv_split"]
    kv = describe(tensors, how)

    async def main() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=40, backend="cuda", strategy="dma") as w:
            drv = w._core.backend.driver
            results = []
            for i in range(60):
                blocks = [(7 * i + k) % 40 for k in range(8)]
                results.append(await w.submit_store(i, GPULoadStoreSpec(blocks), CPULoadStoreSpec(blocks)))
                if i == 19:
                    created = len(drv._all_events)
            assert len(drv._all_events) == created  # 40 more jobs, no new events
            times: list = []
            reader = threading.Thread(target=lambda: times.extend(r.transfer_time for r in results))
            reader.start()
            reader.join()
            assert len(times) == 60 and all(t is not None and 0 < t < 1 for t in times)

    anyio.run(main)


def test_unsettled_results_read_on_another_thread_carry_device_times() -> None:
    """Results of the sync face are settled at the next get_finished(); read before that on
    a thread where no CUDA context is current, they still carry their device times."""
    import threading

    from aiokv.specs import _Later

    tensors, how = layouts("cuda", seed=6)["kv_split"]
    w = _sync_worker(describe(tensors, how), "dma")
    try:
        for i in range(6):
            blocks = [5 * i + k for k in range(5)]
            w.submit_store(i, GPULoadStoreSpec(blocks), CPULoadStoreSpec(blocks))
        results = drain(w, set(range(6)))
        assert len(results) == 6
        assert all(isinstance(vars(r)["transfer_time"], _Later) for r in results)  # not read yet
        times: list = []
        reader = threading.Thread(target=lambda: times.extend(r.transfer_time for r in results))
        reader.start()
        reader.join()
        assert len(times) == 6 and all(t is not None and 0 < t < 1 for t in times)
    finally:
        w.shutdown()
