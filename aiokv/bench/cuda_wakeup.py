"""The CUDA benchmark's completion rows: one job in flight at a time, how long after the
device finishes the awaiting coroutine runs again, the round trip, and the CPU spent while
awaiting, on asyncio and (where installed) uvloop and trio.

Reads only documented records: ``AsyncOffloadingWorker.poller_statistics()`` (polls and
poll windows) and ``WorkerStatistics.lanes`` (when the copies were handed to the device, and
the issuer threads' CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
import numpy as np
import torch

from .. import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from .cuda_rows import bursts, device_rate, issued
from .cuda_setup import BenchSetup, BusyThread, JobIds, submit_job
from .report import BenchRow

__all__ = ["OTHER_LOOPS", "loop_available", "native_rows", "run_on_loop", "wakeup_rows"]

T = TypeVar("T")

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


async def _wakeups(worker: Any, submit: Callable[[int], Any], iters: int) -> dict[str, float]:
    """One store at a time: submit time, round trip, wake-up and CPU spent while awaiting.

    Wake-up (device end -> the awaiting coroutine runs again) is bounded from above two
    ways, and the smaller bound is reported per job: (a) from the last poll that found the
    job not done (or its launch) to the await returning (the poller's latest detect window,
    ``PollerStatistics.detect_windows``, plus the hop from the poller resolving the future
    to the task resuming), tight when the poller spins; (b) from when the copies were
    handed to the device (``LaneStatistics.last_started_at``, after planning) to the await
    returning, minus their device time, tight when the poller napped and the doorbell woke
    it. ``worker`` is an open ``AsyncOffloadingWorker``.
    """
    subs, trips, wakes, windows, dev = [], [], [], [], []
    cpu = wall = 0.0
    resolved: list[float] = []
    polls = 0
    issuing = 0.0  # CPU the lanes' issuer threads spent enqueueing (submit work, moved)
    for i in range(iters + 10):
        resolved.clear()
        # Snapshots before the submit, so that none of their cost lands between the submit
        # and the await. Nothing polls in between: the poller runs on this loop, which only
        # gets control back at the await.
        i1 = issued(worker)[2]
        p1 = worker.poller_statistics().polls
        t0 = time.perf_counter()
        fut = submit(i)
        t1 = time.perf_counter()
        fut.add_done_callback(lambda _f: resolved.append(time.perf_counter()))
        c1 = time.process_time()
        res = await fut
        t2 = time.perf_counter()
        c2 = time.process_time()
        stats = worker.statistics()
        i2 = sum(lane.issue_cpu_seconds for lane in stats.lanes.values())
        if i < 10:
            continue
        poller = worker.poller_statistics()
        window = poller.detect_windows[-1]
        started = stats.lanes["store"].last_started_at
        subs.append(t1 - t0)
        trips.append(t2 - t0)
        hop = t2 - resolved[0] if resolved else 0.0
        device = res.transfer_time or 0.0
        bound = window + hop
        wakes.append(min(bound, t2 - started - device) if device and started is not None else bound)
        windows.append(window)
        polls += poller.polls - p1
        dev.append(res.transfer_time or 0.0)
        cpu += c2 - c1 - (i2 - i1)
        issuing += i2 - i1
        wall += t2 - t1
    return {
        "submit": _p(subs, 50), "trip50": _p(trips, 50), "trip99": _p(trips, 99),
        "wake50": _p(wakes, 50), "wake99": _p(wakes, 99), "device": _p(dev, 50),
        "window50": _p(windows, 50),
        "polls": polls / max(1, len(trips)),
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
    setup: BenchSetup, iters: int, doorbell: bool = True, busy: bool = False, issue_thread: bool = False,
    in_runs: bool = False,
) -> dict[str, float]:
    ids = JobIds()
    async with setup.worker("auto", doorbell=doorbell, issue_thread=issue_thread) as w:
        with BusyThread() if busy else contextlib.nullcontext():
            return await _wakeups(w, lambda i: submit_job(w, setup, True, i, ids, in_runs), iters)


def wakeup_rows(per_layer: BenchSetup, big: BenchSetup, quick: bool) -> list[BenchRow]:
    """Wake-up, round trip and CPU rows for a 4 KiB job, a per-layer (32 KiB-page) job and
    a 2 MiB-page job, with and without the doorbell, beside a busy Python thread, and on the
    other event loops."""
    rows: list[BenchRow] = []
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
        ("32 KiB-page job, Python issuer thread" + beside,
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
            rows.append(BenchRow.skipped(sec, f"{label}: skipped", f"{loop} is not installed"))
            continue
        try:
            w = run_on_loop(loop, run)
        except Exception as exc:
            rows.append(BenchRow(sec, f"{label}: FAILED", None, "", None, repr(exc)[:200], failed=True))
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
    return rows


async def _submit_path_figures(setup: BenchSetup, native: bool, busy: bool, quick: bool) -> dict[str, float]:
    """One submit path, idle or beside a busy Python thread: the per-layer job's host
    submit after an ``await`` and back to back with its device time, a 1-block job's round
    trip and wake-up, and (native) the issuer thread's lag on the per-layer jobs."""
    ids = JobIds()
    opts = {"strategy": "auto", "native": native}
    worker = AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend="cuda", options=opts)
    t = torch.randn(64, 1024, device="cuda").view(torch.uint8)
    tiny = AsyncOffloadingWorker(CanonicalKVCaches.from_tensors([t]), num_cpu_chunks=64, backend="cuda",
                                 options={"native": native})
    async with worker, tiny:
        with BusyThread() if busy else contextlib.nullcontext():
            rate, _ = await device_rate(worker, setup, True, 3, ids)
            warm, cold = await bursts(worker, setup, True, ids, bursts=4 if quick else 8)
            w = await _wakeups(
                tiny, lambda i: tiny.submit_store(i, GPULoadStoreSpec([i % 64]), CPULoadStoreSpec([i % 64])),
                100 if quick else 400)
        # Lags of the jobs the issuer thread ran (a job run at submit waited for nothing: 0).
        lags = [lag for lane in worker.statistics().lanes.values() for lag in lane.issue_lags if lag > 0]
        pickups, spun, issued = _pickups(worker)
    return {"transfer": setup.job_bytes / rate / 1e9, "warm": warm, "cold": cold,
            "lag50": _p(lags, 50), "lag99": _p(lags, 99), "lags": float(len(lags)),
            "pick50": _p(pickups, 50), "pick99": _p(pickups, 99), "spun": spun, "issued": issued, **w}


