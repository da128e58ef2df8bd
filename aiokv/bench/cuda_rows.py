"""The CUDA benchmark's strategy rows: for one KV layout and one worker configuration,
device GB/s of single jobs, streamed GB/s idle and under GEMM loads, host submit time per
job, and how many jobs took each copy path, read from ``WorkerStatistics.lanes``."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..backends.base import LaneStatistics
from ..specs import Direction
from .cuda_setup import GB, BenchSetup, Gemm, JobIds, submit_job
from .report import BenchRow

__all__ = [
    "Conditions", "bursts", "device_rate", "issued", "lane_statistics", "pitched_share",
    "staged_share", "strategy_rows", "stream_jobs",
]


@dataclass(frozen=True)
class Conditions:
    """What every strategy run shares: the ceilings, the GEMM loads with their rates
    alone, the job ids, and how long and how often to measure."""

    ceilings: dict[str, float]
    big_gemm: Gemm
    big_alone: float
    medium_gemm: Gemm
    medium_alone: float
    ids: JobIds
    reps: int
    window: float


def lane_statistics(worker: Any, store: bool | None = None) -> list[LaneStatistics]:
    """The worker's lanes (one direction, or all) as ``WorkerStatistics.lanes`` reports them."""
    lanes = worker.statistics().lanes
    return [lane for d, lane in lanes.items() if store is None or Direction(d).to_host == store]


def pitched_share(worker: Any) -> tuple[int, str]:
    """How many jobs went as pitched copies, and the run heights the layout allows."""
    lanes = lane_statistics(worker)
    heights = sorted({h for lane in lanes for h in lane.pitched_heights})
    how = f"runs of {heights} pages" if heights else "no uniform pitch"
    return sum(lane.pitched_jobs for lane in lanes), how


def staged_share(worker: Any) -> tuple[int, str]:
    """How many jobs went through a staging ring (the rest went as plain DMA)."""
    lanes = worker.statistics().lanes
    paths = {d: lane.strategy for d, lane in lanes.items()}
    return sum(lane.staged_jobs for lane in lanes.values()), f"lanes: {paths}"


def issued(worker: Any, store: bool | None = None) -> tuple[int, float, float]:
    """Jobs the lanes' issuer threads enqueued (in one direction, or both), their host
    seconds, and the CPU seconds those threads spent on them."""
    lanes = lane_statistics(worker, store)
    return (sum(lane.issued_later for lane in lanes), sum(lane.issue_seconds for lane in lanes),
            sum(lane.issue_cpu_seconds for lane in lanes))


async def device_rate(
    worker: Any, setup: BenchSetup, store: bool, reps: int, ids: JobIds
) -> tuple[float, float]:
    """Median GB/s of single jobs by device time, and median host submit seconds."""
    times, submits = [], []
    for k in range(reps + 1):
        t0 = time.perf_counter()
        fut = submit_job(worker, setup, store, k, ids)
        submits.append(time.perf_counter() - t0)
        res = await fut
        times.append(res.transfer_time)
    return setup.job_bytes / statistics.median(times[1:]) / GB, statistics.median(submits[1:])


