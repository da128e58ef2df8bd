"""What makes a submit after an ``await`` dearer than one back to back, and which thread
spends the CPU while a long job is awaited.

Per-layer 32 KiB-page job (the bench's), stores and loads, default worker, median host
submit in us over rounds in alternating order:

- ``awaited``: submit, await, submit (the bench's streamed submit with one job in flight);
- ``awaited+spin``: the same with a pure-Python spin of ``SPIN_US`` before each submit;
- ``idle sleep`` / ``idle spin``: the job before fully done, then 5 ms asleep or spinning,
  then submit: the GPU idle in both, the core idle only in the first;
- ``back to back``: the 2nd to 4th of bursts of four.

Then the CPU each thread of the process used (``/proc/self/task/*/schedstat``) per awaited
job. Needs a GPU: python3 probes/probe_warmth.py
"""

import asyncio
import glob
import os
import statistics
import time

import torch
from _setups import per_layer

from aiokv.bench import cuda as b

SPIN_US = (100, 300)
JOBS = 24


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def threads_cpu() -> dict[str, int]:
    """ns on a CPU per thread of this process, keyed by 'tid name'."""
    out = {}
    for task in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            with open(f"{task}/comm") as f:
                name = f.read().strip()
            with open(f"{task}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue
        out[f"{os.path.basename(task)} {name}"] = ns
    return out


async def awaited(worker, setup, store, ids, pre_us: float = 0.0) -> list[float]:
    out = []
    fut = b._submit(worker, setup, store, 0, ids)
    for k in range(1, JOBS + 1):
        await fut
        if pre_us:
            spin(pre_us)
        t0 = time.perf_counter()
        fut = b._submit(worker, setup, store, k, ids)
        out.append(time.perf_counter() - t0)
    await fut
    return out


async def idle(worker, setup, store, ids, busy: bool) -> list[float]:
    out = []
    for k in range(JOBS):
        if busy:
            spin(5000)
        else:
            time.sleep(0.005)
        t0 = time.perf_counter()
        fut = b._submit(worker, setup, store, k, ids)
        out.append(time.perf_counter() - t0)
        await fut
    return out


async def gpu_busy(worker, setup, store, ids) -> list[float]:
    """The GPU busy with another stream's kernel, the core spinning, then submit."""
    out = []
    side = torch.cuda.Stream()
    for k in range(JOBS):
        with torch.cuda.stream(side):
            torch.cuda._sleep(30_000_000)  # ~15 ms at 2 GHz
        spin(5000)
        t0 = time.perf_counter()
        fut = b._submit(worker, setup, store, k, ids)
        out.append(time.perf_counter() - t0)
        await fut
        side.synchronize()
    return out


async def after_tiny(worker, setup, store, ids) -> list[float]:
    """The GPU idle and the core spinning, then a one-block job, then the measured submit."""
    used_blocks = {int(x) for blocks, _ in setup.jobs for x in blocks}
    used_chunks = {int(x) for _, chunks in setup.jobs for x in chunks}
    block = next(i for i in range(10_000) if i not in used_blocks)
    chunk = next(i for i in range(setup.chunks) if i not in used_chunks)
    out = []
    for k in range(JOBS):
        spin(5000)
        tiny = worker.submit_load(ids(), b.CPULoadStoreSpec([chunk]), b.GPULoadStoreSpec([block]))
        t0 = time.perf_counter()
        fut = b._submit(worker, setup, store, k, ids)
        out.append(time.perf_counter() - t0)
        await tiny
        await fut
    return out


def driver_calls() -> None:
    """Eight cuEventRecord calls on an idle stream, timed in three states (us, median)."""
    from cuda.bindings import driver as cu

    stream = cu.cuStreamCreate(1)[1]
    event = cu.cuEventCreate(2)[1]  # timing disabled
    side = torch.cuda.Stream()

    def eight() -> float:
        t0 = time.perf_counter()
        for _ in range(8):
            cu.cuEventRecord(event, stream)
        return time.perf_counter() - t0

    states = ("idle, slept", "idle, spun", "GPU busy, spun", "back to back")
    res: dict[str, list[float]] = {n: [] for n in states}
    for _ in range(60):
        time.sleep(0.005)
        res["idle, slept"].append(eight())
        spin(5000)
        res["idle, spun"].append(eight())
        res["back to back"].append(eight())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
        spin(5000)
        res["GPU busy, spun"].append(eight())
        side.synchronize()
    print("8 cuEventRecord on an idle stream (cuda.bindings), median us:")
    for name, v in res.items():
        print(f"  {name:<16} {statistics.median(v) * 1e6:6.1f}")


async def bursts(worker, setup, store, ids) -> list[float]:
    warm, _ = await b._bursts(worker, setup, store, ids, bursts=JOBS // 3)
    return [warm]


async def cpu_by_thread(worker, setup, store, ids, jobs: int = 60) -> None:
    await awaited(worker, setup, store, ids)  # warm
    before = threads_cpu()
    c0, t0 = time.process_time(), time.perf_counter()
    fut = b._submit(worker, setup, store, 0, ids)
    for k in range(1, jobs + 1):
        await fut
        fut = b._submit(worker, setup, store, k, ids)
    await fut
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    after = threads_cpu()
    per = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    print(
        f"  {'store' if store else 'load'}: {jobs} jobs, {wall / jobs * 1e6:.0f} us each; "
        f"process CPU {cpu / jobs * 1e6:.0f} us a job ({100 * cpu / wall:.1f}% of a core)"
    )
    for ns, name in per[:6]:
        if ns:
            print(f"    {name:<28} {ns / jobs / 1e3:8.1f} us a job")


def host_facts() -> None:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
        mhz = [float(ln.split(":", 1)[1]) for ln in lines if ln.startswith("cpu MHz")]
        print(f"cpu: {model}, {len(mhz)} cpus, MHz {min(mhz):.0f}-{max(mhz):.0f}")
    except (OSError, StopIteration, ValueError):
        pass
    for p in (
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
        "/sys/devices/system/cpu/cpuidle/current_driver",
    ):
        try:
            with open(p) as f:
                print(f"{p}: {f.read().strip()}")
        except OSError:
            print(f"{p}: (none)")
    states = sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*/name"))
    names = []
    for s in states:
        with open(s) as f:
            names.append(f.read().strip())
    print(f"idle states: {names or '(none)'}")


async def submit_modes(worker, setup, store: bool, ids) -> None:
    await awaited(worker, setup, store, ids)  # warm-up
    modes = {
        "awaited": lambda: awaited(worker, setup, store, ids),
        **{f"awaited+spin {us}": (lambda us=us: awaited(worker, setup, store, ids, us)) for us in SPIN_US},
        "idle sleep 5 ms": lambda: idle(worker, setup, store, ids, False),
        "idle spin 5 ms": lambda: idle(worker, setup, store, ids, True),
        "GPU busy, spin 5 ms": lambda: gpu_busy(worker, setup, store, ids),
        "after a 1-block job": lambda: after_tiny(worker, setup, store, ids),
        "back to back": lambda: bursts(worker, setup, store, ids),
    }
    got: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(3):
        for m in list(modes) if r % 2 == 0 else list(modes)[::-1]:
            got[m] += await modes[m]()
    print(f"{'store' if store else 'load'} submit, median us over 3 rounds:")
    for m, v in got.items():
        q = statistics.quantiles(v, n=4)
        print(f"  {m:<20} {statistics.median(v) * 1e6:7.0f}   (quartiles {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f})")


async def main() -> None:
    host_facts()
    driver_calls()
    setup = per_layer(torch.device("cuda"))
    ids = b._JobIds()
    async with setup.worker("auto") as worker:
        for store in (True, False):
            await submit_modes(worker, setup, store, ids)
        print("CPU by thread while one job at a time is awaited:")
        for store in (True, False):
            await cpu_by_thread(worker, setup, store, ids)


if __name__ == "__main__":
    asyncio.run(main())
