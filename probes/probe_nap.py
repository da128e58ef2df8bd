"""What one nap on the doorbell's alarm costs: how late it ends and the CPU it takes.

Each way of napping below sleeps until the bell's ``timerfd`` alarm goes off 4.4 ms out
(about a 2 MiB-page job's nap), then drains it; per nap it records the lateness (wake ->
the alarm's time) and the napping thread's CPU time, and prints p10/p50/p90 (us):

- ``time.sleep``: no descriptor at all (the host's floor for waking a sleeping thread);
- ``epoll``: a thread blocked in ``epoll.poll`` on the bell (the kernel's floor with the fd);
- ``anyio``: what the poller does, ``anyio.wait_readable`` inside ``move_on_after``;
- ``reader``: a reader registered once with the loop (``add_reader``) that resolves a
  future per nap, with a ``call_later`` backstop;

the last two on asyncio and, where installed, uvloop. Needs no GPU (Linux only):
``python3 probes/probe_nap.py [naps, default 200]``.
"""

import asyncio
import select
import sys
import time
from collections.abc import Callable

import anyio
import numpy as np

from aiokv.doorbell import Doorbell

NAP = 4.4e-3


def _row(name: str, late: list[float], cpu: list[float]) -> None:
    q = lambda xs: " ".join(f"{np.percentile(xs, p) * 1e6:6.0f}" for p in (10, 50, 90))  # noqa: E731
    print(f"{name:<22} late {q(late)}   CPU {q(cpu)}", flush=True)


def _sleep(naps: int) -> None:
    late, cpu = [], []
    for _ in range(naps):
        t0, c0 = time.perf_counter(), time.thread_time()
        time.sleep(NAP)
        late.append(time.perf_counter() - t0 - NAP)
        cpu.append(time.thread_time() - c0)
    _row("time.sleep", late, cpu)


class _Naps:
    """Times naps on one bell's alarm: CPU from ``begin`` to ``end``, lateness past it."""

    def __init__(self, bell: Doorbell) -> None:
        self.bell = bell
        self.late: list[float] = []
        self.cpu: list[float] = []

    def begin(self) -> None:
        self._c0 = time.thread_time()
        self._target = time.perf_counter() + NAP
        self.bell.set_alarm(NAP)

    def end(self) -> None:
        self.late.append(time.perf_counter() - self._target)
        self.cpu.append(time.thread_time() - self._c0)

    def report(self, name: str) -> None:
        self.bell.close()
        _row(name, self.late, self.cpu)


def _epoll(naps: int) -> None:
    timing, ep = _Naps(Doorbell()), select.epoll()
    ep.register(timing.bell.fileno(), select.EPOLLIN)
    for _ in range(naps):
        timing.bell.drain()
        timing.begin()
        ep.poll(0.01)
        timing.end()
    ep.close()
    timing.report("epoll")


async def _anyio(naps: int, label: str) -> None:
    timing = _Naps(Doorbell())
    for _ in range(naps):
        timing.bell.drain()
        timing.begin()
        with anyio.move_on_after(0.01):
            await anyio.wait_readable(timing.bell.fileno())
        timing.end()
    timing.report(f"anyio, {label}")


async def _reader(naps: int, label: str) -> None:
    timing, loop = _Naps(Doorbell()), asyncio.get_running_loop()
    bell = timing.bell
    waiter: list[asyncio.Future[None] | None] = [None]

    def rung() -> None:
        bell.drain()
        fut = waiter[0]
        if fut is not None and not fut.done():
            fut.set_result(None)

    loop.add_reader(bell.fileno(), rung)
    for _ in range(naps):
        timing.begin()
        fut = waiter[0] = loop.create_future()
        backstop = loop.call_later(0.01, lambda f=fut: f.done() or f.set_result(None))
        await fut
        backstop.cancel()
        timing.end()
    loop.remove_reader(bell.fileno())
    timing.report(f"reader, {label}")


def main() -> None:
    naps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    _sleep(naps)
    _epoll(naps)
    runners: list[tuple[str, Callable]] = [("asyncio", asyncio.run)]
    try:
        import uvloop

        runners.append(("uvloop", uvloop.run))
    except ImportError:
        pass
    for label, run in runners:
        run(_anyio(naps, label))
        run(_reader(naps, label))


if __name__ == "__main__":
    main()
