"""The native issuer thread's lag after a job's end, measured without a GPU: how long a
program submitted right after a completion waits for the thread's first driver call
(``Ticket.started_at - Ticket.queued_at``), with and without the waiter's nudge.

The pattern is a per-layer job's: the issuer thread issues a job and goes idle, the copy
runs for ``transfer_s`` (a sleep here), its end event completes, the lane's waiter wakes
from its wait and rings the doorbell, the loop wakes to the ring and submits the next job.
Every driver call is a C no-op, and the waiter's wait is libc's ``sem_wait`` on a
semaphore this thread posts as the "completion", so no native thread needs Python. With
``nudge_us`` the waiter wakes the issuer into a spin as it rings, so the submit finds it
awake; without it the submit has to wake the thread from its futex sleep
(docs/native.md, "The issuer"; docs/performance.md, "Host side").

    PYTHONPATH=$PWD python -m aiokv.bench.hostside_wakeup --rounds 6 --jobs 200
"""

from __future__ import annotations

import argparse
import ctypes
import select
import statistics
import time
from typing import Any

from ..backends.cuda import native
from ..doorbell import Doorbell

__all__ = ["issuer_lags", "main"]

# Fake CUmemcpyAttributes addresses (never read: no batch is made) and the handles used.
_ATTRS = (0xA0, 0xA1, 0xA2, 0xA3)
_MAIN, _RESCUE, _END, _BELL_STREAM = 0x100, 0x300, 0x3E0, 0x77
_OP_RECORD, _WORDS = 2, 8
_ORDER = ("cuStreamWaitEvent", "cuEventRecord", "cuMemcpyAsync", "cuLaunchKernel", "cuMemcpyBatchAsync",
          "cuMemcpy3DBatchAsync", "cuEventSynchronize", "cuEventCreate", "cuEventDestroy", "cuCtxSetCurrent")


class _Semaphore:
    """One POSIX semaphore: the waiter's event. Posting it keeps the GIL."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._buf = ctypes.create_string_buffer(64)
        libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        libc.sem_init.restype = ctypes.c_int
        if libc.sem_init(ctypes.addressof(self._buf), 0, 0) != 0:
            raise OSError("sem_init failed")
        self.address = ctypes.addressof(self._buf)
        self.wait_address = int(ctypes.cast(libc.sem_wait, ctypes.c_void_p).value or 0)
        post = ctypes.PyDLL(None).sem_post
        post.argtypes, post.restype = [ctypes.c_void_p], ctypes.c_int
        self._post = post

    def post(self) -> None:
        if self._post(self.address) != 0:
            raise OSError("sem_post failed")


def _tables(sem: _Semaphore) -> tuple[Any, Any, Any]:
    """(the issuer's table: every call a C no-op; the waiter's: its one event is ``sem``,
    its wait ``sem_wait``; the callback that hands the event out, kept alive)."""
    ext = native.helper()
    fakes = ext.FAKES
    procs = [fakes["noop"]] * len(_ORDER)
    procs[_ORDER.index("cuEventCreate")] = fakes["event_create"]
    issuer_table = ext.Table(tuple(procs), 13000, _ATTRS, 0)

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint)
    def create(out: int | None, flags: int) -> int:  # once, on the arming (this) thread
        ctypes.c_void_p.from_address(out or 0).value = sem.address
        return 0

    waiter_procs = list(procs)
    waiter_procs[_ORDER.index("cuEventCreate")] = int(ctypes.cast(create, ctypes.c_void_p).value or 0)
    waiter_procs[_ORDER.index("cuEventSynchronize")] = sem.wait_address
    return issuer_table, ext.Table(tuple(waiter_procs), 13000, _ATTRS, 0), create


def _program(rows: int = 8) -> list[int]:
    words: list[int] = []
    for i in range(rows):
        words += [_OP_RECORD, 0xE0 + i, _MAIN, 0, 0, 0, 0, 0]
    return words


def issuer_lags(nudge_us: float, jobs: int = 200,
                transfer_s: float = 5e-3) -> tuple[list[float], dict[str, Any]]:
    """Seconds from each submit's return to the issuer thread's first driver call, for
    ``jobs`` submits each made as soon as the doorbell rang the previous job's end; and the
    issuer's ``stats()`` after them (its spin seconds, programs found while spinning)."""
    if native.helper() is None:
        raise RuntimeError("needs the native helper built (python setup.py build_ext --inplace)")
    sem = _Semaphore()
    issuer_table, waiter_table, keep = _tables(sem)
    bell = Doorbell()
    waiter = native.NativeWaiter(waiter_table, _BELL_STREAM, slots=1)
    issuer = native.NativeIssuer(issuer_table, waiter, spin_us=20.0, nudge_us=nudge_us)
    words = _program()
    lags: list[float] = []
    try:
        for _ in range(jobs):
            ticket = issuer.submit(words, (), _MAIN, _RESCUE, _END, False)
            if not ticket.wait(10.0):
                raise RuntimeError("the issuer did not issue within 10 s")
            if ticket.started_at is not None:
                lags.append(ticket.started_at - ticket.queued_at)
            if waiter.watch(_END, bell.ring_fd()) != 0:  # the poller naps: the job asks for a ring
                raise RuntimeError("the waiter refused a ring")
            time.sleep(transfer_s)  # the copy runs; the issuer thread goes to sleep meanwhile
            sem.post()  # the job's end event completes: the waiter wakes and rings
            select.select([bell.fileno()], [], [], 10.0)  # the loop wakes to the ring
            bell.drain()
        issuer.drain(10.0)
        # The waiter nudges after writing the ring, so the loop can see the last ring before
        # its nudge is counted; it counts the ring itself after the nudge, under one lock.
        deadline = time.monotonic() + 10.0
        while waiter.stats()["rung"] < jobs:
            if time.monotonic() > deadline:
                raise RuntimeError("the waiter did not finish its rings within 10 s")
            time.sleep(1e-4)
        stats = issuer.stats()
    finally:
        issuer.close()
        waiter.close()
        bell.close()
    del keep
    return lags[1:], stats  # the first lag came after no completion


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4, help="alternating runs of each setting")
    parser.add_argument("--jobs", type=int, default=200, help="jobs per run")
    parser.add_argument("--nudge-us", type=float, default=300.0, help="the nudged runs' spin window")
    args = parser.parse_args(argv)
    for r in range(args.rounds):
        for nudge in (0.0, args.nudge_us):
            found, stats = issuer_lags(nudge, args.jobs)
            lags = sorted(found)
            p50 = statistics.median(lags) * 1e6
            p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1e6
            spin = stats["spin_seconds"] / args.jobs * 1e6
            print(f"round {r}  nudge_us {nudge:6.0f}  issuer lag p50 {p50:8.2f} us  p99 {p99:8.2f} us  "
                  f"found spinning {stats['spin_picked']:4d}/{args.jobs}  spin {spin:6.1f} us/job")


if __name__ == "__main__":
    main()
