"""How far a job's end, as the poller first sees it, falls from the end the handler predicted.

The poller naps until a lead (``spin_seconds`` plus the learned nap lateness) before a
job's predicted end (``Handler.expected_wait``: from ``Job.started_at`` plus bytes over the
learned rate) and spins from there, so the error of that prediction decides how long it
spins and whether the job ends before the spin begins. This runs the bench's one-job rows
with ``spin_seconds`` = 3 ms (every end is caught by spinning, so seen ~ actual end) and
with the default, and prints percentiles (us) of seen - predicted, beside the time from
``started_at`` to the launch's return (the enqueue). Run on the GPU machine from the repo
root: ``python3 probes/probe_predict.py [jobs, default 100]``.
"""

import asyncio
import sys
import time

import numpy as np
import torch
from _setups import one_alloc, two_mib

from aiokv.bench import cuda as b
from aiokv.handler import Handler, Job

_pop = Handler.pop_finished
errors: list[float] = []
enqueues: list[float] = []


def _recording(self: Handler) -> list[Job]:
    rate, last = self._rate, self._last_done
    done = _pop(self)
    seen = time.perf_counter()
    for job in done:
        if rate:
            errors.append(seen - (max(job.started_at, last) + job.nbytes / rate))
            enqueues.append(job.launched_at - job.started_at)
        last = seen
    return done


Handler.pop_finished = _recording  # type: ignore[method-assign]


async def _row(setup: b._Setup, iters: int, spin: float) -> None:
    ids = b._JobIds()
    async with b.AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend="cuda",
                                       options={"spin_seconds": spin}) as w:
        await b._wakeups(w, lambda i: b._submit(w, setup, True, i, ids), iters)


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    dev = torch.device("cuda")
    big, one = two_mib(dev), one_alloc(dev)
    qs = (1, 10, 50, 90, 99)
    print(f"{'job':<28} " + " ".join(f"{'p' + str(q):>7}" for q in qs) + f" {'enqueue':>8}")
    for setup in (big, one):
        for spin in (3e-3, 200e-6):
            errors.clear()
            enqueues.clear()
            asyncio.run(_row(setup, iters, spin))
            err = np.array(errors[10:]) * 1e6
            print(f"{setup.name + f' spin={spin * 1e6:g}us':<28} "
                  + " ".join(f"{np.percentile(err, q):7.0f}" for q in qs)
                  + f" {np.median(enqueues[10:]) * 1e6:8.0f}", flush=True)


if __name__ == "__main__":
    main()
