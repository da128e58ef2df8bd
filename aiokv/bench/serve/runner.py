"""A server's model thread: one persistent thread that launches forwards in arrival order,
as an engine's model runner does, and never waits for one to end.

The event loop prepares a forward's inputs and submits its layerwise load (unless it was
submitted early, while the request waited for the model), then hands the forward over
through a queue the idle thread sleeps on (anyio's worker pool would hand it to whichever
pool thread wakes, behind a capacity limiter). Where the thread was idle, the loop's
thread then parks (GIL released) until the forward has written layer 0's new K and
V, the point where a layerwise forward gates on its first layer: an engine's model runner
submits and launches on one thread, and with the loop back at its other tasks the model
thread would wait for the GIL (up to a switch interval, 5 ms) before it launched anything.
Every forward parks the loop the same way, whatever its arm. On CUDA the thread enqueues
the forward's kernels between two timing events and takes the next forward at once; a
second thread waits for each end event in launch order (the stream runs them in that
order) and hands the first token back to the loop. On the CPU the forward is the work:
the model thread computes it and hands it back itself, and the next one waits for it as
it would queue behind it on a device's stream.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

from ...errors import UsageError
from ...loops import LoopEvent, loop_event, loop_library
from .measure import Device, Gate, Launched, Prepared
from .model import LlamaModel

__all__ = ["ModelThread", "Prefilled"]

PARK_S = 0.02
"""The longest the loop's thread stays parked on a hand-over (a bound, not a timing)."""


@dataclass(frozen=True)
class Prefilled:
    """One prefill's first token, the device seconds it spent (``Device.finish``) and when
    the model thread began it (``time.perf_counter``)."""

    token: int
    seconds: float
    began: float


@dataclass
class _Forward:
    """One forward on its way through the threads, and how its result goes back."""

    launch: Callable[[], Launched]
    call_soon: Callable[[Callable[[], object]], object]  # the loop's, from any thread
    done: LoopEvent
    taken: threading.Event | None = None
    began: float = 0.0
    result: tuple[int, float] | None = None
    error: BaseException | None = None
    cancelled: bool = False
    launched: Launched | None = field(default=None, repr=False)

    def deliver(self) -> None:
        """Wake the awaiting task (on its loop's thread); a closed loop has nobody waiting."""
        try:
            self.call_soon(self.done.set)
        except Exception:  # the loop ended: nothing awaits this forward any more
            pass


class ModelThread:
    """One server's model thread (module docs). ``prefill`` from the loop's thread;
    ``aclose`` stops it: forwards queued but not begun fail with ``UsageError`` (closed),
    the one running ends first. Started on the first forward."""

    def __init__(self, device: Device, name: str = "aiokv-model") -> None:
        self.device, self.name = device, name
        self._forwards: queue.SimpleQueue[_Forward | None] = queue.SimpleQueue()
        self._ends: queue.SimpleQueue[_Forward | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        # Forwards handed over and launched: each count written by one thread only.
        self._handed = self._launched = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    async def prefill(self, model: LlamaModel, tokens: np.ndarray, start: int, table: Sequence[int],
                      kv: Sequence[torch.Tensor], *, gate: Gate | None = None,
                      after_layer: Gate | None = None, prepared: Prepared | None = None) -> Prefilled:
        """``Device.prefill_sync`` on the model thread, after the forwards handed over before
        it; the loop is free meanwhile, but for the park (module docs). Raises what the
        forward raised, or ``UsageError`` (closed)."""
        if self._closed:
            raise UsageError(f"{self.name} is closed")
        if not self._threads:
            self._start()
        device = self.device

        idle = self._handed == self._launched  # none queued, none launching
        parked = threading.Event() if idle else None
        mark = after_layer
        if parked is not None:
            def mark(i: int) -> object:
                if i == 0:
                    parked.set()
                return after_layer(i) if after_layer is not None else None

        def launch() -> Launched:
            return device.launch(model, tokens, start, table, kv, gate, mark, prepared)

        fwd = _Forward(launch, _call_soon(), loop_event(), taken=parked)
        self._handed += 1
        self._forwards.put(fwd)
        if parked is not None:
            parked.wait(PARK_S)
        try:
            await fwd.done.wait()
        except BaseException:
            fwd.cancelled = True  # not begun: the thread skips it; begun: it runs out unawaited
            raise
        if fwd.error is not None:
            raise fwd.error
        assert fwd.result is not None
        return Prefilled(*fwd.result, began=fwd.began)

    async def aclose(self) -> None:
        """Stop the threads once the forward running ends; never cancelled half way."""
        self._closed = True
        if not self._threads:
            return
        self._forwards.put(None)
        with anyio.CancelScope(shield=True):
            while self.running:
                await anyio.sleep(0.001)  # the loop stays free: a gate may need its copies

    async def __aenter__(self) -> ModelThread:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _start(self) -> None:
        self._threads.append(threading.Thread(target=self._launcher, name=self.name, daemon=True))
        if self.device.kind == "cuda":
            self._threads.append(threading.Thread(target=self._waiter, name=f"{self.name}-ends", daemon=True))
        for t in self._threads:
            t.start()

    def _launcher(self) -> None:
        """Launch each forward in arrival order; on CUDA hand its end to the waiter."""
        cuda = self.device.kind == "cuda"
        try:
            while (fwd := self._forwards.get()) is not None:
                fwd.began = time.perf_counter()
                if self._closed or fwd.cancelled:
                    fwd.error = UsageError(f"{self.name} closed before this forward began")
                else:
                    try:
                        fwd.launched = fwd.launch()
                        if not cuda:
                            fwd.result = self.device.finish(fwd.launched)
                    except BaseException as exc:  # its request's, not the thread's: a dead
                        fwd.error = exc  # thread would leave this request and all after it hanging
                self._launched += 1
                if fwd.taken is not None:
                    fwd.taken.set()  # the loop parks no longer than this forward's launch
                if cuda and fwd.error is None:
                    self._ends.put(fwd)
                else:
                    fwd.deliver()
        finally:
            self._ends.put(None)

    def _waiter(self) -> None:
        """Wait for each launched forward's end event, in launch order, and hand it back."""
        while (fwd := self._ends.get()) is not None:
            try:
                assert fwd.launched is not None
                fwd.result = self.device.finish(fwd.launched)
            except BaseException as exc:  # a CUDA error fails the request (and the waiter
                fwd.error = exc  # lives on: the ends after it are still handed back)
            fwd.launched = None
            fwd.deliver()


def _call_soon() -> Callable[[Callable[[], object]], Any]:
    """The running loop's thread-safe "call this soon" (it never blocks the caller)."""
    if loop_library() == "trio":
        import trio.lowlevel

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe
