"""Where a long job's wake-up and CPU go, poll by poll.

Runs the bench's one-job-at-a-time rows for the 2 MiB-page job and the pitched 32 KiB-page
job (``_wakeups``) with the default worker, and logs every poll (start, cost, jobs found
done) and every nap (start, end, the end it aimed at). Per job it then reports
(percentiles over the jobs, us):

- turn: time between two polls of one spin (the poll itself, the yield, one loop pass);
- poll: the cost of one poll that found nothing;
- spin: time spent spinning (polls with no nap between them) per job, and polls per job;
- nap late: how late the last nap before the end ended, against the end it aimed at;
- window: the detection window the bench reports (last poll that saw the job running ->
  the poll that saw it done), split by whether the job was caught spinning or on waking;
- CPU per job, from a submit's return to the next submit's start: the whole process, the
  loop's thread, and the loop thread's share spent inside polls and inside naps;
- each call on the completion path (GPU only): the event query (done / not done), the
  elapsed-time read and the events' return to the pool (these two run after the woken
  task, in the settle, since device run 58; a health check, a record on an idle stream,
  ran after the query until run 65); and on the nap's:
  arming the head job's ring, draining the bell, the alarm, the wait itself (wall and
  loop-thread CPU, calls per job).

Rows: asyncio and uvloop (when installed). Run on the GPU machine from the repo root:
``python3 probes/probe_turns.py [jobs, default 100] [cpu] [nobell]``; ``cpu`` runs the jobs
on the CPU backend (no GPU needed: only the loop-side figures mean anything); ``nobell``
adds a 2 MiB row with the doorbell off.
"""

import asyncio
import itertools
import sys
import time
from typing import Any

import numpy as np
import torch
from _setups import one_alloc, two_mib

from aiokv.bench import cuda as b
from aiokv.poller import Poller
from aiokv.worker import AsyncOffloadingWorker

polls: list[tuple[float, float, int, float]] = []  # (start, cost, jobs done, thread CPU)
naps: list[tuple[float, float, float | None, float]] = []  # (start, end, aimed end, thread CPU)
_complete = AsyncOffloadingWorker._complete_finished
_nap = Poller._nap


def _logged_complete(self: AsyncOffloadingWorker) -> int:
    t0, c0 = time.perf_counter(), time.thread_time()
    n = _complete(self)
    polls.append((t0, time.perf_counter() - t0, n, time.thread_time() - c0))
    return n


async def _logged_nap(self: Poller, until: float | None) -> float | None:
    t0, c0 = time.perf_counter(), time.thread_time()
    aimed = None if until is None else t0 + until
    target = await _nap(self, until)
    naps.append((t0, time.perf_counter(), aimed, time.thread_time() - c0))
    return target


AsyncOffloadingWorker._complete_finished = _logged_complete  # type: ignore[method-assign]
Poller._nap = _logged_nap  # type: ignore[method-assign]

# Calls on the completion and nap paths, timed: (name, wall seconds, loop-thread CPU seconds).
calls: list[tuple[str, float, float, float]] = []  # (name, start, wall, loop-thread CPU)