async def stream_jobs(
    worker: Any, setup: BenchSetup, seconds: float, ids: JobIds, store: bool = True, depth: int = 2,
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
                inflight.append(submit_job(worker, setup, True, k, ids))
                inflight.append(submit_job(worker, setup, False, k + 1, ids))
            else:
                inflight.append(submit_job(worker, setup, store, k, ids, in_runs))
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


async def bursts(
    worker: Any, setup: BenchSetup, store: bool, ids: JobIds, in_runs: bool = False, bursts: int = 8,
    size: int = 4, clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Median host submit seconds of jobs submitted back to back (the 2nd to last of each
    burst of ``size``), and of each burst's first, which follows an ``await``. A submit
    after an await costs more than one right after another (likely its code and data have
    left the caches; a sleeping core does not explain it), so the bench reports both."""
    warm: list[float] = []
    cold: list[float] = []
    for _ in range(bursts):
        futs = []
        for k in range(size):
            t0 = clock()
            futs.append(submit_job(worker, setup, store, k, ids, in_runs))
            (cold if k == 0 else warm).append(clock() - t0)
        for fut in futs:
            await fut
    return statistics.median(warm), statistics.median(cold)


async def _measure(worker: Any, setup: BenchSetup, name: str, sec: str, label: str, full: bool,
                   env: Conditions) -> list[BenchRow]:
    """Every figure of one strategy run on an unopened ``worker`` (see ``strategy_rows``)."""
    ceil, ids, reps, window = env.ceilings, env.ids, env.reps, env.window
    out: list[BenchRow] = []
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
            rate, _ = await device_rate(worker, setup, store, reps, ids)
            add(f"{what}, one job (device time)", rate, "GB/s", top)
            if not full:
                continue
            jobs0, secs0, _ = issued(worker, store)
            s = await stream_jobs(worker, setup, window, ids, store=store)
            jobs1, secs1, _ = issued(worker, store)
            add(f"{what}, streamed idle (wall)", s["gbps"], "GB/s", top,
                f"cpu {100 * s['cpu']:.1f}% of a core")
            transfer_us = setup.job_bytes / rate / GB * 1e6
            add(f"{what}, host submit per job", s["submit_p50"] * 1e6, "us", transfer_us,
                f"ratio = share of transfer time; max {s['submit_max'] * 1e6:.0f} us")
            if jobs1 > jobs0:
                add(f"{what}, issue on the lane's thread per job",
                    (secs1 - secs0) / (jobs1 - jobs0) * 1e6, "us", transfer_us,
                    f"mean over {jobs1 - jobs0} jobs, after submit returned")
            staged = bool(staged_share(worker)[0])
            if staged:  # chunk order only matters to the ring's DMAs
                s = await stream_jobs(worker, setup, window, ids, store=store, in_runs=True)
                add(f"{what}, host submit per job, chunks in runs", s["submit_p50"] * 1e6, "us",
                    transfer_us, f"ratio = share of transfer time; the job's chunks are neighbours; "
                    f"streamed {s['gbps'] / top:.2f} of the ceiling")
            for in_runs in (False, True) if staged else (False,):
                warm, cold = await bursts(worker, setup, store, ids, in_runs)
                runs_note = ", chunks in runs" if in_runs else ""
                add(f"{what}, host submit per job, back to back{runs_note}", warm * 1e6, "us",
                    transfer_us,
                    f"ratio = share of transfer time; 2nd-4th of bursts of 4 (a core kept busy); "
                    f"each burst's first, after an await: {cold * 1e6:.0f} us")
            for gname, gemm, alone in (("GEMM 8192^3", env.big_gemm, env.big_alone),
                                       ("medium GEMMs (thread)", env.medium_gemm, env.medium_alone)):
                with gemm:
                    s = await stream_jobs(worker, setup, window, ids, store=store)
                add(f"{what}, under {gname}", s["gbps"], "GB/s", top,
                    f"GEMM {100 * (1 - gemm.rate / alone):+.1f}% slower")
        if full:
            s = await stream_jobs(worker, setup, window, ids, both=True, depth=4)
            add("both directions at once (sum, wall)", s["gbps"], "GB/s", ceil["both"])
            c0 = issued(worker)[2]
            s = await stream_jobs(worker, setup, window, ids, store=True, depth=1)
            issuing = (issued(worker)[2] - c0) / s["wall"]
            add("CPU while awaiting long transfers", 100 * s["cpu"], "% core", None,
                "one job in flight at a time, submits included"
                + (f"; {100 * issuing:.1f}% of it the issuer thread's" if issuing else ""))
        if name == "dma":
            jobs, how = pitched_share(worker)
            add("jobs sent as pitched (2D) copies", jobs, "jobs", None, how)
        elif name in ("auto", "staged"):
            jobs, how = staged_share(worker)
            add("jobs through the staging ring", jobs, "jobs", None, how)
    return out


def strategy_rows(setup: BenchSetup, name: str, streams: int, threads: int | None, issuer: bool,
                  env: Conditions, say: Callable[[str], None]) -> list[BenchRow]:
    """One strategy run: ``name`` on ``streams`` streams (0: the default, and the full set
    of figures), ``threads`` submit threads (None: the default), with the issuer thread
    or not. A run that fails becomes one FAILED row."""
    label = f"{name} x{streams} streams" if streams else name
    if name == "dma" and threads is not None:
        label += f", {threads} submit threads" if threads else ", no submit threads"
    if issuer:
        label += ", Python issuer thread"
    say(f"{setup.name}: {label}")
    sec = f"{setup.name}, {label}"
    try:  # building the worker too: an explicit strategy may refuse this machine
        worker = setup.worker(name, streams, threads, issue_thread=issuer)
        rows = asyncio.run(_measure(worker, setup, name, sec, label, not streams, env))
    except Exception as exc:  # keep the rest of the run; the row says what broke
        rows = [BenchRow(sec, "FAILED", None, "", None, repr(exc)[:200], failed=True)]
    say("\n".join(f"  {r.name}: {'-' if r.value is None else f'{r.value:.2f}'} {r.unit} ratio={r.ratio} "
                  f"{r.note}" for r in rows))
    return rows
