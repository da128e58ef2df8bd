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
  sharing a worker must own disjoint ranges, and nothing else may write them.
- With lower tiers (``tiers=``), blocks the host evicts are copied off their chunk before
  the chunk is reused and written below in the background; restores read them back through
  staging chunks that the host bookkeeping never hands out (``cascade.py``, ``restore.py``).

Everything runs on the event-loop thread of the worker; no locks are needed because the
only checkpoints in ``offload`` are the awaits of its copy.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import anyio
import anyio.abc
import numpy as np

from ..errors import InvalidSpec, TransferFailed, UsageError
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec, GPULoadStoreSpec
from .admission import AdmissionPolicy
from .cascade import DEFAULT_QUEUE_BYTES, Cascade
from .counters import Counters
from .jobs import Jobs
from .keys import as_block_ids, as_keys, check_hashable_values, unhashable
from .manager import ChunkManager
from .pages import page_map_of
from .policies import EvictionPolicy
from .protocol import CacheWorker, check_worker, result_or_none, split_chunks
from .records import OffloadCacheStats, OffloadResult, RestoreResult
from .restore import Staging, restore_from_host, restore_through_tiers
from .tiers.base import Tier
from .tiers.codec import default_fingerprint

__all__ = ["DEFAULT_POLICY", "OffloadCache", "OffloadCacheStats", "OffloadResult", "RestoreResult"]

DEFAULT_POLICY = "adaptive"
"""The recommended policy: prefix-ordered LRU behind an adaptive admission filter."""


class _Shared:
    """What the caches on one worker share: who owns which chunks (entries go with their
    caches), and one job id counter, so they never collide on ids."""

    def __init__(self) -> None:
        self.caches: weakref.WeakSet[OffloadCache] = weakref.WeakSet()
        self.job_ids = itertools.count(1)


