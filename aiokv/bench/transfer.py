"""Transfer benchmark through the public worker, each figure beside its same-run ceiling.

Runs on any backend; on the CPU backend it proves the machinery and gives CPU-side
figures, on CUDA the same rows come out next to a contiguous pinned copy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np
import torch

from ..layout import CanonicalKVCaches
from ..specs import CPULoadStoreSpec, GPULoadStoreSpec
from ..worker import AsyncOffloadingWorker
from .report import BenchRow

__all__ = ["TransferCase", "default_cases", "run_transfer_bench"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TransferCase:
    """A KV layout and a job of ``job_blocks`` random blocks out of ``num_blocks``."""

    name: str
    layers: int
    page_shape: tuple[int, ...]  # one K or V page of one block, in bf16 elements
    num_blocks: int
    job_blocks: int

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.page_shape)) * 2


def default_cases(quick: bool) -> list[TransferCase]:
    """The realistic job (32 layers of (2, N, 16, 8, 128) bf16: 32 KiB pages) and a sweep."""
    scale = 4 if quick else 1
    return [
        TransferCase("16 KiB pages", 32, (16, 4, 128), 256 // scale, 128 // scale),
        TransferCase("32 KiB pages (realistic)", 32, (16, 8, 128), 256 // scale, 128 // scale),
        TransferCase("256 KiB pages", 8, (128, 8, 128), 128 // scale, 64 // scale),
        TransferCase("2 MiB pages", 2, (1024, 8, 128), 64 // scale, 32 // scale),
    ]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def _measure_case(case: TransferCase, device: str, reps: int) -> list[BenchRow]:
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.randint(-(2**15), 2**15, (2, case.num_blocks, *case.page_shape), dtype=torch.int16,
                      generator=gen).view(torch.bfloat16)
        .to(device)
        for _ in range(case.layers)
    ]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    rng = np.random.default_rng(1)
    blocks = rng.choice(case.num_blocks, case.job_blocks, replace=False)
    chunks = np.arange(case.job_blocks)
    nbytes = case.job_blocks * case.layers * 2 * case.page_bytes
    # Written first: a copy from memory never touched reads faster than from written memory,
    # which would inflate the store ceiling.
    flat_dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    rows: list[BenchRow] = []
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=case.job_blocks) as worker:
        host = worker.host_pool[:nbytes]
        copies = _contiguous_copies(host, flat_dev, device, case.page_bytes)
        # The ceiling is timed before and after the worker's jobs, each kind of copy: the
        # machine drifts, and the ceiling must be the best it did, not a typical run.
        ceilings = {f"{kind}, start": _best_rate(fn, device, nbytes, reps) for kind, fn in copies.items()}
        job = 0
        timings: dict[str, list[float]] = {"store": [], "load": []}
        submit: list[float] = []
        for _ in range(reps + 1):
            for direction in ("store", "load"):
                job += 1
                t0 = time.perf_counter()
                if direction == "store":
                    fut = worker.submit_store(job, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
                else:
                    fut = worker.submit_load(job, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))
                t1 = time.perf_counter()
                await fut
                t2 = time.perf_counter()
                if job > 2:  # first round warms up
                    timings[direction].append(t2 - t0)
                    submit.append(t1 - t0)
        ceilings.update({f"{kind}, end": _best_rate(fn, device, nbytes, reps) for kind, fn in copies.items()})
    for direction in ("store", "load"):
        mine = {kind: rate for kind, rate in ceilings.items() if kind.startswith(direction)}
        got = nbytes / statistics.median(timings[direction]) / 1e9
        rows.append(BenchRow(
            "throughput", f"{direction} {case.name}", got, "GB/s", max(mine.values()),
            note=f"{nbytes / 2**20:.0f} MiB, {case.job_blocks * case.layers * 2} pages",
            extra={"page_bytes": case.page_bytes, "direction": direction, "strategy": "worker",
                   "ceilings_gbps": mine},
        ))
    job_time = statistics.median(timings["store"] + timings["load"])
    rows.append(BenchRow(
        "host cost", f"submit time per job, {case.name}", statistics.median(submit) * 1e6, "us",
        note=f"{statistics.median(submit) / job_time:.1%} of the job's transfer time",
    ))
    return rows


def _contiguous_copies(
    host: torch.Tensor, dev: torch.Tensor, device: str, page_bytes: int
) -> dict[str, Callable[[], None]]:
    """The same bytes moved contiguously, each direction: as one copy, and (on the CPU) in
    page-sized pieces, which is how the lane copies and which the caches can make faster
    than one long copy. The ceiling is the best of them, so it bounds the worker's rate."""
    if device != "cpu":
        def store_pinned() -> None:
            host.copy_(dev, non_blocking=True)

        def load_pinned() -> None:
            dev.copy_(host, non_blocking=True)

        return {"store, one copy": store_pinned, "load, one copy": load_pinned}
    # The CPU lane copies with numpy slice assignment, and torch's threaded copy_ of the
    # same bytes was the slower of the two on a 2-core VM: the ceiling copies as the lane does.
    h, d = host.numpy(), dev.numpy()
    bounds = [(i, min(i + page_bytes, h.size)) for i in range(0, h.size, page_bytes)]

    def store_one() -> None:
        h[:] = d

    def load_one() -> None:
        d[:] = h

    def store_pages() -> None:
        for a, b in bounds:
            h[a:b] = d[a:b]

    def load_pages() -> None:
        for a, b in bounds:
            d[a:b] = h[a:b]

    return {"store, one copy": store_one, "store, page pieces": store_pages,
            "load, one copy": load_one, "load, page pieces": load_pages}


