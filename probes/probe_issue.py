"""The issuer thread on the bench's per-layer 32 KiB-page and 2 MiB-page jobs, one job in
flight at a time: the caller's submit, the hand-off (submit returned -> the issuer thread
starts on the job), the issuer's prepare and enqueue, and the round trip, with and without
the issuer thread, idle and beside a busy Python thread (medians, us).

Then the trade-offs for the per-layer job, in rounds alternating the variants (issued by
the caller; by the issuer thread dropping the GIL in its batched copies; by the issuer
thread keeping it, the default): both directions at once, a store stream
under the medium GEMMs launched from a Python thread (rate and GEMM slowdown), and the
round trip beside a busy Python thread.

Run on the GPU machine from the repo root: python3 probes/probe_issue.py [jobs, default 60]
"""

import asyncio
import contextlib
import statistics
import sys
import time

import torch
from _setups import per_layer, two_mib

import aiokv.backends.cuda as cuda_backend
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


async def tradeoffs(setup: b._Setup, issue_thread: bool, ceil: dict, medium: b._Gemm, alone: float) -> str:
    ids = b._JobIds()
    async with setup.worker("auto", issue_thread=issue_thread) as w:
        await b._stream(w, setup, 0.2, ids, both=True, depth=4)  # warm: rings, events
        both = await b._stream(w, setup, 0.6, ids, both=True, depth=4)
        with medium:
            s = await b._stream(w, setup, 0.6, ids, store=True)
        trips = []
        with b._BusyThread():
            for k in range(12):
                t0 = time.perf_counter()
                await b._submit(w, setup, True, k, ids)
                trips.append(time.perf_counter() - t0)
    return (f"both {both['gbps'] / ceil['both']:.2f}, under medium GEMMs {s['gbps'] / ceil['store']:.2f} "
            f"(GEMM {100 * (1 - medium.rate / alone):+.1f}%), busy-thread trip p50 "
            f"{statistics.median(trips[2:]) * 1e3:.1f} ms")


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    dev = torch.device("cuda")
    setup = per_layer(dev)
    ceil = b._Contiguous(setup.job_bytes).rates(3)
    medium = b._Gemm(4096, 4096, 14336)
    alone = medium.alone(0.6)
    print(f"ceilings {ceil}; medium GEMM alone {alone:.0f} TFLOP/s", flush=True)
    # Run 78 also had one issuer thread shared by the lanes (commit 49e11d9's SHARED_ISSUER).
    variants = (("caller", False, True), ("issuer, GIL dropped", True, False), ("issuer", True, True))
    for rnd in range(2):
        for label, thread, keep in variants if rnd % 2 == 0 else variants[::-1]:
            cuda_backend.ISSUE_THREAD_KEEPS_GIL = keep
            print(f"round {rnd} {label:17} " + asyncio.run(tradeoffs(setup, thread, ceil, medium, alone)),
                  flush=True)
    cuda_backend.ISSUE_THREAD_KEEPS_GIL = True
    print(f"{'job':14} {'issue':6} {'host':4} " + " ".join(f"{k:>7}" for k in
          ("submit", "hand-off", "prepare", "enqueue", "trip")), flush=True)
    for setup in (per_layer(dev), two_mib(dev)):
        for busy in (False, True):
            for issue_thread in (True, False):
                n = jobs if not busy else max(10, jobs // 3)
                print(asyncio.run(one(setup, issue_thread, busy, n)), flush=True)


if __name__ == "__main__":
    main()
