"""Copies are ordered against compute: a store waits for the kernel still writing its source,
a load waits for work still touching its destination, and ``after=`` overrides the default."""

from __future__ import annotations

import anyio
import pytest
import torch

import aiokv.backends.cuda.lane as cuda_lane
from aiokv import (
    AsyncOffloadingWorker,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SyncOffloadingWorker,
)
from aiokv.errors import InvalidSpec

from .gpu_support import SLEEP_CYCLES, STRATEGIES, drain, gpu, ones_kv, slow_fill

pytestmark = gpu


def _sync(kv: CanonicalKVCaches, strategy: str, options: dict | None = None) -> SyncOffloadingWorker:
    return SyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", strategy=strategy, options=options)


def _pool_block(w: SyncOffloadingWorker, chunk: int) -> torch.Tensor:
    cb = w.chunk_bytes
    return w.host_pool[chunk * cb : (chunk + 1) * cb]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("issuer", [False, True])
def test_store_waits_for_pending_write_on_current_stream(
    strategy: str, issuer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with every job enqueued later, by the lane's issuer thread."""
    if issuer:
        monkeypatch.setattr(cuda_lane, "ISSUE_THREAD_BYTES", 0)
    tensors, kv = ones_kv()
    w = _sync(kv, strategy, {"issue_thread": issuer})
    try:
        torch.cuda.synchronize()
        slow_fill(tensors, 3, 7.0)
        w.submit_store(1, GPULoadStoreSpec([3]), CPULoadStoreSpec([0]))  # after=None: current stream
        (res,) = drain(w, {1})
        assert res.success
        got = _pool_block(w, 0)[: 4 * 8 * 256 * 2].view(torch.bfloat16)
        assert torch.all(got == 7.0), "the store read its source before the pending write landed"
    finally:
        w.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_waits_for_pending_write_to_destination(strategy: str) -> None:
    tensors, kv = ones_kv()
    w = _sync(kv, strategy)
    try:
        for t in tensors:
            t[:, 5].fill_(9.0)
        w.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([2]))
        drain(w, {1})
        slow_fill(tensors, 6, -1.0)  # a pending write to the load's destination
        w.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([6]))
        drain(w, {2})
        torch.cuda.synchronize()
        for t in tensors:
            assert torch.all(t[:, 6] == 9.0), "the pending write landed after the load"
    finally:
        w.shutdown()


def _after_variants(side: torch.cuda.Stream) -> dict[str, object]:
    ev = torch.cuda.Event()
    ev.record(side)

    class HasProtocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, side.cuda_stream)

    return {"event": ev, "stream": side, "protocol": HasProtocol(), "raw": side.cuda_stream}


@pytest.mark.parametrize("kind", ["event", "stream", "protocol", "raw"])
@pytest.mark.parametrize("strategy", ["dma", "staged"])
def test_after_overrides_current_stream(kind: str, strategy: str) -> None:
    tensors, kv = ones_kv()
    w = _sync(kv, strategy)
    side = torch.cuda.Stream()
    try:
        torch.cuda.synchronize()
        slow_fill(tensors, 1, 3.0, side)
        after = _after_variants(side)[kind]
        w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([4]), after=after)
        drain(w, {1})
        got = _pool_block(w, 4)[: 4 * 8 * 256 * 2].view(torch.bfloat16)
        assert torch.all(got == 3.0)
    finally:
        w.shutdown()


def test_bad_after_is_rejected_and_worker_stays_usable() -> None:
    _, kv = ones_kv()
    w = _sync(kv, "dma")
    try:
        with pytest.raises(InvalidSpec):
            w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after="soon")
        with pytest.raises(InvalidSpec):
            w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=-5)
        w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        assert drain(w, {1})[0].success
    finally:
        w.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_after_from_coroutine_on_loop_thread(strategy: str) -> None:
    tensors, kv = ones_kv()

    async def main() -> None:
        side = torch.cuda.Stream()
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=16, backend="cuda", strategy=strategy) as w:
            done = slow_fill(tensors, 2, 5.0, side)
            res = await w.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([3]), after=done)
            assert res.success
            got = w.host_pool[3 * w.chunk_bytes :][: 4 * 8 * 256 * 2].view(torch.bfloat16)
            assert torch.all(got == 5.0)

    anyio.run(main)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jobs_of_one_direction_complete_in_order(strategy: str) -> None:
    """Many stores into one chunk: the last submitted wins, and results come out in order."""
    tensors, kv = ones_kv()
    w = _sync(kv, strategy)
    try:
        for b in range(16):
            for t in tensors:
                t[:, b].fill_(float(b))
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        for j, b in enumerate([4, 9, 1, 12, 7]):
            w.submit_store(j, GPULoadStoreSpec([b]), CPULoadStoreSpec([0]))
        results = drain(w, set(range(5)))
        assert [r.job_id for r in results] == list(range(5))
        got = _pool_block(w, 0)[: 4 * 8 * 256 * 2].view(torch.bfloat16)
        assert torch.all(got == 7.0)
    finally:
        w.shutdown()
