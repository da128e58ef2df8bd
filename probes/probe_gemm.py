"""Pitched 32 KiB copies under a GEMM: direct vs a copy-engine gather into staging + big DMA.

Run on the GPU machine from the repo root: python3 probes/probe_gemm.py (device run 5).
"""

import statistics
import threading
import time

import numpy as np
import torch

from aiokv.backends.cuda import Driver

drv = Driver(0)
L, N, PAGE, JOB = 32, 1024, 32768, 128
one = torch.randn(L, 2, N, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
base, pitch, rows = one.data_ptr(), N * PAGE, L * 2
nbytes = JOB * rows * PAGE
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
stage = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
hbase, sbase = host.data_ptr(), stage.data_ptr()
blocks = np.random.default_rng(0).choice(N, JOB, replace=False).astype(np.int64)
streams = [drv.create_stream() for _ in range(16)]
home = drv.create_stream()
ev0, ev1 = drv.create_event(timing=True), drv.create_event(timing=True)
fork = drv.create_event()
joins = [drv.create_event() for _ in range(16)]
slice_ev = [drv.create_event() for _ in range(16)]


def ops(store, target):
    dev = base + blocks * PAGE
    tgt = target + np.arange(JOB) * rows * PAGE
    n = np.full(JOB, PAGE)
    h = np.full(JOB, rows)
    if store:
        return drv.pitched_ops(tgt, n, dev, np.full(JOB, pitch), n, h)
    return drv.pitched_ops(dev, np.full(JOB, pitch), tgt, n, n, h)


def spread(kind_ops, nstreams):
    drv.record(fork, home)
    parts = np.array_split(np.arange(kind_ops.shape[0]), nstreams)
    for i, p in enumerate(parts):
        drv.stream_wait(streams[i], fork)
        drv.memcpy_pitched(kind_ops[int(p[0]) : int(p[-1]) + 1], streams[i])
        drv.record(joins[i], streams[i])
        drv.stream_wait(home, joins[i])


def direct(store, nstreams):
    spread(ops(store, hbase), nstreams)


def staged(store, nslices):
    # store: CE gather (D2D pitched) slice i on streams[i], then its D2H on home after it.
    per = JOB // nslices
    sl = ops(store, sbase)
    drv.record(fork, home)
    for i in range(nslices):
        lo, hi = i * per, (i + 1) * per
        off, size = lo * rows * PAGE, (hi - lo) * rows * PAGE
        if store:
            drv.stream_wait(streams[i], fork)
            drv.memcpy_pitched(sl[lo:hi], streams[i])
            drv.record(slice_ev[i], streams[i])
            drv.stream_wait(home, slice_ev[i])
            drv.memcpy(hbase + off, sbase + off, size, home)
        else:
            drv.memcpy(sbase + off, hbase + off, size, home)
            drv.record(slice_ev[i], home)
            drv.stream_wait(streams[i], slice_ev[i])
            drv.memcpy_pitched(sl[lo:hi], streams[i])
            drv.record(joins[i], streams[i])
    if not store:
        for i in range(nslices):
            drv.stream_wait(home, joins[i])


def timed(fn, reps=6):
    ts = []
    for _ in range(reps):
        drv.record(ev0, home)
        fn()
        drv.record(ev1, home)
        drv.stream_synchronize(home)
        ts.append(drv.elapsed(ev0, ev1))
    return nbytes / statistics.median(ts[1:]) / 1e9


def ceiling():
    def f():
        drv.memcpy(hbase, sbase, nbytes, home)

    return timed(f)


class Gemm:
    def __init__(self):
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        self.b = self.a.clone()
        self.s = torch.cuda.Stream()
        self.stop = threading.Event()
        self.n = 0

    def loop(self):
        with torch.cuda.stream(self.s):
            t0 = time.perf_counter()
            while not self.stop.is_set():
                for _ in range(4):
                    self.a @ self.b
                self.s.synchronize()
                self.n += 4
            self.rate = self.n * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12

    def __enter__(self):
        self.stop.clear()
        self.n = 0
        self.t = threading.Thread(target=self.loop)
        self.t.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.t.join()


g = Gemm()
with g:
    time.sleep(0.5)
alone = g.rate
c = ceiling()
print(f"ceiling D2H {c:.2f} GB/s, GEMM alone {alone:.0f} TFLOP/s", flush=True)
cases = [
    ("direct x1", lambda s: direct(s, 1)),
    ("direct x4", lambda s: direct(s, 4)),
    ("direct x16", lambda s: direct(s, 16)),
    ("staged 1", lambda s: staged(s, 1)),
    ("staged 4", lambda s: staged(s, 4)),
    ("staged 8", lambda s: staged(s, 8)),
]
for name, fn in cases:
    for store in (True, False):
        idle = timed(lambda fn=fn, store=store: fn(store))
        with g:
            loaded = timed(lambda fn=fn, store=store: fn(store), reps=10)
        what = "store" if store else "load "
        slowdown = 100 * (1 - g.rate / alone)
        print(
            f"{name:11s} {what}: idle {idle:6.2f} GB/s ({idle / c:.2f})  "
            f"under GEMM {loaded:6.2f} ({loaded / c:.2f}) GEMM {slowdown:+.1f}%",
            flush=True,
        )
# byte-exactness of staged store and load
host.zero_()
staged(True, 4)
drv.stream_synchronize(home)
exp = one.view(torch.uint8).view(rows, N, PAGE)[:, torch.from_numpy(blocks).cuda()].permute(1, 0, 2).cpu()
print("staged store byte-exact:", torch.equal(host.view(JOB, rows, PAGE), exp))
snap = one.clone()
one.zero_()
torch.cuda.synchronize()
staged(False, 4)
drv.stream_synchronize(home)
bt = torch.from_numpy(blocks).cuda()
print("staged load byte-exact:", torch.equal(one[:, :, bt], snap[:, :, bt]))
