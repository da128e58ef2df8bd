"""The bench's wake-up rows with more jobs, for each job shape with the doorbell on and off.

Prints, per row: wake-up p50/p99 (the bench's upper bound), the median poll window, round
trip, device time and submit (us), process CPU while awaiting, polls per job, and the nap
lateness the poller learned. Run on the GPU machine from the repo root:
python3 probes/probe_wakeups.py [jobs per row, default 100; 3x that for 4 KiB] (device runs
16-24, as `wake.py` then).
"""

import asyncio
import sys

import torch

from aiokv.bench import cuda as b
from aiokv.poller import Poller

_learn = Poller._learn_lateness
learned = [0.0]


def _recording(self: Poller, target: float) -> None:
    _learn(self, target)
    learned[0] = self._lateness


Poller._learn_lateness = _recording  # type: ignore[method-assign]


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dev = torch.device("cuda")
    bf16 = torch.bfloat16
    per_layer = b._Setup("32K per-layer", [torch.randn(2, b.BLOCKS, 16, 8, 128, dtype=bf16, device=dev)
                                           for _ in range(b.LAYERS)], block_dim=1, chunks=b.CHUNKS, seed=1)
    layers = torch.randn(b.LAYERS, 2, b.BLOCKS, 16, 8, 128, dtype=bf16, device=dev)
    one = b._Setup("32K one-alloc", list(layers.unbind(0)), block_dim=1, chunks=b.CHUNKS, seed=1)
    big = b._Setup("2 MiB", [torch.randn(b.BLOCKS, b.LAYERS, 2, 16, 8, 128, dtype=bf16, device=dev)],
                   block_dim=0, chunks=b.CHUNKS // 2, seed=2)
    runs = [("4 KiB", lambda: b._tiny_wakeups(3 * iters))]
    for setup in (per_layer, one, big):
        for bell in (True, False):
            runs.append((f"{setup.name} bell={bell}",
                         lambda s=setup, bell=bell: b._long_wakeups(s, iters, doorbell=bell)))
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
