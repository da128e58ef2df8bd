"""A 1-block job's submit and ``await`` on the async face, measured without a GPU: a
CUDA worker on no-op drivers (``hostside.noop_cuda``, native path) whose job's end event
reads complete ``delay`` after ``submit_store`` returned, so the time from that end to the
awaiting task running again (the wake-up), the round trip and the process CPU per job
are aiokv's and the event loop's own work (docs/performance.md, "Host side").

With no delay the job is over before its await begins, as a 4 KiB copy can be on a GPU
when the submit outlasts it; longer delays leave the end to the poller's spinning turns.

    PYTHONPATH=$PWD python -m aiokv.bench.hostside_await --jobs 2000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from .. import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec
from .hostside import noop_cuda, tiny_kv

__all__ = ["await_figures", "main"]

_WARMUP = 100


async def _run(jobs: int, delay: float) -> dict[str, float]:
    end = [0.0]
    with noop_cuda():
        worker = AsyncOffloadingWorker(tiny_kv(), num_cpu_chunks=64, backend="cuda", options={"native": True})
    for handler in worker._core.handlers.values():  # the end event completes at ``end``
        handler.lane._driver.query = lambda _event: time.perf_counter() >= end[0]  # type: ignore[attr-defined]
    wakes, trips, subs = [], [], []
    async with worker:
        cpu0 = time.process_time()
        for i in range(jobs + _WARMUP):
            end[0] = float("inf")
            t0 = time.perf_counter()
            fut = worker.submit_store(i, GPULoadStoreSpec([i % 64]), CPULoadStoreSpec([i % 64]))
            t1 = time.perf_counter()
            end[0] = t1 + delay
            await fut
            t2 = time.perf_counter()
            if i == _WARMUP - 1:
                cpu0 = time.process_time()
            if i >= _WARMUP:
                wakes.append(t2 - end[0])
                trips.append(t2 - t0)
                subs.append(t1 - t0)
        cpu = time.process_time() - cpu0
    return {"wake50": statistics.median(wakes), "trip50": statistics.median(trips),
            "submit50": statistics.median(subs), "cpu_job": cpu / jobs}


def await_figures(jobs: int = 2000,
                  delays: tuple[float, ...] = (0.0, 20e-6)) -> dict[float, dict[str, float]]:
    """Per end delay (seconds after the submit returned): median wake-up, round trip and
    submit, and process CPU per job."""
    return {delay: asyncio.run(_run(jobs, delay)) for delay in delays}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--delays-us", type=float, nargs="+", default=[0.0, 5.0, 20.0, 50.0])
    args = parser.parse_args(argv)
    figures = await_figures(args.jobs, tuple(d * 1e-6 for d in args.delays_us))
    print("end after submit | wake-up p50 | round trip p50 | submit p50 | CPU per job")
    for delay, f in figures.items():
        print(f"{delay * 1e6:7.0f} us | {f['wake50'] * 1e6:8.1f} us | {f['trip50'] * 1e6:8.1f} us | "
              f"{f['submit50'] * 1e6:6.1f} us | {f['cpu_job'] * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
