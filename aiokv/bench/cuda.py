"""The CUDA benchmark: every figure beside its ceiling, measured in the same run.

Ceilings are contiguous pinned copies of the same bytes (one direction, and both at
once). Strategy figures go through ``AsyncOffloadingWorker`` on asyncio: device GB/s of
one job (from ``TransferResult.transfer_time``), and streamed GB/s (jobs kept in flight,
bytes over wall time) idle, under a saturating GEMM and under medium GEMMs launched from
another Python thread, with each GEMM's slowdown. Completion wake-up is measured on
asyncio, and for the 4 KiB and 2 MiB-page jobs on uvloop and trio too, where installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import numpy as np
import torch

from .. import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from .report import BenchRow

__all__ = ["OTHER_LOOPS", "loop_available", "run_cuda_bench", "run_on_loop"]

GB = 1e9
T = TypeVar("T")
LAYERS, BLOCKS, JOB_BLOCKS = 32, 1024, 128
CHUNKS = 512


class _Setup:
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
        options: dict[str, Any] = {
            "strategy": strategy, "streams_per_direction": streams, "doorbell": doorbell,
            "issue_thread": issue_thread,
        }
        if threads is not None:
            options["submit_threads"] = threads
        return AsyncOffloadingWorker(self.kv, num_cpu_chunks=self.chunks, backend="cuda", options=options)


def _pitched_share(worker: AsyncOffloadingWorker) -> tuple[int, str]:
    """How many jobs went as pitched copies, and the run heights the layout allows."""
    lanes = worker._core.backend._lanes  # type: ignore[attr-defined]
    jobs = sum(getattr(lane._strategy, "pitched_jobs", 0) for lane in lanes)
    runs = lanes[0]._strategy.ctx.runs if lanes and hasattr(lanes[0]._strategy, "ctx") else ()
    heights = sorted({len(r.refs) for r in runs})
    return jobs, f"runs of {heights} pages" if heights else "no uniform pitch"


def _staged_share(worker: AsyncOffloadingWorker) -> tuple[int, str]:
    """How many jobs went through a staging ring (the rest went as plain DMA)."""
    lanes = worker._core.backend._lanes  # type: ignore[attr-defined]
    jobs = sum(getattr(lane._strategy, "staged_jobs", 0) for lane in lanes)
    paths = {lane.direction.value: lane.strategy_name for lane in lanes}
    return jobs, f"lanes: {paths}"


def _issued(worker: AsyncOffloadingWorker, store: bool | None = None) -> tuple[int, float, float]:
    """Jobs the lanes' issuer threads enqueued (in one direction, or both), their host
    seconds, and the CPU seconds those threads spent on them."""
    lanes = [lane for lane in worker._core.backend._lanes  # type: ignore[attr-defined]
             if store is None or lane.direction.to_host == store]
    return (sum(getattr(lane, "issued_later", 0) for lane in lanes),
            sum(getattr(lane, "issue_seconds", 0.0) for lane in lanes),
            sum(getattr(lane, "issue_cpu_seconds", 0.0) for lane in lanes))


class _JobIds:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _submit(
    worker: AsyncOffloadingWorker, setup: _Setup, store: bool, k: int, ids: _JobIds, in_runs: bool = False
) -> Any:
    jobs = setup.jobs_in_runs if in_runs else setup.jobs
    blocks, chunks = jobs[k % len(jobs)]
    if store:
        return worker.submit_store(ids(), GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
    return worker.submit_load(ids(), CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))


async def _device_rate(
    worker: Any, setup: _Setup, store: bool, reps: int, ids: _JobIds
) -> tuple[float, float]:
    """Median GB/s of single jobs by device time, and median host submit seconds."""
    times, submits = [], []
    for k in range(reps + 1):
        t0 = time.perf_counter()
        fut = _submit(worker, setup, store, k, ids)
        submits.append(time.perf_counter() - t0)
        res = await fut
        times.append(res.transfer_time)
    return setup.job_bytes / statistics.median(times[1:]) / GB, statistics.median(submits[1:])


async def _stream(
    worker: Any, setup: _Setup, seconds: float, ids: _JobIds, store: bool = True, depth: int = 2,
    both: bool = False, in_runs: bool = False,
) -> dict[str, float]:
    """Keep ``depth`` jobs in flight for ``seconds``; GB/s over wall, CPU share, submit times.
    ``in_runs``: the jobs whose chunks are neighbours."""
    inflight: deque[Any] = deque()
    submits: list[float] = []
    moved, k = 0, 0
    c0, t0 = time.process_time(), time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end or inflight:
        if time.perf_counter() < end and len(inflight) < depth:
            s0 = time.perf_counter()
            if both:
                inflight.append(_submit(worker, setup, True, k, ids))
                inflight.append(_submit(worker, setup, False, k + 1, ids))
            else:
                inflight.append(_submit(worker, setup, store, k, ids, in_runs))
            submits.append(time.perf_counter() - s0)
            k += 1
            continue
        await inflight.popleft()
        moved += setup.job_bytes
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return {
        "gbps": moved / wall / GB, "cpu": cpu / wall, "wall": wall,
        "submit_p50": statistics.median(submits), "submit_max": max(submits),
    }


async def _bursts(
    worker: Any, setup: _Setup, store: bool, ids: _JobIds, in_runs: bool = False, bursts: int = 8,
    size: int = 4, clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Median host submit seconds of jobs submitted back to back (the 2nd to last of each
    burst of ``size``), and of each burst's first, which follows an ``await``. A submit
    after an await costs more than one right after another (likely its code and data have
    left the caches; not a sleeping core, probes/probe_warmth.py), so the bench reports
    both."""
    warm: list[float] = []
    cold: list[float] = []
    for _ in range(bursts):
        futs = []
        for k in range(size):
            t0 = clock()
            futs.append(_submit(worker, setup, store, k, ids, in_runs))
            (cold if k == 0 else warm).append(clock() - t0)
        for fut in futs:
            await fut
    return statistics.median(warm), statistics.median(cold)


