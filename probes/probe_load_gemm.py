"""Why staged loads of the per-layer 32 KiB-page job fell to 0.81-0.84 of the ceiling under
the 8192^3 GEMM in runs 79-80 (stores held 0.93-1.00): host gaps or the device?

The bench's streamed row (two jobs in flight, GB/s over wall time) is rerun per direction
under each GEMM load, in rounds alternating the ways a job can be issued: by the caller
(the default: batched slices of more than 16 descriptors drop the GIL), by the caller
keeping the GIL through every batched call, and by the lane's issuer thread. Beside the
wall rate it prints the median rate by device time of the same jobs (start to stop event)
and the median submit. Device rate near the ceiling with a low wall rate means the device
waited on the host; both low means the device side (the scatter waiting for SMs).

With ``one`` as second argument it instead times single jobs (one in flight, so spans do
not overlap) by device time, idle and under each GEMM load, issued by the caller.

Run on the GPU machine from the repo root: python3 probes/probe_load_gemm.py [rounds, default 2] [one]
"""

import asyncio
import statistics
import sys
import time
from collections import deque

import torch
from _setups import per_layer

import aiokv.backends.cuda as cuda_backend
from aiokv.bench import cuda as b

DEFAULT_HELD = cuda_backend.GIL_HELD_DESCRIPTORS


async def stream(
    worker, setup: b._Setup, store: bool, seconds: float, ids: b._JobIds
) -> tuple[float, float, float]:
    """Two jobs in flight: (GB/s over wall, median GB/s by device time, median submit s)."""
    inflight: deque = deque()
    submits, device = [], []
    moved, k = 0, 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end or inflight:
        if time.perf_counter() < end and len(inflight) < 2:
            s0 = time.perf_counter()
            inflight.append(b._submit(worker, setup, store, k, ids))
            submits.append(time.perf_counter() - s0)
            k += 1
            continue
        res = await inflight.popleft()
        device.append(res.transfer_time)
        moved += setup.job_bytes
    wall = time.perf_counter() - t0
    return moved / wall / b.GB, setup.job_bytes / statistics.median(device) / b.GB, statistics.median(submits)


async def variant(setup: b._Setup, issue_thread: bool, ceil: dict, gemms: list) -> list[str]:
    ids = b._JobIds()
    out = []
    async with setup.worker("auto", issue_thread=issue_thread) as w:
        await stream(w, setup, True, 0.2, ids)  # warm: rings, events, tables
        await stream(w, setup, False, 0.2, ids)
        for gname, gemm, alone in gemms:
            for what, store in (("load", False), ("store", True)):
                with gemm:
                    wall, dev, sub = await stream(w, setup, store, 0.6, ids)
                out.append(f"{what} under {gname:6}: wall {wall / ceil[what]:.2f}, "
                           f"device {dev / ceil[what]:.2f}, submit {sub * 1e6:4.0f} us, "
                           f"GEMM {100 * (1 - gemm.rate / alone):+.1f}%")
    return out


async def single_jobs(setup: b._Setup, ceil: dict, gemms: list, reps: int = 12) -> list[str]:
    """One job at a time, by device time: idle, then under each GEMM load."""
    ids = b._JobIds()
    out = []
    async with setup.worker("auto") as w:
        await stream(w, setup, True, 0.2, ids)  # warm
        await stream(w, setup, False, 0.2, ids)
        for what, store in (("load", False), ("store", True)):
            rate, _ = await b._device_rate(w, setup, store, reps, ids)
            line = [f"{what} one job: idle {rate / ceil[what]:.2f}"]
            for gname, gemm, alone in gemms:
                with gemm:
                    rate, _ = await b._device_rate(w, setup, store, reps, ids)
                slower = 100 * (1 - gemm.rate / alone)
                line.append(f"under {gname} {rate / ceil[what]:.2f} (GEMM {slower:+.1f}%)")
            out.append(", ".join(line))
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    one = len(sys.argv) > 2 and sys.argv[2] == "one"
    dev = torch.device("cuda")
    setup = per_layer(dev)
    ceil = b._Contiguous(setup.job_bytes).rates(3)
    big, medium = b._Gemm(8192, 8192, 8192), b._Gemm(4096, 4096, 14336)
    gemms = [("8192^3", big, big.alone(0.6)), ("medium", medium, medium.alone(0.6))]
    print(f"ceilings {ceil}; GEMMs alone {gemms[0][2]:.0f} / {gemms[1][2]:.0f} TFLOP/s", flush=True)
    if one:
        for rnd in range(rounds):
            for line in asyncio.run(single_jobs(setup, ceil, gemms)):
                print(f"round {rnd} {line}", flush=True)
        return
    variants = (("caller", False, DEFAULT_HELD), ("caller, GIL kept", False, 1 << 30),
                ("issuer", True, DEFAULT_HELD))
    for rnd in range(rounds):
        for label, thread, held in variants if rnd % 2 == 0 else variants[::-1]:
            cuda_backend.GIL_HELD_DESCRIPTORS = held
            for line in asyncio.run(variant(setup, thread, ceil, gemms)):
                print(f"round {rnd} {label:16} {line}", flush=True)
    cuda_backend.GIL_HELD_DESCRIPTORS = DEFAULT_HELD


if __name__ == "__main__":
    main()
