"""Scheduler-side chunk bookkeeping: which block hash lives in which host chunk.

Metadata only; the worker moves bytes. Every held key is in one of three states:

- being written (``prepare_store`` .. ``complete_store``): not loadable, not evictable;
- ready and unpinned: loadable and evictable;
- ready and pinned by ``prepare_load`` (a count): loadable, not evictable until
  ``complete_load`` drops the count to zero.

Stores are all or nothing, and a failed store frees its chunks, so a key is never loadable
unless its bytes landed and every chunk returns to the free pool.

Free chunks are handed out lowest id first (a heap), so a store's keys get ascending
chunks: the key ranges a policy later evicts together free neighbouring chunks, which the
next store takes as few DMA runs (docs/cache.md, "Which chunk a block gets").
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from ..errors import InvalidSpec, KeyNotLoadable
from .admission import AdmissionPolicy, make_admission
from .policies import EvictionPolicy, make_policy
from .registry import release

__all__ = [
    "CacheStats",
    "ChunkManager",
    "KeysRemoved",
    "KeysStored",
    "LookupResult",
    "StorePlan",
]


class LookupResult(enum.Enum):
    """What the cache holds for one key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    """Held but still being written: not loadable yet."""


@dataclass(frozen=True)
class StorePlan:
    """What to write: ``chunk_ids[i]`` receives ``keys_to_store[i]`` (a CPULoadStoreSpec's ids).

    ``evicted_chunks[i]`` held ``evicted[i]`` until this plan: a lower tier reads it from
    there before the store reuses the chunk.
    """

    keys_to_store: list[Hashable]
    chunk_ids: list[int]
    evicted: list[Hashable]
    evicted_chunks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KeysStored:
    """Keys that became loadable (for a router's prefix index)."""

    keys: tuple[Hashable, ...]


@dataclass(frozen=True)
class KeysRemoved:
    """Keys that stopped being loadable (evicted)."""

    keys: tuple[Hashable, ...]


CacheEvent = KeysStored | KeysRemoved


@dataclass(frozen=True)
class CacheStats:
    """Counters since construction, plus current occupancy."""

    num_chunks: int
    chunks_used: int
    chunks_free: int
    keys: int
    pending_keys: int
    pinned_keys: int
    stores: int
    failed_stores: int
    evictions: int
    rejected_by_admission: int
    store_plans_refused: int


class _Entry:
    __slots__ = ("chunk", "pins", "ready")

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.pins = 0
        self.ready = False


