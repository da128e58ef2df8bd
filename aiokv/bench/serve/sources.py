"""What serves a request's blocks that the GPU prefix cache lacks, for the tiered arms.

``CacheSource`` is an ``OffloadCache`` (host pool, and tiers below it): ``restore`` returns
once the blocks have landed. ``LayerwiseSource`` restores from the host with one layerwise
load per request, so the prefill starts at once and layer ``i`` waits (``gate(i)``) only
for its own copy. ``OffloadCache.restore`` is not layerwise and the cache does not say
which chunk holds a key, so this source keeps its own host index: a ``ChunkManager`` with
the cache's policy and admission and the same pool size, driven as ``OffloadCache`` drives
its own (a key becomes loadable once its store landed; chunks read by a load are pinned
until it ends), over the public ``AsyncOffloadingWorker`` calls.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass

from ...cache import ChunkManager
from ...cache.offload import DEFAULT_POLICY, OffloadCache
from ...errors import KeyNotLoadable, TransferFailed
from ...future import TransferFuture
from ...layer_timeline import LayerTimeline
from ...specs import CPULoadStoreSpec, GPULoadStoreSpec, LayerStatus
from ...worker import AsyncOffloadingWorker

__all__ = ["CacheSource", "LayerwiseSource", "PlannedLoad", "Restored", "Source"]


@dataclass
class Restored:
    """One restore: blocks that came from the host and from a tier, and its seconds: the
    wall time of ``OffloadCache.restore``, or a layerwise load's copy time (its wall time
    runs on beside the prefill).

    A layerwise restore also has the prefill's ``gate``, which sets ``failed`` when a layer
    failed (the prefill then read wrong bytes); ``take_stalls``, called right after the
    prefill, gives the seconds the forward waited on each layer after it was due; ``end``
    awaits the job and fills in ``load_s``: True if every layer landed; ``submit_s`` is the
    host time its submit took (from ``submitted_at``, ``time.perf_counter`` at its call),
    ``forward_start_s`` the host time from the submit's call to the forward's first gate
    (on the forward's thread: it has enqueued its work up to the first read of the
    prefix), and ``timeline`` (once it ended) the job's ``LayerTimeline``."""

    host: int
    disk: int = 0
    load_s: float = 0.0
    gate: Callable[[int], object] | None = None
    failed: bool = False
    take_stalls: Callable[[], list[float]] | None = None
    end: Callable[[], Awaitable[bool]] | None = None
    submit_s: float = 0.0
    submitted_at: float = 0.0
    forward_start_s: float | None = None
    timeline: Callable[[], LayerTimeline | None] | None = None


class Source:
    """The calls a server makes below its GPU pool (``OffloadCache``'s, by name)."""

    def lookup(self, keys: Sequence[int]) -> int:
        raise NotImplementedError

    async def alookup(self, keys: Sequence[int]) -> int:
        """``lookup``, and a round trip to any remote tier for the keys after the local run."""
        return self.lookup(keys)

    async def restore(self, keys: Sequence[int], blocks: list[int]) -> Restored:
        raise NotImplementedError

    def plan(self, keys: Sequence[int], blocks: list[int]) -> PlannedLoad | None:
        """A load the server submits and does not await (a layerwise source's): in the
        request's restore stage if its forward must wait, else once the forward's inputs
        are ready. None: ``restore`` then moves the blocks first."""
        return None

    async def offload(self, keys: Sequence[int], blocks: list[int]) -> None:
        raise NotImplementedError

    async def drain(self) -> None:
        raise NotImplementedError


class CacheSource(Source):
    """An ``OffloadCache``: restores return once every block has landed."""

    def __init__(self, cache: OffloadCache) -> None:
        self.cache = cache

    def lookup(self, keys: Sequence[int]) -> int:
        return self.cache.lookup(keys)

    async def alookup(self, keys: Sequence[int]) -> int:
        if any(tier.remote for tier in self.cache.tiers):  # what another server stored counts too
            return await self.cache.alookup(keys)
        return self.cache.lookup(keys)

    async def restore(self, keys: Sequence[int], blocks: list[int]) -> Restored:
        t0 = time.perf_counter()
        result = await self.cache.restore(keys, blocks)
        load_s = time.perf_counter() - t0
        disk = min(result.from_tiers, result.restored)
        return Restored(result.restored - disk, disk, load_s)

    async def offload(self, keys: Sequence[int], blocks: list[int]) -> None:
        await self.cache.offload(keys, blocks)

    async def drain(self) -> None:
        await self.cache.drain()


