"""How fast this host runs the Python side of a submit: the staged plan of the bench's
per-layer job (numpy) and one launch's ctypes argument block, built anew (before session
18) or rewritten in place (session 18; since session 19 a launch rewrites only the values
that change), medians in us. Runs anywhere
(no GPU needed), so hosts can be compared: python3 probes/probe_pyspeed.py
"""

import ctypes
import statistics
import time

import numpy as np

from aiokv.copy.staged import block_job


def median_us(fn, n: int = 2000) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def main() -> None:
    rng = np.random.default_rng(1)
    rows = rng.choice(1024, 128, replace=False).astype(np.int64)
    host = (rng.choice(512, 128, replace=False) * (2 << 20) + 0x7F0000000000).astype(np.uint64)
    pages = np.zeros((64, 4), dtype=np.uint64)
    pages[:, 2] = 32768
    pages[:, 3] = np.arange(64) * 32768

    def args() -> object:
        a = (ctypes.c_uint64(1), ctypes.c_uint64(2), ctypes.c_uint32(3), ctypes.c_uint32(4),
             ctypes.c_uint32(5), ctypes.c_uint32(6), ctypes.c_uint32(7), ctypes.c_uint32(8))
        return (ctypes.c_void_p * len(a))(*(ctypes.addressof(x) for x in a))

    kept = (ctypes.c_uint64(), ctypes.c_uint64()) + tuple(ctypes.c_uint32() for _ in range(6))
    block = (ctypes.c_void_p * len(kept))(*(ctypes.addressof(x) for x in kept))

    def rewrite() -> object:  # session 18's PieceKernel.launch (it now rewrites only what changes)
        for arg, value in zip(kept, (1, 2, 3, 4, 5, 6, 7, 8)):
            arg.value = value
        return block

    print(f"block_job {median_us(lambda: block_job(rows, host, pages, 2 << 20, 64 << 20)):.1f} us, "
          f"launch args built {median_us(args):.2f} us, rewritten {median_us(rewrite):.2f} us, "
          f"empty loop {median_us(lambda: None):.2f} us")


if __name__ == "__main__":
    main()
