"""One job alone against two in flight, beside a GEMM loop, and how much each slows the GEMM.

Question it answers: what a server whose model runs long kernels gets from offloading one
job at a time, against keeping a second job in flight (``aiokv bench`` prints only the
latter under load). The GEMM load is ``aiokv bench``'s own,
:class:`aiokv.bench.Gemm` (its own stream in a Python thread, four GEMMs per
synchronize, rate over its run), and the slowdown is computed as the bench computes it, so
the two agree by construction. Each row under the GEMM repeats its jobs for the whole
window, so the GEMM's rate is taken while jobs run. The KV job is per-layer 32 KiB pages
moved through the public worker. Rates are fractions of a contiguous copy of the same
bytes measured in the same run.

On a CUDA device it uses the bf16 8192^3 GEMM (4096^3 with ``--quick``) and 256 MiB jobs
(32 MiB); without one it runs the same steps on the CPU backend beside a float32 matmul
loop measured the same way (:class:`CpuGemm`), which says only that the machinery works.

    python3 benchmarks/gemm_overlap.py
    python3 benchmarks/gemm_overlap.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import anyio
import numpy as np
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.bench import Gemm


class CpuGemm:
    """The CPU stand-in for :class:`aiokv.bench.Gemm`, measured the same way.

    Four float32 matmuls between checks of the stop flag, rate (TFLOP/s) over the whole
    run, so the CPU path runs the same steps as the CUDA one.
    """

    def __init__(self, n: int) -> None:
        self.a, self.b = torch.randn(n, n), torch.randn(n, n)
        self.flops = 2.0 * n**3
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rate = 0.0

    def _loop(self) -> None:
        count, t0 = 0, time.perf_counter()
        while not self._stop.is_set():
            for _ in range(4):
                self.a @ self.b
            count += 4
        self.rate = count * self.flops / (time.perf_counter() - t0) / 1e12

    def __enter__(self) -> CpuGemm:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def alone(self, seconds: float) -> float:
        with self:
            time.sleep(seconds)
        return self.rate


def per_layer_kv(device: str, layers: int, blocks: int) -> CanonicalKVCaches:
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-(2**15), 2**15, (2, blocks, 16, 8, 128), dtype=torch.int16, generator=gen)
        .view(torch.bfloat16).to(device)
        for _ in range(layers)
    ]
    return CanonicalKVCaches.from_tensors(tensors, block_dim=1)


async def run(device: str, quick: bool, reps: int) -> list[tuple[str, float, str]]:
    cuda = device == "cuda"
    layers, blocks, job_blocks = (8, 256, 64) if quick else (32, 1024, 128)
    if not cuda:
        layers, blocks, job_blocks = (4, 64, 16) if quick else (8, 128, 64)
    if cuda:
        n = 4096 if quick else 8192
        gemm: Gemm | CpuGemm = Gemm(n, n, n)
    else:
        gemm = CpuGemm(256 if quick else 512)
    window = 0.3 if quick else 1.0
    kv = per_layer_kv(device, layers, blocks)
    rng = np.random.default_rng(1)
    nbytes = job_blocks * layers * 2 * 32768
    rows: list[tuple[str, float, str]] = []
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=2 * job_blocks) as worker:
        flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        host = worker.host_pool[:nbytes]

        def contiguous() -> float:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(flat, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize()
            return nbytes / (time.perf_counter() - t0)

        ceiling = max(contiguous() for _ in range(reps + 1))
        job_id = iter(range(10**9))

        def store(slot: int) -> object:
            gpu = rng.choice(blocks, job_blocks, replace=False)
            chunks = np.arange(job_blocks) + slot * job_blocks
            return worker.submit_store(next(job_id), GPULoadStoreSpec(gpu), CPULoadStoreSpec(chunks))

        async def one_at_a_time() -> float:
            rates = []
            for _ in range(reps):
                result = await store(0)  # type: ignore[misc]
                rates.append(nbytes / (result.transfer_time or float("inf")))
            return statistics.median(rates)

        async def two_in_flight() -> float:
            t0 = time.perf_counter()
            pending = store(0)
            for i in range(1, reps):
                nxt = store(i % 2)
                await pending  # type: ignore[misc]
                pending = nxt
            await pending  # type: ignore[misc]
            return (reps - 1) * nbytes / (time.perf_counter() - t0)  # the first overlaps the rest

        alone = gemm.alone(window)
        rows.append(("contiguous copy of the same bytes (ceiling)", ceiling / 1e9, "GB/s"))
        # a small CPU matmul can run under 0.01 TFLOP/s, which two decimals would print as 0
        rows.append(("GEMM alone", alone, "TFLOP/s") if cuda else ("GEMM alone", alone * 1e3, "GFLOP/s"))
        idle = await one_at_a_time()
        rows.append(("store, one job at a time, idle (device time)", idle / ceiling, "ratio"))
        for label, measure in (("one job at a time (device time)", one_at_a_time),
                               ("two jobs in flight (wall)", two_in_flight)):
            with gemm:
                rates = [await measure()]
                t_end = time.perf_counter() + window
                while time.perf_counter() < t_end:  # keep jobs running while the GEMM is timed
                    rates.append(await measure())
            rows.append((f"store under the GEMM, {label}", statistics.median(rates) / ceiling, "ratio"))
            rows.append(("  GEMM slowdown beside it", 100 * (1 - gemm.rate / alone), "%"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small jobs, few repetitions")
    parser.add_argument("--reps", type=int, default=None, help="jobs per row (default 20, quick 3)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reps = args.reps or (3 if args.quick else 20)
    if reps < 2:
        parser.error("--reps must be at least 2")
    if device == "cpu":
        print("CUDA not available: running on the CPU backend beside a CPU matmul loop "
              "(proves the machinery; the figures say nothing about a GPU)")
    rows = anyio.run(run, device, args.quick, reps)
    for name, value, unit in rows:
        print(f"{name:<60} {value:>9.2f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
