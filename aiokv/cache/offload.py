"""``OffloadCache``: a prefix KV cache in host memory, with optional tiers below it.

It joins the scheduler-side bookkeeping (``ChunkManager``) to the bytes (an entered
``AsyncOffloadingWorker``): one key per GPU block, one host chunk per key. The rules that
keep KV correct:

- A key becomes loadable only when its store's bytes have landed; a failed store frees
  its chunks, so a failed transfer degrades to a miss, never to a hit with wrong data.
- A key being stored (pending) is skipped by further offers and is a miss for ``lookup``
  and ``restore``: nothing ever waits on another task's store.
- Chunks read by a load are pinned (not evictable) until that load is over.
- Bookkeeping runs in the future's done callback, not after the ``await``: cancelling the
  awaiting task cancels the wait, never the copy, and can never leak a pinned or pending
  chunk.
- A cache owns its chunks of the pool (all of them unless ``chunks=`` says which); caches
  sharing a worker must own disjoint ranges, and nothing else may write them. Closing the
  cache gives them back once no copy of its own still writes them.
- With lower tiers (``tiers=``) the cascade owns every copy between the host pool and the
  tiers (``cascade.py``): blocks the host evicts or turns away go down, restores read them
  back through staging chunks the host bookkeeping never hands out (``restore.py``).

Everything runs on the event-loop thread of the worker; no locks are needed: bookkeeping
changes between checkpoints, and each call re-reads what it needs after an await.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ..errors import InvalidSpec, TransferFailed, UsageError
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec, GPULoadStoreSpec, flag
from . import descend
from .admission import AdmissionPolicy
from .cascade import DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_WAIT, Cascade, tier_list
from .counters import Counters
from .jobs import Jobs
from .keys import as_block_ids, as_keys, check_hashable_values, unhashable
from .manager import ChunkManager
from .owners import owners_of
from .pages import page_map_of
from .persist import persist_host
from .policies import EvictionPolicy
from .protocol import CacheWorker, check_store_ids, check_worker, result_or_none, split_chunks
from .records import OffloadCacheStats, OffloadResult, RestoreResult
from .restore import restore_from_host, restore_through_tiers
from .tiers.base import Tier
from .tiers.codec import default_fingerprint

if TYPE_CHECKING:
    from ..metrics import OffloadMetrics

__all__ = ["DEFAULT_POLICY", "OffloadCache", "OffloadCacheStats", "OffloadResult", "RestoreResult"]

DEFAULT_POLICY = "adaptive"
"""The recommended policy: prefix-ordered LRU behind an adaptive admission filter."""


class OffloadCache:
    """Prefix cache of KV blocks in a worker's host pool, keyed by block hash.

    Args:
        worker: an ``AsyncOffloadingWorker`` with ``blocks_per_chunk=1``; enter it before
            the first ``offload``/``restore`` and call those on its loop thread.
        policy: ``"lru"`` stores everything offered and evicts the least recently used;
            ``"arc"``, ``"prefix-lru"`` and registered names select others; an
            ``EvictionPolicy`` instance is used as is; None takes the default, ``"adaptive"``.
        admission: admission name or instance; None takes the policy's own pairing.
        keep_events: keep the manager's stored/removed events for ``take_events`` (a
            router's prefix index). Off by default, so an unread event list cannot grow.
        chunks: the host chunks this cache owns, a ``range`` (default: the whole pool).
            Caches sharing one worker must own disjoint ranges; nothing else may write them.
        tiers: lower tiers, nearest first (``DiskTier``, ``RedisTier``). A cache with tiers
            must be entered (``async with cache:``, inside the worker's block) and keeps the
            last ``staging_chunks`` of its chunks to move blocks to and from the tiers.
        staging_chunks: chunks kept aside for the tiers (default: 64, at most a quarter of
            the cache's chunks, at least one).
        fingerprint: names the KV layout for the tiers (``codec.layout_fingerprint``); the
            default (``codec.default_fingerprint``) folds in each page's size, dtype and
            shape, so pass one naming the model when servers of different models with the
            same layout share a tier (or give each model its own tier ``namespace=``).
        queue_bytes: per tier, bytes of blocks on their way down (queued or being written);
            never more than the tier's own ``capacity_bytes``.
        queue_wait: seconds a tier may free no room while an offer waits first in line for
            it; then the tier counts as stalled and what does not fit is dropped (counted
            and logged) until half its room is free. Offers wait their turn for room
            meanwhile (backpressure: nothing is dropped while the tier writes).
        drain_timeout: seconds leaving the cache waits for copies and tier writes (and for
            ``persist_on_close``) before it drops what is left (counted) and closes the tiers,
            whatever way it is left (``math.inf``: no bound). Once left (``async with`` or
            ``aclose()``) the cache is closed: its chunks are free for a new cache (those a
            copy still writes once it ends) and every later call raises ``UsageError``.
        persist_on_close: when the cache is left without an error, first write the blocks
            the host holds to the nearest tier, so a process opening the same directory and
            layout next finds them (docs/tiers.md, "Warm restarts").
        metrics: an ``aiokv.metrics.OffloadMetrics``: each copy the cache makes is observed
            in its transfer time and size histograms at the next ``offload``, ``restore``
            or ``stats()`` (never in the wake-up path), all by the close.
            ``CacheCollector`` exports the cache's own counters.
    """

    def __init__(
        self,
        worker: CacheWorker,
        *,
        policy: str | EvictionPolicy | None = None,
        admission: str | AdmissionPolicy | None = None,
        keep_events: bool = False,
        chunks: range | None = None,
        tiers: Sequence[Tier] = (),
        staging_chunks: int | None = None,
        fingerprint: bytes | None = None,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        queue_wait: float = DEFAULT_QUEUE_WAIT,
        drain_timeout: float = 30.0,
        persist_on_close: bool = False,
        metrics: OffloadMetrics | None = None,
    ) -> None:
        check_worker(worker)
        tiers = tier_list(tiers)
        if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, (int, float)) \
                or not drain_timeout > 0:
            raise InvalidSpec(f"drain_timeout must be seconds > 0 (math.inf: no bound), "
                              f"got {drain_timeout!r}")
        chunks, host, staging = split_chunks(worker, chunks, staging_chunks, tiers=bool(tiers))
        cascade = Cascade(tiers, pages=page_map_of(worker), staging=staging, queue_bytes=queue_bytes,
                          queue_wait=queue_wait) if tiers else None
        self._n = Counters(metrics)  # refuses what is no OffloadMetrics, before any claim
        owners = owners_of(worker)
        self.chunks: range = chunks
        owners.claim(self)
        try:  # the manager adopts a policy object, which then serves no other
            self._mgr = ChunkManager(
                len(host), policy=DEFAULT_POLICY if policy is None else policy, admission=admission
            )
        except BaseException:
            owners.release(self)
            raise
        self._worker = worker
        self._host = host
        self._keep_events = keep_events
        self._cascade = cascade
        self._fingerprint = fingerprint or (
            default_fingerprint(worker.host_layout) if cascade is not None else b""
        )
        self._drain_timeout = float(drain_timeout)
        self._persist = bool(persist_on_close)
        self._owners = owners
        self._state = "new"  # "open" once entered, "closed" once left or aclose()d
        self._closing: anyio.Event | None = None  # set once the close under way is over
        self._jobs = Jobs(worker, owners.job_ids, self._n)

    @property
    def manager(self) -> ChunkManager:
        """The bookkeeping underneath (read it; mutate it only through this cache)."""
        return self._mgr

    @property
    def worker(self) -> CacheWorker:
        return self._worker

    @property
    def tiers(self) -> list[Tier]:
        return [link.tier for link in self._cascade.links] if self._cascade else []

    @property
    def closed(self) -> bool:
        """Whether the cache was left (or ``aclose()``d): its chunks are free for another."""
        return self._state == "closed"

    def __len__(self) -> int:
        """Keys the host pool holds now (loadable ones; pending stores not counted)."""
        return len(self._mgr)

    def __bool__(self) -> bool:
        # With __len__ alone an empty cache would be falsy, and `if cache:` would skip a
        # cache that merely holds nothing yet.
        return True

    def __repr__(self) -> str:
        st = self._mgr.stats()
        state = " closed" if self.closed else ""
        return (
            f"<OffloadCache{state} {type(self._mgr.policy).__name__} keys={st.keys}/{st.num_chunks} "
            f"pending={st.pending_keys} pinned={st.pinned_keys} in_flight={len(self._jobs.in_flight)}"
            f" tiers={[t.name for t in self.tiers]}>"
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> OffloadCache:
        if self._state == "closed":
            raise UsageError("this OffloadCache is closed; build a new one (its chunks are free)")
        if self._state == "open":
            raise UsageError("this OffloadCache is entered already")
        if self._cascade is not None:
            pool = np.asarray(self._worker.host_pool.numpy()).reshape(-1)
            await self._cascade.open(self._fingerprint, pool)
        self._state = "open"
        return self

    async def __aexit__(self, exc_type: Any, *exc_info: Any) -> None:
        await self._close(graceful=exc_type is None)

    async def aclose(self) -> None:
        """Leave the cache as ``async with`` does without an error (call it in the task
        that entered it; a cache without tiers needs no ``async with`` and may be closed
        from any task on the worker's loop): wait for copies and tier writes in flight,
        within ``drain_timeout``, stop the writers, close the tiers and give the cache's
        chunks back, so another ``OffloadCache`` may own them. Idempotent: called while
        another task closes it, it returns once that close is over."""
        await self._close(graceful=True)

    async def _close(self, *, graceful: bool) -> None:
        if self._state == "closed":
            # A close from another task may still drain: return when it does, as it will.
            if self._closing is not None:
                await self._closing.wait()
            return
        cascade = self._cascade if self._state == "open" else None
        self._state = "closed"  # calls from here on raise; copies already started finish
        closing = self._closing = anyio.Event()
        try:
            # Shielded, so any cancellation (the owner's, a timeout's) still drains, and
            # bounded, so a tier (or a copy) that hangs cannot hold the exit.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._drain_timeout):
                await self._jobs.wait()
                if cascade is not None:
                    if graceful and self._persist:
                        await persist_host(cascade, self._mgr, self._host.start)
                    await cascade.drain()
        finally:
            try:
                if cascade is not None:
                    await cascade.stop()
            finally:
                # A copy still running past the bound writes into these chunks: they go
                # free when it ends, never before.
                self._jobs.when_idle(lambda: self._owners.release(self))
                closing.set()  # wakes a concurrent aclose() once this task next yields
                self._n.fold(0)  # the last copies' figures, into stats() and the metrics

    def _check_open(self) -> None:
        if self._state == "closed":
            raise UsageError("this OffloadCache is closed (left or aclose()d); build a new one")
        if self._cascade is not None and self._state != "open":
            raise UsageError("an OffloadCache with tiers must be entered: `async with cache:` "
                             "inside the worker's `async with`")

    # -- the calls a server makes -------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are loadable now from the host or a local
        tier, or on their way down to one (no I/O). Pure query: it does not count as a use
        for eviction (``restore`` does), so schedulers may poll it."""
        keys = as_keys(keys)
        self._check_open()  # a closed or unopened tier cannot answer holds()
        n = self._host_run(keys)
        total = n
        if self._cascade is not None and n < len(keys):
            run, host = self._cascade.local_run(self._mgr, keys[n:])
            total, n = total + run, n + host
        self._n.count_hits(len(keys), n, total)
        return total

    async def alookup(self, keys: Sequence[Hashable]) -> int:
        """``lookup`` that also asks the remote tiers (one batched round trip each) about
        the keys after the local run, so a server sees prefixes another server stored."""
        keys = as_keys(keys)
        self._check_open()
        n = self._host_run(keys)
        total = n
        if self._cascade is not None and n < len(keys):
            run, host = await self._cascade.leading_run(self._mgr, keys[n:])
            total, n = total + run, n + host
        else:
            await anyio.lowlevel.checkpoint()
        self._n.count_hits(len(keys), n, total)
        return total

    async def offload(
        self, keys: Sequence[Hashable], gpu_block_ids: Sequence[int] | np.ndarray, *, after: Any = None
    ) -> OffloadResult:
        """Store the blocks of the keys not held yet (``gpu_block_ids[i]`` holds ``keys[i]``).

        Returns when every copy from the GPU blocks is over: they must not be overwritten
        before then. If the awaiting task is cancelled, copies already started still run
        to completion (see ``drain``) and their keys become loadable (or are freed) when
        they do. With tiers, blocks the host evicts or turns away go down to the nearest
        tier; an offer may wait its turn for room in a tier's write queue (``queue_wait``).
        """
        keys = as_keys(keys)
        check_hashable_values(keys)
        self._check_open()
        blocks = as_block_ids(keys, gpu_block_ids)
        block_of: dict[Hashable, int] = {}
        try:
            for key, block in zip(keys, blocks):
                block_of.setdefault(key, block)
        except TypeError as exc:
            raise unhashable(exc) from exc
        cascade = self._cascade
        if cascade is None:
            self._worker.check_submittable(after)
        else:
            # Several jobs may follow: refuse bad ids and keys without stable bytes first.
            check_store_ids(self._worker, list(block_of.values()), after)
            for key in block_of:
                cascade.tier_key(key)
        self._n.fold()
        return await self._offload(block_of, after)

    async def _offload(self, block_of: dict[Hashable, int], after: Any) -> OffloadResult:
        cascade, mgr = self._cascade, self._mgr
        plan = mgr.prepare_store(block_of)
        self._drop_events()
        evicted = len(plan.evicted) if plan is not None else 0
        stored = plan.keys_to_store if plan is not None else []
        skipped = sum(1 for k in block_of if k in mgr) - len(stored)
        rest = len(block_of) - skipped - len(stored)
        host_chunks = [self._host.start + c for c in plan.chunk_ids] if plan is not None else []
        spill: list[Hashable] = []
        first: list[int] = []
        if cascade is not None:
            try:
                if plan is not None and plan.evicted:
                    # Copied out before the store below reuses the evicted chunks (the
                    # stored keys are pending meanwhile, so nothing else touches those
                    # chunks), part by part as the tier's queue has room.
                    await descend.demote(cascade, plan.evicted,
                                         [self._host.start + c for c in plan.evicted_chunks])
                spill = descend.spill_wanted(cascade, mgr, list(block_of))
                first = await descend.first_spill(cascade, spill)
            except BaseException:  # cancelled waiting for room: the store never starts
                mgr.complete_store(stored, success=False, counted=False)
                if spill and cascade.demote_to is not None:
                    cascade.demote_to.drop(len(spill))
                raise
        landed = anyio.Event()
        if stored or first:
            try:
                failed = await self._store(block_of, after, stored, host_chunks, spill[: len(first)],
                                           first, skipped, landed)
            except BaseException:
                if cascade is not None and cascade.demote_to is not None:
                    cascade.demote_to.drop(len(spill) - len(first))  # their rounds never ran
                raise
            if failed:
                return OffloadResult(0, skipped, rest + len(stored), evicted, failed=True)
        else:
            self._n.count_offer(len(block_of), skipped)
        spilled = len(first)
        if cascade is not None and len(spill) > len(first):
            later = spill[len(first):]  # the rounds count their own drops
            spilled += await descend.spill(cascade, later, [block_of[k] for k in later],
                                           lambda b, c: self._jobs.store(b, c, after))
        elif not stored and not first:
            await anyio.lowlevel.checkpoint()  # as an awaited copy would: a loop stays cancellable
        return OffloadResult(len(stored), skipped, rest, evicted, spilled=spilled)

    async def _store(self, block_of: dict[Hashable, int], after: Any,
                     stored: list[Hashable], host_chunks: list[int], spill: list[Hashable],
                     staging: list[int], skipped: int, landed: anyio.Event) -> bool:
        """Submit the offer's store (its host keys and the first spills) and wait for it and
        the copies down it decided; whether the copy failed."""
        cascade, mgr = self._cascade, self._mgr
        ticket = descend.ticket(cascade, stored, host_chunks, spill, staging) if cascade is not None else None
        try:
            future = self._jobs.store([block_of[k] for k in [*stored, *spill]], host_chunks + staging, after)
        except BaseException:
            mgr.complete_store(stored, success=False, counted=False)
            if ticket is not None:
                ticket.failed()
            raise  # refused (bad block ids among them): not counted as an offer
        self._n.count_offer(len(block_of), skipped)

        def finish(fut: TransferFuture) -> None:
            ok = result_or_none(fut) is not None
            mgr.complete_store(stored, success=ok)
            self._drop_events()
            if ok:
                self._n.stored += len(stored)
            else:
                self._n.failed_stores += len(stored)
            if ticket is not None:
                ticket.settle(fut, mgr, landed)
            else:
                landed.set()

        future.add_done_callback(finish)
        try:
            await future
        except TransferFailed:
            return True
        await landed.wait()  # write-through and spill copies off the pool
        return False

    async def restore(
        self,
        keys: Sequence[Hashable],
        gpu_block_ids: Sequence[int] | np.ndarray,
        *,
        expedited: bool = False,
        after: Any = None,
    ) -> RestoreResult:
        """Load ``keys`` into ``gpu_block_ids``; see ``RestoreResult`` for what came back.

        Without tiers it is all or nothing: nothing loads if any key is missing or still
        being stored (no waiting on another task's store), or if the copy failed (then the
        blocks' contents are undefined and must be recomputed). With tiers, keys the host
        lacks are read into staging chunks from memory (blocks on their way down) or from
        the nearest tier holding them, in batches whose reads overlap the previous batch's
        copy to the GPU; the first key found nowhere (or failing to verify) ends the
        restore there, and ``restored`` says how many leading keys arrived. Chunks stay
        pinned until their copy is over, even if the awaiting task is cancelled; the GPU
        blocks belong to the copies until then. Raises ``WorkerClosed`` once the worker is
        closed.
        """
        keys = as_keys(keys)
        self._check_open()
        blocks = as_block_ids(keys, gpu_block_ids)
        expedited = flag("expedited", expedited)
        self._worker.check_submittable(after)
        self._n.fold()
        if not keys:
            self._n.count_restore(0)
            await anyio.lowlevel.checkpoint()
            return RestoreResult(0, 0)
        ready = self._host_run(keys)
        submit = self._jobs.loader(expedited, after)
        try:
            if ready == len(keys) or self._cascade is None:
                outcome = await restore_from_host(keys, blocks, mgr=self._mgr, host_start=self._host.start,
                                                  submit=submit)
            else:
                # Several loads may follow: the worker refuses bad ids before the first.
                self._worker.check_load(CPULoadStoreSpec([self._host.start] * len(blocks)),
                                        GPULoadStoreSpec(blocks), expedited=expedited, after=after)
                outcome = await restore_through_tiers(keys, blocks, mgr=self._mgr, cascade=self._cascade,
                                                      host_start=self._host.start, submit=submit)
        except Exception:
            raise  # misuse (a closed tier) or a refused submit: counted in no restore figure
        except BaseException:
            self._n.restores += 1  # cancelled: the loads it submitted still run
            raise
        self._n.count_restore(outcome.result.restored, outcome.failed_loads)
        if self._cascade is not None:
            self._cascade.count_restored(outcome.sources)
        return outcome.result

    async def drain(self) -> None:
        """Wait until every copy this cache had started when called is over (also those whose
        awaiting task was cancelled), e.g. before reusing GPU blocks of a cancelled request,
        and then until the tier writes queued by then are done. Copies started meanwhile
        are not waited for, so a busy server does not hold it. Raises ``UsageError`` on a
        closed cache (its exit drained already)."""
        self._check_open()
        await self._jobs.wait()
        if self._cascade is not None:
            await self._cascade.drain()

    # -- inspection ---------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """Stored/removed events since the last call (needs ``keep_events=True``)."""
        return self._mgr.take_events()

    def stats(self) -> OffloadCacheStats:
        cascade = self._cascade
        tiers = [link.stats() for link in cascade.links] if cascade else []
        staging = (cascade.staging.total, cascade.staging.available) if cascade else (0, 0)
        return self._n.snapshot(self._mgr.stats(), len(self._jobs.in_flight), tiers, staging)

    # -- internals ----------------------------------------------------------------------

    def _host_run(self, keys: Sequence[Hashable]) -> int:
        try:
            return self._mgr.count_leading_hits(keys)
        except TypeError as exc:
            raise unhashable(exc) from exc

    def _drop_events(self) -> None:
        if not self._keep_events:
            self._mgr.take_events()

