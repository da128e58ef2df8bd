"""The server loop of one arm: requests arrive on the clock, one model serves them in order.

An arrival task releases each request of a segment at its (compressed) arrival time; the
engine takes them first come, first served. For each it finds the leading blocks the GPU
prefix cache holds, asks the source below (an ``OffloadCache``, or the layerwise arm's
host pool) for the next ones, takes the request's whole block table and restores into it,
prefills the rest over that cached prefix, and stamps the first token. One request is
served at a time (its first token before the next one's lookup), so a server has at most
one forward in flight; its forwards run on the server's model thread
(``runner.ModelThread``), every arm's the same way. A layerwise load is submitted once the
prefill's inputs are prepared, the forward is handed to the model thread right after it,
and the load is not awaited: the model gates each layer on its copy. The request's full
blocks are then offloaded in the background while the next request runs; they stay held
in the GPU pool until that copy is over. A request's TTFT runs from its arrival, so time queued behind
earlier requests counts. A segment ends once its requests are served and its copies (and
tier writes) have settled, so the arms can take turns on the machine. Only the public API
of aiokv is used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import torch

from ...layer_timeline import LayerTimeline
from .loopwatch import LoopWatch
from .measure import Device
from .model import BLOCK_TOKENS, LlamaModel
from .pool import BlockPool
from .runner import ModelThread
from .sources import Restored, Source
from .workload import ServeRequest

__all__ = ["HIT_CLASSES", "Served", "Server"]

HIT_CLASSES = ("miss", "gpu", "host", "disk")
"""A request's class is the lowest tier any of its reused blocks came from."""


@dataclass
class Served:
    """What one measured request saw; times in seconds on the compressed trace clock (the
    measured part's first arrival is 0), in the segment it was served in."""

    index: int
    prompt: int
    reusable: int
    arrival: float
    start: float
    first_token: float
    token: int
    gpu_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    prefill_s: float = 0.0
    load_s: float = 0.0
    segment: int = 0
    stall_s: float = 0.0  # of prefill_s, waiting on layerwise loads' layers
    recomputed: int = 0  # tokens restored by a load that failed, then computed
    wall: float = 0.0  # when its service began, in seconds since the arms opened
    late_failure: bool = False  # a layerwise load failed after the forward had read it
    submit_s: float = 0.0  # host seconds a layerwise load's submit took
    forward_start_s: float | None = None  # host seconds from that submit to the forward's first gate
    # forward_start_s = submit_s + handover_s + first_gate_s (host clock):
    handover_s: float | None = None  # the submit's return to the model thread beginning the forward
    first_gate_s: float | None = None  # that to the first gate (layer 0's work before the prefix)
    timeline: LayerTimeline | None = None  # a layerwise load's, once it ended

    @property
    def compute_s(self) -> float:
        """Prefill seconds less the time it waited on layers: the model's own work."""
        return self.prefill_s - self.stall_s

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def busy(self) -> float:
        """Seconds the model was taken by this request (restore included)."""
        return self.first_token - self.start

    @property
    def computed(self) -> int:
        return self.prompt - self.gpu_tokens - self.host_tokens - self.disk_tokens

    @property
    def hit(self) -> str:
        if self.disk_tokens:
            return "disk"
        if self.host_tokens:
            return "host"
        return "gpu" if self.gpu_tokens else "miss"


