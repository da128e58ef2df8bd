"""Where a job's host submit time goes, and the floor the driver calls alone set.

For the bench's 2 MiB-page job and its pitched 32 KiB-page job (layers in one allocation),
times each phase of ``submit_store`` separately over many jobs (median, us):

- plan: ``map_blocks`` + ``plan_copies`` (validation and the page plan, numpy);
- capture: recording the dependency event on the current torch stream;
- prepare: the strategy's pointer arrays / pitched rows and the cut between streams;
- enqueue: the driver calls (waits, start/stop records, fork/join, batched copies);
- whole: ``AsyncOffloadingWorker.submit_store`` end to end, for comparison.

Then the floor: the same descriptors issued by one batched call on one stream with no
events at all, and single ``cuEventRecord`` / ``cuStreamWaitEvent`` calls, to show how much
of the submit no Python-side change can remove: the record through cuda-python and through
ctypes (the backend's way), and torch's current stream looked up as a raw handle (the
backend's way), by index, or inside ``torch.cuda.device()``. Run on the GPU machine from
the repo root:
``python3 probes/probe_submit.py [jobs, default 200]``.
"""

import asyncio
import statistics
import sys
import time

import torch
from _setups import one_alloc, two_mib
from cuda.bindings import driver as cu

from aiokv.backends.cuda import _current_stream
from aiokv.bench import cuda as b
from aiokv.plan import map_blocks, plan_copies


def _us(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:8.1f}"


def phases(setup: b._Setup, jobs: int) -> None:
    async def go() -> None:
        ids = b._JobIds()
        async with setup.worker("auto") as w:
            core = w._core
            lane = core.handlers[next(iter(core.handlers))].lane
            for d, h in core.handlers.items():
                if d.to_host:
                    lane = h.lane
            strat, drv = lane._strategy, lane._driver
            cols: dict[str, list[float]] = {k: [] for k in ("plan", "capture", "prepare", "enqueue", "whole")}
            floor: dict[str, list[float]] = {
                k: []
                for k in ("one call", "record", "wait", "cuda-python record", "raw stream", "stream",
                          "stream in device()")
            }
            for k in range(jobs + 5):
                blocks, chunks = setup.jobs[k % len(setup.jobs)]
                t0 = time.perf_counter()
                mapping = map_blocks(blocks, chunks, layout=core.layout, num_chunks=core.num_cpu_chunks,
                                     unique_host=True)
                plan = plan_copies(mapping, core.layout)
                _ = plan.num_pages
                t1 = time.perf_counter()
                dep = core.backend.capture(None)
                t2 = time.perf_counter()
                prepared = strat.prepare(plan)
                t3 = time.perf_counter()
                ev = drv.take_job_events()
                t3b = time.perf_counter()
                strat.enqueue(prepared, dep.event, ev.start, ev.stop)  # stop marks the end
                t4 = time.perf_counter()
                drv.synchronize(ev.done)
                drv.give_job_events(ev)
                drv.give_sync_event(dep.event)
                # The floor: every descriptor in one call on one stream, nothing else.
                if hasattr(prepared, "ops"):
                    f0 = time.perf_counter()
                    drv.memcpy_pitched(prepared.ops, lane.stream)
                else:
                    f0 = time.perf_counter()
                    drv.memcpy_batch(prepared.dst, prepared.src, prepared.sizes, lane.stream, to_host=True)
                f1 = time.perf_counter()
                drv.record(ev.done, lane.stream)
                f2 = time.perf_counter()
                drv.stream_wait(lane.stream, ev.done)
                f3 = time.perf_counter()
                cu.cuEventRecord(ev.done, lane.stream)
                f4 = time.perf_counter()
                _ = _current_stream(0)
                f4b = time.perf_counter()
                _ = torch.cuda.current_stream(0).cuda_stream
                f5 = time.perf_counter()
                with torch.cuda.device(0):
                    _ = torch.cuda.current_stream().cuda_stream
                f6 = time.perf_counter()
                drv.stream_synchronize(lane.stream)
                s0 = time.perf_counter()
                fut = b._submit(w, setup, True, k, ids)
                s1 = time.perf_counter()
                await fut
                if k >= 5:
                    for name, dt in (("plan", t1 - t0), ("capture", t2 - t1), ("prepare", t3 - t2),
                                     ("enqueue", t4 - t3b), ("whole", s1 - s0)):
                        cols[name].append(dt)
                    for name, dt in (("one call", f1 - f0), ("record", f2 - f1), ("wait", f3 - f2),
                                     ("cuda-python record", f4 - f3), ("raw stream", f4b - f4),
                                     ("stream", f5 - f4b),
                                     ("stream in device()", f6 - f5)):
                        floor[name].append(dt)
            parts = len(getattr(prepared, "bounds", [0, 0])) - 1
            n = prepared.ops.shape[0] if hasattr(prepared, "ops") else prepared.sizes.shape[0]
            kind = "pitched ops" if hasattr(prepared, "ops") else "descriptors"
            print(f"== {setup.name}: {n} {kind} over {parts} stream(s), {setup.job_bytes / 1e6:.0f} MB/job")
            print("  " + " ".join(f"{k:>8}" for k in cols))
            print("  " + " ".join(_us(v) for v in cols.values()))
            print("  floor: " + ", ".join(f"{k} {_us(v).strip()} us" for k, v in floor.items()))

    asyncio.run(go())


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    dev = torch.device("cuda")
    for setup in (two_mib(dev), one_alloc(dev)):
        phases(setup, jobs)


if __name__ == "__main__":
    main()