class ChunkManager:
    """Maps block hashes to chunks of a fixed pool of ``num_chunks``.

    Args:
        num_chunks: size of the host pool, in chunks.
        policy: eviction policy name (see ``available_policies``) or instance.
        admission: admission name or instance; None takes the policy's own pairing
            (``"adaptive"`` pairs with adaptive admission, others admit everything).
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        policy: str | EvictionPolicy = "lru",
        admission: str | AdmissionPolicy | None = None,
    ) -> None:
        if num_chunks < 1:
            raise InvalidSpec("num_chunks must be >= 1")
        self.num_chunks = num_chunks
        self._policy = make_policy(policy, num_chunks)
        if admission is None:
            admission = getattr(self._policy, "preferred_admission", None)
        try:
            self._admission = make_admission(admission, num_chunks)
        except BaseException:
            if self._policy is policy:
                release(policy)  # refused: the caller's policy object stays theirs
            raise
        self._entries: dict[Hashable, _Entry] = {}
        self._free: list[int] = list(range(num_chunks))  # a heap: lowest id first
        self._events: list[CacheEvent] = []
        self._pending = 0
        self._pinned = 0
        self._stores = 0
        self._failed_stores = 0
        self._evictions = 0
        self._rejected = 0
        self._refused = 0

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def admission(self) -> AdmissionPolicy:
        return self._admission

    @property
    def num_free_chunks(self) -> int:
        return len(self._free)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def lookup(self, key: Hashable) -> LookupResult:
        """Whether ``key`` is loadable now (HIT), being written (HIT_PENDING) or absent."""
        entry = self._entries.get(key)
        if entry is None:
            return LookupResult.MISS
        return LookupResult.HIT if entry.ready else LookupResult.HIT_PENDING

    def count_leading_hits(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are loadable before the first that is not."""
        entries = self._entries
        n = 0
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.ready:
                break
            n += 1
        return n

    def keys_by_eviction(self) -> list[Hashable]:
        """The loadable keys in the policy's eviction order, next victim first (to write the
        host out coldest first, so its hottest keys are the newest below)."""
        entries = self._entries
        ready = [k for k, e in entries.items() if e.ready]
        return self._policy.victims(len(ready), lambda k: entries[k].ready) or ready

    def touch(self, keys: Sequence[Hashable]) -> None:
        """Mark held keys as just used (prefix order); unknown keys are ignored."""
        held = [k for k in keys if k in self._entries]
        if held:
            self._policy.on_access(held)

    def prepare_store(self, keys: Iterable[Hashable], *, admit: bool = True,
                      keep: Container[Hashable] = ()) -> StorePlan | None:
        """Allocate chunks for the admitted keys not held yet, evicting if needed.

        Never evicts a key of this offer, nor one in ``keep`` (a set, looked up per
        candidate: keys the caller needs kept without offering them again). Returns None,
        changing nothing, when the admitted keys cannot all fit; a plan with no keys when
        nothing needs storing. ``admit=False`` takes every key without asking (or teaching)
        the admission policy: a block read back from a lower tier was admitted once and is
        wanted again now.
        """
        offer = list(dict.fromkeys(keys))
        entries = self._entries
        new = [k for k in offer if k not in entries]
        if not new:
            if admit:
                self._admission.observe(offer)
            return StorePlan([], [], [])
        flags = self._admission.admit_offer(offer, new, len(self._free)) if admit else [True] * len(new)
        to_store = [k for k, ok in zip(new, flags) if ok]
        need = len(to_store) - len(self._free)
        victims: list[Hashable] = []
        victim_chunks: list[int] = []
        if need > 0:
            protected = set(offer)

            def evictable(key: Hashable) -> bool:
                entry = entries[key]
                return entry.ready and entry.pins == 0 and key not in protected and key not in keep

            found = self._policy.victims(need, evictable)
            if found is None:
                self._refused += 1
                return None
            victims = found
        if admit:
            self._admission.observe(offer)
            self._admission.on_offer(new, flags)
        self._rejected += len(new) - len(to_store)
        if victims:
            victim_chunks = [entries[key].chunk for key in victims]
            for key in victims:
                self._drop(key, evicted=True)
            self._evictions += len(victims)
            self._events.append(KeysRemoved(tuple(victims)))
        chunks = self._take_chunks(len(to_store))
        for key, chunk in zip(to_store, chunks):
            entries[key] = _Entry(chunk)
        self._pending += len(to_store)
        if to_store:
            self._policy.on_insert(to_store)
        return StorePlan(to_store, chunks, victims, victim_chunks)

    def complete_store(self, keys: Iterable[Hashable], success: bool = True, *, counted: bool = True) -> None:
        """Finish a store: make keys loadable, or on failure free their chunks.

        Keys that are not pending (unknown, or already complete) are ignored. ``counted=False``
        frees a store that never started (the worker refused its submit) without counting
        it in ``failed_stores``.
        """
        entries = self._entries
        done = [k for k in dict.fromkeys(keys) if (e := entries.get(k)) is not None and not e.ready]
        if not done:
            return
        self._pending -= len(done)
        if success:
            for key in done:
                entries[key].ready = True
            self._stores += len(done)
            self._events.append(KeysStored(tuple(done)))
        else:
            for key in done:
                self._drop(key, evicted=False)
            if counted:
                self._failed_stores += len(done)

    def prepare_load(self, keys: Sequence[Hashable], *, touch: bool = True) -> list[int]:
        """Pin loadable keys (not evictable until ``complete_load``); their chunk ids.

        Raises KeyNotLoadable, pinning nothing, if any key is missing or being written.
        ``touch=False`` pins without counting a use (a copy to a lower tier is no reuse).
        """
        entries = self._entries
        found: list[_Entry] = []
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.ready:
                state = "missing" if entry is None else "still being written"
                raise KeyNotLoadable(f"key {key!r} is {state}")
            found.append(entry)
        for entry in found:
            if entry.pins == 0:
                self._pinned += 1
            entry.pins += 1
        if touch:
            self._policy.on_access(list(keys))
        return [e.chunk for e in found]

    def complete_load(self, keys: Sequence[Hashable]) -> None:
        """Unpin keys pinned by ``prepare_load`` (once per pin). Unpinned keys are ignored."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned -= 1

    def take_events(self) -> list[CacheEvent]:
        """Stored/removed events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> CacheStats:
        used = self.num_chunks - len(self._free)
        return CacheStats(
            num_chunks=self.num_chunks,
            chunks_used=used,
            chunks_free=len(self._free),
            keys=len(self._entries),
            pending_keys=self._pending,
            pinned_keys=self._pinned,
            stores=self._stores,
            failed_stores=self._failed_stores,
            evictions=self._evictions,
            rejected_by_admission=self._rejected,
            store_plans_refused=self._refused,
        )

    def _take_chunks(self, n: int) -> list[int]:
        return [heapq.heappop(self._free) for _ in range(n)]

    def _give_chunk(self, chunk: int) -> None:
        heapq.heappush(self._free, chunk)

    def _drop(self, key: Hashable, *, evicted: bool) -> None:
        entry = self._entries.pop(key)
        self._give_chunk(entry.chunk)
        self._policy.on_remove(key, evicted=evicted)
        if evicted:
            self._admission.on_evict(key)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        entries = self._entries
        chunks = [e.chunk for e in entries.values()]
        free = self._free
        assert len(chunks) + len(free) == self.num_chunks, "chunk leaked or double-counted"
        every = set(chunks) | set(free)
        assert len(every) == self.num_chunks, "chunk owned twice"
        assert every == set(range(self.num_chunks)), "chunk id out of range"
        assert all(free[(i - 1) // 2] <= free[i] for i in range(1, len(free))), "free chunks not a heap"
        assert self._pending == sum(1 for e in entries.values() if not e.ready), "pending count"
        assert self._pinned == sum(1 for e in entries.values() if e.pins > 0), "pinned count"
        assert all(e.ready or e.pins == 0 for e in entries.values()), "pinned key not ready"
        assert len(self._policy) == len(entries), "policy tracks other keys than the manager"