_SHARED: weakref.WeakKeyDictionary[Any, _Shared] = weakref.WeakKeyDictionary()


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
            last ``staging_chunks`` of its chunks for restores from the tiers.
        staging_chunks: chunks kept aside for tier restores (default 64, at most a quarter).
        fingerprint: names the KV layout for the tiers (``codec.layout_fingerprint``); the
            default (``codec.default_fingerprint``) folds in each page's size, dtype and
            shape, so pass one naming the model when servers of different models with the
            same layout share a tier (or give each model its own tier ``namespace=``).
        queue_bytes: per tier, bytes of blocks allowed to wait for writing; more are dropped.
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
    ) -> None:
        check_worker(worker)
        tiers = _tier_list(tiers)
        cascade = Cascade(tiers, pages=page_map_of(worker), queue_bytes=queue_bytes) if tiers else None
        chunks, host, staging = split_chunks(worker, chunks, staging_chunks, tiers=bool(tiers))
        shared = _SHARED.setdefault(worker, _Shared())
        for other in shared.caches:
            both = range(max(chunks.start, other.chunks.start), min(chunks.stop, other.chunks.stop))
            if both:
                raise InvalidSpec(
                    f"chunks {both.start}..{both.stop - 1} of this worker already belong to another "
                    f"OffloadCache ({other.chunks!r}); give each cache its own chunks=range(...)"
                )
        # After every check: the manager adopts a policy object, which then serves no other.
        self._mgr = ChunkManager(
            len(host), policy=DEFAULT_POLICY if policy is None else policy, admission=admission
        )
        self._worker = worker
        self.chunks: range = chunks
        self._host = host
        shared.caches.add(self)
        self._keep_events = keep_events
        self._cascade = cascade
        self._staging = Staging(staging)
        self._fingerprint = fingerprint or (
            default_fingerprint(worker.host_layout) if cascade is not None else b""
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._pool: np.ndarray | None = None
        self._n = Counters()
        self._jobs = Jobs(worker, shared.job_ids, self._n)

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

    def __len__(self) -> int:
        return len(self._mgr)

    def __repr__(self) -> str:
        st = self._mgr.stats()
        return (
            f"<OffloadCache {type(self._mgr.policy).__name__} keys={st.keys}/{st.num_chunks} "
            f"pending={st.pending_keys} pinned={st.pinned_keys} in_flight={len(self._jobs.in_flight)}"
            f" tiers={[t.name for t in self.tiers]}>"
        )

    # -- lifecycle (needed only with tiers) ---------------------------------------------

    async def __aenter__(self) -> OffloadCache:
        if self._tg is not None:
            raise UsageError("this OffloadCache is entered already")
        if self._cascade is None:
            return self
        self._pool = np.asarray(self._worker.host_pool.numpy()).reshape(-1)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await self._cascade.open(self._fingerprint, tg)
        except BaseException as exc:
            tg.cancel_scope.cancel()
            await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        self._tg = tg
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Wait for copies and tier writes in flight, stop the writers, close the tiers."""
        if self._tg is None or self._cascade is None:
            return
        tg, self._tg = self._tg, None
        try:
            with anyio.CancelScope(shield=True):
                await self.drain()
        finally:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            await self._cascade.aclose()

    def _check_entered(self) -> None:
        if self._cascade is not None and self._tg is None:
            raise UsageError("an OffloadCache with tiers must be entered: `async with cache:` "
                             "inside the worker's `async with`")

    # -- the calls a server makes -------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are loadable now from the host or a local
        tier (no I/O). Pure query: it does not count as a use for eviction (``restore``
        does), so schedulers may poll it."""
        keys = as_keys(keys)
        self._check_entered()  # a closed or unopened tier cannot answer holds()
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
        self._check_entered()
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

        Returns when the copy is over. The GPU blocks must not be overwritten before then;
        if the awaiting task is cancelled, the copy still runs to completion (see
        ``drain``) and the keys become loadable (or are freed) when it does. Blocks the
        host evicts for room go to the first lower tier in the background.
        """
        keys = as_keys(keys)
        check_hashable_values(keys)
        self._check_entered()
        blocks = as_block_ids(keys, gpu_block_ids)
        self._worker.check_submittable(after)
        self._n.fold()
        block_of: dict[Hashable, int] = {}
        try:
            for key, block in zip(keys, blocks):
                block_of.setdefault(key, block)
        except TypeError as exc:
            raise unhashable(exc) from exc
        if self._cascade is not None:  # refuse keys without stable bytes before any bookkeeping
            for key in block_of:
                self._cascade.tier_key(key)
        plan = self._mgr.prepare_store(block_of)
        self._drop_events()
        evicted = len(plan.evicted) if plan is not None else 0
        stored = plan.keys_to_store if plan is not None else []
        skipped = sum(1 for k in block_of if k in self._mgr) - len(stored)
        rest = len(block_of) - skipped - len(stored)
        if plan is not None and plan.evicted and self._cascade is not None and self._pool is not None:
            # Copied out before the store below reuses the evicted chunks (the stored keys
            # are pending meanwhile, so nothing else touches those chunks). Shielded: the
            # store must follow its bookkeeping, and a cancel lands at its await.
            evicted_at = [self._host.start + c for c in plan.evicted_chunks]
            try:
                with anyio.CancelScope(shield=True):
                    await self._cascade.demote_evicted(self._pool, plan.evicted, evicted_at)
            except BaseException:
                self._mgr.complete_store(stored, success=False, counted=False)
                raise
        spill, spill_chunks = self._spill_plan(block_of)
        if not stored and not spill:
            self._n.count_offer(len(block_of), skipped)
            await anyio.lowlevel.checkpoint()  # as an awaited copy would: a loop stays cancellable
            return OffloadResult(0, skipped, rest, evicted)
        host_chunks = [self._host.start + c for c in plan.chunk_ids] if plan is not None else []
        src = GPULoadStoreSpec([block_of[k] for k in [*stored, *spill]])
        dst = CPULoadStoreSpec(host_chunks + spill_chunks)
        try:
            future = self._jobs.submit(lambda jid: self._worker.submit_store(jid, src, dst, after=after))
        except BaseException:
            self._mgr.complete_store(stored, success=False, counted=False)
            self._staging.give(spill_chunks)
            raise  # refused (bad block ids among them): not counted as an offer
        self._n.count_offer(len(block_of), skipped)

        def finish(fut: TransferFuture) -> None:
            res = result_or_none(fut)
            self._mgr.complete_store(stored, success=res is not None)
            self._drop_events()
            if res is not None:
                self._n.stored += len(stored)
                self._n.store_bytes += res.transfer_size or 0
                self._n.untimed_stores.append(res)
                if self._cascade is not None and self._pool is not None:
                    self._write_through(stored, host_chunks)
                    self._demote_spill(spill, spill_chunks)
                    return
            else:
                self._n.failed_stores += len(stored)
            self._staging.give(spill_chunks)

        future.add_done_callback(finish)
        try:
            await future
        except TransferFailed:
            return OffloadResult(0, skipped, rest + len(stored), evicted, failed=True)
        return OffloadResult(len(stored), skipped, rest, evicted, spilled=len(spill))

    def _spill_plan(self, block_of: dict[Hashable, int]) -> tuple[list[Hashable], list[int]]:
        """Offered keys the host turned away that the nearest tier should get straight from
        the GPU, and the staging chunks their copy passes through (none free: none spill)."""
        if self._cascade is None or self._pool is None:
            return [], []
        wanted = [k for k in block_of if k not in self._mgr and self._cascade.wants_spill(k)]
        chunks = self._staging.take(len(wanted))
        self._cascade.count_spill_dropped(len(wanted) - len(chunks))
        return wanted[: len(chunks)], chunks

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
        lacks are read from the nearest tier holding them into staging chunks, in batches
        whose reads overlap the previous batch's copy to the GPU; the first key found in
        no tier (or failing to verify) ends the restore there, and ``restored`` says how
        many leading keys arrived. Chunks stay pinned until their copy is over, even if
        the awaiting task is cancelled; the GPU blocks belong to the copies until then.
        Raises ``WorkerClosed`` once the worker is closed.
        """
        keys = as_keys(keys)
        self._check_entered()
        blocks = as_block_ids(keys, gpu_block_ids)
        self._worker.check_submittable(after)
        if len(set(blocks)) != len(blocks):  # before prepare_load counts a use of the keys
            raise InvalidSpec("a GPU block appears twice, so one load would write it twice")
        self._n.fold()
        if not keys:
            self._n.restores += 1
            await anyio.lowlevel.checkpoint()
            return RestoreResult(0, 0)
        try:
            ready = self._mgr.count_leading_hits(keys)
        except TypeError as exc:
            raise unhashable(exc) from exc
        if ready == len(keys) or self._cascade is None:
            return await restore_from_host(keys, blocks, mgr=self._mgr, counters=self._n,
                                           host_start=self._host.start,
                                           submit=self._jobs.loader(expedited, after))
        limit = self._worker.num_gpu_blocks  # several submits: refuse bad ids before the first
        if any(not 0 <= b < limit for b in blocks):
            raise InvalidSpec(f"GPU block ids must lie in [0, {limit}); got "
                              f"{[b for b in blocks if not 0 <= b < limit][:5]}")
        assert self._pool is not None
        try:
            result, failed = await restore_through_tiers(
                keys, blocks, mgr=self._mgr, cascade=self._cascade, staging=self._staging,
                pool=self._pool, host_start=self._host.start, submit=self._jobs.loader(expedited, after),
            )
        except Exception:
            raise  # misuse (a closed tier) or a refused submit: counted in no restore figure
        except BaseException:
            self._n.restores += 1  # cancelled: the loads it submitted still run
            raise
        self._n.restores += 1
        self._n.restored += result.restored
        self._n.failed_loads += failed
        if result.restored == 0:
            self._n.restore_misses += 1
        return result

    async def drain(self) -> None:
        """Wait until every copy this cache had started when called is over (also those whose
        awaiting task was cancelled), e.g. before reusing GPU blocks of a cancelled request,
        and then until the tier writes queued by then are done. Copies started meanwhile
        are not waited for, so a busy server does not hold it."""
        await self._jobs.wait()
        if self._cascade is not None:
            await self._cascade.drain()

    # -- inspection ---------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """Stored/removed events since the last call (needs ``keep_events=True``)."""
        return self._mgr.take_events()

    def stats(self) -> OffloadCacheStats:
        tiers = [link.stats() for link in self._cascade.links] if self._cascade else []
        return self._n.snapshot(self._mgr.stats(), len(self._jobs.in_flight), tiers)

    # -- internals ----------------------------------------------------------------------

    def _host_run(self, keys: Sequence[Hashable]) -> int:
        try:
            return self._mgr.count_leading_hits(keys)
        except TypeError as exc:
            raise unhashable(exc) from exc

    def _write_through(self, keys: list[Hashable], chunks: list[int]) -> None:
        """Queue just-stored keys for the write-through tiers. Large copies run on a worker
        thread (this runs in a done callback on the loop), the keys pinned meanwhile so
        their chunks are not reused before the copy is over."""
        assert self._cascade is not None and self._pool is not None
        cascade, pool = self._cascade, self._pool
        reserved = cascade.reserve_through(keys, chunks)
        if not reserved:
            return
        n = max(len(pairs) for _, pairs in reserved)
        if cascade.copies_inline(n) or self._tg is None:
            cascade.push_through(reserved, cascade.pages.gather(pool, chunks[:n]))
            return
        pinned = keys[:n]
        self._mgr.prepare_load(pinned, touch=False)

        async def copy() -> None:
            try:
                rows = await anyio.to_thread.run_sync(cascade.pages.gather, pool, chunks[:n])
            except BaseException:
                cascade.cancel_through(reserved)
                raise
            finally:
                self._mgr.complete_load(pinned)
            cascade.push_through(reserved, rows)

        self._tg.start_soon(copy)

    def _demote_spill(self, keys: list[Hashable], chunks: list[int]) -> None:
        """Queue spilled keys for the demotion tier, then give their staging chunks back;
        a large copy runs on a worker thread (this runs in a done callback on the loop)."""
        assert self._cascade is not None and self._pool is not None
        cascade, pool, staging = self._cascade, self._pool, self._staging
        reserved = cascade.reserve_demotion(keys, chunks)
        if reserved is None:
            staging.give(chunks)
            return
        if cascade.copies_inline(len(reserved[1])) or self._tg is None:
            cascade.push_demotion(pool, reserved)
            staging.give(chunks)
            return

        async def copy() -> None:
            try:
                await cascade.copy_demotion(pool, reserved)
            finally:
                staging.give(chunks)

        self._tg.start_soon(copy)

    def _drop_events(self) -> None:
        if not self._keep_events:
            self._mgr.take_events()


def _tier_list(tiers: Sequence[Tier]) -> list[Tier]:
    """``tiers=`` as a list; one tier or a non-sequence is refused rather than iterated."""
    if isinstance(tiers, (Tier, str, bytes)) or not isinstance(tiers, (Sequence, tuple, list)):
        raise InvalidSpec(f"tiers must be a sequence of tiers, nearest first (tiers=[DiskTier(...)]); "
                          f"got {type(tiers).__name__}")
    return list(tiers)
