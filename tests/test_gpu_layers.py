"""Layerwise jobs on a real GPU: byte-exact round trips for every strategy, a gate that
orders the consumer's reads after its layer (no host block), pushes that wait for the
compute that wrote the layer, per-layer awaits, and the stall measured on the device."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiokv import (
    AsyncOffloadingWorker,
    CanonicalKVCaches,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    LayerStatus,
    SyncOffloadingWorker,
)

from .gpu_support import SLEEP_CYCLES, STRATEGIES, gpu, random_like, slow_fill

pytestmark = gpu

LAYERS, BLOCKS = 6, 32


def random_kv(seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [random_like((2, BLOCKS, 16, 8, 64), torch.bfloat16, "cuda", gen) for _ in range(LAYERS)]
    return tensors, CanonicalKVCaches.from_tensors(tensors, block_dim=1)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gated_consumer_reads_each_layer_after_it_landed(strategy: str) -> None:
    tensors, kv = random_kv(seed=1)
    before = [as_bytes(t).clone() for t in tensors]
    w = SyncOffloadingWorker(kv, num_cpu_chunks=16, strategy=strategy)
    try:
        src, dst, chunks = [3, 4, 5, 6], [20, 21, 22, 23], [0, 1, 2, 3]
        store = w.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(chunks), layerwise=True)
        for layer in range(LAYERS):
            assert store.push(layer)
        w.wait([1])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)  # the load starts late: an ungated read would race it
            late = torch.cuda.Event()
            late.record()
        load = w.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst), layerwise=True, after=late)
        seen = []
        for layer in range(LAYERS):
            assert load.gate(layer) is LayerStatus.READY  # returns before the copy: no host block
            seen.append(as_bytes(tensors[layer][:, dst]).clone())  # ordered after the gate
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(seen[layer], as_bytes(before[layer].view(tensors[layer].dtype)[:, src]))
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True, True]
    finally:
        w.shutdown()


def test_a_push_waits_for_the_compute_that_wrote_its_layer() -> None:
    tensors = [torch.full((2, BLOCKS, 8, 256), 1.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    w = SyncOffloadingWorker(kv, num_cpu_chunks=8)
    try:
        store = w.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([2]), layerwise=True)
        for layer, t in enumerate(tensors):
            slow_fill([t], 5, 7.0 + layer)  # on the current stream, behind a device sleep
            store.push(layer)  # waits on the current stream as it stands now
        w.wait([1])
        load = w.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([9]), layerwise=True)
        for layer in range(2):
            assert load.wait_layer(layer, timeout=30) is LayerStatus.READY
        for layer, t in enumerate(tensors):
            assert bool((t[:, 9] == 7.0 + layer).all())
    finally:
        w.shutdown()


def test_layer_stalls_are_measured_on_the_device() -> None:
    _, kv = random_kv(seed=2)
    w = SyncOffloadingWorker(kv, num_cpu_chunks=8, options={"layer_stalls": True})
    try:
        w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1]))
        w.wait([1])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            late = torch.cuda.Event()
            late.record()
        load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([7, 8]), layerwise=True,
                             after=late)
        assert load.gate(0) is LayerStatus.READY
        torch.cuda.synchronize()
        stats = w.statistics().layers
        assert stats.gates == 1 and stats.stalls_measured == 1 and stats.stalls[-1] > 0
    finally:
        w.shutdown()


@pytest.mark.anyio
async def test_awaited_layers_resolve_before_the_job() -> None:
    tensors, kv = random_kv(seed=3)
    before = [as_bytes(t).clone() for t in tensors]
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=8) as w:
        await w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1]))
        load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([9, 10]), layerwise=True)
        with anyio.fail_after(30):
            for layer in range(LAYERS):
                assert await load.layer(layer) is LayerStatus.READY
                got = as_bytes(tensors[layer][:, [9, 10]]).cpu()
                assert torch.equal(got, as_bytes(before[layer].view(tensors[layer].dtype)[:, [1, 2]]).cpu())
            assert (await load).success


@pytest.mark.parametrize("blocks", ["runs", "scattered", "scattered small pages"])
def test_a_layers_copies_go_pitched_straight_or_through_the_slot_and_land_byte_exact(blocks: str) -> None:
    """192 blocks a job in 192 consecutive chunks. Llama-8B pages (32 KiB K and V a layer):
    blocks that run go as a few pitched ops a layer straight to their pages, scattered ones
    straight too, as 384 batched descriptors a layer (their enqueue keeps up with their
    copy: ``STAGE_ABOVE_COPY``). Pages of 2 KiB scattered go through the lane's device slot
    (a 2-D copy of the chunk run, a kernel scatter): their descriptors would outpace the
    copy. Every way, both directions land byte for byte, and a gated read sees each layer
    in place."""
    gen = torch.Generator().manual_seed(5)
    layers, nb, n = 8, 448, 192
    heads, dim = (1, 64) if blocks == "scattered small pages" else (8, 128)
    tensors = [random_like((2, nb, 16, heads, dim), torch.bfloat16, "cuda", gen) for _ in range(layers)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    before = [as_bytes(t).clone() for t in tensors]
    order = torch.randperm(nb, generator=gen).tolist()
    src = list(range(8, 8 + n)) if blocks == "runs" else order[:n]
    dst = list(range(240, 240 + n)) if blocks == "runs" else order[n : 2 * n]
    chunks = list(range(4, 4 + n))
    w = SyncOffloadingWorker(kv, num_cpu_chunks=4 + n)
    try:
        store = w.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(chunks), layerwise=True)
        for layer in range(layers):
            assert store.push(layer)
        w.wait([1])
        load = w.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst), layerwise=True)
        ops = load._run._ops  # type: ignore[attr-defined]
        assert (ops.staged is not None) is (blocks == "scattered small pages")
        most = max(load._run.layer_descriptors(i) for i in range(layers))  # type: ignore[attr-defined]
        assert most > n if blocks == "scattered" else most <= 4  # scattered: about 2n descriptors
        seen = []
        for layer in range(layers):
            assert load.gate(layer) is LayerStatus.READY
            seen.append(as_bytes(tensors[layer][:, dst]).clone())
        torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(seen[layer], before[layer][:, src])
        w.wait([2])
        assert [r.success for r in w.get_finished()] == [True, True]
        untouched = [b for b in range(nb) if b not in dst]
        for layer in range(layers):
            assert torch.equal(as_bytes(tensors[layer])[:, untouched], before[layer][:, untouched])
    finally:
        w.shutdown()
