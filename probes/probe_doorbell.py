"""How soon after a copy ends can a sleeping event loop know, with no Python in between?

The "doorbell": a host function enqueued with cuLaunchHostFunc is libc's ``fclose`` on a
``FILE`` that wraps a dup of a pipe's write end and holds one buffered byte. When the
stream reaches it, the driver's callback thread flushes that byte into the pipe (no GIL,
no Python), and a loop sleeping in epoll on the read end wakes up.

Measured per job size (all host clocks, perf_counter):
- ``bell after query``: spin on cuEventQuery until the copy's event is done, then spin on
  select(0) until the pipe is readable: the bell's own latency.
- ``trip - device``: from before the enqueue to the waiter running again, minus the copy's
  device time (timing events); an upper bound on the wake-up that needs no spinning.
  Modes: spinning on the event, sleeping in select() on the bell, asyncio awaiting the
  bell through add_reader, and the bell on the copy stream itself instead of a side one.

Run on the GPU machine from the repo root: python3 probes/probe_doorbell.py
"""

import asyncio
import ctypes
import os
import select
import time

import torch
from cuda.bindings import driver as cu

libc = ctypes.CDLL(None, use_errno=True)
fdopen = libc.fdopen
fdopen.restype, fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
fputc = libc.fputc
fputc.argtypes = [ctypes.c_int, ctypes.c_void_p]
FCLOSE = ctypes.cast(libc.fclose, ctypes.c_void_p).value


def check(ret):
    code = ret[0] if isinstance(ret, tuple) else ret
    assert int(code) == 0, ret
    return ret[1] if isinstance(ret, tuple) and len(ret) == 2 else None


torch.zeros(1, device="cuda")
check(cu.cuInit(0))
ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
check(cu.cuCtxSetCurrent(ctx))
_default = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
ret = cu.cuGetProcAddress(b"cuLaunchHostFunc", 12000, _default)
assert int(ret[0]) == 0 and int(ret[1]), ret
addr = ret[1]
launch_host = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(int(addr))
rfd, wfd = os.pipe()
os.set_blocking(rfd, False)
copy_s = check(cu.cuStreamCreate(1))
bell_s = check(cu.cuStreamCreate(1))
done = check(cu.cuEventCreate(2))
t_start, t_stop = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))


def ring(stream):
    f = fdopen(os.dup(wfd), b"w")
    assert f
    fputc(120, f)
    assert launch_host(int(stream), FCLOSE, f) == 0


def drain():
    try:
        while os.read(rfd, 4096):
            pass
    except BlockingIOError:
        pass


def enqueue(dst, src, nbytes, bell):
    check(cu.cuEventRecord(t_start, copy_s))
    check(cu.cuMemcpyAsync(dst, src, nbytes, copy_s))
    check(cu.cuEventRecord(t_stop, copy_s))
    check(cu.cuEventRecord(done, copy_s))
    if bell == "side":
        check(cu.cuStreamWaitEvent(bell_s, done, 0))
        ring(bell_s)
    elif bell == "same":
        ring(copy_s)


def device_time():
    return check(cu.cuEventElapsedTime(t_start, t_stop)) / 1e3


def spin_event():
    while cu.cuEventQuery(done)[0] != cu.CUresult.CUDA_SUCCESS:
        pass


def spin_bell():
    while not select.select([rfd], [], [], 0)[0]:
        pass


def p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e6


def one_size(nbytes, iters):
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s, d = src.data_ptr(), dst.data_ptr()
    torch.cuda.synchronize()
    out = {}
    # the bell's own latency, measured by spinning on both sides
    for bell in ("side", "same"):
        lat = []
        for i in range(iters + 5):
            enqueue(d, s, nbytes, bell)
            spin_event()
            t_ev = time.perf_counter()
            spin_bell()
            if i >= 5:
                lat.append(time.perf_counter() - t_ev)
            drain()
        out[f"bell after query ({bell} stream)"] = lat
    # trip - device, by waiting mode
    for mode in ("spin", "select", "asyncio", "asyncio same"):
        bound, cpu, wall = [], 0.0, 0.0
        loop = asyncio.new_event_loop() if mode.startswith("asyncio") else None
        for i in range(iters + 5):
            c0, t0 = time.process_time(), time.perf_counter()
            enqueue(d, s, nbytes, "none" if mode == "spin" else ("same" if mode.endswith("same") else "side"))
            if mode == "spin":
                spin_event()
            elif mode == "select":
                select.select([rfd], [], [], 1.0)
            else:
                fut = loop.create_future()
                loop.add_reader(rfd, lambda f=fut: f.done() or f.set_result(None))
                loop.run_until_complete(fut)
                loop.remove_reader(rfd)
            t1 = time.perf_counter()
            c1 = time.process_time()
            drain()
            check(cu.cuStreamSynchronize(bell_s))
            if i >= 5:
                bound.append(t1 - t0 - device_time())
                cpu += c1 - c0
                wall += t1 - t0
        if loop is not None:
            loop.close()
        out[f"trip - device ({mode})"] = bound
        out[f"cpu% ({mode})"] = cpu / wall
    return out


def main():
    print(f"{'size':>10} {'measure':<36} {'p50 us':>9} {'p99 us':>9}")
    for nbytes, iters in ((4096, 400), (1 << 20, 300), (32 << 20, 100), (256 << 20, 40)):
        res = one_size(nbytes, iters)
        for name, val in res.items():
            if name.startswith("cpu%"):
                print(f"{nbytes:>10} {name:<36} {100 * val:>8.1f}%")
            else:
                print(f"{nbytes:>10} {name:<36} {p(val, 50):>9.1f} {p(val, 99):>9.1f}")
    os.close(rfd)
    os.close(wfd)


if __name__ == "__main__":
    main()
