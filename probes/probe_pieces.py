"""The one-launch piece kernel (aiokv/copy/pieces.py) as the gather of a staged job.

Per-layer 32 KiB pages (32 tensors of (2, 1024, 16, 8, 128) bf16, 128 random blocks =
8192 pages, 256 MiB). Arms, each idle and under the bench's two GEMM loads:
- ``dma``: one descriptor per page, cuMemcpyBatchAsync over 4 streams, straight to the host;
- ``staged S``: the kernel gathers slice i of S into device staging (high-priority stream),
  then one contiguous DMA moves it (the reverse for loads); ``lowprio`` on a normal stream.
Ratios are against a contiguous pinned copy of the same bytes measured here. Also: the
kernel alone, the host time of a staged submit, and byte-exact checks.

Run on the GPU machine from the repo root: python3 probes/probe_pieces.py
"""

import statistics
import time

import numpy as np
import torch

from aiokv.backends.cuda import Driver
from aiokv.bench.cuda import _Gemm
from aiokv.copy.pieces import PieceKernel

drv = Driver(0)
L, N, PAGE, JOB = 32, 1024, 32768, 128
dev = torch.device("cuda")
kern = PieceKernel(drv, dev)
layers = [torch.randn(2, N, 16, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(L)]
nbytes = JOB * L * 2 * PAGE
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
stage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
hbase, sbase = host.data_ptr(), stage.data_ptr()
blocks = np.random.default_rng(0).choice(N, JOB, replace=False).astype(np.int64)

# Host order is block-major (the chunk-contiguous layout): block j, layer l, k/v.
bases = np.array([t.data_ptr() for t in layers], dtype=np.int64)
j, l_, kv = np.meshgrid(np.arange(JOB), np.arange(L), np.arange(2), indexing="ij")
dev_addr = (bases[l_] + kv * N * PAGE + blocks[j] * PAGE).ravel()
offset = (((j * L + l_) * 2 + kv) * PAGE).ravel()
sizes = np.full(dev_addr.size, PAGE, dtype=np.int64)
u64 = lambda a: np.ascontiguousarray(a, dtype=np.int64).view(np.uint64)  # noqa: E731
# Piece by piece: a page row per piece (address, stride 0, bytes, staging offset), one
# block (row 0, its image at the staging base).
pages = np.zeros((dev_addr.size, 4), dtype=np.uint64)
pages[:, 0], pages[:, 2], pages[:, 3] = u64(dev_addr), u64(sizes), u64(offset)
tables = torch.from_numpy(pages.ravel().view(np.int64)).to(dev)
table_ptr, row0 = tables.data_ptr(), np.zeros(1, dtype=np.uint32)

home = drv.create_stream()
hi_prio, lo_prio, dma_s = drv.create_stream(high_priority=True), drv.create_stream(), drv.create_stream()
subs = [drv.create_stream() for _ in range(4)]
ev0, ev1 = drv.create_event(timing=True), drv.create_event(timing=True)
fork = drv.create_event()
slice_ev = [drv.create_event() for _ in range(16)]
joins = [drv.create_event() for _ in range(16)]


def join(streams):
    for i, s in enumerate(streams):
        drv.record(joins[i], s)
        drv.stream_wait(home, joins[i])


def per_page(store):
    dst, src = (u64(hbase + offset), u64(dev_addr)) if store else (u64(dev_addr), u64(hbase + offset))
    drv.record(fork, home)
    n = dst.size // 4
    for i, s in enumerate(subs):
        drv.stream_wait(s, fork)
        lo, hi = i * n, (i + 1) * n
        drv.memcpy_batch(dst[lo:hi], src[lo:hi], u64(sizes[lo:hi]), s, to_host=store)
    join(subs)


def staged(store, slices, kstream):
    per = offset.size // slices
    drv.record(fork, home)
    drv.stream_wait(kstream, fork)
    drv.stream_wait(dma_s, fork)
    for i in range(slices):
        first, off, size = i * per, i * per * PAGE, per * PAGE
        if store:
            kern.launch(table_ptr, (first, first + per), row0, sbase, 0, PAGE, False, kstream)
            drv.record(slice_ev[i], kstream)
            drv.stream_wait(dma_s, slice_ev[i])
            drv.memcpy(hbase + off, sbase + off, size, dma_s)
        else:
            drv.memcpy(sbase + off, hbase + off, size, dma_s)
            drv.record(slice_ev[i], dma_s)
            drv.stream_wait(kstream, slice_ev[i])
            kern.launch(table_ptr, (first, first + per), row0, sbase, 0, PAGE, True, kstream)
    join([kstream, dma_s])


def kernel_only(kstream):
    drv.record(fork, home)
    drv.stream_wait(kstream, fork)
    kern.launch(table_ptr, (0, offset.size), row0, sbase, 0, PAGE, False, kstream)
    join([kstream])


def timed(fn, reps=8):
    ts, host_us = [], []
    for _ in range(reps + 1):
        drv.record(ev0, home)
        t0 = time.perf_counter()
        fn()
        host_us.append((time.perf_counter() - t0) * 1e6)
        drv.record(ev1, home)
        drv.stream_synchronize(home)
        ts.append(drv.elapsed(ev0, ev1))
    return statistics.median(ts[1:]), statistics.median(host_us[1:])


def ceiling():
    def d2h():
        drv.memcpy(hbase, sbase, nbytes, home)

    def h2d():
        drv.memcpy(sbase, hbase, nbytes, home)

    return nbytes / timed(d2h)[0] / 1e9, nbytes / timed(h2d)[0] / 1e9


big, medium = _Gemm(8192, 8192, 8192), _Gemm(4096, 4096, 14336)
alone = {"big": big.alone(0.6), "medium": medium.alone(0.6)}
c_store, c_load = ceiling()
t, _ = timed(lambda: kernel_only(hi_prio))
print(f"ceilings: store {c_store:.2f} GB/s, load {c_load:.2f}; GEMM alone {alone['big']:.0f} / "
      f"{alone['medium']:.0f} TFLOP/s; gather kernel alone {t * 1e6:.0f} us "
      f"({nbytes / t / 1e9:.0f} GB/s of pages)", flush=True)
for name, g in (("big", big), ("medium", medium)):
    with g:
        t, _ = timed(lambda: kernel_only(hi_prio))
        t2, _ = timed(lambda: kernel_only(lo_prio))
    print(f"gather kernel alone under {name} GEMM: high priority {t * 1e6:.0f} us, "
          f"normal {t2 * 1e6:.0f} us; GEMM {100 * (1 - g.rate / alone[name]):+.1f}%", flush=True)

cases = [("dma per-page x4", per_page)]
for slices in (1, 2, 4, 8, 16):
    cases.append((f"staged {slices}", lambda st, s=slices: staged(st, s, hi_prio)))
cases.append(("staged 4 lowprio", lambda st: staged(st, 4, lo_prio)))
for name, fn in cases:
    for store in (True, False):
        c = c_store if store else c_load
        t, host_us = timed(lambda fn=fn, store=store: fn(store))
        cells = [f"idle {nbytes / t / 1e9 / c:.2f} (host {host_us:.0f} us)"]
        for gname, g in (("big", big), ("medium", medium)):
            with g:
                tg, _ = timed(lambda fn=fn, store=store: fn(store), reps=12)
            slow = 100 * (1 - g.rate / alone[gname])
            cells.append(f"{gname} {nbytes / tg / 1e9 / c:.2f} GEMM {slow:+.1f}%")
        print(f"{name:17s} {'store' if store else 'load '}: " + "  ".join(cells), flush=True)

# Byte-exact: staged store, then a staged load into wiped pages.
bt = torch.from_numpy(blocks).to(dev)
expect = torch.stack([t.view(torch.uint8).view(2, N, PAGE)[:, bt] for t in layers]).permute(2, 0, 1, 3).cpu()
host.fill_(7)
staged(True, 4, hi_prio)
drv.stream_synchronize(home)
print("staged store byte-exact:", torch.equal(host.view(JOB, L, 2, PAGE), expect), flush=True)
snap = [t.clone() for t in layers]
for t in layers:
    t.view(torch.uint8).view(2, N, PAGE)[:, bt] = 0
torch.cuda.synchronize()
staged(False, 4, hi_prio)
drv.stream_synchronize(home)
print("staged load byte-exact:", all(torch.equal(a, b) for a, b in zip(layers, snap)), flush=True)
# A tail: pieces of 20 KiB + 48 bytes (not a multiple of the 16 KiB tile).
odd = 20 * 1024 + 48
src_t = torch.randint(1, 255, (64, odd), dtype=torch.uint8, device=dev)
dst_t = torch.zeros(64, odd + 16, dtype=torch.uint8, device=dev)
rows = np.arange(64, dtype=np.int64)
odd_pages = np.array([[src_t.data_ptr(), odd, odd, 0]], dtype=np.uint64)
kern.launch(kern.upload(odd_pages, home), (0, 1), rows.astype(np.uint32), dst_t.data_ptr(), odd + 16,
            odd, False, home)
drv.stream_synchronize(home)
print("odd-size pages exact, bytes past each page untouched:",
      torch.equal(dst_t[:, :odd], src_t) and not dst_t[:, odd:].any().item(), flush=True)
