"""What ``OffloadCache`` reports: per-call results and counters, per tier included."""

from __future__ import annotations

from dataclasses import dataclass, field

from .manager import CacheStats
from .tiers.base import TierStatistics

__all__ = ["OffloadCacheStats", "OffloadResult", "RestoreResult", "TierCacheStats"]


@dataclass(frozen=True)
class OffloadResult:
    """What one ``offload`` did with the keys it was offered.

    ``stored`` keys are loadable now; ``skipped`` were already held or being stored by
    another task; ``not_stored`` were turned away (admission, no evictable room, or a
    failed copy: then ``failed`` is True). With tiers, ``spilled`` of the keys the host
    turned away were copied for the nearest tier instead. ``int(result)`` is ``stored``.
    """

    stored: int
    skipped: int
    not_stored: int
    evicted: int
    failed: bool = False
    spilled: int = 0

    def __int__(self) -> int:
        return self.stored


@dataclass(frozen=True)
class RestoreResult:
    """What one ``restore`` brought back.

    ``restored`` leading keys have their bytes in their GPU blocks; the keys after them
    are misses (absent, failed or corrupt in every tier) whose blocks must be recomputed.
    ``bool(result)`` is True only when keys were asked for and every one was restored, so
    ``if await cache.restore(...)`` keeps its all-or-nothing meaning and a restore of no
    keys (a lookup that found nothing) reads as a miss; ``int(result)`` is ``restored``.
    Without lower tiers a restore is all or nothing.
    """

    restored: int
    requested: int
    from_host: int = 0
    from_tiers: int = 0

    def __bool__(self) -> bool:
        return 0 < self.restored == self.requested

    def __int__(self) -> int:
        return self.restored


@dataclass(frozen=True)
class TierCacheStats:
    """What the cache did with one lower tier, beside the tier's own counters.

    ``hits`` are keys that ``lookup``/``alookup`` counted from this tier (held there, or on
    their way down to it); ``restored_keys`` and ``restored_bytes`` came back through it;
    ``demoted`` blocks were written after the host evicted them or turned them away
    (``write_throughs`` as they were stored, ``persisted`` as the cache closed);
    ``demotions_dropped`` were not written: the tier stalled (freed no room for
    ``queue_wait`` seconds), refused them, or the cache closed before they were written;
    ``read_misses`` are reads of keys it was asked for that failed (absent, I/O, corrupt);
    ``queued_blocks`` are on their way down now; ``room_waits`` copies down waited their
    turn for room (backpressure), ``room_wait_seconds`` all together.
    """

    name: str
    hits: int
    restored_keys: int
    restored_bytes: int
    demoted: int
    write_throughs: int
    demotions_dropped: int
    read_misses: int
    queued_blocks: int
    tier: TierStatistics
    persisted: int = 0
    room_waits: int = 0
    room_wait_seconds: float = 0.0


@dataclass(frozen=True)
class OffloadCacheStats:
    """Counters since construction. Hits and misses are keys, counted by ``lookup`` and
    ``alookup`` (leading hits and the rest); ``host_hits`` of them came from the host pool,
    the rest from the tiers in ``tiers``. GB/s are bytes over summed device copy time. A
    call that raised (bad input, or a submit the worker refused) counts in no offer,
    restore or hit figure; evictions it made before the worker refused stay counted.
    Units: ``failed_stores`` counts keys (of failed store copies), ``restores``,
    ``restore_misses`` and ``failed_loads`` count ``restore`` calls; a cancelled ``restore``
    counts as a call and restores no key. ``staging_chunks`` (``staging_free`` of them
    free now) move blocks to and from the tiers."""

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
    host_hits: int = 0
    tiers: tuple[TierCacheStats, ...] = field(default=())
    staging_chunks: int = 0
    staging_free: int = 0

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