class _Gemm:
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

    def __enter__(self) -> _Gemm:
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


class _Contiguous:
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
        # One copy per direction measured 82-100 GB/s across runs on the H200 while jobs
        # spread over many streams reached ~100, so the bidirectional ceiling is the best of
        # one and four streams per direction.
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


def _baselines(setup: _Setup, reps: int, ceiling: dict[str, float]) -> list[BenchRow]:
    """What a user would otherwise write: one memcpy per page, or one batched call per job."""
    from ..backends.cuda.driver import Driver
    from ..plan import HostLayout, map_blocks, plan_copies

    drv = Driver(torch.cuda.current_device())
    layout = HostLayout.build(setup.kv, 1)
    host = torch.empty(setup.chunks * layout.chunk_bytes, dtype=torch.uint8, pin_memory=True)
    blocks, chunks = setup.jobs[0]
    plan = plan_copies(map_blocks(blocks, chunks, layout=layout, num_chunks=setup.chunks), layout)
    dev = np.array([t.tensor.data_ptr() for t in setup.kv.tensors], dtype=np.int64)[plan.tensor_idx]
    dev = (dev + plan.device_offset).tolist()
    hst = (plan.host_offset + host.data_ptr()).tolist()
    sizes = plan.nbytes.tolist()
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

    rate = timed(per_page)
    rows.append(BenchRow("baselines (32 KiB pages)", "store, one cudaMemcpyAsync per page", rate, "GB/s",
                         ceiling["store"], "wall, incl. host submit"))
    for label, store in (("store", True), ("load", False)):
        d, s = (hst, dev) if store else (dev, hst)
        def batched(d: list[int] = d, s: list[int] = s) -> None:
            drv.memcpy_batch_lists(d, s, sizes, stream)

        rate = timed(batched)
        rows.append(BenchRow("baselines (32 KiB pages)", f"{label}, one batched memcpy call per job", rate,
                             "GB/s", ceiling[label], "cuda-python list API, 1 stream"))
    drv.stream_synchronize(stream)
    drv.destroy_stream(stream)
    del host
    return rows


# Loops the wake-up rows also run on besides asyncio: uvloop is what uvicorn picks when it
# is installed, and trio is the other loop the async face supports.
OTHER_LOOPS = ("uvloop", "trio")


def loop_available(loop: str) -> bool:
    """Whether ``loop`` ("asyncio", "uvloop" or "trio") can be run here."""
    return loop == "asyncio" or importlib.util.find_spec(loop) is not None


