"""The server of one arm: requests arrive on the clock, one model serves them, and a
request whose KV is still loading never holds the model.

An arrival task releases each request of a segment at its (compressed) arrival time. The
server then runs three stages, as an engine's scheduler does with requests whose KV loads
asynchronously (vLLM parks them in WAITING_FOR_REMOTE_KVS and schedules the others):

1. **Admission**, in arrival order: the leading blocks the GPU prefix cache holds, the
   source below (an ``OffloadCache``, or the layerwise arm's host pool) asked for the next
   ones, and the request's whole block table taken at once. Only the head of the
   admission queue waits for blocks (``BlockPool.take_waiting``), so two requests never
   each hold part of the pool waiting for the rest. At most ``ahead`` requests are
   between admission and the model (``AHEAD``).
2. **Restore**, one task per request, concurrently: the awaited restore of its host,
   disk or Redis hits into its table. A layerwise load is planned (its chunks pinned);
   if its forward cannot start now (the model busy, or others admitted before it still
   waiting), it is submitted here and not awaited, so its copy runs while the request
   waits, as the host arm's restore does; else it is submitted right before its forward
   (stage 3). The oracle moves nothing. A restore (or such a submit) that raises is a
   miss: its tokens are computed (``Served.recomputed``).
3. **Model**, one forward at a time on the server's model thread
   (``runner.ModelThread``), every arm's the same way: of the requests whose restore is
   over, the earliest arrival first (a later arrival goes ahead of an earlier one only
   while the earlier one's restore is still running). The forward's inputs are prepared,
   a layerwise load not yet submitted is submitted, and the forward handed to the model
   thread right after it, so an idle model starts as early as it can; the load is not
   awaited: the model gates each layer on its copy (one landed passes at once). The first
   token is stamped, the request's full blocks are registered in the GPU prefix cache and
   offloaded in the background; they stay held in the GPU pool until that copy is over.

A request's TTFT runs from its arrival, so waits for admission, for its restore and for
the model all count (``Served`` splits them). A segment ends once its requests are served
and its copies (and tier writes) have settled, so the arms can take turns on the machine.
Whatever ends a run (its end, a cancel, an error in a forward), every block a request
held is given back once, after the source drained if a copy into it may still run (a
restore cut half way, a layerwise load submitted for a request never forwarded). Only
the public API of aiokv is used.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import torch

from .loopwatch import LoopWatch
from .measure import Device
from .model import BLOCK_TOKENS, LlamaModel
from .pool import BlockPool
from .runner import ModelThread
from .served import Served
from .sources import PlannedLoad, Restored, Source
from .workload import ServeRequest

__all__ = ["AHEAD", "Server"]

AHEAD = 4
"""Requests between admission and the model at most: admitted, their restores running or
over, not yet taken by the model. Each holds its whole block table, and the GPU pool is
sized for the prefix cache plus one largest request, so tables taken far ahead of the
model only evict cached prefixes it will want; four let a request pass up to three slow
tier restores ahead of it, and keep the tier reads in flight to the few the tier's own
threads serve at once."""


@dataclass(eq=False)
class _Admitted:
    """A request past admission: its whole block table held, its restore running or over."""

    req: ServeRequest
    arrival: float
    start: float
    wall: float
    gpu: list[int]
    table: list[int]
    hits: int = 0  # leading blocks after the GPU's the source said it holds
    seq: int = 0  # admission order (ties of arrival)
    got: Restored = field(default_factory=lambda: Restored(0))
    planned: PlannedLoad | None = None
    restoring: bool = False  # a restore began or a load was submitted (its copies may outlive a cancel)
    ready: float = 0.0
    recomputed: int = 0
    restore_error: str = ""
    blocks_wait: float = 0.0  # seconds its admission waited for blocks other requests held
    load_at: float | None = None  # when its awaited restore began
    held: bool = True  # the table's holds not yet given back
    served: Served | None = None


@dataclass(eq=False)
class _Stages:
    """What the stages of one run share (all on the loop's thread)."""

    slots: anyio.Semaphore
    admitted: list[_Admitted] = field(default_factory=list)
    ready: list[tuple[float, int, _Admitted]] = field(default_factory=list)  # by arrival: a heap
    waiting: int = 0  # admitted, not yet taken by the model
    busy: bool = False  # the model stage has taken a request and runs its forward
    admitting: bool = True
    changed: anyio.Event = field(default_factory=anyio.Event)

    def push(self, adm: _Admitted) -> None:
        heapq.heappush(self.ready, (adm.arrival, adm.seq, adm))
        self.wake()

    def wake(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


@dataclass
class Server:
    """One arm's server: the model, its paged KV, a pool, and the source below it.

    ``oracle`` maps a request index to the tokens another arm served from its GPU cache,
    host and disk; such a server allocates blocks for them and prefills only the rest,
    moving nothing: the same hits at zero transfer time. ``ahead`` bounds the requests
    between admission and the model (``AHEAD``).
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
    ahead: int = AHEAD
    _offloads: int = field(default=0, init=False)
    _clock0: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.ahead < 1:
            raise ValueError(f"a server admits at least one request ahead of the model, got {self.ahead}")
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
        """Serve the warm-up requests back to back (untimed), each once the one before has
        its first token, so the caches they leave do not hang on how fast a restore was,
        and let their copies settle."""
        self._clock0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, req in enumerate(requests):
                send, receive = anyio.create_memory_object_stream[tuple[ServeRequest, float]](1)
                send.send_nowait((req, self._now()))
                send.close()
                await self._run(receive, tg)
                if i % 100 == 99:
                    self.progress(f"  warm-up {i + 1}/{len(requests)}")
            await self._settle()
        self.stalls.clear()  # the measured requests' only

    async def serve(self, requests: Sequence[ServeRequest], segment: int = 0) -> list[Served]:
        """Replay ``requests`` on the clock from the first one's arrival, then settle; what
        each saw, in arrival order."""
        if not requests:
            return []
        async with self.loop.watching(), anyio.create_task_group() as tg:
            send, receive = anyio.create_memory_object_stream[tuple[ServeRequest, float]](math.inf)
            self._clock0 = time.perf_counter() - requests[0].arrival
            tg.start_soon(self._arrivals, list(requests), send)
            out = await self._run(receive, tg, segment)
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

    # -- the stages ------------------------------------------------------------------------

    async def _run(self, receive: anyio.abc.ObjectReceiveStream[tuple[ServeRequest, float]],
                   tg: anyio.abc.TaskGroup, segment: int = 0) -> list[Served]:
        """Admit what ``receive`` brings in order, restore concurrently, forward one at a
        time (module docs); the background copies go to ``tg``. What each request saw, in
        arrival order; on any way out, the blocks of requests not served are given back."""
        st = _Stages(anyio.Semaphore(self.ahead))
        try:
            async with anyio.create_task_group() as stages:
                stages.start_soon(self._model_stage, st, tg, segment)
                async with receive:
                    async for req, arrival in receive:
                        await st.slots.acquire()  # given back when the model takes one
                        adm = await self._admit(req, arrival)
                        adm.seq = len(st.admitted)
                        st.admitted.append(adm)
                        early = adm.planned is not None and (st.busy or st.waiting > 0)  # its forward waits
                        st.waiting += 1
                        if early:  # its restore stage: the copy runs while it waits
                            self._submit_early(adm)
                        if adm.hits and adm.planned is None and not early:
                            stages.start_soon(self._restore, adm, st)
                        else:  # nothing to await: a miss, a layerwise load (submitted or not), the oracle
                            adm.ready = self._now()
                            st.push(adm)
                st.admitting = False
                st.wake()
        finally:
            left = [adm for adm in st.admitted if adm.held]
            if left:
                with anyio.CancelScope(shield=True):
                    await self._give_back(left)
        return [adm.served for adm in st.admitted if adm.served is not None]

    async def _admit(self, req: ServeRequest, arrival: float) -> _Admitted:
        """Its GPU prefix hits, the source's hits after them, and its whole block table,
        taken at once: only this request (the head) waits for blocks meanwhile."""
        start, wall = self._now(), time.perf_counter() - self.epoch
        pool, n = self.pool, req.cacheable_blocks
        blocks = -(-len(req.tokens) // BLOCK_TOKENS)
        if self.oracle is not None:
            gpu_t, host_t, disk_t = self.oracle.get(req.index, (0, 0, 0))
            t0 = self._now()
            table = await pool.take_waiting(blocks)  # nothing cached: its "hits" are fresh blocks
            gpu = table[:gpu_t // BLOCK_TOKENS]
            return _Admitted(req, arrival, start, wall, gpu, table, blocks_wait=self._now() - t0,
                             got=Restored(host_t // BLOCK_TOKENS, disk_t // BLOCK_TOKENS))
        gpu = pool.match(req.keys[:n])
        try:
            hits, rest = 0, req.keys[len(gpu):n]
            if self.source is not None and rest:
                hits = await self.source.alookup(rest)
            # The whole block table before anything moves, as an engine's scheduler has it.
            t0 = self._now()
            table = gpu + await pool.take_waiting(blocks - len(gpu))
        except BaseException:
            pool.release(gpu)
            raise
        adm = _Admitted(req, arrival, start, wall, gpu, table, hits=hits, blocks_wait=self._now() - t0)
        if hits:
            assert self.source is not None
            try:
                adm.planned = self.source.plan(rest[:hits], table[len(gpu):len(gpu) + hits])
            except BaseException:
                pool.release(table)
                raise
            if adm.planned is not None:
                adm.got = adm.planned.restored
        return adm

    async def _restore(self, adm: _Admitted, st: _Stages) -> None:
        """The awaited restore of one request, beside the others' and the model's work."""
        assert self.source is not None
        rest = adm.req.keys[len(adm.gpu):len(adm.gpu) + adm.hits]
        adm.restoring = True
        adm.load_at = self._now()
        try:
            adm.got = await self.source.restore(rest, adm.table[len(adm.gpu):len(adm.gpu) + adm.hits])
        except Exception as exc:  # a tier that raised: a miss, the request computes its tokens
            adm.got, adm.recomputed = Restored(0), adm.hits * BLOCK_TOKENS
            adm.restore_error = f"{type(exc).__name__}: {exc}"
        adm.restoring = bool(adm.got.submitted_at)  # a layerwise source's load runs on past it
        adm.ready = self._now()
        st.push(adm)

    def _submit_early(self, adm: _Admitted) -> None:
        """The restore stage of a layerwise load whose forward cannot start now: its submit,
        on the loop's thread (the async face requires it), so the copy runs while the
        request waits for the model; its forward gates on the layers landed by then. A
        submit that raises is a miss, as a restore that raises."""
        assert adm.planned is not None
        adm.restoring = True  # it may write into the table from the submit on
        try:
            adm.planned.submit()
        except Exception as exc:
            adm.planned.cancel()
            adm.planned, adm.got, adm.recomputed = None, Restored(0), adm.hits * BLOCK_TOKENS
            adm.restore_error = f"{type(exc).__name__}: {exc}"

    async def _model_stage(self, st: _Stages, tg: anyio.abc.TaskGroup, segment: int) -> None:
        """One forward at a time: of the restored requests, the earliest arrival first."""
        while True:
            while not st.ready:
                if not st.admitting and st.waiting == 0:
                    return
                await st.changed.wait()
            await anyio.lowlevel.checkpoint_if_cancelled()  # a cancel runs no further forward
            _, _, adm = heapq.heappop(st.ready)
            st.waiting -= 1
            st.busy = True  # before the slot goes: a request admitted now finds the model busy
            st.slots.release()
            try:
                adm.served = await self._forward(adm, tg, segment)
            finally:
                st.busy = False

    async def _forward(self, adm: _Admitted, tg: anyio.abc.TaskGroup, segment: int) -> Served:
        """Its forward over what was restored; then its blocks cached, offloaded, released."""
        model_start = self._now()
        req, gpu, table, got, planned = adm.req, adm.gpu, adm.table, adm.got, adm.planned
        pool = self.pool
        begin = (len(gpu) + got.host + got.disk) * BLOCK_TOKENS
        runner = self.runner
        assert runner is not None
        at_start = planned is not None and not planned.submitted  # else submitted early, or none
        try:
            # The forward's inputs are ready before a layerwise load is submitted, and the
            # forward is launched right after it, as an engine's model runner does.
            prepared = self.device.prepare(self.model, req.tokens[begin:], begin, table)
            adm.restoring = adm.restoring or at_start  # its copies from the submit on
            gate = planned.submit() if planned is not None and at_start else got.gate
            # Shielded: a forward that began writes into the table until it ends, so a cancel
            # waits for it (one forward at most) before the table can go back.
            with anyio.CancelScope(shield=True):
                ran = await runner.prefill(self.model, req.tokens[begin:], begin, table, self.kv, gate=gate,
                                           prepared=prepared)
            token, prefill_s = ran.token, ran.seconds
        finally:
            if planned is not None:
                planned.cancel()
        stalls = got.take_stalls() if got.take_stalls is not None else []
        recomputed = adm.recomputed
        if got.failed:  # a layer failed under the forward: what it read there is wrong
            if got.end is not None:
                await got.end()
            recomputed, begin = got.host * BLOCK_TOKENS, len(gpu) * BLOCK_TOKENS
            got.host = 0
            with anyio.CancelScope(shield=True):  # as above
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
        adm.held = False
        pool.release(table)
        served = Served(req.index, len(req.tokens), req.reusable, adm.arrival, adm.start, first, token,
                        gpu_tokens=len(gpu) * BLOCK_TOKENS, host_tokens=got.host * BLOCK_TOKENS,
                        disk_tokens=got.disk * BLOCK_TOKENS, prefill_s=prefill_s, load_s=got.load_s,
                        segment=segment, stall_s=min(sum(stalls), prefill_s), recomputed=recomputed,
                        wall=adm.wall, submit_s=got.submit_s, forward_start_s=got.forward_start_s,
                        ready=adm.ready, model_start=model_start, restore_error=adm.restore_error,
                        blocks_wait=adm.blocks_wait, load_at=adm.load_at)
        served.early_submit = bool(got.submitted_at) and not at_start  # in its restore stage
        if got.forward_start_s is not None and got.submitted_at and at_start:  # the forward start's parts
            served.handover_s = ran.began - got.submitted_at - got.submit_s
            served.first_gate_s = got.forward_start_s - got.submit_s - served.handover_s
        if got.end is not None and not got.failed:
            tg.start_soon(self._end_load, got, served)
        return served

    async def _give_back(self, left: list[_Admitted]) -> None:
        """Release the tables of requests a run ended without serving (cancelled, or a
        forward raised). A restore cancelled half way, or a layerwise load submitted (in
        the restore stage, or under a forward that raised), may have copies still landing
        in its blocks: the source drains first (a source that fails to drain has nothing
        to wait for; a load's pins go when it ends). A planned layerwise load not
        submitted is unpinned."""
        if self.source is not None and any(adm.restoring for adm in left):
            try:
                await self.source.drain()
            except Exception:  # closed or broken: no copy of it is running
                pass
        for adm in left:
            if adm.planned is not None:
                adm.planned.cancel()
            adm.held = False
            self.pool.release(adm.table)

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
