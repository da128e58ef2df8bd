"""The bench's wake-up rows with more jobs, for each job shape with the doorbell on and off.

Prints, per row: wake-up p50/p99 (the bench's upper bound), the median poll window, round
trip, device time and submit (us), process CPU while awaiting, polls per job, and the nap
lateness the poller learned. Run on the GPU machine from the repo root:
python3 probes/probe_wakeups.py [jobs per row, default 100; 3x that for 4 KiB] (device runs
16-24, as `wake.py` then). With ``sweep`` after the job count, it instead runs the 2 MiB-page
job under several ``spin_seconds`` (the trade between wake-up latency and CPU), and prints
which threads used the process CPU over each row (from /proc, 10 ms ticks).
"""

import asyncio
import os
import sys
import time
from typing import Any

import _setups
import torch

from aiokv.bench import cuda as b
from aiokv.poller import Poller

_learn = Poller._learn_lateness
learned = [0.0]


def _recording(self: Poller, target: float) -> None:
    _learn(self, target)
    learned[0] = self._lateness


Poller._learn_lateness = _recording  # type: ignore[method-assign]


def _thread_ticks() -> dict[str, int]:
    """CPU ticks (user + system) per thread of this process, keyed by name and id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}[{tid}]"] = int(fields[11]) + int(fields[12])
    return out


async def _spin_wakeups(setup: b._Setup, iters: int, spin: float) -> dict[str, float]:
    ids = b._JobIds()
    options = {"spin_seconds": spin}
    async with b.AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend="cuda",
                                       options=options) as w:
        before, t0 = _thread_ticks(), time.perf_counter()
        result = await b._wakeups(w, lambda i: b._submit(w, setup, True, i, ids), iters)
        after, wall = _thread_ticks(), time.perf_counter() - t0
    hz = os.sysconf("SC_CLK_TCK")
    used = {k: (v - before.get(k, 0)) / hz / wall for k, v in after.items()}
    top = sorted(((v, k) for k, v in used.items() if v > 0), reverse=True)[:6]
    print("    threads, % of wall over the row:", ", ".join(f"{k} {100 * v:.1f}" for v, k in top), flush=True)
    return result


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dev = torch.device("cuda")
    per_layer, one, big = _setups.per_layer(dev), _setups.one_alloc(dev), _setups.two_mib(dev)
    runs: list[tuple[str, Any]] = [("4 KiB", lambda: b._tiny_wakeups(3 * iters))]
    for setup in (per_layer, one, big):
        for bell in (True, False):
            runs.append((f"{setup.name} bell={bell}",
                         lambda s=setup, bell=bell: b._long_wakeups(s, iters, doorbell=bell)))
    if "sweep" in sys.argv[2:]:
        runs = [(f"2 MiB spin={spin:g}us", lambda spin=spin: _spin_wakeups(big, iters, spin * 1e-6))
                for spin in (0, 50, 100, 200, 400)]
    print(f"{'job':<24} {'wake50':>8} {'wake99':>8} {'win50':>8} {'trip50':>8} {'dev':>8} "
          f"{'submit':>8} {'cpu%':>6} {'polls':>6} {'late':>6}")
    for name, run in runs:
        learned[0] = 0.0
        w = asyncio.run(run())
        us = {k: w[k] * 1e6 for k in ("wake50", "wake99", "window50", "trip50", "device", "submit")}
        print(f"{name:<24} {us['wake50']:8.0f} {us['wake99']:8.0f} {us['window50']:8.0f} {us['trip50']:8.0f} "
              f"{us['device']:8.0f} {us['submit']:8.0f} {100 * w['cpu_wait']:6.1f} {w['polls']:6.1f} "
              f"{learned[0] * 1e6:6.0f}", flush=True)


if __name__ == "__main__":
    main()
