"""How soon ``await`` returns after a copy ends, on asyncio, uvloop and trio, doorbell on and off.

Question it answers: which event loop (and whether the doorbell) to run a worker on. One
job in flight at a time, a tiny job and a long one, through the public worker only.

Wake-up here is ``await`` return minus ``submit_*`` return minus the job's device time
(``TransferResult.transfer_time``): exact when the copy starts after ``submit`` returns,
and biased the same way on every loop, so the loops compare fairly. ``aiokv bench`` uses
internal stamps for its own wake-up rows. Loop CPU is the event-loop thread's CPU time
between submit and wake over that wall time.

    python3 benchmarks/wakeup_loops.py            # 200 jobs per row
    python3 benchmarks/wakeup_loops.py --quick    # a few jobs per row (what the tests run)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import anyio
import numpy as np
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec, WorkerOptions

LOOPS = ("asyncio", "uvloop", "trio")


@dataclass(frozen=True)
class Job:
    """A KV layout of ``layers`` tensors ``(2, blocks, *page)`` bf16 and a job of ``job_blocks``."""

    name: str
    layers: int
    page: tuple[int, ...]
    blocks: int
    job_blocks: int


def jobs_for(device: str, quick: bool) -> list[Job]:
    """A tiny job (one 4 KiB page pair) and a long one (2 MiB pages; smaller on the CPU)."""
    long_blocks = 8 if quick else (64 if device == "cuda" else 16)
    page = (1024, 8, 128) if device == "cuda" else (256, 8, 128)  # 2 MiB or 512 KiB
    page_kib = int(np.prod(page)) * 2 // 1024
    return [
        Job("tiny (4 KiB pages, 1 block)", 1, (16, 128), 8, 1),
        Job(f"long ({page_kib} KiB pages, {long_blocks} blocks)", 2, page, long_blocks, long_blocks),
    ]


def make_kv(job: Job, device: str) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.randint(-(2**15), 2**15, (2, job.blocks, *job.page), dtype=torch.int16, generator=gen)
        .view(torch.bfloat16).to(device)
        for _ in range(job.layers)
    ]
    return CanonicalKVCaches.from_tensors(layers, block_dim=1)


async def measure(job: Job, device: str, n: int, doorbell: bool) -> dict[str, float]:
    """One job in flight at a time, stores and loads alternating; medians and p99 in us."""
    kv = make_kv(job, device)
    blocks = np.arange(job.job_blocks)
    wake, trip, cpu_share = [], [], []
    options = WorkerOptions(doorbell=doorbell)
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=job.job_blocks, options=options) as worker:
        for i in range(n + 2):  # the first store and load warm up
            t0 = time.perf_counter()
            if i % 2 == 0:
                fut = worker.submit_store(i, GPULoadStoreSpec(blocks), CPULoadStoreSpec(blocks))
            else:
                fut = worker.submit_load(i, CPULoadStoreSpec(blocks), GPULoadStoreSpec(blocks))
            t1, c1 = time.perf_counter(), time.thread_time()
            result = await fut
            t2, c2 = time.perf_counter(), time.thread_time()
            if i >= 2:
                device_time = result.transfer_time or 0.0
                wake.append(max(0.0, t2 - t1 - device_time) * 1e6)
                trip.append((t2 - t0) * 1e6)
                cpu_share.append((c2 - c1) / max(t2 - t1, 1e-9))
    return {
        "wake_p50": statistics.median(wake),
        "wake_p99": float(np.percentile(wake, 99)),
        "trip_p50": statistics.median(trip),
        "loop_cpu": 100 * statistics.fmean(cpu_share),
    }


def run_on(loop: str, fn: Callable[[], Awaitable[dict[str, float]]]) -> dict[str, float]:
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few jobs per row")
    parser.add_argument("--jobs", type=int, default=None, help="jobs per row (default 200, quick 6)")
    parser.add_argument("--loops", default=",".join(LOOPS),
                        help="comma-separated subset of " + ",".join(LOOPS))
    args = parser.parse_args(argv)
    n = args.jobs or (6 if args.quick else 200)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"backend: {device} ({torch.cuda.get_device_name(0) if device == 'cuda' else 'no CUDA device'});"
          f" {n} jobs per row, one in flight")
    print(f"{'loop':<8} {'doorbell':<8} {'job':<34} {'wake p50':>9} {'wake p99':>9} {'trip p50':>10} "
          f"{'loop CPU':>8}")
    for loop in args.loops.split(","):
        if loop not in LOOPS:
            parser.error(f"unknown loop {loop!r}; choose from {', '.join(LOOPS)}")
        if loop != "asyncio" and importlib.util.find_spec(loop) is None:
            print(f"{loop:<8} skipped: {loop} is not installed")
            continue
        for job in jobs_for(device, args.quick):
            for doorbell in (True, False):
                row = run_on(loop, partial(measure, job, device, n, doorbell))
                print(f"{loop:<8} {'on' if doorbell else 'off':<8} {job.name:<34} {row['wake_p50']:>6.1f} us "
                      f"{row['wake_p99']:>6.1f} us {row['trip_p50']:>7.1f} us {row['loop_cpu']:>7.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