class LayerwiseSource(Source):
    """A host pool of its own, restored with layerwise loads (module docs)."""

    def __init__(self, worker: AsyncOffloadingWorker, num_chunks: int, policy: str | None = None) -> None:
        self.worker = worker
        self.manager = ChunkManager(num_chunks, policy=policy or DEFAULT_POLICY)
        self._ids = itertools.count(1)
        self._in_flight: set[TransferFuture] = set()
        self._stalls_seen = 0

    def lookup(self, keys: Sequence[int]) -> int:
        return self.manager.count_leading_hits(keys)

    async def restore(self, keys: Sequence[int], blocks: list[int]) -> Restored:
        """Submit one layerwise load of every layer and return at once."""
        planned = self.plan(keys, blocks)
        if planned is None:
            return Restored(0)
        planned.submit()
        return planned.restored

    def plan(self, keys: Sequence[int], blocks: list[int]) -> PlannedLoad | None:
        """Pin the keys' chunks for a load into ``blocks`` and return it unsubmitted (its
        ``restored`` says how many blocks it brings), or None if a key was evicted since
        the lookup (a miss, as the cache's). The server submits it early if the request
        must wait for the model, else after the forward's inputs, as an engine does."""
        try:
            chunks = self.manager.prepare_load(list(keys), touch=False)
        except KeyNotLoadable:
            return None
        return PlannedLoad(self, list(keys), chunks, blocks)

    def new_stalls(self) -> list[float]:
        """Stall samples taken since the last call (the worker keeps the last 4096)."""
        st = self.worker.statistics().layers
        fresh = st.stalls_measured - self._stalls_seen
        self._stalls_seen = st.stalls_measured
        return list(st.stalls[len(st.stalls) - min(fresh, len(st.stalls)):]) if fresh > 0 else []

    async def offload(self, keys: Sequence[int], blocks: list[int]) -> None:
        """Store the keys not held yet, as ``OffloadCache.offload`` does on the host."""
        mgr = self.manager
        block_of: dict[Hashable, int] = dict(zip(keys, blocks))
        plan = mgr.prepare_store(block_of)
        if plan is None or not plan.keys_to_store:
            return
        stored = plan.keys_to_store
        try:
            fut = self.worker.submit_store(next(self._ids), GPULoadStoreSpec([block_of[k] for k in stored]),
                                           CPULoadStoreSpec(plan.chunk_ids))
        except BaseException:
            mgr.complete_store(stored, success=False, counted=False)
            raise

        # Bookkeeping in the done callback, as the cache does: a failed store frees its
        # chunks (a miss later, never a hit with wrong bytes), even if the await is cancelled.
        fut.add_done_callback(lambda f: mgr.complete_store(stored, success=_ok(f)))
        self._track(fut)
        await _landed(fut)

    async def drain(self) -> None:
        for fut in list(self._in_flight):
            await _landed(fut)

    def _track(self, fut: TransferFuture) -> None:
        self._in_flight.add(fut)
        fut.add_done_callback(self._in_flight.discard)


class PlannedLoad:
    """One layerwise load whose chunks are pinned; ``submit`` starts it (once, on the
    event loop's thread) and returns the forward's gate. ``restored`` is its ``Restored``,
    filled in by the submit."""

    def __init__(self, source: LayerwiseSource, pinned: list[int], chunks: list[int],
                 blocks: list[int]) -> None:
        self.source, self.pinned, self.chunks, self.blocks = source, pinned, chunks, blocks
        self.restored = Restored(len(pinned), take_stalls=source.new_stalls)
        self._pinned_here = True  # until the submit takes the pins over (or cancel drops them)

    @property
    def submitted(self) -> bool:
        """Its submit returned: the copy runs, and ``restored.gate`` gates on it."""
        return self.restored.gate is not None

    def submit(self) -> Callable[[int], object]:
        src, mgr, pinned, restored = self.source, self.source.manager, self.pinned, self.restored
        if not self._pinned_here:
            raise RuntimeError("a planned load is submitted once, and not after cancel()")
        self._pinned_here = False
        t0 = time.perf_counter()
        try:
            fut = src.worker.submit_load(next(src._ids), CPULoadStoreSpec(self.chunks),
                                         GPULoadStoreSpec(self.blocks), layerwise=True)
        except BaseException:
            mgr.complete_load(pinned)
            raise
        restored.submitted_at, restored.submit_s = t0, time.perf_counter() - t0
        layer_gate = fut.gate

        def gate(layer: int) -> bool:  # on the model's thread
            if restored.forward_start_s is None:
                restored.forward_start_s = time.perf_counter() - t0
            ready = layer_gate(layer) is LayerStatus.READY
            if not ready:
                restored.failed = True
            return ready

        def loaded(_f: object) -> None:  # the policy's touch too: off the way to the forward
            mgr.touch(pinned)
            mgr.complete_load(pinned)

        async def end() -> bool:
            try:
                result = await fut
            except TransferFailed:
                return False
            # Its wall time runs on beside the prefill: the load's own is its copy time.
            restored.load_s = result.transfer_time or time.perf_counter() - t0
            return result.success

        restored.gate, restored.end, restored.timeline = gate, end, fut.timeline
        fut.add_done_callback(loaded)
        src._track(fut)
        return gate

    def cancel(self) -> None:
        """Unpin the chunks of a load that was never submitted (a no-op once it was)."""
        if self._pinned_here:
            self._pinned_here = False
            self.source.manager.complete_load(self.pinned)


def _ok(fut: TransferFuture) -> bool:
    try:
        return fut.result().success
    except TransferFailed:
        return False


async def _landed(fut: TransferFuture) -> bool:
    try:
        return (await fut).success
    except TransferFailed:
        return False