def _best_rate(fn: Callable[[], None], device: str, nbytes: int, reps: int) -> float:
    """GB/s of the fastest of ``reps`` timed calls (after one untimed warm-up)."""
    _time_sync(fn, device)
    return nbytes / min(_time_sync(fn, device) for _ in range(reps)) / 1e9


def _time_sync(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


async def _measure_wakeup(device: str, samples: int) -> list[BenchRow]:
    """Round trip of a tiny job through ``await``, and loop-thread CPU while waiting."""
    layers = [torch.randn(2, 8, 16, device=device) for _ in range(2)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    big = [torch.randn(2, 64, 256, 1024, device=device) for _ in range(2)]
    kv_big = CanonicalKVCaches.from_tensors(big, block_dim=1)
    latencies = []
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=8) as worker:
        for i in range(samples):
            t0 = time.perf_counter()
            await worker.submit_store(i, GPULoadStoreSpec([i % 8]), CPULoadStoreSpec([i % 8]))
            latencies.append(time.perf_counter() - t0)
    async with AsyncOffloadingWorker(kv_big, num_cpu_chunks=64) as worker:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        for i in range(4):
            await worker.submit_store(i, GPULoadStoreSpec(np.arange(64)), CPULoadStoreSpec(np.arange(64)))
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    return [
        BenchRow("completion", "tiny job round trip p50", _percentile(latencies, 50) * 1e6, "us"),
        BenchRow("completion", "tiny job round trip p99", _percentile(latencies, 99) * 1e6, "us"),
        BenchRow("completion", "loop-thread CPU while awaiting long jobs", cpu / wall * 100, "% core",
                 note=f"{wall * 1e3:.0f} ms of awaits"),
    ]


def run_transfer_bench(
    device: str = "cpu", *, quick: bool = False, progress: Progress | None = None,
    backend: str = "asyncio",
) -> list[BenchRow]:
    """Measure every case and the completion path; returns the rows."""
    say = progress or (lambda _msg: None)
    reps = 3 if quick else 5
    rows: list[BenchRow] = []

    async def main() -> None:
        cases = default_cases(quick)
        for i, case in enumerate(cases, 1):
            say(f"[{i}/{len(cases) + 1}] {case.name}: store and load beside a contiguous copy")
            rows.extend(await _measure_case(case, device, reps))
        say(f"[{len(cases) + 1}/{len(cases) + 1}] completion wake-up latency")
        rows.extend(await _measure_wakeup(device, 100 if quick else 400))

    anyio.run(main, backend=backend)
    return rows
