"""Submit of the per-layer 32 KiB-page job (8192 descriptors) beside a busy Python thread:
batch calls that drop the GIL (default, from the submit threads) against calls that keep
it (issued in turn from the submitting thread).

A pure-Python thread never drops the GIL by itself, so each call of ours that drops it must
wait for the interpreter's forced switch (``sys.getswitchinterval()``, 5 ms) to get it back.
Per mode and with / without the busy thread: submit time p50 (ms) over the jobs, and the
busy thread's progress during the submits as a share of its rate alone (how much the
submit took from it). With the busy thread, the default mode also runs under shorter
switch intervals (``sys.setswitchinterval``), which bound each hand-off, and two library
calls that drop the GIL are timed beside it: a small torch op on the GPU and a numpy add
over 8192 elements.

Run on the GPU machine from the repo root: ``python3 probes/probe_gilhold.py [jobs, default 12]``.
"""

import asyncio
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

import aiokv.backends.cuda as cuda_backend
from aiokv.bench import cuda as b


class Busy:
    def __init__(self) -> None:
        self.n = 0
        self.stop = False
        self.thread = threading.Thread(target=self.spin, daemon=True)

    def spin(self) -> None:
        while not self.stop:
            self.n += 1


async def run(setup: b._Setup, threads: int, jobs: int, busy: Busy | None) -> tuple[float, float]:
    ids = b._JobIds()
    subs, share = [], []
    async with setup.worker("dma", threads=threads) as w:
        for k in range(jobs + 2):
            n0, t0 = (busy.n if busy else 0), time.perf_counter()
            fut = b._submit(w, setup, True, k, ids)
            t1, n1 = time.perf_counter(), (busy.n if busy else 0)
            await fut
            if k >= 2:
                subs.append(t1 - t0)
                share.append((n1 - n0) / (t1 - t0))
    return float(np.median(subs)), float(np.median(share))


def _per_call(op: Callable[[], object], n: int) -> float:
    """Mean seconds per call."""
    op()
    t0 = time.perf_counter()
    for _ in range(n):
        op()
    return (time.perf_counter() - t0) / n


def main() -> None:
    jobs = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    setup = b._Setup("32 KiB pages", [torch.randn(2, b.BLOCKS, 16, 8, 128, dtype=bf16, device=dev)
                                      for _ in range(b.LAYERS)], block_dim=1, chunks=b.CHUNKS, seed=1)
    held = cuda_backend.GIL_HELD_DESCRIPTORS
    x, arr = torch.ones(16, device=dev), np.ones(8192)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("one small torch op on CUDA (x.add_(1))", lambda: x.add_(1)),
        ("numpy add over 8192 elements", lambda: arr + 1),
    ]
    idle_calls = {name: _per_call(op, 200) for name, op in calls}
    modes = [("drop GIL, 4 submit threads", 4, held), ("keep GIL, no submit threads", 1, 1 << 30),
             ("drop GIL, no submit threads", 1, held)]
    for with_busy in (False, True):
        busy = None
        alone = 0.0
        if with_busy:
            busy = Busy()
            busy.thread.start()
            n0, t0 = busy.n, time.perf_counter()
            time.sleep(0.3)  # sleeping drops the GIL: the busy thread runs alone
            alone = (busy.n - n0) / (time.perf_counter() - t0)
        for name, threads, limit in modes:
            cuda_backend.GIL_HELD_DESCRIPTORS = limit
            sub, rate = asyncio.run(run(setup, threads, jobs, busy))
            extra = f", busy thread at {rate / alone:.0%} of its rate alone" if busy else ""
            print(f"{'busy' if busy else 'idle'} | {name}: submit p50 {sub * 1e3:.1f} ms{extra}", flush=True)
        cuda_backend.GIL_HELD_DESCRIPTORS = held
        if busy:
            # The same wait hits any library call that drops the GIL: a model runner's torch
            # ops (each releases it in torch's Python binding) and numpy loops over >500 items.
            for name, op in calls:
                print(f"busy | {name}: {_per_call(op, 20) * 1e6:.0f} us per call "
                      f"(idle {idle_calls[name] * 1e6:.1f} us)", flush=True)
            # What a server can do: a shorter switch interval bounds every hand-off.
            default = sys.getswitchinterval()
            for interval in (1e-3, 2e-4):
                sys.setswitchinterval(interval)
                sub, rate = asyncio.run(run(setup, 4, jobs, busy))
                print(f"busy | drop GIL, 4 submit threads, switch interval {interval * 1e3:g} ms: "
                      f"submit p50 {sub * 1e3:.1f} ms, busy thread at {rate / alone:.0%} of its rate alone",
                      flush=True)
            sys.setswitchinterval(default)
            busy.stop = True
            busy.thread.join()


if __name__ == "__main__":
    main()