def _timed(owner: Any, name: str, label: Any) -> None:
    original = getattr(owner, name)

    def timed(*args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = original(*args)
        calls.append((label(out), t0, time.perf_counter() - t0, time.thread_time() - c0))
        return out

    setattr(owner, name, timed)


def _time_calls() -> None:
    import anyio

    from aiokv.backends.cuda import Driver
    from aiokv.doorbell import Doorbell

    _timed(Driver, "query", lambda done: "query, done" if done else "query, not done")
    _timed(Driver, "elapsed", lambda _: "elapsed time read")
    _timed(Driver, "give_job_events", lambda _: "events back to the pool")
    _timed(AsyncOffloadingWorker, "_arm_heads", lambda _: "nap: arm the head job's ring")
    _timed(Doorbell, "drain", lambda _: "nap: drain the bell")
    _timed(Doorbell, "set_alarm", lambda _: "nap: set or clear the alarm")

    def timed_wait(wait: Any) -> Any:
        async def timed(*args: Any) -> None:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                await wait(*args)
            finally:
                calls.append(("nap: wait on the bell", t0, time.perf_counter() - t0, time.thread_time() - c0))

        return timed

    from aiokv import poller

    if hasattr(poller, "_ReaderNaps"):  # the wait itself, however the loop watches the bell
        for cls in (poller._ReaderNaps, poller._BellNaps):
            cls.nap = timed_wait(cls.nap)
    else:  # trees before it: anyio's wait_readable on every loop
        anyio.wait_readable = timed_wait(anyio.wait_readable)


def _q(values: list[float]) -> str:
    if not values:
        return "      -"
    return " ".join(f"{np.percentile(values, q) * 1e6:7.0f}" for q in (10, 50, 90))


def _analyse(spans: list[tuple[float, float]], stores: Any) -> None:
    """Split the log by job (submit -> await return) and print the per-job figures."""
    turns, idle_polls, spins, counts, late, caught_spin, caught_wake = [], [], [], [], [], [], []
    cpu: dict[str, list[float]] = {k: [] for k in ("process", "loop thread", "in polls", "in naps")}
    windows = list(stores.detect_windows)[-len(spans) - 1 : -1]  # the last job has no span
    for (t0, t1, thread_cpu, process_cpu), window in zip(spans, windows, strict=True):
        mine = [p for p in polls if t0 <= p[0] <= t1]
        my_naps = [n for n in naps if t0 <= n[0] <= t1]
        counts.append(len(mine))
        idle_polls += [p[1] for p in mine if p[2] == 0]
        spin = 0.0
        for a, c in itertools.pairwise(mine):
            if not any(n[0] < c[0] and n[1] > a[0] for n in my_naps):  # no nap between
                turns.append(c[0] - a[0])
                spin += c[0] - a[0]
        spins.append(spin)
        timed = [n for n in my_naps if n[2] is not None]
        if timed:
            late.append(timed[-1][1] - timed[-1][2])
        hit = next((p for p in mine if p[2]), None)
        # Caught on waking: a nap ended after the last poll that saw the job running.
        last_miss = max((p[0] for p in mine if hit and p[0] < hit[0]), default=t0)
        woke = hit is not None and any(last_miss < n[1] <= hit[0] for n in my_naps)
        (caught_wake if woke else caught_spin).append(window)
        for key, value in (("process", process_cpu), ("loop thread", thread_cpu),
                           ("in polls", sum(p[3] for p in mine)), ("in naps", sum(n[3] for n in my_naps))):
            cpu[key].append(value)
    n = len(spans)
    print(f"  {'figure (us)':<34} {'p10':>7} {'p50':>7} {'p90':>7}")
    for label, vals in (
        ("turn (poll to poll, spinning)", turns),
        ("poll that found nothing", idle_polls),
        ("spin per job", spins),
        ("nap late (last timed nap)", late),
        (f"window, caught spinning ({len(caught_spin)}/{n})", caught_spin),
        (f"window, caught on waking ({len(caught_wake)}/{n})", caught_wake),
    ):
        print(f"  {label:<34} {_q(vals)}")
    print(f"  polls per job: p50 {np.median(counts):.0f}")
    for key, values in cpu.items():
        print(f"  CPU per job, {key:<22} {_q(values)}")
    print(f"  {'call: wall / loop-thread CPU (us)':<34} {'calls/job':>9} {'wall p50':>9} {'CPU p50':>8}")
    measured = [c for c in calls if spans[0][0] <= c[1] <= spans[-1][1]]
    for label in sorted({c[0] for c in measured}):
        mine = [c for c in measured if c[0] == label]
        print(f"  {label:<34} {len(mine) / n:9.1f} {np.median([c[2] for c in mine]) * 1e6:9.1f}"
              f" {np.median([c[3] for c in mine]) * 1e6:8.1f}")


async def _row(setup: b._Setup, iters: int, backend: str, bell: bool) -> None:
    ids = b._JobIds()
    # Around each submit: perf counter, thread and process CPU, before and after.
    marks: list[tuple[tuple[float, float, float], tuple[float, float, float]]] = []

    def submit(i: int) -> Any:
        before = (time.perf_counter(), time.thread_time(), time.process_time())
        fut = b._submit(w, setup, True, i, ids)
        marks.append((before, (time.perf_counter(), time.thread_time(), time.process_time())))
        return fut

    worker = AsyncOffloadingWorker(setup.kv, num_cpu_chunks=setup.chunks, backend=backend,
                                   options={"doorbell": bell})
    async with worker as w:
        polls.clear()
        naps.clear()
        calls.clear()
        stores = next(h for d, h in w._core.handlers.items() if d.to_host)
        out = await b._wakeups(w, submit, iters)
    # One job at a time: a job's polls and naps lie between its submit's return and the
    # next submit's start.
    spans = [(a[0], c[0], c[1] - a[1], c[2] - a[2]) for (_, a), (c, _) in itertools.pairwise(marks)][10:]
    print(f"  bench figures: wake-up p50 {out['wake50'] * 1e6:.0f} / p99 {out['wake99'] * 1e6:.0f} us, "
          f"window p50 {out['window50'] * 1e6:.0f} us, CPU {100 * out['cpu_wait']:.1f}%, "
          f"device {out['device'] * 1e6:.0f} us, polls/job {out['polls']:.0f}")
    _analyse(spans, stores)


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    cpu = "cpu" in sys.argv[2:]
    dev = torch.device("cpu" if cpu else "cuda")
    setups = [two_mib(dev)] if cpu else [two_mib(dev), one_alloc(dev)]
    if not cpu:
        _time_calls()
    runners: list[tuple[str, Any]] = [("asyncio", asyncio.run)]
    try:
        import uvloop

        runners.append(("uvloop", uvloop.run))
    except ImportError:
        pass
    for setup in setups:
        for name, run in runners:
            print(f"== {setup.name} job, default worker, {name}", flush=True)
            run(_row(setup, iters, "cpu" if cpu else "cuda", True))
    if "nobell" in sys.argv[2:]:
        print(f"== {setups[0].name} job, no doorbell, asyncio", flush=True)
        asyncio.run(_row(setups[0], iters, "cpu" if cpu else "cuda", False))


if __name__ == "__main__":
    main()
