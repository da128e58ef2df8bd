"""What the CUDA benchmark measures with: KV caches and their jobs, the ceilings
(contiguous pinned copies), GEMM loads, a busy Python thread, and the baselines a user
would otherwise write (one memcpy per page, one batched call per job)."""

from __future__ import annotations

import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from ..host_layout import HostLayout
from ..plan import map_blocks, plan_copies
from .report import BenchRow

__all__ = [
    "BLOCKS", "CHUNKS", "GB", "LAYERS", "BenchSetup", "BusyThread", "Contiguous", "Gemm", "JobIds",
    "baselines", "submit_job",
]

GB = 1e9
LAYERS, BLOCKS, JOB_BLOCKS = 32, 1024, 128
CHUNKS = 512


class BenchSetup:
    """A KV cache, a fixed set of random jobs over it, and a worker factory."""

    def __init__(
        self, name: str, tensors: list[torch.Tensor], block_dim: int, chunks: int, seed: int
    ) -> None:
        self.name = name
        self.tensors = tensors
        self.kv = CanonicalKVCaches.from_tensors(tensors, block_dim=block_dim)
        self.chunks = chunks
        rng = np.random.default_rng(seed)
        nblocks = self.kv.tensors[0].tensor.shape[0]
        self.jobs = [
            (rng.choice(nblocks, JOB_BLOCKS, replace=False), rng.choice(chunks, JOB_BLOCKS, replace=False))
            for _ in range(4)
        ]
        # The same blocks onto 128 neighbouring chunks, listed in descending order (as a
        # LIFO free list hands back a freed run): one DMA run per slice of the ring.
        self.jobs_in_runs = [
            (blocks, (int(rng.integers(chunks - JOB_BLOCKS + 1)) + np.arange(JOB_BLOCKS))[::-1].copy())
            for blocks, _ in self.jobs
        ]
        self.job_bytes = JOB_BLOCKS * sum(r.page_size_bytes for r in self.kv.group_data_refs[0])

    def worker(
        self, strategy: str, streams: int = 0, threads: int | None = None, doorbell: bool = True,
        issue_thread: bool = False,
    ) -> AsyncOffloadingWorker:
        """A worker of the defaults but these; ``issue_thread`` is the Python path's issuer
        thread (a native lane has its own whatever the option says), so it takes that path."""
        options: dict[str, Any] = {
            "strategy": strategy, "streams_per_direction": streams, "doorbell": doorbell,
            "issue_thread": issue_thread,
        }
        if issue_thread:
            options["native"] = False
        if threads is not None:
            options["submit_threads"] = threads
        return AsyncOffloadingWorker(self.kv, num_cpu_chunks=self.chunks, backend="cuda", options=options)


class JobIds:
    """Fresh job ids, one per call."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def submit_job(
    worker: AsyncOffloadingWorker, setup: BenchSetup, store: bool, k: int, ids: JobIds, in_runs: bool = False
) -> Any:
    """Submit job ``k`` of the setup's fixed jobs (a store or a load); its future."""
    jobs = setup.jobs_in_runs if in_runs else setup.jobs
    blocks, chunks = jobs[k % len(jobs)]
    if store:
        return worker.submit_store(ids(), GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
    return worker.submit_load(ids(), CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))


class Gemm:
    """A GEMM loop on its own stream in a Python thread; rate in TFLOP/s over its run."""

    def __init__(self, m: int, k: int, n: int) -> None:
        dev = torch.device("cuda")
        self.a = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        self.b = torch.randn(k, n, dtype=torch.bfloat16, device=dev)
        self.flops = 2.0 * m * k * n
        self.stream = torch.cuda.Stream()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rate = 0.0

    def _loop(self) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                self.a @ self.b
            self.stream.synchronize()
            count, t0 = 0, time.perf_counter()
            while not self._stop.is_set():
                for _ in range(4):
                    self.a @ self.b
                self.stream.synchronize()
                count += 4
            self.rate = count * self.flops / (time.perf_counter() - t0) / 1e12

    def __enter__(self) -> Gemm:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        time.sleep(0.15)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def alone(self, seconds: float) -> float:
        with self:
            time.sleep(seconds)
        return self.rate


