"""Where the staged per-layer job's host submit goes, call by call: every ``Driver`` method
and the staged strategy's own steps, timed by wrappers over many jobs (one in flight at a
time, issued by the caller), printed as microseconds per job with call counts, beside the
whole ``submit_*``; what no wrapper covers is Python between the calls. Only calls made
inside ``submit_*`` count (not the poller's while awaiting). Jobs with random chunks (the
bench's) and with neighbouring chunks.

Run on the GPU machine from the repo root: python3 probes/probe_enqueue.py [jobs, default 60]
"""

import asyncio
import functools
import statistics
import sys
import time
from collections import defaultdict

import torch
from _setups import per_layer

from aiokv.backends import cuda as cuda_backend
from aiokv.bench import cuda as b
from aiokv.copy import pieces, staged

DRIVER_CALLS = ("ensure_context", "check_usable", "take_job_events", "take_sync_event", "record",
                "stream_wait", "memcpy_batch", "memcpy_batch_at", "memcpy", "launch", "query")


SUBMITTING = [False]  # count only calls made inside submit_*, not the poller's while awaiting


def timed(table: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not SUBMITTING[0]:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = table[name]
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
    return wrapper


async def run(setup: b._Setup, store: bool, jobs: int, in_runs: bool) -> str:
    table: dict = defaultdict(lambda: [0.0, 0])
    ids = b._JobIds()
    async with setup.worker("auto") as w:
        for k in range(5):  # warm: ring, tables, events
            await b._submit(w, setup, store, k, ids, in_runs)
        drv = w._core.backend.driver
        saved = {}
        for name in DRIVER_CALLS:
            saved[name] = getattr(drv, name)
            setattr(drv, name, timed(table, f"drv.{name}", saved[name]))
        lane = next(lane for lane in w._core.backend._lanes if lane.direction.to_host == store)
        strat = lane._strategy
        strat.prepare = timed(table, "strategy.prepare (incl. calls)", strat.prepare)
        strat.enqueue = timed(table, "strategy.enqueue (incl. calls)", strat.enqueue)
        strat.kernel.upload = timed(table, "kernel.upload (incl. calls)", strat.kernel.upload)
        backend = w._core.backend
        backend.capture = timed(table, "backend.capture (incl. calls)", backend.capture)
        submits = []
        for k in range(jobs):
            SUBMITTING[0] = True
            t0 = time.perf_counter()
            fut = b._submit(w, setup, store, k, ids, in_runs)
            submits.append(time.perf_counter() - t0)
            SUBMITTING[0] = False
            await fut
        for name, fn in saved.items():
            setattr(drv, name, fn)
    lines = [f"{'store' if store else 'load'}, chunks {'in runs' if in_runs else 'random'}: submit median "
             f"{statistics.median(submits) * 1e6:.0f} us, mean {statistics.mean(submits) * 1e6:.0f} us"]
    for name, (secs, calls) in sorted(table.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name:34} {secs / jobs * 1e6:7.1f} us/job  {calls / jobs:5.1f} calls/job")
    return "\n".join(lines)


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    setup = per_layer(torch.device("cuda"))
    print(f"slot {staged.SLOTS} x ring; GIL held up to {cuda_backend.GIL_HELD_DESCRIPTORS} descriptors; "
          f"MAX_CTAS {pieces.MAX_CTAS}", flush=True)
    for in_runs in (False, True):
        for store in (True, False):
            print(asyncio.run(run(setup, store, jobs, in_runs)), flush=True)


if __name__ == "__main__":
    main()
