"""Where a submit's host time goes, by function: cProfile over the submits alone (not the
awaits) of the bench's per-layer 32 KiB-page job, default worker, stores then loads, each
submitted back to back in bursts of four and after an ``await``. cProfile adds a few us
per Python call, so read the shares, not the totals. Needs a GPU:
python3 probes/probe_profile.py [bursts]
"""

import asyncio
import cProfile
import io
import pstats
import sys
import time

import torch
from _setups import per_layer

from aiokv.bench import cuda as b


async def profile(worker, setup, store: bool, ids, bursts: int, awaited: bool) -> None:
    prof = cProfile.Profile()
    spent = []
    for _ in range(bursts):
        futs = []
        for k in range(1 if awaited else 4):
            prof.enable()
            t0 = time.perf_counter()
            futs.append(b._submit(worker, setup, store, k, ids))
            spent.append(time.perf_counter() - t0)
            prof.disable()
        for fut in futs:
            await fut
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(22)
    n = len(spent)
    how = "after an await" if awaited else "back to back (bursts of 4)"
    each = sum(spent) / n * 1e6
    print(f"== {'store' if store else 'load'}, {how}: {n} submits, {each:.0f} us each under cProfile")
    lines = out.getvalue().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    for ln in lines[start : start + 23]:
        print(ln[:150])
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("aiokv", 16)
    lines = out.getvalue().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print("   cumulative, aiokv's own functions:")
    for ln in lines[start : start + 17]:
        print(ln[:150])


async def main() -> None:
    bursts = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    setup = per_layer(torch.device("cuda"))
    ids = b._JobIds()
    async with setup.worker("auto") as worker:
        for store in (True, False):
            await profile(worker, setup, store, ids, 4, False)  # warm-up
            await profile(worker, setup, store, ids, bursts, False)
            await profile(worker, setup, store, ids, bursts * 2, True)


if __name__ == "__main__":
    asyncio.run(main())
