"""What noticing a finished job costs on the host, call by call.

Medians over many calls (us) of each way to make the calls a poll makes:

- ``cuEventQuery`` on a finished event and on one still waiting: cuda-python, ctypes
  ``CFUNCTYPE`` (drops and re-takes the GIL) and ctypes ``PYFUNCTYPE`` (keeps it);
- a health check before a job is reported done: recording an event on an idle stream
  (the check aiokv made until device run 65, see probes/probe_health.py) against
  ``cuStreamQuery`` of that stream;
- ``cuEventElapsedTime``: cuda-python against ``PYFUNCTYPE``;
- one zero-length yield to the event loop: ``anyio.lowlevel.checkpoint`` against the
  loop's own (``asyncio.sleep(0)``), on asyncio and uvloop;
- one spinning turn of a worker's poller while its only job waits behind a 1 s kernel;
- some of those calls again while another Python thread runs pure Python: a call that
  drops the GIL must win it back, which can take the whole switch interval.

Run on the GPU machine from the repo root: ``python3 probes/probe_completion.py``.
"""

import asyncio
import ctypes
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import torch
from cuda.bindings import driver as cu

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.backends.cuda import Driver

REPS = 3000


def median_us(fn: Callable[[], Any], reps: int = REPS) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def driver_calls() -> None:
    drv = Driver(0)
    vp = ctypes.c_void_p
    q_c = drv._load_proc(b"cuEventQuery", ctypes.CFUNCTYPE(ctypes.c_int, vp))
    q_py = drv._load_proc(b"cuEventQuery", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
    sq_py = drv._load_proc(b"cuStreamQuery", ctypes.PYFUNCTYPE(ctypes.c_int, vp))
    el_proto = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), vp, vp)
    el_py = drv._load_proc(b"cuEventElapsedTime", el_proto)
    default = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    ret = cu.cuGetProcAddress(b"cuEventElapsedTime", 13000, default)
    el_py13 = el_proto(int(ret[1])) if ret[0] == cu.CUresult.CUDA_SUCCESS and int(ret[1]) else el_py
    rec_c = drv._load_proc(b"cuEventRecord", ctypes.CFUNCTYPE(ctypes.c_int, vp, vp))
    rec_py = drv._load_proc(b"cuEventRecord", ctypes.PYFUNCTYPE(ctypes.c_int, vp, vp))
    stream = drv.create_stream()
    start, stop = drv.create_event(timing=True), drv.create_event(timing=True)
    done = drv.create_event()
    drv.record(start, stream)
    drv.record(stop, stream)
    drv.record(done, stream)
    drv.stream_synchronize(stream)
    waiting_stream = drv.create_stream()
    hold = torch.cuda.ExternalStream(int(waiting_stream))
    with torch.cuda.stream(hold):
        torch.cuda._sleep(4_000_000_000)  # ~2 s: the "waiting" event stays NOT_READY
    waiting = drv.create_event()
    drv.record(waiting, waiting_stream)
    idle, probe_ev = drv.create_stream(), drv.create_event()
    out = ctypes.c_float()
    rows = {
        "query done, cuda-python": lambda: cu.cuEventQuery(done),
        "query done, ctypes CFUNCTYPE": lambda: q_c(int(done)),
        "query done, ctypes PYFUNCTYPE": lambda: q_py(int(done)),
        "query waiting, cuda-python": lambda: cu.cuEventQuery(waiting),
        "query waiting, ctypes PYFUNCTYPE": lambda: q_py(int(waiting)),
        "Driver.query (done)": lambda: drv.query(done),
        "health: record, CFUNCTYPE (old)": lambda: rec_c(int(probe_ev), int(idle)),
        "health: record, PYFUNCTYPE": lambda: rec_py(int(probe_ev), int(idle)),
        "health: cuStreamQuery, PYFUNCTYPE": lambda: sq_py(int(idle)),
        "elapsed, cuda-python": lambda: cu.cuEventElapsedTime(start, stop),
        "elapsed, PYFUNCTYPE (12.0 entry)": lambda: el_py(ctypes.byref(out), int(start), int(stop)),
        "elapsed, PYFUNCTYPE (13.0 entry)": lambda: el_py13(ctypes.byref(out), int(start), int(stop)),
        "Driver.elapsed": lambda: drv.elapsed(start, stop),
    }
    print("== driver calls (median us)")
    for name, fn in rows.items():
        print(f"  {name:36s} {median_us(fn):7.2f}")
    # The same calls while another Python thread runs pure Python: a call that drops the
    # GIL waits to win it back (up to sys.getswitchinterval()).
    stop_busy = threading.Event()

    def busy() -> None:
        x = 0
        while not stop_busy.is_set():
            x += 1

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    contended = {
        "query done, cuda-python": rows["query done, cuda-python"],
        "query done, ctypes CFUNCTYPE": rows["query done, ctypes CFUNCTYPE"],
        "query done, ctypes PYFUNCTYPE": rows["query done, ctypes PYFUNCTYPE"],
        "record, CFUNCTYPE (old)": rows["health: record, CFUNCTYPE (old)"],
        "record, PYFUNCTYPE": rows["health: record, PYFUNCTYPE"],
        "elapsed, cuda-python": rows["elapsed, cuda-python"],
        "elapsed, PYFUNCTYPE (13.0 entry)": rows["elapsed, PYFUNCTYPE (13.0 entry)"],
    }
    print(f"== the same with a busy Python thread (switch interval {sys.getswitchinterval() * 1e3:.0f} ms;"
          " median us over 60 calls)")
    for name, fn in contended.items():
        print(f"  {name:36s} {median_us(fn, 60):9.2f}")
    stop_busy.set()
    spinner.join()
    assert q_py(int(waiting)) == int(cu.CUresult.CUDA_ERROR_NOT_READY), "the held event finished early"
    torch.cuda.synchronize()


def loop_yields() -> None:
    async def per_yield(fn: Callable[[], Any], n: int = 20000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            await fn()
        return (time.perf_counter() - t0) / n * 1e6

    async def both() -> str:
        a = await per_yield(anyio.lowlevel.checkpoint)
        b = await per_yield(lambda: asyncio.sleep(0))
        return f"anyio checkpoint {a:5.2f} us, asyncio.sleep(0) {b:5.2f} us"

    print("== one yield to the loop")
    print("  asyncio:", asyncio.run(both()))
    try:
        import uvloop

        print("  uvloop: ", uvloop.run(both()))
    except ImportError:
        print("  uvloop:  not installed")


def poller_turn() -> None:
    t = torch.randn(64, 1024, device="cuda").view(torch.uint8)
    kv = CanonicalKVCaches.from_tensors([t])
    side = torch.cuda.Stream()

    async def main() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=8, backend="cuda",
                                         options={"spin_seconds": 10.0}) as w:
            with torch.cuda.stream(side):
                torch.cuda._sleep(2_000_000_000)  # ~1 s: the job waits behind it
            fut = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=side)
            poller = w._poller
            assert poller is not None
            await anyio.sleep(0.05)
            p0, t0 = poller.polls, time.perf_counter()
            await anyio.sleep(0.3)
            n, dt = poller.polls - p0, time.perf_counter() - t0
            pending = not fut.done()
            await fut
            print(f"== one spinning poll turn, job held: {dt / max(n, 1) * 1e6:.2f} us "
                  f"({n} turns in {dt * 1e3:.0f} ms; job still pending then: {pending})")

    asyncio.run(main())


if __name__ == "__main__":
    torch.cuda.init()
    driver_calls()
    loop_yields()
    poller_turn()