class Contiguous:
    """Contiguous pinned copies of ``nbytes``: the ceilings."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()
        self.extra = [torch.cuda.Stream() for _ in range(8)]

    def _timed(self, fn: Callable[[], None], reps: int) -> float:
        out = []
        for _ in range(reps + 2):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(self.s1)
            fn()
            self.s1.wait_stream(self.s2)
            e1.record(self.s1)
            e1.synchronize()
            out.append(e0.elapsed_time(e1) / 1e3)
        return statistics.median(out[2:])  # two warm-ups: first copies after allocation run slow

    def d2h(self) -> None:
        with torch.cuda.stream(self.s1):
            self.host.copy_(self.dev, non_blocking=True)

    def h2d(self) -> None:
        with torch.cuda.stream(self.s1):
            self.dev.copy_(self.host, non_blocking=True)

    def both(self, parts: int = 1) -> None:
        """Both directions at once, each cut into ``parts`` copies on their own streams."""
        self.s2.wait_stream(self.s1)
        step = self.nbytes // parts
        for i in range(parts):
            lo, hi = i * step, self.nbytes if i == parts - 1 else (i + 1) * step
            with torch.cuda.stream(self.extra[2 * i]):
                self.extra[2 * i].wait_stream(self.s1)
                self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
            with torch.cuda.stream(self.extra[2 * i + 1]):
                self.extra[2 * i + 1].wait_stream(self.s1)
                self.dev2[lo:hi].copy_(self.host2[lo:hi], non_blocking=True)
        for s in self.extra[: 2 * parts]:
            self.s1.wait_stream(s)

    def rates(self, reps: int) -> dict[str, float]:
        # One copy per direction does not always reach what jobs spread over many streams
        # reach both ways at once, so the bidirectional ceiling is the best of one and four
        # streams per direction.
        both = max(2 * self.nbytes / self._timed(functools.partial(self.both, n), reps) / GB for n in (1, 4))
        return {
            "store": self.nbytes / self._timed(self.d2h, reps) / GB,
            "load": self.nbytes / self._timed(self.h2d, reps) / GB,
            "both": both,
        }

    def stream_rate(self, seconds: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.d2h()
            self.s1.synchronize()
            n += 1
        return n * self.nbytes / (time.perf_counter() - t0) / GB


def baselines(setup: BenchSetup, reps: int, ceiling: dict[str, float]) -> list[BenchRow]:
    """What a user would otherwise write: one memcpy per page, or one batched call per job.

    Opens a ``Driver`` of its own and closes it on every way out."""
    from ..backends.cuda.driver import Driver  # here: the module imports without cuda-python

    drv = Driver(torch.cuda.current_device())
    try:
        return _baseline_rows(drv, setup, reps, ceiling)
    finally:
        drv.close()


def list_api_batch(drv: Any) -> Callable[[list[int], list[int], list[int], Any], None]:
    """One ``cuMemcpyBatchAsync`` per call through cuda-python's own list API, the way code
    without aiokv calls it (every address converted in Python, one stream-ordered attribute).

    The bench's baseline only: aiokv's runtime copies go through ``Driver``, whose batched
    calls take numpy arrays as they are.
    """
    from cuda.bindings import driver as cu

    from ..backends.cuda.driver import translate

    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = 0

    def copy(dst: list[int], src: list[int], sizes: list[int], stream: Any) -> None:
        dsts = [cu.CUdeviceptr(x) for x in dst]
        srcs = [cu.CUdeviceptr(x) for x in src]
        ret = cu.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attr], [0], 1, stream)
        code = ret[0] if isinstance(ret, tuple) else ret
        if code != cu.CUresult.CUDA_SUCCESS:
            raise translate(int(code), "cuMemcpyBatchAsync")

    return copy


def _baseline_rows(drv: Any, setup: BenchSetup, reps: int, ceiling: dict[str, float]) -> list[BenchRow]:
    layout = HostLayout.build(setup.kv, 1)
    host = torch.empty(setup.chunks * layout.chunk_bytes, dtype=torch.uint8, pin_memory=True)
    blocks, chunks = setup.jobs[0]
    plan = plan_copies(map_blocks(blocks, chunks, layout=layout, num_chunks=setup.chunks), layout)
    dev = np.array([t.tensor.data_ptr() for t in setup.kv.tensors], dtype=np.int64)[plan.tensor_idx]
    dev = (dev + plan.device_offset).tolist()
    hst = (plan.host_offset + host.data_ptr()).tolist()
    sizes = plan.nbytes.tolist()
    batch = list_api_batch(drv)
    stream = drv.create_stream()
    rows = []

    def timed(fn: Callable[[], None]) -> float:
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            drv.stream_synchronize(stream)
            ts.append(time.perf_counter() - t0)
        return setup.job_bytes / statistics.median(ts[1:]) / GB

    def per_page() -> None:
        for d, h, n in zip(dev, hst, sizes):
            drv.memcpy(h, d, n, stream)

    try:
        rate = timed(per_page)
        rows.append(BenchRow("baselines (32 KiB pages)", "store, one cudaMemcpyAsync per page", rate, "GB/s",
                             ceiling["store"], "wall, incl. host submit"))
        for label, store in (("store", True), ("load", False)):
            d, s = (hst, dev) if store else (dev, hst)

            def batched(d: list[int] = d, s: list[int] = s) -> None:
                batch(d, s, sizes, stream)

            rate = timed(batched)
            rows.append(BenchRow("baselines (32 KiB pages)", f"{label}, one batched memcpy call per job",
                                 rate, "GB/s", ceiling[label], "cuda-python list API, 1 stream"))
    finally:
        try:
            drv.stream_synchronize(stream)  # the copies read and write ``host``
        finally:
            drv.destroy_stream(stream)
    del host
    return rows


class BusyThread:
    """Another Python thread that never drops the GIL by itself (pure Python), as a
    tokenizer or a scheduler might: every call of ours that drops the GIL, and every wake
    from a nap, may then wait up to the switch interval (5 ms) to get it back."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


