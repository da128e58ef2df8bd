"""Fewer, larger slices: the per-layer 32 KiB-page job (256 MiB) through staging rings of
128 MiB (the default: four slices of 64 MiB), 256 MiB (two of 128 MiB) and 512 MiB (one),
in rounds that each start with another ring. Each slice costs a launch, two records, two
waits and a DMA call on the host, so fewer slices should shorten the submit; the question
is what the longer first gather costs the transfer, idle and beside the GEMM loads. Rates are against a
contiguous pinned copy of the same bytes measured in this run. Needs a GPU:
python3 probes/probe_slots.py [rounds]
"""

import asyncio
import sys

import torch
from _setups import per_layer

from aiokv import AsyncOffloadingWorker
from aiokv.bench import cuda as b

SIZES = (128 << 20, 256 << 20, 512 << 20)


async def one_round(setup, staging: int, ids, gemms: dict[str, tuple[b._Gemm, float]]) -> dict[str, float]:
    opts = {"staging_bytes": staging}
    out: dict[str, float] = {}
    worker = AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend="cuda", options=opts)
    async with worker as w:
        for store in (True, False):
            d = "store" if store else "load"
            await b._stream(w, setup, 0.2, ids, store)  # warm
            rate, submit = await b._device_rate(w, setup, store, 8, ids)
            out[f"{d} one job GB/s"], out[f"{d} submit after await us"] = rate, submit
            s = await b._stream(w, setup, 0.5, ids, store)
            out[f"{d} streamed GB/s"] = s["gbps"]
            warm, _ = await b._bursts(w, setup, store, ids)
            out[f"{d} submit back to back us"] = warm
            warm, _ = await b._bursts(w, setup, store, ids, in_runs=True)
            out[f"{d} submit b2b in runs us"] = warm
            for name, (gemm, alone) in gemms.items():
                with gemm:
                    s = await b._stream(w, setup, 0.6, ids, store)
                out[f"{d} under {name} GB/s"] = s["gbps"]
                out[f"{d} {name} slowdown %"] = 100 * (alone / gemm.rate - 1)
    for k in list(out):
        if k.endswith(" us"):
            out[k] *= 1e6
    return out


async def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dev = torch.device("cuda")
    setup = per_layer(dev)
    ceiling = b._Contiguous(setup.job_bytes).rates(5)
    big, medium = b._Gemm(8192, 8192, 8192), b._Gemm(4096, 4096, 14336)
    gemms = {"8192^3": (big, big.alone(0.6)), "medium": (medium, medium.alone(0.6))}
    store, load = ceiling["store"], ceiling["load"]
    rates = ", ".join(f"{k} {v[1]:.0f}" for k, v in gemms.items())
    print(f"ceiling store {store:.1f}, load {load:.1f} GB/s; GEMMs alone (TFLOP/s): {rates}")
    ids = b._JobIds()
    got: dict[int, list[dict[str, float]]] = {s: [] for s in SIZES}
    for r in range(rounds):
        for size in SIZES[r % len(SIZES) :] + SIZES[: r % len(SIZES)]:  # each size first in turn
            got[size].append(await one_round(setup, size, ids, gemms))
    keys = list(got[SIZES[0]][0])
    print(f"{'':34}" + "".join(f"{s >> 20:>10} MiB ring" for s in SIZES))
    for k in keys:
        cells = []
        for s in SIZES:
            vals = [r[k] for r in got[s]]
            if "GB/s" in k:
                base = ceiling["store" if k.startswith("store") else "load"]
                cells.append(" ".join(f"{v / base:.2f}" for v in vals))
            else:
                cells.append(" ".join(f"{v:.0f}" if v > 20 else f"{v:.1f}" for v in vals))
        print(f"{k.replace('GB/s', '(of ceiling)'):34}" + "".join(f"{c:>19}" for c in cells))
    print("(one figure per round; GB/s rows as shares of the contiguous ceiling)")


if __name__ == "__main__":
    asyncio.run(main())