def run_on_loop(loop: str, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``fn()`` to completion on a fresh event loop of the named kind."""
    if loop == "asyncio":
        return asyncio.run(fn())
    if loop == "uvloop":
        return anyio.run(fn, backend="asyncio", backend_options={"use_uvloop": True})
    if loop == "trio":
        return anyio.run(fn, backend="trio")
    raise ValueError(f"unknown event loop {loop!r}")


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else float("nan")


async def _wakeups(
    worker: AsyncOffloadingWorker, submit: Callable[[int], Any], iters: int
) -> dict[str, float]:
    """One job at a time: submit time, round trip, wake-up and CPU spent while awaiting.

    Wake-up (device end -> the awaiting coroutine runs again) is bounded from above two
    ways, and the smaller bound is reported per job: (a) from the last poll that found the
    job not done (or its launch) to the await returning (``Handler.detect_windows`` plus the
    hop from the poller resolving the future to the task resuming), tight when the poller
    spins; (b) from when the copies were handed to the device (``Job.started_at``, after planning)
    to the await returning, minus their device time, tight when the poller napped and the
    doorbell woke it.
    """
    from ..specs import Direction

    stores = worker._core.handlers[Direction.STORE]
    subs, trips, wakes, windows, dev = [], [], [], [], []
    cpu = wall = 0.0
    resolved: list[float] = []
    poller = worker._poller
    assert poller is not None  # the worker is open
    polls = 0
    issuing = 0.0  # CPU the lanes' issuer threads spent enqueueing (submit work, moved)
    for i in range(iters + 10):
        resolved.clear()
        t0 = time.perf_counter()
        fut = submit(i)
        t1 = time.perf_counter()
        job = stores.pending()[-1]
        fut.add_done_callback(lambda _f: resolved.append(time.perf_counter()))
        c1 = time.process_time()
        i1 = _issued(worker)[2]
        p1 = poller.polls
        res = await fut
        t2 = time.perf_counter()
        c2 = time.process_time()
        i2 = _issued(worker)[2]
        if i < 10:
            continue
        window = stores.detect_windows[-1]
        subs.append(t1 - t0)
        trips.append(t2 - t0)
        hop = t2 - resolved[0] if resolved else 0.0
        device = res.transfer_time or 0.0
        wakes.append(min(window + hop, t2 - job.started_at - device) if device else window + hop)
        windows.append(window)
        polls += poller.polls - p1
        dev.append(res.transfer_time or 0.0)
        cpu += c2 - c1 - (i2 - i1)
        issuing += i2 - i1
        wall += t2 - t1
    return {
        "submit": _p(subs, 50), "trip50": _p(trips, 50), "trip99": _p(trips, 99),
        "wake50": _p(wakes, 50), "wake99": _p(wakes, 99), "device": _p(dev, 50),
        "window50": _p(windows, 50), "polls": polls / max(1, len(trips)),
        "cpu_wait": cpu / wall if wall else float("nan"),
        "cpu_job": cpu / max(1, len(trips)), "await": wall / max(1, len(trips)),
        "issue_job": issuing / max(1, len(trips)),
    }


async def _tiny_wakeups(iters: int) -> dict[str, float]:
    t = torch.randn(64, 1024, device="cuda").view(torch.uint8)
    kv = CanonicalKVCaches.from_tensors([t])
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=64, backend="cuda") as w:
        return await _wakeups(
            w, lambda i: w.submit_store(i, GPULoadStoreSpec([i % 64]), CPULoadStoreSpec([i % 64])), iters
        )


async def _long_wakeups(
    setup: _Setup, iters: int, doorbell: bool = True, busy: bool = False, issue_thread: bool = False,
    in_runs: bool = False,
) -> dict[str, float]:
    ids = _JobIds()
    async with setup.worker("auto", doorbell=doorbell, issue_thread=issue_thread) as w:
        with _BusyThread() if busy else contextlib.nullcontext():
            return await _wakeups(w, lambda i: _submit(w, setup, True, i, ids, in_runs), iters)


class _BusyThread:
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

    def __enter__(self) -> _BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_cuda_bench(quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Run the whole CUDA benchmark and return its rows (see module docstring)."""
    say = progress or (lambda _msg: None)
    reps = 3 if quick else 7
    window = 0.6 if quick else 1.2
    torch.cuda.init()
    dev = torch.device("cuda")
    rows: list[BenchRow] = []
    say("allocating KV caches")
    per_layer = _Setup(
        "32 KiB pages",
        [torch.randn(2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)],
        block_dim=1, chunks=CHUNKS, seed=1,
    )
    big = _Setup(
        "2 MiB pages",
        [torch.randn(BLOCKS, LAYERS, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)],
        block_dim=0, chunks=CHUNKS // 2, seed=2,
    )
    contig = _Contiguous(per_layer.job_bytes)
    say("ceilings")
    ceil = contig.rates(reps)
    sec = "ceilings (contiguous pinned copy, 256 MiB)"
    rows += [
        BenchRow(sec, "store D2H", ceil["store"], "GB/s"),
        BenchRow(sec, "load H2D", ceil["load"], "GB/s"),
        BenchRow(sec, "both directions at once (sum)", ceil["both"], "GB/s"),
    ]
    big_gemm, med_gemm = _Gemm(8192, 8192, 8192), _Gemm(4096, 4096, 14336)
    say("GEMMs alone")
    big_alone, med_alone = big_gemm.alone(window), med_gemm.alone(window)
    say(f"ceilings {ceil}")
    rows.append(BenchRow(sec, "GEMM 8192^3 bf16 alone", big_alone, "TFLOP/s"))
    rows.append(BenchRow(sec, "GEMM 4096x4096x14336 bf16 alone (thread)", med_alone, "TFLOP/s"))
    with big_gemm:
        c_big = contig.stream_rate(window)
    rows.append(BenchRow(sec, "store D2H under GEMM 8192^3", c_big, "GB/s", ceil["store"],
                         f"GEMM {100 * (1 - big_gemm.rate / big_alone):+.1f}% slower"))

    ids = _JobIds()
    one_alloc = _Setup(
        "32 KiB pages, layers in one allocation",
        list(torch.randn(LAYERS, 2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=dev).unbind(0)),
        block_dim=1, chunks=CHUNKS, seed=1,
    )
    # (setup, strategy, streams, submit threads, issuer threads); None = the default.
    # "auto" is what a worker gets by default: staged for the 32 KiB pages, plain DMA for
    # the 2 MiB ones; "dma" beside it is one copy per page (or a pitched copy per block).
    # "issuer thread" is the default worker with WorkerOptions(issue_thread=True).
    runs: list[tuple[_Setup, str, int, int | None, bool]] = [
        (per_layer, "auto", 0, None, False), (per_layer, "auto", 0, None, True),
        (per_layer, "dma", 0, None, False), (per_layer, "kernel", 0, None, False),
        (one_alloc, "auto", 0, None, False), (one_alloc, "dma", 0, None, False),
        (big, "auto", 0, None, False), (big, "auto", 0, None, True), (big, "staged", 0, None, False),
        (big, "kernel", 0, None, False),
    ]
    if not quick:
        runs += [(per_layer, "dma", 0, 0, False)] + [(per_layer, "dma", n, None, False) for n in (1, 4, 32)]
    for setup, name, streams, threads, issuer in runs:
        label = f"{name} x{streams} streams" if streams else name
        if name == "dma" and threads is not None:
            label += f", {threads} submit threads" if threads else ", no submit threads"
        if issuer:
            label += ", issuer thread"
        say(f"{setup.name}: {label}")
        sec = f"{setup.name}, {label}"

        async def body(worker: Any, setup: _Setup = setup, sec: str = sec, label: str = label,
                       full: bool = not streams, name: str = name) -> list[BenchRow]:
            out = []
            page = setup.kv.group_data_refs[0][0].page_size_bytes

            def add(fig: str, value: float, unit: str, ceiling: float | None, note: str = "") -> None:
                # A job's rate carries its page size, for --plot (one line per strategy).
                what = fig.split(",")[0]
                extra = ({"page_bytes": page, "direction": what, "strategy": f"{label} ({setup.name})"}
                         if fig.endswith("one job (device time)") else {})
                out.append(BenchRow(sec, fig, value, unit, ceiling, note, extra))

            async with worker:
                for what, store in (("store", True), ("load", False)):
                    top = ceil[what]
                    rate, _ = await _device_rate(worker, setup, store, reps, ids)
                    add(f"{what}, one job (device time)", rate, "GB/s", top)
                    if not full:
                        continue
                    jobs0, secs0, _ = _issued(worker, store)
                    s = await _stream(worker, setup, window, ids, store=store)
                    jobs1, secs1, _ = _issued(worker, store)
                    add(f"{what}, streamed idle (wall)", s["gbps"], "GB/s", top,
                        f"cpu {100 * s['cpu']:.1f}% of a core")
                    transfer_us = setup.job_bytes / rate / GB * 1e6
                    add(f"{what}, host submit per job", s["submit_p50"] * 1e6, "us", transfer_us,
                        f"ratio = share of transfer time; max {s['submit_max'] * 1e6:.0f} us")
                    if jobs1 > jobs0:
                        add(f"{what}, issue on the lane's thread per job",
                            (secs1 - secs0) / (jobs1 - jobs0) * 1e6, "us", transfer_us,
                            f"mean over {jobs1 - jobs0} jobs, after submit returned")
                    staged = bool(_staged_share(worker)[0])
                    if staged:  # chunk order only matters to the ring's DMAs
                        s = await _stream(worker, setup, window, ids, store=store, in_runs=True)
                        add(f"{what}, host submit per job, chunks in runs", s["submit_p50"] * 1e6, "us",
                            transfer_us, f"ratio = share of transfer time; the job's chunks are neighbours; "
                            f"streamed {s['gbps'] / top:.2f} of the ceiling")
                    for in_runs in (False, True) if staged else (False,):
                        warm, cold = await _bursts(worker, setup, store, ids, in_runs)
                        runs_note = ", chunks in runs" if in_runs else ""
                        add(f"{what}, host submit per job, back to back{runs_note}", warm * 1e6, "us",
                            transfer_us,
                            f"ratio = share of transfer time; 2nd-4th of bursts of 4 (a core kept busy); "
                            f"each burst's first, after an await: {cold * 1e6:.0f} us")
                    for gname, gemm, alone in (("GEMM 8192^3", big_gemm, big_alone),
                                               ("medium GEMMs (thread)", med_gemm, med_alone)):
                        with gemm:
                            s = await _stream(worker, setup, window, ids, store=store)
                        add(f"{what}, under {gname}", s["gbps"], "GB/s", top,
                            f"GEMM {100 * (1 - gemm.rate / alone):+.1f}% slower")
                if full:
                    s = await _stream(worker, setup, window, ids, both=True, depth=4)
                    add("both directions at once (sum, wall)", s["gbps"], "GB/s", ceil["both"])
                    c0 = _issued(worker)[2]
                    s = await _stream(worker, setup, window, ids, store=True, depth=1)
                    issuing = (_issued(worker)[2] - c0) / s["wall"]
                    add("CPU while awaiting long transfers", 100 * s["cpu"], "% core", None,
                        "one job in flight at a time, submits included"
                        + (f"; {100 * issuing:.1f}% of it the issuer thread's" if issuing else ""))
                if name == "dma":
                    jobs, how = _pitched_share(worker)
                    add("jobs sent as pitched (2D) copies", jobs, "jobs", None, how)
                elif name in ("auto", "staged"):
                    jobs, how = _staged_share(worker)
                    add("jobs through the staging ring", jobs, "jobs", None, how)
            return out

        try:  # building the worker too: an explicit strategy may refuse this machine
            rows += asyncio.run(body(setup.worker(name, streams, threads, issue_thread=issuer)))
        except Exception as exc:  # keep the rest of the run; the row says what broke
            rows.append(BenchRow(sec, "FAILED", 0.0, "", None, repr(exc)[:200], failed=True))
        say("\n".join(f"  {r.name}: {r.value:.2f} {r.unit} ratio={r.ratio} {r.note}"
                      for r in rows if r.section == sec))
    say("wake-up latency")
    sec = "completion wake-up (one job in flight; asyncio unless the row names its loop)"
    long_iters = 50 if quick else 200
    tiny_iters = 100 if quick else 400
    beside = ", a busy Python thread beside"
    wake_runs: list[tuple[str, Callable[[], Any]]] = [
        ("4 KiB job", lambda: _tiny_wakeups(tiny_iters)),
        ("32 KiB-page job (default worker)", lambda: _long_wakeups(per_layer, long_iters)),
        ("2 MiB-page job (default worker)", lambda: _long_wakeups(big, long_iters)),
        ("32 KiB-page job, no doorbell", lambda: _long_wakeups(per_layer, long_iters, doorbell=False)),
        ("2 MiB-page job, no doorbell", lambda: _long_wakeups(big, long_iters, doorbell=False)),
        ("2 MiB-page job" + beside, lambda: _long_wakeups(big, long_iters // 2, busy=True)),
        ("32 KiB-page job" + beside, lambda: _long_wakeups(per_layer, long_iters // 2, busy=True)),
        ("32 KiB-page job, issuer thread" + beside,
         lambda: _long_wakeups(per_layer, long_iters // 2, busy=True, issue_thread=True)),
        ("32 KiB-page job, chunks in runs" + beside,
         lambda: _long_wakeups(per_layer, long_iters // 2, busy=True, in_runs=True)),
    ]
    for loop in OTHER_LOOPS:
        wake_runs += [
            (f"4 KiB job on {loop}", functools.partial(_tiny_wakeups, tiny_iters)),
            (f"2 MiB-page job on {loop}", functools.partial(_long_wakeups, big, long_iters)),
        ]
    for label, run in wake_runs:
        loop = next((name for name in OTHER_LOOPS if label.endswith(f" on {name}")), "asyncio")
        if not loop_available(loop):
            rows.append(BenchRow(sec, f"{label}: skipped", 0.0, "", None, f"{loop} is not installed"))
            continue
        try:
            w = run_on_loop(loop, run)
        except Exception as exc:
            rows.append(BenchRow(sec, f"{label}: FAILED", 0.0, "", None, repr(exc)[:200], failed=True))
            continue
        rows += [
            BenchRow(sec, f"{label}: wake-up p50", w["wake50"] * 1e6, "us", None,
                     "upper bound: min(last poll that saw it running -> await returns, "
                     "enqueue -> await returns - device time); "
                     f"median poll window {w['window50'] * 1e6:.0f} us"),
            BenchRow(sec, f"{label}: wake-up p99", w["wake99"] * 1e6, "us"),
            BenchRow(sec, f"{label}: round trip p50", w["trip50"] * 1e6, "us", None,
                     f"submit {w['submit'] * 1e6:.0f} us, device time {w['device'] * 1e6:.0f} us"),
            BenchRow(sec, f"{label}: round trip p99", w["trip99"] * 1e6, "us"),
        ]
        if not label.endswith(beside):  # there, the process CPU is mostly the busy thread's
            note = (f"process CPU between submit return and await return, less the issuer thread's "
                    f"{w['issue_job'] * 1e6:.0f} us: {w['cpu_job'] * 1e6:.0f} us "
                    f"per job over a {w['await'] * 1e6:.0f} us await; {w['polls']:.0f} polls per job")
            cpu = 100 * w["cpu_wait"]
            rows.append(BenchRow(sec, f"{label}: CPU while awaiting", cpu, "% core", None, note))
    say("baselines")
    try:
        rows += _baselines(per_layer, reps, ceil)
    except Exception as exc:
        rows.append(BenchRow("baselines (32 KiB pages)", "FAILED", 0.0, "", None, repr(exc)[:200],
                             failed=True))
    say("ceilings again")
    _raise_ceilings(rows, ceil, contig.rates(reps))
    return rows


def _raise_ceilings(rows: list[BenchRow], first: dict[str, float], again: dict[str, float]) -> None:
    """Ceilings are the better of the run's first and last measurement (shared machines
    drift); every ratio is recomputed against it, so no figure is flattered by a slow start."""
    names = {"store": "store D2H", "load": "load H2D", "both": "both directions at once (sum)"}
    for key, label in names.items():
        best = max(first[key], again[key])
        for row in rows:
            if row.ceiling == first[key]:
                row.ceiling = best
            if row.section.startswith("ceilings") and row.name == label:
                row.value = best
                row.note = f"best of start {first[key]:.2f} / end {again[key]:.2f} GB/s"