def _pickups(worker: Any) -> tuple[list[float], float, float]:
    """The native issuer threads' pickup lags (a lag less any wait behind the program
    before: the thread's own wake-up or spin), the programs they found while spinning and
    the programs they issued (the per-layer worker's lanes; none on the Python path)."""
    pickups: list[float] = []
    spun = issued = 0.0
    for handler in worker._core.handlers.values():
        issuer = getattr(handler.lane, "native", None)
        if issuer is None:
            continue
        pickups += [lag for lag in issuer.lags(True) if lag > 0]
        stats = issuer.stats()
        spun += float(stats.get("spin_picked", 0))
        issued += float(stats.get("issued", 0)) - float(stats.get("inline", 0))
    return pickups, spun, issued


def native_rows(per_layer: BenchSetup, quick: bool) -> list[BenchRow]:
    """The native submit path beside the Python one, in the same run: host submit as a
    share of the per-layer job's transfer (after an ``await``, back to back), a 1-block
    job's round trip p50/p99 and wake-up p50, idle and beside a busy Python thread, and the
    native issuer thread's own lag (submit return -> its first driver call for the job)."""
    from ..backends.cuda import native

    sec = "submit path: native issuer beside the Python path (store, asyncio)"
    # Measured beside the Python path whatever the default; only an explicit
    # AIOKV_NATIVE=0 (or a helper that is not built) leaves the native rows out.
    usable, why = native.status(None if os.environ.get(native.ENV) else True)
    if not usable:
        return [BenchRow.skipped(sec, "native rows: skipped", f"the native path is off here: {why}")]
    rows: list[BenchRow] = []
    idle: dict[str, float] = {}  # the native idle submits: beside a busy thread, held to 2x
    for busy in (False, True):
        where = ", a busy Python thread beside" if busy else ""
        for flag, name in ((True, "native"), (False, "python")):
            label = f"{name}{where}"
            try:
                f = asyncio.run(_submit_path_figures(per_layer, flag, busy, quick))
            except Exception as exc:
                rows.append(BenchRow(sec, f"{label}: FAILED", None, "", None, repr(exc)[:200], failed=True))
                continue
            transfer_us = f["transfer"] * 1e6
            # The default (native) path is held to issue 37's targets; the Python rows are
            # there to compare against.
            aim = _native_targets(transfer_us, busy, idle) if flag else {}
            if flag and not busy:
                idle.update(cold=f["cold"] * 1e6, warm=f["warm"] * 1e6)
            rows += [
                BenchRow(sec, f"{label}: per-layer job submit after an await", f["cold"] * 1e6, "us",
                         transfer_us, "ratio = share of the job's transfer (device time)",
                         target=aim.get("cold")),
                BenchRow(sec, f"{label}: per-layer job submit back to back", f["warm"] * 1e6, "us",
                         transfer_us, "ratio = share of the job's transfer; 2nd-4th of bursts of 4",
                         target=aim.get("warm")),
                BenchRow(sec, f"{label}: 1-block round trip p50", f["trip50"] * 1e6, "us", None,
                         f"submit {f['submit'] * 1e6:.0f} us, device {f['device'] * 1e6:.0f} us",
                         target=aim.get("trip50")),
                BenchRow(sec, f"{label}: 1-block round trip p99", f["trip99"] * 1e6, "us",
                         target=aim.get("trip99")),
                BenchRow(sec, f"{label}: 1-block wake-up p50", f["wake50"] * 1e6, "us", None,
                         "upper bound, as in the wake-up rows", target=aim.get("wake50")),
            ]
            if flag:
                rows += [
                    BenchRow(sec, f"{label}: issuer lag p50", f["lag50"] * 1e6, "us", None,
                             f"submit return -> the issuer thread's first driver call for the job, "
                             f"timed by the thread; {f['lags']:.0f} per-layer jobs", target=aim.get("lag50")),
                    BenchRow(sec, f"{label}: issuer lag p99", f["lag99"] * 1e6, "us"),
                    BenchRow(sec, f"{label}: issuer pickup lag p50", f["pick50"] * 1e6, "us", None,
                             "the lag less any wait behind the program before (back to back, the "
                             "thread is still issuing it): its own wake-up or spin; "
                             f"{f['spun']:.0f} of {f['issued']:.0f} programs found while it spun"),
                    BenchRow(sec, f"{label}: issuer pickup lag p99", f["pick99"] * 1e6, "us"),
                ]
    return rows


def _native_targets(transfer_us: float, busy: bool, idle: dict[str, float]) -> dict[str, tuple[str, float]]:
    """Issue 37's targets for the native rows: idle, a per-layer submit at most 2% of its
    transfer, a 1-block round trip p50 / p99 at most 50 / 150 us, its wake-up p50 20 us, the
    issuer's lag p50 20 us; beside a busy Python thread, submits at most twice their idle
    value and the wake-up p50 100 us."""
    if not busy:
        share = ("<=", 0.02 * transfer_us)
        return {"cold": share, "warm": share, "trip50": ("<=", 50.0), "trip99": ("<=", 150.0),
                "wake50": ("<=", 20.0), "lag50": ("<=", 20.0)}
    aim: dict[str, tuple[str, float]] = {"wake50": ("<=", 100.0)}
    for key in ("cold", "warm"):
        if key in idle:
            aim[key] = ("<=", 2 * idle[key])
    return aim
