"""How many CTAs the staging ring's piece kernel should launch: one per 16 KiB tile (4096
for a 64 MiB slice of the per-layer job), or a few that loop over the tiles, so a GEMM
running beside the copy loses fewer SM slots to it.

Per variant of ``aiokv.copy.pieces.MAX_CTAS``, in rounds alternating their order: the
per-layer 32 KiB-page job's one-job rate by device time idle, then streamed (two jobs in
flight, wall time) under the 8192^3 GEMM and under medium GEMMs from a Python thread, with
the GEMM's slowdown; beside them each round, the same for a contiguous pinned copy.

Run on the GPU machine from the repo root: python3 probes/probe_ctas.py [rounds, default 3]
"""

import asyncio
import sys

import torch
from _setups import per_layer

from aiokv.bench import cuda as b
from aiokv.copy import pieces

WINDOW = 1.0


async def variant(setup: b._Setup, ceil: dict, gemms: list) -> str:
    ids = b._JobIds()
    parts = []
    async with setup.worker("auto") as w:
        for what, store in (("store", True), ("load", False)):
            rate, _ = await b._device_rate(w, setup, store, 5, ids)
            parts.append(f"{what} idle {rate / ceil[what]:.2f}")
        for gname, gemm, alone in gemms:
            for what, store in (("store", True), ("load", False)):
                with gemm:
                    s = await b._stream(w, setup, WINDOW, ids, store=store)
                slower = 100 * (1 - gemm.rate / alone)
                parts.append(f"{what} {gname} {s['gbps'] / ceil[what]:.2f} ({slower:+.1f}%)")
    return ", ".join(parts)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    setup = per_layer(torch.device("cuda"))
    contig = b._Contiguous(setup.job_bytes)
    ceil = contig.rates(3)
    big, medium = b._Gemm(8192, 8192, 8192), b._Gemm(4096, 4096, 14336)
    gemms = [("8192^3", big, big.alone(WINDOW)), ("medium", medium, medium.alone(WINDOW))]
    print(f"ceilings {ceil}; GEMMs alone {gemms[0][2]:.0f} / {gemms[1][2]:.0f} TFLOP/s", flush=True)
    variants = (None, 264, 132, 32)
    for rnd in range(rounds):
        floor = []
        for gname, gemm, alone in gemms:
            with gemm:
                rate = contig.stream_rate(WINDOW)
            floor.append(f"{gname} {rate / ceil['store']:.2f} ({100 * (1 - gemm.rate / alone):+.1f}%)")
        print(f"round {rnd} contiguous store: " + ", ".join(floor), flush=True)
        for ctas in variants if rnd % 2 == 0 else variants[::-1]:
            pieces.MAX_CTAS = ctas
            print(f"round {rnd} ctas {ctas!s:5} " + asyncio.run(variant(setup, ceil, gemms)), flush=True)
    pieces.MAX_CTAS = None


if __name__ == "__main__":
    main()
