"""Which cheap driver call reports a dead context, how soon, and what it costs right after
a job's done event is seen (where a health check would sit on the wake-up path).

Candidates, each through ctypes ``PYFUNCTYPE`` on raw handles, as the backend binds them:
``record`` (an event on an idle stream: the check aiokv made before every job was called
done, until this probe's run 65 showed the done query needs no help), ``ctx_flags``
(``cuCtxGetFlags``), ``ctx_device`` (``cuCtxGetDevice``), ``stream_query``
(``cuStreamQuery`` of the idle stream) and ``stream_prio`` (``cuStreamGetPriority``).

- ``cost``: an 8 MiB device-to-pinned copy, polled until its done event says so, then
  every candidate once, in an order that rotates per round; medians (us) for the call
  made first after the done query and for the same call made later.
- ``sticky MODE``: poison the context with a device-side assert on a stream of its own
  (kernels loaded beforehand) and log every change in the candidates' return codes, and
  in the job's done-event query, with the time since the poison was enqueued. MODE:
  ``waiting`` (the copy waits behind a long kernel on another stream), ``midcopy`` (a
  1 GiB copy is running) or ``idle`` (nothing of ours in flight). The question is whether
  the done query can ever say "done" for a copy that did not land, with no other check.

Run on the GPU machine from the repo root: ``python3 probes/probe_health.py`` runs ``cost``
and each sticky mode in a child process (a poisoned context cannot be reused).
"""

import ctypes
import statistics
import subprocess
import sys
import time

import torch
from cuda.bindings import driver as cu

from aiokv.backends.cuda import Driver

NAMES = ("record", "ctx_flags", "ctx_device", "stream_query", "stream_prio")


