"""Pitched (2D) copies vs one descriptor per page, for 32 KiB pages of 32 layers.

Run on the GPU machine from the repo root: python3 probes/probe_pitch.py (device run 1).
"""

import ctypes
import statistics
import time

import numpy as np
import torch
from cuda.bindings import driver as cu

from aiokv.backends.cuda import Driver

drv = Driver(0)
L, N, PAGE, JOB = 32, 1024, 32768, 128
sep = [torch.randn(2, N, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
addrs = np.array([x.data_ptr() for x in sep], dtype=np.int64)
print("separate allocations: layer deltas (MiB):", sorted(set((np.diff(addrs) // (1 << 20)).tolist()))[:10])
one = torch.randn(L, 2, N, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
base = one.data_ptr()
pitch = N * PAGE  # every (layer, kv) row of a block sits this far apart
host = torch.empty(JOB * L * 2 * PAGE, dtype=torch.uint8, pin_memory=True)
hbase = host.data_ptr()
ok, mp = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH, drv.device)
print("max pitch", mp)
rng = np.random.default_rng(0)
blocks = rng.choice(N, JOB, replace=False).astype(np.int64)
rows = L * 2
nbytes = JOB * rows * PAGE
streams = [drv.create_stream() for _ in range(16)]
ev0, ev1 = drv.create_event(timing=True), drv.create_event(timing=True)
fork = drv.create_event()
joins = [drv.create_event() for _ in range(16)]
home = drv.create_stream()


def ceiling():
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(5):
        drv.record(ev0, home)
        drv.memcpy(hbase, src.data_ptr(), nbytes, home)
        drv.record(ev1, home)
        drv.stream_synchronize(home)
        ts.append(drv.elapsed(ev0, ev1))
    return nbytes / statistics.median(ts[1:]) / 1e9


def one_d(store):
    # page-major descriptors (what the 1-D plan does): dev page (r, b) -> host chunk j, row r
    dev = (base + np.arange(rows)[:, None] * pitch + blocks[None, :] * PAGE).ravel()
    hst = (hbase + np.arange(JOB)[None, :] * rows * PAGE + np.arange(rows)[:, None] * PAGE).ravel()
    d, s = (hst, dev) if store else (dev, hst)
    return d.astype(np.uint64), s.astype(np.uint64), np.full(d.size, PAGE, dtype=np.uint64)


def ops3d(store, height=rows):
    # one op per block and group of `height` rows; pointer operands, element size 1 byte
    groups = rows // height
    n = JOB * groups
    op = np.zeros((n, 14), dtype=np.uint64)
    g = np.tile(np.arange(groups), JOB)
    b = np.repeat(np.arange(JOB), groups)
    dev = base + g * height * pitch + blocks[b] * PAGE
    hst = hbase + b * rows * PAGE + g * height * PAGE
    srcp, srow = (dev, pitch) if store else (hst, PAGE)
    dstp, drow = (hst, PAGE) if store else (dev, pitch)
    op[:, 0] = 1
    op[:, 1] = srcp
    op[:, 2] = srow
    op[:, 3] = height
    op[:, 5] = 1
    op[:, 6] = dstp
    op[:, 7] = drow
    op[:, 8] = height
    op[:, 10] = PAGE
    op[:, 11] = height
    op[:, 12] = 1
    op[:, 13] = 1  # stream-ordered source access, flags 0
    return np.ascontiguousarray(op)


ret = cu.cuGetProcAddress(
    b"cuMemcpy3DBatchAsync", 13000, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
)
print("3d batch proc", ret[0], hex(int(ret[1])))
vp, sz = ctypes.c_void_p, ctypes.c_size_t
batch3d = ctypes.CFUNCTYPE(ctypes.c_int, sz, vp, ctypes.c_ulonglong, vp)(int(ret[1]))
ret2 = cu.cuGetProcAddress(
    b"cuMemcpy2DAsync", 13000, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
)
m2d = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(int(ret2[1]))


def ops2d(store):
    n = JOB
    m = np.zeros((n, 16), dtype=np.uint64)
    dev = base + blocks * PAGE
    hst = hbase + np.arange(JOB) * rows * PAGE
    sp, spitch, dp, dpitch = (dev, pitch, hst, PAGE) if store else (hst, PAGE, dev, pitch)
    m[:, 2] = 4
    m[:, 4] = sp
    m[:, 6] = spitch
    m[:, 9] = 4
    m[:, 11] = dp
    m[:, 13] = dpitch
    m[:, 14] = PAGE
    m[:, 15] = rows
    return np.ascontiguousarray(m)


def issue(kind, store, nstreams):
    t0 = time.perf_counter()
    if kind == "1d":
        d, s, z = one_d(store)
        parts = np.array_split(np.arange(d.size), nstreams)
    elif kind.startswith("3d"):
        h = int(kind[2:] or rows)
        op = ops3d(store, h)
        parts = np.array_split(np.arange(op.shape[0]), nstreams)
    else:
        m = ops2d(store)
        parts = np.array_split(np.arange(m.shape[0]), nstreams)
    t_build = time.perf_counter() - t0
    drv.record(ev0, home)
    drv.record(fork, home)
    for i, p in enumerate(parts):
        st = streams[i]
        drv.stream_wait(st, fork)
        lo, hi = int(p[0]), int(p[-1]) + 1
        if kind == "1d":
            drv.memcpy_batch(d[lo:hi], s[lo:hi], z[lo:hi], st)
        elif kind.startswith("3d"):
            code = batch3d(hi - lo, op[lo:hi].ctypes.data, 0, int(st))
            assert code == 0, code
        else:
            for j in range(lo, hi):
                code = m2d(m[j:].ctypes.data, int(st))
                assert code == 0, code
        drv.record(joins[i], st)
        drv.stream_wait(home, joins[i])
    drv.record(ev1, home)
    t_sub = time.perf_counter() - t0
    drv.stream_synchronize(home)
    return t_build, t_sub, drv.elapsed(ev0, ev1), time.perf_counter() - t0


def check(store):
    if store:
        got = host.view(JOB, rows, PAGE)
        exp = (
            one.view(torch.uint8)
            .view(L * 2, N, PAGE)[:, torch.from_numpy(blocks).cuda()]
            .permute(1, 0, 2)
            .cpu()
        )
        return torch.equal(got, exp)
    return None


ceil = ceiling()
print(f"ceiling D2H {ceil:.2f} GB/s")
for kind in ("1d", "3d", "3d2", "2d"):
    for store in (True, False):
        for ns in (1, 2, 4, 16):
            if kind == "2d" and ns > 4:
                continue
            res = [issue(kind, store, ns) for _ in range(6)][1:]
            b = statistics.median(r[0] for r in res) * 1e6
            s = statistics.median(r[1] for r in res) * 1e6
            dev_t = statistics.median(r[2] for r in res)
            wall = statistics.median(r[3] for r in res)
            print(
                f"{kind:4s} {'store' if store else 'load '} streams {ns:2d}: "
                f"build {b:7.0f} us submit {s:7.0f} us device {nbytes / dev_t / 1e9:6.2f} GB/s "
                f"({nbytes / dev_t / 1e9 / ceil:.2f}) wall {nbytes / wall / 1e9:6.2f}",
                flush=True,
            )
        if store:
            host.zero_()
            issue(kind, True, 4)
            print(kind, "store byte-exact:", check(True), flush=True)
# load correctness for 3d: perturb, load back from host
host.zero_()
issue("3d", True, 4)
snap = one.clone()
one.zero_()
torch.cuda.synchronize()
issue("3d", False, 4)
bt = torch.from_numpy(blocks).cuda()
print(
    "3d load byte-exact on blocks:",
    torch.equal(one[:, :, bt], snap[:, :, bt]),
    "others untouched (zero):",
    not one[:, :, torch.tensor(sorted(set(range(N)) - set(blocks.tolist()))[:8]).cuda()].any().item(),
)
