"""How much of the event loop an arm takes while it serves: what a tier's work costs the loop.

Two figures, sampled on the loop thread during each measured turn: the loop thread's CPU
time over the turn's wall time (its busy share: the server's own work plus whatever a
cache or tier runs on the loop), and how late a short periodic sleep wakes (its lag: a
busy loop, or one waiting for the GIL behind another thread, wakes late, and so does
every completion a restore waits for). The host arm is the arm without a tier, so its
figures beside the disk and Redis arms' are what the tiers cost the loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import numpy as np

__all__ = ["PERIOD", "LoopWatch"]

PERIOD = 0.005
"""Seconds the lag probe sleeps between wake-ups (asyncio rounds a timer up to 1 ms)."""


@dataclass
class LoopWatch:
    """The loop thread's CPU seconds, wall seconds and wake-up lags, over the turns watched."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    lags: list[float] = field(default_factory=list)

    @property
    def busy(self) -> float:
        """The loop thread's CPU time over wall time (nan before anything was watched)."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    def lag_ms(self, q: float) -> float:
        """The ``q``-th percentile of the probe's wake-up lag, in ms (nan without samples)."""
        return float(np.percentile(self.lags, q)) * 1e3 if self.lags else float("nan")

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Watch the loop (call on it) for the duration of the block."""
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._probe)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self.cpu_s += time.thread_time() - cpu0
            self.wall_s += time.perf_counter() - wall0

    async def _probe(self) -> None:
        while True:
            t0 = time.perf_counter()
            await anyio.sleep(PERIOD)
            self.lags.append(max(0.0, time.perf_counter() - t0 - PERIOD))
