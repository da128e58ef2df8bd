"""``OffloadCache``: a prefix KV cache in host memory for async servers.

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

Everything runs on the event-loop thread of the worker; no locks are needed because the
only checkpoint in ``offload`` and ``restore`` is the final ``await``.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import numpy as np

from ..errors import DuplicateJob, InvalidSpec, KeyNotLoadable, TransferFailed
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferResult
from .admission import AdmissionPolicy
from .manager import CacheStats, ChunkManager
from .policies import EvictionPolicy


class _Shared:
    """What the caches on one worker share: who owns which chunks (entries go with their
    caches), and one job id counter, so they never collide on ids."""

    def __init__(self) -> None:
        self.caches: weakref.WeakSet[OffloadCache] = weakref.WeakSet()
        self.job_ids = itertools.count(1)


_SHARED: weakref.WeakKeyDictionary[Any, _Shared] = weakref.WeakKeyDictionary()

# Results kept before their device times are summed (bounds the lists between stats()).
_FOLD_AT = 256

__all__ = ["DEFAULT_POLICY", "OffloadCache", "OffloadCacheStats", "OffloadResult"]

DEFAULT_POLICY = "adaptive"
"""The recommended policy: prefix-ordered LRU behind an adaptive admission filter."""


@dataclass(frozen=True)
class OffloadResult:
    """What one ``offload`` did with the keys it was offered.

    ``stored`` keys are loadable now; ``skipped`` were already held or being stored by
    another task; ``not_stored`` were turned away (admission, no evictable room, or a
    failed copy: then ``failed`` is True). ``int(result)`` is ``stored``.
    """

    stored: int
    skipped: int
    not_stored: int
    evicted: int
    failed: bool = False

    def __int__(self) -> int:
        return self.stored


@dataclass(frozen=True)
class OffloadCacheStats:
    """Counters since construction. Hits and misses are keys, counted by ``lookup``
    (leading hits and the rest); GB/s are bytes over summed device copy time. A call that
    raised (bad input, or a submit the worker refused) counts in no offer, restore or hit
    figure; evictions it made before the worker refused stay counted. Units:
    ``failed_stores`` counts keys (of failed store copies), ``restores``,
    ``restore_misses`` and ``failed_loads`` count ``restore`` calls."""

    hits: int
    misses: int
    offered_keys: int
    stored_keys: int
    skipped_keys: int
    failed_stores: int
    restores: int
    restored_keys: int
    restore_misses: int
    failed_loads: int
    evictions: int
    store_bytes: int
    store_seconds: float
    load_bytes: int
    load_seconds: float
    in_flight: int
    manager: CacheStats

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_seconds / 1e9 if self.store_seconds > 0 else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0


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
    """

    def __init__(
        self,
        worker: Any,
        *,
        policy: str | EvictionPolicy | None = None,
        admission: str | AdmissionPolicy | None = None,
        keep_events: bool = False,
        chunks: range | None = None,
    ) -> None:
        if worker.blocks_per_chunk != 1:
            raise InvalidSpec(
                f"OffloadCache keeps one key per chunk and needs a worker with blocks_per_chunk=1, "
                f"got {worker.blocks_per_chunk}"
            )
        if worker.num_groups != 1:
            raise InvalidSpec(
                f"OffloadCache keys one block per chunk of a single KV-cache group; this worker's "
                f"layout has {worker.num_groups} groups. Use the worker's submit_store/submit_load "
                f"with group_sizes for hybrid layouts"
            )
        chunks = range(worker.num_cpu_chunks) if chunks is None else chunks
        if not isinstance(chunks, range) or chunks.step != 1 or not 0 <= chunks.start < chunks.stop <= (
            worker.num_cpu_chunks
        ):
            raise InvalidSpec(f"chunks must be a non-empty range(start, stop) within "
                              f"[0, {worker.num_cpu_chunks}), got {chunks!r}")
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
            len(chunks), policy=DEFAULT_POLICY if policy is None else policy, admission=admission
        )
        self._worker = worker
        self.chunks: range = chunks
        shared.caches.add(self)
        self._job_ids = shared.job_ids
        self._keep_events = keep_events
        self._in_flight: dict[int, TransferFuture] = {}
        self._hits = self._misses = 0
        self._offered = self._stored = self._skipped = self._failed_stores = 0
        self._restores = self._restored = self._restore_misses = self._failed_loads = 0
        self._store_bytes = self._load_bytes = 0
        self._store_seconds = self._load_seconds = 0.0
        # Results whose device time is not summed yet: reading it in the done callback
        # would put the CUDA timing read back before the awaiting task wakes (_fold_times).
        self._untimed_stores: list[TransferResult] = []
        self._untimed_loads: list[TransferResult] = []

    @property
    def manager(self) -> ChunkManager:
        """The bookkeeping underneath (read it; mutate it only through this cache)."""
        return self._mgr

    @property
    def worker(self) -> Any:
        return self._worker

    def __len__(self) -> int:
        return len(self._mgr)

    def __repr__(self) -> str:
        st = self._mgr.stats()
        return (
            f"<OffloadCache {type(self._mgr.policy).__name__} keys={st.keys}/{st.num_chunks} "
            f"pending={st.pending_keys} pinned={st.pinned_keys} in_flight={len(self._in_flight)}>"
        )

    # -- the three calls a server makes -------------------------------------------------

    def _checked_blocks(self, keys: Sequence[Hashable], gpu_block_ids: Sequence[int] | np.ndarray,
                        after: Any) -> list[int]:
        """Reject bad input before the manager evicts or pins anything."""
        self._worker.check_submittable(after)
        blocks = _as_block_list(gpu_block_ids)
        if not all(map(_is_id, blocks)):
            raise InvalidSpec(f"GPU block ids must be integers; got {[type(b).__name__ for b in blocks][:5]}")
        # Plain ints: a 0-d tensor hashes by identity and a 0-d array not at all, which
        # would slip past restore's duplicate check or break it.
        blocks = [operator.index(b) for b in blocks]
        if len(blocks) != len(keys):
            raise InvalidSpec(f"got {len(keys)} keys but {len(blocks)} GPU block ids; pass one block per key")
        limit = self._worker.num_gpu_blocks
        bad = [b for b in blocks if not 0 <= b < limit]
        if bad:
            raise InvalidSpec(f"GPU block ids must lie in [0, {limit}); got {bad[:5]}")
        return blocks

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are loadable now. Pure query: it does not
        count as a use for eviction (``restore`` does), so schedulers may poll it."""
        keys = _as_keys(keys)
        try:
            n = self._mgr.count_leading_hits(keys)
        except TypeError as exc:
            raise _unhashable(exc) from exc
        self._hits += n
        self._misses += len(keys) - n
        return n

    async def offload(
        self, keys: Sequence[Hashable], gpu_block_ids: Sequence[int] | np.ndarray, *, after: Any = None
    ) -> OffloadResult:
        """Store the blocks of the keys not held yet (``gpu_block_ids[i]`` holds ``keys[i]``).

        Returns when the copy is over. The GPU blocks must not be overwritten before then;
        if the awaiting task is cancelled, the copy still runs to completion (see
        ``drain``) and the keys become loadable (or are freed) when it does.
        """
        keys = _as_keys(keys)
        if any(_is_tensor(k) or isinstance(k, np.ndarray) for k in keys):
            raise InvalidSpec("keys must hash by value (ints, bytes, str, tuples); a tensor or array "
                              "hashes by identity and would never hit: pass tensor.tolist()")
        blocks = self._checked_blocks(keys, gpu_block_ids, after)
        self._fold_times()
        block_of: dict[Hashable, int] = {}
        try:
            for key, block in zip(keys, blocks):
                block_of.setdefault(key, block)
        except TypeError as exc:
            raise _unhashable(exc) from exc
        plan = self._mgr.prepare_store(block_of)
        self._drop_events()
        if plan is None:
            held = sum(1 for k in block_of if k in self._mgr)
            self._count_offer(len(block_of), held)
            await anyio.lowlevel.checkpoint()  # as an awaited copy would: a loop stays cancellable
            return OffloadResult(0, held, len(block_of) - held, 0)
        stored = plan.keys_to_store
        skipped = sum(1 for k in block_of if k in self._mgr) - len(stored)
        rest = len(block_of) - skipped - len(stored)
        if not stored:
            self._count_offer(len(block_of), skipped)
            await anyio.lowlevel.checkpoint()
            return OffloadResult(0, skipped, rest, len(plan.evicted))
        src = GPULoadStoreSpec([block_of[k] for k in stored])
        dst = CPULoadStoreSpec([self.chunks.start + c for c in plan.chunk_ids])
        try:
            future = self._submit(lambda jid: self._worker.submit_store(jid, src, dst, after=after))
        except BaseException:
            self._mgr.complete_store(stored, success=False, counted=False)
            raise  # refused: not counted as an offer, nor as a failed store
        self._count_offer(len(block_of), skipped)

        def finish(fut: TransferFuture) -> None:
            self._in_flight.pop(fut.job_id, None)
            res = _result_or_none(fut)
            self._mgr.complete_store(stored, success=res is not None)
            self._drop_events()
            if res is not None:
                self._stored += len(stored)
                self._store_bytes += res.transfer_size or 0
                self._untimed_stores.append(res)
            else:
                self._failed_stores += len(stored)

        future.add_done_callback(finish)
        try:
            await future
        except TransferFailed:
            return OffloadResult(0, skipped, rest + len(stored), len(plan.evicted), failed=True)
        return OffloadResult(len(stored), skipped, rest, len(plan.evicted))

    async def restore(
        self,
        keys: Sequence[Hashable],
        gpu_block_ids: Sequence[int] | np.ndarray,
        *,
        expedited: bool = False,
        after: Any = None,
    ) -> bool:
        """Load ``keys`` into ``gpu_block_ids``; True once the bytes are there.

        False, loading nothing, if any key is missing or still being stored (no waiting on
        another task's store), or if the copy failed (then the blocks' contents are
        undefined and must be recomputed). Chunks stay pinned until the copy is over, even
        if the awaiting task is cancelled; the GPU blocks belong to the copy until then.
        Raises ``WorkerClosed`` once the worker is closed (its host pool is gone, though
        ``lookup`` still answers from the bookkeeping).
        """
        keys = _as_keys(keys)
        blocks = self._checked_blocks(keys, gpu_block_ids, after)
        if len(set(blocks)) != len(blocks):  # before prepare_load counts a use of the keys
            raise InvalidSpec("a GPU block appears twice, so one load would write it twice")
        self._fold_times()
        if not keys:
            self._restores += 1
            await anyio.lowlevel.checkpoint()
            return True
        try:
            chunks = self._mgr.prepare_load(keys)  # pins nothing unless every key is loadable
        except TypeError as exc:
            raise _unhashable(exc) from exc
        except KeyNotLoadable:
            try:  # an unhashable key raises even behind a miss
                for key in keys:
                    hash(key)
            except TypeError as exc:
                raise _unhashable(exc) from exc
            self._restores += 1
            self._restore_misses += 1
            await anyio.lowlevel.checkpoint()
            return False
        pinned = list(keys)
        src = CPULoadStoreSpec([self.chunks.start + c for c in chunks])
        dst = GPULoadStoreSpec(blocks)
        try:
            future = self._submit(
                lambda jid: self._worker.submit_load(jid, src, dst, expedited=expedited, after=after)
            )
        except BaseException:
            self._mgr.complete_load(pinned)
            raise  # refused: not counted as a restore
        self._restores += 1

        def finish(fut: TransferFuture) -> None:
            self._in_flight.pop(fut.job_id, None)
            self._mgr.complete_load(pinned)
            res = _result_or_none(fut)
            if res is not None:
                self._restored += len(pinned)
                self._load_bytes += res.transfer_size or 0
                self._untimed_loads.append(res)
            else:
                self._failed_loads += 1

        future.add_done_callback(finish)
        try:
            await future
        except TransferFailed:
            return False
        return True

    async def drain(self) -> None:
        """Wait until every copy this cache had started when called is over (also those whose
        awaiting task was cancelled), e.g. before reusing GPU blocks of a cancelled request.
        Copies started meanwhile are not waited for, so a busy server does not hold it."""
        if not self._in_flight:
            await anyio.lowlevel.checkpoint()
        for future in list(self._in_flight.values()):
            try:
                await future
            except TransferFailed:
                pass  # its done callback has run and removed it

    # -- inspection ---------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """Stored/removed events since the last call (needs ``keep_events=True``)."""
        return self._mgr.take_events()

    def stats(self) -> OffloadCacheStats:
        self._fold_times(0)
        mgr = self._mgr.stats()
        return OffloadCacheStats(
            hits=self._hits,
            misses=self._misses,
            offered_keys=self._offered,
            stored_keys=self._stored,
            skipped_keys=self._skipped,
            failed_stores=self._failed_stores,
            restores=self._restores,
            restored_keys=self._restored,
            restore_misses=self._restore_misses,
            failed_loads=self._failed_loads,
            evictions=mgr.evictions,
            store_bytes=self._store_bytes,
            store_seconds=self._store_seconds,
            load_bytes=self._load_bytes,
            load_seconds=self._load_seconds,
            in_flight=len(self._in_flight),
            manager=mgr,
        )

    # -- internals ----------------------------------------------------------------------

    def _submit(self, submit: Any) -> TransferFuture:
        """Submit under the next free job id (ids the caller uses on the same worker are skipped)."""
        for _ in range(1024):
            job_id = next(self._job_ids)
            try:
                future: TransferFuture = submit(job_id)
            except DuplicateJob:
                continue
            self._in_flight[job_id] = future
            return future
        raise DuplicateJob("OffloadCache found no free job id in 1024 tries")

    def _fold_times(self, at_least: int = _FOLD_AT) -> None:
        """Sum the device times of finished copies once ``at_least`` wait (a new call's
        entry, or ``stats()``: never a done callback, which runs before the wake-up)."""
        if len(self._untimed_stores) >= at_least:
            self._store_seconds += _device_seconds(self._untimed_stores)
        if len(self._untimed_loads) >= at_least:
            self._load_seconds += _device_seconds(self._untimed_loads)

    def _count_offer(self, offered: int, skipped: int) -> None:
        self._offered += offered
        self._skipped += skipped

    def _drop_events(self) -> None:
        if not self._keep_events:
            self._mgr.take_events()


def _as_keys(keys: Sequence[Hashable] | np.ndarray) -> Sequence[Hashable]:
    """A numpy array's or a tensor's keys as plain values (its elements would hash by
    identity, a tensor's, and never hit); any other sequence as it is, not copied:
    ``lookup`` is polled, and returns at the first miss."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise InvalidSpec(f"keys must be a sequence of keys; got one {type(keys).__name__} "
                          "(it would be read as one key per element): wrap it in a list")
    tolist = getattr(keys, "tolist", None)
    if not callable(tolist):
        if not isinstance(keys, Sequence):  # a generator: read once, then counted and indexed
            return list(keys)
        return cast(Sequence[Hashable], keys)
    out = tolist()
    if not isinstance(out, list) or (out and isinstance(out[0], list)):
        shape = tuple(getattr(keys, "shape", ()))
        raise InvalidSpec(f"keys must be a 1-D sequence; got an array of shape {shape}")
    return out


def _unhashable(exc: TypeError) -> InvalidSpec:
    return InvalidSpec(f"keys must be hashable (ints, bytes, str, tuples): {exc}")


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "tolist")


def _as_block_list(ids: Sequence[int] | np.ndarray) -> list[Any]:
    """Plain Python ids (numpy arrays' and torch tensors' become ints)."""
    out = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(out, (str, bytes)) or not isinstance(out, Iterable):
        raise InvalidSpec(f"GPU block ids must be a sequence of integers, one per key; "
                          f"got {type(ids).__name__}")
    return list(out)


def _is_id(value: Any) -> bool:
    """An integer (numpy and 0-d torch ones included), not a bool or a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _device_seconds(results: list[TransferResult]) -> float:
    """Sum and forget the results' device times."""
    total = sum(r.transfer_time or 0.0 for r in results)
    results.clear()
    return total


def _result_or_none(fut: TransferFuture) -> TransferResult | None:
    """The result of a done future if its copy succeeded, else None."""
    try:
        res = fut.result()
    except TransferFailed:
        return None
    return res if res.success else None