def candidates(drv: Driver) -> dict[str, object]:
    vp = ctypes.c_void_p
    flags, dev, prio = ctypes.c_uint(), ctypes.c_int(), ctypes.c_int()
    get_flags = drv._load_proc(b"cuCtxGetFlags", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
    get_dev = drv._load_proc(b"cuCtxGetDevice", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
    squery = drv._load_proc(b"cuStreamQuery", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
    sprio = drv._load_proc(b"cuStreamGetPriority", ctypes.PYFUNCTYPE(ctypes.c_int, vp, vp))
    record = drv._record_fn
    ev, st = int(drv.create_event()), int(drv.create_stream())
    pf, pd, pp = ctypes.addressof(flags), ctypes.addressof(dev), ctypes.addressof(prio)
    return {
        "record": lambda: record(ev, st),
        "ctx_flags": lambda: get_flags(pf),
        "ctx_device": lambda: get_dev(pd),
        "stream_query": lambda: squery(st),
        "stream_prio": lambda: sprio(st, pp),
    }


def cost() -> None:
    drv = Driver(0)
    calls = candidates(drv)
    query = drv._query_fn
    src = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
    stream = drv.create_stream()
    done = drv.create_event(timing=True, blocking=True)
    torch.cuda.synchronize()
    first: dict[str, list[float]] = {n: [] for n in NAMES}
    later: dict[str, list[float]] = {n: [] for n in NAMES}
    query_done: list[float] = []
    rounds = 600
    for i in range(rounds):
        code = cu.cuMemcpyDtoHAsync(dst.data_ptr(), src.data_ptr(), src.numel(), stream)[0]
        assert code == cu.CUresult.CUDA_SUCCESS, code
        drv.record(done, stream)
        while True:
            t0 = time.perf_counter()
            code = query(int(done))
            t1 = time.perf_counter()
            if code == 0:
                break
        query_done.append(t1 - t0)
        order = NAMES[i % len(NAMES):] + NAMES[: i % len(NAMES)]
        for k, name in enumerate(order):
            t0 = time.perf_counter()
            code = calls[name]()
            t1 = time.perf_counter()
            assert code == 0, (name, code)
            (first if k == 0 else later)[name].append(t1 - t0)
    assert torch.equal(dst, src.cpu())
    print(f"cost after a done query, {rounds} rounds of an 8 MiB copy (median / p90, us)")
    qd = sorted(query_done)
    print(f"  {'query, done':14} {statistics.median(qd) * 1e6:7.2f} / {qd[int(0.9 * len(qd))] * 1e6:7.2f}")
    print(f"  {'call':14} {'made first':>17} {'made later':>17}")
    for name in NAMES:
        a, b = sorted(first[name]), sorted(later[name])
        print(
            f"  {name:14} {statistics.median(a) * 1e6:7.2f} / {a[int(0.9 * len(a))] * 1e6:7.2f}"
            f" {statistics.median(b) * 1e6:7.2f} / {b[int(0.9 * len(b))] * 1e6:7.2f}"
        )


def sticky(mode: str) -> None:
    drv = Driver(0)
    calls = candidates(drv)
    query = drv._query_fn
    nbytes = (1 << 30) if mode == "midcopy" else (64 << 20)
    expect = torch.randint(-(1 << 62), 1 << 62, (nbytes // 8,), dtype=torch.int64).view(torch.uint8)
    src = expect.cuda()
    dst = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = drv.create_stream()
    done = drv.create_event(timing=True, blocking=True)
    side, bad = torch.cuda.Stream(), torch.cuda.Stream()
    # Load the kernels the scenario launches, or their first launch waits for the device.
    torch.cuda._sleep(1000)
    torch._assert_async(torch.ones((), dtype=torch.bool, device="cuda"))
    poison_flag = torch.zeros((), dtype=torch.bool, device="cuda")
    torch.cuda.synchronize()
    if mode == "waiting":
        with torch.cuda.stream(side):
            torch.cuda._sleep(300_000_000)
        gate = drv.create_event()
        drv.record(gate, side.cuda_stream)
        drv.stream_wait(stream, gate)
    if mode != "idle":
        code = cu.cuMemcpyDtoHAsync(dst.data_ptr(), src.data_ptr(), nbytes, stream)[0]
        assert code == cu.CUresult.CUDA_SUCCESS, code
        drv.record(done, stream)
    t0 = time.perf_counter()
    with torch.cuda.stream(bad):
        torch._assert_async(poison_flag)
    enqueued = (time.perf_counter() - t0) * 1e6
    what = "nothing in flight" if mode == "idle" else f"copy {nbytes >> 20} MiB"
    print(f"sticky {mode}: {what}; poison enqueued in {enqueued:.0f} us", flush=True)
    last: tuple[int, ...] | None = None
    log: list[tuple[float, tuple[int, ...]]] = []
    saw_done_ok = None
    end = t0 + 3.0
    settled_at = None
    while True:
        now = time.perf_counter()
        codes = (int(query(int(done))) if mode != "idle" else -1,) + tuple(int(calls[n]()) for n in NAMES)
        if codes != last:
            log.append((now - t0, codes))
            last = codes
            if codes[0] == 0 and saw_done_ok is None:
                saw_done_ok = now - t0
        if all(c not in (0, 600) for c in codes[1:]) and (mode == "idle" or codes[0] not in (0, 600)):
            settled_at = settled_at or now
            if now - settled_at > 0.05:
                break
        if now > end:
            break
    print(f"  {'t (us)':>9} {'done_query':>10} " + " ".join(f"{n:>12}" for n in NAMES))
    for t, codes in log:
        cells = " ".join(f"{c:>10}" if i == 0 else f"{c:>12}" for i, c in enumerate(codes))
        print(f"  {t * 1e6:9.0f} {cells}")
    if mode == "idle":
        return
    landed = bool(torch.equal(dst, expect))
    print(f"  done query said done: {'never' if saw_done_ok is None else f'at {saw_done_ok * 1e6:.0f} us'};"
          f" data landed byte-exact: {landed}", flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "cost":
        cost()
    elif what == "sticky":
        sticky(sys.argv[2])
    else:
        cost()
        for mode in ("waiting", "midcopy", "idle", "midcopy"):
            proc = subprocess.run([sys.executable, __file__, "sticky", mode], capture_output=True, text=True)
            print(proc.stdout, end="")
            if proc.returncode:
                print(f"  (exit {proc.returncode}) {proc.stderr[-600:]}")
