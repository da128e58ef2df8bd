"""The least a Python submit of the bench's per-layer staged job (and of its 2 MiB-page
job) can cost: the driver calls that one aiokv submit makes (through aiokv's ``Driver``
and its ctypes entry points), recorded once with copies of their arguments and replayed
from a prebuilt list, so no validation, planning or bookkeeping runs. Timed after an
``await`` of the previous transfer, as the bench's "host submit per job" row, alternating
with aiokv's own submit of the same job in each round, and back to back. The replay's
list with every call made a no-op gives the loop's own cost. Shares are of the median
device time of the aiokv jobs.

Run on the GPU machine from the repo root: python3 probes/probe_floor.py [rounds, default 40]
"""

import asyncio
import ctypes
import statistics
import sys
import time

import numpy as np
import torch
from _setups import per_layer, two_mib

from aiokv.bench import cuda as b
from aiokv.copy.pieces import ROWS_PER_LAUNCH

DRIVER_CALLS = ("ensure_context", "check_usable", "record", "stream_wait", "memcpy_batch",
                "memcpy_batch_at", "memcpy", "launch")
# The piece kernel's parameter sizes in order (pieces.PieceKernel), then its rows.
PARAM_BYTES = (8, 8, 8, 4, 4, 4, 4, 4, 4 * ROWS_PER_LAUNCH)


def _copy_table(at: int, n: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(at, 8 * n), dtype=np.uint64).copy()


def _snapshot(name: str, args: tuple, kwargs: dict, keep: list) -> tuple:
    """The call's arguments as they are now, in objects the replay owns (the strategy
    rewrites its launch block and run tables in place)."""
    if name == "launch":
        function, grid, block, stream, params = args
        bufs = [ctypes.create_string_buffer(ctypes.string_at(params[i], size), size)
                for i, size in enumerate(PARAM_BYTES)]
        block_ = (ctypes.c_void_p * len(bufs))(*(ctypes.addressof(x) for x in bufs))
        keep.append(bufs)
        return (function, grid, block, stream, block_)
    if name == "memcpy_batch_at":
        dst, src, sizes, n, stream = args
        tables = [_copy_table(at, n) for at in (dst, src, sizes)]
        keep.append(tables)
        return (*(t.ctypes.data for t in tables), n, stream)
    if name == "memcpy_batch":
        dst, src, sizes, stream = args
        return (dst.copy(), src.copy(), sizes.copy(), stream)
    return args


def record_calls(worker, setup: b._Setup, store: bool, ids: b._JobIds) -> tuple[list, list, object]:
    """Submit one job with the driver's methods wrapped; its calls, and the job's future."""
    drv = worker._core.backend.driver
    calls: list = []
    keep: list = []
    saved = {name: getattr(drv, name) for name in DRIVER_CALLS}

    depth = [0]  # memcpy_batch calls memcpy_batch_at: record the outer call only

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if not depth[0]:
                calls.append((fn, _snapshot(name, args, kwargs, keep), dict(kwargs)))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, fn in saved.items():
        setattr(drv, name, wrap(name, fn))
    try:
        fut = b._submit(worker, setup, store, 0, ids)
    finally:
        for name, fn in saved.items():
            setattr(drv, name, fn)
    return calls, keep, fut


def replay(calls: list) -> None:
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


async def run(setup: b._Setup, store: bool, rounds: int) -> str:
    ids = b._JobIds()
    async with setup.worker("auto") as w:
        for k in range(5):  # warm: ring, tables, events
            await b._submit(w, setup, store, k, ids)
        drv = w._core.backend.driver
        calls, keep, fut = record_calls(w, setup, store, ids)
        await fut
        # The job's own stop event is the last one recorded; the replay waits for it.
        last = next(args[0] for fn, args, _ in reversed(calls) if fn.__name__ == "record")
        noops = [((lambda *a, **k: None), args, kwargs) for _, args, kwargs in calls]

        async def settled() -> None:
            await asyncio.sleep(0)
            w._core.settle()  # the jobs' events are back in the pool before a replay

        async def replayed_done() -> None:
            while not drv.query(last):
                await asyncio.sleep(2e-4)

        own, bare, loop_only, times = [], [], [], []
        for k in range(rounds):
            t0 = time.perf_counter()
            fut = b._submit(w, setup, store, k, ids)
            own.append(time.perf_counter() - t0)
            times.append((await fut).transfer_time)
            await settled()
            t0 = time.perf_counter()
            replay(calls)
            bare.append(time.perf_counter() - t0)
            await replayed_done()
            t0 = time.perf_counter()
            replay(noops)
            loop_only.append(time.perf_counter() - t0)
        b2b = []
        for _ in range(max(4, rounds // 4)):
            for j in range(4):
                t0 = time.perf_counter()
                replay(calls)
                if j:
                    b2b.append(time.perf_counter() - t0)
            await replayed_done()
        del keep
    xfer = statistics.median(times)
    names: dict[str, int] = {}
    for fn, _, _ in calls:
        names[fn.__name__] = names.get(fn.__name__, 0) + 1

    def row(what: str, secs: list[float]) -> str:
        med = statistics.median(secs)
        return f"  {what:44} {med * 1e6:7.1f} us  {med / xfer * 100:5.2f}%"

    return "\n".join([
        f"{'store' if store else 'load'}: {len(calls)} driver calls a job "
        f"({', '.join(f'{n} {c}' for n, c in sorted(names.items()))}); transfer {xfer * 1e6:.0f} us",
        row("aiokv submit, after an await", own),
        row("the same calls replayed, after an await", bare),
        row("the same calls replayed, back to back", b2b),
        row("the replay loop alone (calls made no-ops)", loop_only),
    ])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    for make in (per_layer, two_mib):
        setup = make(torch.device("cuda"))
        for store in (True, False):
            print(f"[{setup.name}] " + asyncio.run(run(setup, store, rounds)), flush=True)
        del setup
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
