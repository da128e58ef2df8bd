"""The counters behind ``OffloadCache.stats()``, and the per-copy figures it feeds to an
``OffloadMetrics``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..errors import InvalidSpec
from ..specs import Direction, TransferResult
from .manager import CacheStats
from .records import OffloadCacheStats, TierCacheStats

__all__ = ["FOLD_AT", "Counters"]

FOLD_AT = 256
"""Results kept before their device times are summed (bounds the lists between stats())."""


class Counters:
    """What one cache counted since construction (see ``OffloadCacheStats`` for units)."""

    def __init__(self, metrics: Any = None) -> None:
        # An ``OffloadMetrics`` (or None): each finished copy is observed there as it is
        # folded, so its histograms trail the cache by at most the calls' entries.
        if metrics is not None and not callable(getattr(metrics, "observe", None)):
            raise InvalidSpec(f"metrics must be an aiokv.metrics.OffloadMetrics, "
                              f"got {type(metrics).__name__}")
        self.metrics = metrics
        self.hits = self.misses = self.host_hits = 0
        self.offered = self.stored = self.skipped = self.failed_stores = 0
        self.restores = self.restored = self.restore_misses = self.failed_loads = 0
        self.store_bytes = self.load_bytes = 0
        self.store_seconds = self.load_seconds = 0.0
        # Results whose device time is not summed yet: reading it in the done callback
        # would put the CUDA timing read back before the awaiting task wakes (fold).
        self.untimed_stores: list[TransferResult] = []
        self.untimed_loads: list[tuple[TransferResult, Direction]] = []
        # A collector scraping on its own thread calls stats() while the loop folds at a
        # call's entry: each result is taken by one fold only (done callbacks append
        # without it, past what a fold takes).
        self._folding = threading.Lock()

    def fold(self, at_least: int | None = None) -> None:
        """Sum the device times of finished copies once ``at_least`` wait (a new call's
        entry, or ``stats()``: never a done callback, which runs before the wake-up); with
        metrics, at every call's entry, where each copy is also observed."""
        if at_least is None:
            at_least = 1 if self.metrics is not None else FOLD_AT
        # A call's entry never waits for a fold on another thread (that one takes these).
        if not self._folding.acquire(blocking=at_least == 0):
            return
        try:
            if stores := _take(self.untimed_stores, at_least):
                self.store_seconds += self._seconds([(r, Direction.STORE) for r in stores])
            if loads := _take(self.untimed_loads, at_least):
                self.load_seconds += self._seconds(loads)
        finally:
            self._folding.release()

    def _seconds(self, results: list[tuple[TransferResult, Direction]]) -> float:
        if self.metrics is not None:
            for result, direction in results:
                self.metrics.observe(result, direction)
        return sum(r.transfer_time or 0.0 for r, _ in results)

    def count_hits(self, total: int, host: int, hits: int) -> None:
        self.hits += hits
        self.host_hits += host
        self.misses += total - hits

    def count_offer(self, offered: int, skipped: int) -> None:
        self.offered += offered
        self.skipped += skipped

    def count_restore(self, restored: int, failed_loads: int = 0) -> None:
        """Count one restore that ended: ``restored`` leading keys arrived (none is a
        miss), ``failed_loads`` of its loads failed (a cancelled one counts in ``restores``
        alone)."""
        self.restores += 1
        self.restored += restored
        self.failed_loads += failed_loads
        if restored == 0:
            self.restore_misses += 1

    def snapshot(self, mgr: CacheStats, in_flight: int, tiers: Sequence[TierCacheStats],
                 staging: tuple[int, int] = (0, 0)) -> OffloadCacheStats:
        self.fold(0)
        return OffloadCacheStats(
            hits=self.hits, misses=self.misses, offered_keys=self.offered,
            stored_keys=self.stored, skipped_keys=self.skipped, failed_stores=self.failed_stores,
            restores=self.restores, restored_keys=self.restored,
            restore_misses=self.restore_misses, failed_loads=self.failed_loads,
            evictions=mgr.evictions, store_bytes=self.store_bytes,
            store_seconds=self.store_seconds, load_bytes=self.load_bytes,
            load_seconds=self.load_seconds, in_flight=in_flight, manager=mgr,
            host_hits=self.host_hits, tiers=tuple(tiers), staging_chunks=staging[0],
            staging_free=staging[1],
        )


def _take(results: list[Any], at_least: int) -> list[Any]:
    """The results listed now, removed from ``results`` (an append meanwhile stays), if
    at least ``at_least``; else none."""
    n = len(results)
    if not n or n < at_least:
        return []
    taken = results[:n]
    del results[:n]
    return taken
