"""Why a submit after an ``await`` costs more than the same submit in a tight loop.

Times four numpy calls, a plain-Python loop and ``map_blocks`` of a 128-block job, each
300 times warm (back to back) and cold (after a 5 ms sleep, as a submit that follows an
awaited transfer is). Needs no GPU: python3 probes/probe_cold.py (device run 30; also run
on a desktop CPU).
"""

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from aiokv import CanonicalKVCaches
from aiokv.plan import HostLayout, map_blocks

rng = np.random.default_rng(1)
blocks = rng.choice(1024, 128, replace=False)
chunks = rng.choice(256, 128, replace=False)
# 1024 blocks of 2 MiB, never touched (torch.empty does not fault the pages in).
layout = HostLayout.build(CanonicalKVCaches.from_tensors([torch.empty(1024, 2 << 20, dtype=torch.uint8)]), 1)


def numpy_ops() -> None:
    np.sort(blocks)
    blocks.min()
    blocks.max()
    np.array(blocks, dtype=np.int64)


def python_loop() -> int:
    total = 0
    for i in range(200):
        total += i * i
    return total


def mapping() -> None:
    map_blocks(blocks, chunks, layout=layout, num_chunks=256, unique_host=True)


def timed(fn: Callable[[], object], cold: bool) -> list[float]:
    out = []
    for _ in range(300):
        if cold:
            time.sleep(0.005)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    cases = (("4 numpy ops", numpy_ops), ("python loop 200", python_loop), ("map_blocks 128", mapping))
    for name, fn in cases:
        for cold in (False, True):
            ts = timed(fn, cold)
            print(f"{name:<18} {'cold' if cold else 'warm'}: p50 {statistics.median(ts) * 1e6:7.1f} us  "
                  f"min {min(ts) * 1e6:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
