"""One job alone against two in flight, beside a GEMM loop, and how much each slows the GEMM.

Question it answers: what a server whose model runs long kernels gets from offloading one
job at a time, against keeping a second job in flight (``aiokv bench`` prints only the
latter under load). A GEMM loop runs on its own stream in a Python thread; the KV job is
per-layer 32 KiB pages moved through the public worker. Rates are fractions of a
contiguous copy of the same bytes measured in the same run.

On a CUDA device it uses the bf16 8192^3 GEMM (4096^3 with ``--quick``) and 256 MiB jobs
(32 MiB); without one it runs the same steps on the CPU backend beside a float32 matmul
loop, which says only that the machinery works.

    python3 benchmarks/gemm_overlap.py
    python3 benchmarks/gemm_overlap.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import anyio
import numpy as np
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec


class GemmLoop:
    """Square matmuls back to back in a thread (on a side stream on CUDA); counts FLOPs."""

    def __init__(self, device: str, n: int) -> None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        self.flops = 2 * n**3
        self.stream = torch.cuda.Stream() if device == "cuda" else None

    def _spin(self, stop: threading.Event, done: list[int]) -> None:
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            while not stop.is_set():
                torch.matmul(self.a, self.b)
                if self.stream is not None:
                    self.stream.synchronize()
                done[0] += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[Callable[[], float]]:
        """Run the loop for the block; yields a function giving its rate so far (FLOP/s)."""
        stop, done = threading.Event(), [0]
        thread = threading.Thread(target=self._spin, args=(stop, done), daemon=True)
        thread.start()
        time.sleep(0.05)  # past its first kernels
        count0, t0 = done[0], time.perf_counter()
        try:
            yield lambda: (done[0] - count0) * self.flops / (time.perf_counter() - t0)
        finally:
            stop.set()
            thread.join()


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
    gemm = GemmLoop(device, (4096 if quick else 8192) if cuda else (256 if quick else 512))
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

        with gemm.running() as gemm_rate:
            time.sleep(0.3 if not quick else 0.05)
            alone = gemm_rate()
        rows.append(("contiguous copy of the same bytes (ceiling)", ceiling / 1e9, "GB/s"))
        rows.append(("GEMM alone", alone / 1e12, "TFLOP/s"))
        idle = await one_at_a_time()
        rows.append(("store, one job at a time, idle (device time)", idle / ceiling, "ratio"))
        for label, measure in (("one job at a time (device time)", one_at_a_time),
                               ("two jobs in flight (wall)", two_in_flight)):
            with gemm.running() as gemm_rate:
                rate = await measure()
                beside = gemm_rate()
            rows.append((f"store under the GEMM, {label}", rate / ceiling, "ratio"))
            rows.append(("  GEMM slowdown beside it", 100 * (alone / beside - 1), "%"))
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
