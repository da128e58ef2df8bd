"""The bench's per-layer 32 KiB-page job through the staged ring at several ``staging_bytes``
(two slots each), against plain DMA, idle and under both GEMM loads; and where a staged
submit's host time goes (the strategy's prepare and enqueue, timed in place).

Run on the GPU machine from the repo root: python3 probes/probe_staging.py
"""

import asyncio
import statistics
import time

import torch
from _setups import per_layer

from aiokv import AsyncOffloadingWorker
from aiokv.bench import cuda as b

dev = torch.device("cuda")
setup = per_layer(dev)
contig = b._Contiguous(setup.job_bytes)
ceil = contig.rates(3)
big, medium = b._Gemm(8192, 8192, 8192), b._Gemm(4096, 4096, 14336)
alone = {"big": big.alone(0.6), "medium": medium.alone(0.6)}
print(f"ceilings {ceil['store']:.2f} / {ceil['load']:.2f} GB/s; GEMM alone {alone['big']:.0f} / "
      f"{alone['medium']:.0f} TFLOP/s", flush=True)
ids = b._JobIds()


def timed(strategy, name):
    """Accumulate host seconds spent in the strategy's ``name`` method."""
    fn = getattr(strategy, name)
    spent = []

    def wrapper(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent.append(time.perf_counter() - t0)

    setattr(strategy, name, wrapper)
    return spent


async def one(strategy: str, staging: int) -> str:
    options = {"strategy": strategy, "staging_bytes": staging}
    worker = AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend="cuda", options=options)
    cells = []
    async with worker:
        store_lane = worker._core.backend._lanes[0]._strategy
        prep, enq = timed(store_lane, "prepare"), timed(store_lane, "enqueue")
        for what, store in (("store", True), ("load", False)):
            rate, submit = await b._device_rate(worker, setup, store, 5, ids)
            s = await b._stream(worker, setup, 0.6, ids, store=store)
            cells.append(f"{what}: one {rate / ceil[what]:.2f} submit {submit * 1e6:.0f} us, "
                         f"streamed {s['gbps'] / ceil[what]:.2f} (submit {s['submit_p50'] * 1e6:.0f} us)")
            for gname, gemm in (("big", big), ("medium", medium)):
                with gemm:
                    s = await b._stream(worker, setup, 0.6, ids, store=store)
                slow = 100 * (1 - gemm.rate / alone[gname])
                cells.append(f"  under {gname} {s['gbps'] / ceil[what]:.2f} (GEMM {slow:+.1f}%)")
        s = await b._stream(worker, setup, 0.6, ids, both=True, depth=4)
        cells.append(f"both {s['gbps'] / ceil['both']:.2f}")
        if prep:
            cells.append(f"store lane prepare p50 {statistics.median(prep) * 1e6:.0f} us, "
                         f"enqueue p50 {statistics.median(enq) * 1e6:.0f} us over {len(prep)} jobs")
    return "\n    ".join(cells)


for strategy, staging in (("auto", 32 << 20), ("auto", 64 << 20), ("auto", 128 << 20),
                          ("auto", 256 << 20), ("dma", 0)):
    label = f"{strategy} staging {staging >> 20} MiB" if staging else strategy
    print(f"{label}:\n    {asyncio.run(one(strategy, staging))}", flush=True)