@dataclass
class Server:
    """One arm's server: the model, its paged KV, a pool, and the source below it.

    ``oracle`` maps a request index to the tokens another arm served from its GPU cache,
    host and disk; such a server allocates blocks for them and prefills only the rest,
    moving nothing: the same hits at zero transfer time.
    """

    model: LlamaModel
    kv: Sequence[torch.Tensor]
    device: Device
    pool: BlockPool
    source: Source | None = None
    oracle: dict[int, tuple[int, int, int]] | None = None
    progress: Callable[[str], None] = lambda _msg: None
    stalls: list[float] = field(default_factory=list)
    epoch: float = field(default_factory=time.perf_counter)
    loop: LoopWatch = field(default_factory=LoopWatch)  # the loop's load in measured turns
    runner: ModelThread | None = None  # the model thread (one of its own unless given)
    _offloads: int = field(default=0, init=False)
    _clock0: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.runner is None:
            self.runner = ModelThread(self.device)

    async def aclose(self) -> None:
        """Stop the model thread (after the forward it runs, if any)."""
        assert self.runner is not None
        await self.runner.aclose()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def warm(self, requests: Sequence[ServeRequest]) -> None:
        """Serve the warm-up requests back to back (untimed) and let their copies settle."""
        self._clock0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, req in enumerate(requests):
                await self._serve(req, tg, arrival=self._now())
                if i % 100 == 99:
                    self.progress(f"  warm-up {i + 1}/{len(requests)}")
            await self._settle()
        self.stalls.clear()  # the measured requests' only

    async def serve(self, requests: Sequence[ServeRequest], segment: int = 0) -> list[Served]:
        """Replay ``requests`` on the clock from the first one's arrival, then settle."""
        out: list[Served] = []
        if not requests:
            return out
        async with self.loop.watching(), anyio.create_task_group() as tg:
            send, receive = anyio.create_memory_object_stream[tuple[ServeRequest, float]](math.inf)
            self._clock0 = time.perf_counter() - requests[0].arrival
            tg.start_soon(self._arrivals, list(requests), send)
            async with receive:
                async for req, arrival in receive:
                    out.append(await self._serve(req, tg, arrival=arrival, segment=segment))
            await self._settle()
        return out

    async def _arrivals(self, requests: list[ServeRequest],
                        send: anyio.abc.ObjectSendStream[tuple[ServeRequest, float]]) -> None:
        async with send:
            for req in requests:
                delay = req.arrival - self._now()
                if delay > 0:
                    await anyio.sleep(delay)
                await send.send((req, req.arrival))  # stamped when due, not when noticed

    def _now(self) -> float:
        return time.perf_counter() - self._clock0

    async def _settle(self) -> None:
        """Wait for the offloads in flight and the tier writes behind them."""
        while self._offloads:
            await anyio.sleep(0.001)
        if self.source is not None:
            await self.source.drain()

    async def _serve(self, req: ServeRequest, tg: anyio.abc.TaskGroup, *, arrival: float,
                     segment: int = 0) -> Served:
        start, wall = self._now(), time.perf_counter() - self.epoch
        pool, n = self.pool, req.cacheable_blocks
        gpu = pool.match(req.keys[:n])
        blocks = -(-len(req.tokens) // BLOCK_TOKENS)
        got, planned = Restored(0), None
        if self.oracle is not None:
            gpu_t, host_t, disk_t = self.oracle.get(req.index, (0, 0, 0))
            got = Restored(host_t // BLOCK_TOKENS, disk_t // BLOCK_TOKENS)
            gpu = await pool.take_waiting(gpu_t // BLOCK_TOKENS)
            table = gpu + await pool.take_waiting(blocks - len(gpu))
        else:
            hits, rest = 0, req.keys[len(gpu):n]
            if self.source is not None and rest:
                hits = await self.source.alookup(rest)
            # The whole block table before anything moves, as an engine's scheduler has it.
            table = gpu + await pool.take_waiting(blocks - len(gpu))
            if hits:
                reused = table[len(gpu):len(gpu) + hits]
                assert self.source is not None
                planned = self.source.plan(rest[:hits], reused)
                if planned is None:
                    got = await self.source.restore(rest[:hits], reused)
                else:
                    got = planned.restored
        begin = (len(gpu) + got.host + got.disk) * BLOCK_TOKENS
        runner = self.runner
        assert runner is not None
        try:
            # The forward's inputs are ready before a layerwise load is submitted, and the
            # forward is launched right after it, as an engine's model runner does.
            prepared = self.device.prepare(self.model, req.tokens[begin:], begin, table)
            gate = planned.submit() if planned is not None else got.gate
            ran = await runner.prefill(self.model, req.tokens[begin:], begin, table, self.kv, gate=gate,
                                       prepared=prepared)
            token, prefill_s = ran.token, ran.seconds
        finally:
            if planned is not None:
                planned.cancel()
        stalls = got.take_stalls() if got.take_stalls is not None else []
        recomputed = 0
        if got.failed:  # a layer failed under the forward: what it read there is wrong
            if got.end is not None:
                await got.end()
            recomputed, begin = got.host * BLOCK_TOKENS, len(gpu) * BLOCK_TOKENS
            got.host = 0
            again = await runner.prefill(self.model, req.tokens[begin:], begin, table, self.kv)
            token, prefill_s = again.token, prefill_s + again.seconds
        first = self._now()  # the gates passed: the first token needs nothing more of the load
        self.stalls += stalls
        full = len(req.keys)
        pool.register(req.keys, table[:full])
        if self.source is not None and full:
            pool.hold(table[:full])
            self._offloads += 1
            tg.start_soon(self._offload, req.keys, table[:full])
        pool.release(table)
        served = Served(req.index, len(req.tokens), req.reusable, arrival, start, first, token,
                        gpu_tokens=len(gpu) * BLOCK_TOKENS, host_tokens=got.host * BLOCK_TOKENS,
                        disk_tokens=got.disk * BLOCK_TOKENS, prefill_s=prefill_s, load_s=got.load_s,
                        segment=segment, stall_s=min(sum(stalls), prefill_s), recomputed=recomputed,
                        wall=wall, submit_s=got.submit_s, forward_start_s=got.forward_start_s)
        if got.forward_start_s is not None and got.submitted_at:  # the forward start's parts
            served.handover_s = ran.began - got.submitted_at - got.submit_s
            served.first_gate_s = got.forward_start_s - got.submit_s - served.handover_s
        if got.end is not None and not got.failed:
            tg.start_soon(self._end_load, got, served)
        return served

    async def _end_load(self, got: Restored, served: Served) -> None:
        """A layerwise load's end, off the first token's path: its copy time, and whether a
        layer failed after its gate passed (on CUDA a copy can fail after the wait was
        enqueued: that request's output was computed from wrong bytes)."""
        ok = await got.end()  # type: ignore[misc]
        served.load_s = got.load_s
        served.late_failure = not ok
        if got.timeline is not None:  # the prefill ran past every gate: their marks are in
            served.timeline = got.timeline()

    async def _offload(self, keys: list[int], blocks: list[int]) -> None:
        try:
            await self.source.offload(keys, blocks)  # type: ignore[union-attr]
        finally:
            self.pool.release(blocks)
            self._offloads -= 1
