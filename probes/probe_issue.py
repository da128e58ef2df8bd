"""The issuer thread on the bench's per-layer 32 KiB-page and 2 MiB-page jobs, one job in
flight at a time: the caller's submit, the hand-off (submit returned -> the issuer thread
starts on the job), the issuer's prepare and enqueue, and the round trip, with and without
the issuer thread, idle and beside a busy Python thread (medians, us).

Run on the GPU machine from the repo root: python3 probes/probe_issue.py [jobs, default 60]
"""

import asyncio
import contextlib
import statistics
import sys
import time

import torch
from _setups import per_layer, two_mib

from aiokv.bench import cuda as b


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e6:7.0f}" if xs else "      -"


async def one(setup: b._Setup, issue_thread: bool, busy: bool, jobs: int) -> str:
    ids = b._JobIds()
    async with setup.worker("auto", issue_thread=issue_thread) as w:
        lane = next(lane for lane in w._core.backend._lanes if lane.direction.to_host)
        strategy = lane._strategy
        marks: dict[str, float] = {}
        issue, prepare = lane._issue, strategy.prepare

        def timed_issue(*args):
            marks["entered"] = time.perf_counter()
            issue(*args)
            marks["issued"] = time.perf_counter()

        def timed_prepare(plan):
            out = prepare(plan)
            marks["prepared"] = time.perf_counter()
            return out

        lane._issue, strategy.prepare = timed_issue, timed_prepare
        cols: dict[str, list[float]] = {k: [] for k in ("submit", "hand-off", "prepare", "enqueue", "trip")}
        with b._BusyThread() if busy else contextlib.nullcontext():
            for k in range(jobs + 5):
                marks.clear()
                t0 = time.perf_counter()
                fut = b._submit(w, setup, True, k, ids)
                t1 = time.perf_counter()
                await fut
                t2 = time.perf_counter()
                if k < 5:
                    continue
                cols["submit"].append(t1 - t0)
                if issue_thread and marks["entered"] > t1:  # issued by the thread
                    cols["hand-off"].append(marks["entered"] - t1)
                cols["prepare"].append(marks["prepared"] - marks["entered"])
                cols["enqueue"].append(marks["issued"] - marks["prepared"])
                cols["trip"].append(t2 - t0)
    label = f"{setup.name:14} {'issuer' if issue_thread else 'caller':6} {'busy' if busy else 'idle'}"
    return label + " " + " ".join(med(v) for v in cols.values())


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    dev = torch.device("cuda")
    print(f"{'job':14} {'issue':6} {'host':4} " + " ".join(f"{k:>7}" for k in
          ("submit", "hand-off", "prepare", "enqueue", "trip")), flush=True)
    for setup in (per_layer(dev), two_mib(dev)):
        for busy in (False, True):
            for issue_thread in (True, False):
                n = jobs if not busy else max(10, jobs // 3)
                print(asyncio.run(one(setup, issue_thread, busy, n)), flush=True)


if __name__ == "__main__":
    main()
