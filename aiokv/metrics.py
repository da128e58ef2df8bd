"""Prometheus metrics for an offloading worker (optional: ``pip install 'aiokv[metrics]'``).

Two sources, because the numbers live in two places:

* ``WorkerCollector`` reads the worker's ``statistics()`` snapshot at scrape time: bytes and
  transfers per direction, failures, jobs in flight, host pool size. Nothing to feed, and
  scraping costs nothing between scrapes.
* Per-job histograms (transfer time, transfer size) need each job's ``TransferResult``,
  which only the code that awaited or drained the job holds, so it feeds them:
  ``metrics.observe(result, "store")``, or ``metrics.track(future, "load")`` on the
  async face; an ``OffloadCache(worker, metrics=metrics)`` feeds them its own copies.

``OffloadMetrics`` bundles both. ``CacheCollector`` exports an ``OffloadCache``'s own
counters (hits, stores, restores, evictions, staging chunks, drops) and
``CacheTierCollector`` its per-tier series, both read from ``cache.stats()`` at scrape
time. ``prometheus_client`` is imported when one is built, so ``import aiokv.metrics``
works without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from .core import WorkerStatistics
from .errors import InvalidSpec, TransferFailed
from .extras import require
from .specs import Direction, TransferResult

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from .future import TransferFuture

__all__ = [
    "DEFAULT_SIZE_BUCKETS", "DEFAULT_TIME_BUCKETS", "CacheCollector", "CacheTierCollector", "OffloadMetrics",
    "WorkerCollector",
]

# Seconds a job's copies took on the device: tens of microseconds (a few pages) to seconds.
DEFAULT_TIME_BUCKETS: tuple[float, ...] = (
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0,
)
# Bytes per job: 4 KiB (one small page) to 4 GiB, in factors of 4.
DEFAULT_SIZE_BUCKETS: tuple[float, ...] = tuple(float(4**k) for k in range(6, 17))

_DIRECTIONS = tuple(d.value for d in Direction)


class _HasStatistics(Protocol):
    def statistics(self) -> WorkerStatistics: ...


def _prometheus() -> Any:
    """Import prometheus_client, or say how to get it (``MissingExtra``)."""
    return require("metrics")


def _direction(direction: Direction | str) -> str:
    if isinstance(direction, Direction):
        return direction.value
    if direction not in _DIRECTIONS:
        raise InvalidSpec(f"direction must be one of {_DIRECTIONS} or a Direction, got {direction!r}")
    return direction


_Source = TypeVar("_Source")


class _Labelled(Generic[_Source]):
    """What one collector exports, each source (a worker, a cache) under its own values of
    the collector's label names: a registry holds one collector of a set of metric names,
    so sources told apart by labels (one per rank, say) share it."""

    def __init__(self, what: str, labels: Mapping[str, str] | None) -> None:
        self.what = what
        self.names = list(labels or {})
        self._by_values: dict[tuple[str, ...], _Source] = {}

    def add(self, source: _Source, labels: Mapping[str, str] | None) -> None:
        """``InvalidSpec`` for labels of other names, or values another source has."""
        given = dict(labels or {})
        if sorted(given) != sorted(self.names):
            raise InvalidSpec(f"labels must name {self.names}, as this collector's others do; "
                              f"got {list(given)}")
        values = tuple(str(given[name]) for name in self.names)
        if values in self._by_values:
            raise InvalidSpec(f"a {self.what} with labels {given} is exported here already: "
                              "give each its own")
        self._by_values[values] = source

    def discard(self, labels: Mapping[str, str] | None) -> bool:
        """Forget the source of these label values; whether any sources are left."""
        given = dict(labels or {})
        self._by_values.pop(tuple(str(given.get(name, "")) for name in self.names), None)
        return bool(self._by_values)

    def items(self) -> list[tuple[tuple[str, ...], _Source]]:
        """(label values, source) of each, copied: a scrape may run beside an add."""
        return list(self._by_values.items())


class WorkerCollector:
    """A custom collector exporting a worker's ``statistics()`` at each scrape.

    Works with ``AsyncOffloadingWorker`` and ``SyncOffloadingWorker`` (anything with
    ``statistics()``), open or closed. ``labels`` are constant labels added to every
    sample, e.g. ``{"rank": "0"}`` when one process exports several workers.
    """

    def __init__(
        self, worker: _HasStatistics, *, namespace: str = "aiokv", labels: Mapping[str, str] | None = None
    ) -> None:
        _prometheus()
        self._ns = namespace
        self._workers: _Labelled[_HasStatistics] = _Labelled("worker", labels)
        self.add(worker, labels)

    def add(self, worker: _HasStatistics, labels: Mapping[str, str] | None = None) -> None:
        """Export another worker under other values of the same label names (one registry
        holds one collector of these names, so several workers share it)."""
        if not callable(getattr(worker, "statistics", None)):
            raise InvalidSpec(f"expected a worker with statistics(), got {type(worker).__name__}")
        self._workers.add(worker, labels)

    def discard(self, labels: Mapping[str, str] | None = None) -> bool:
        """Stop exporting the worker of these label values; whether any workers are left."""
        return self._workers.discard(labels)

    def describe(self) -> list[Metric]:
        """The families this collector exports (lets the registry reject name clashes)."""
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        yield from self._families([(values, w.statistics()) for values, w in self._workers.items()])

    def _families(self, snapshots: list[tuple[tuple[str, ...], WorkerStatistics]]) -> Iterator[Metric]:
        core = _prometheus().metrics_core
        const_names = self._workers.names
        per_direction = [
            (core.CounterMetricFamily, "transferred_bytes", "Bytes moved by transfers.", "bytes_moved"),
            (core.CounterMetricFamily, "transfers", "Transfers that completed successfully.", "completed"),
            (core.CounterMetricFamily, "transfer_failures", "Transfers that failed.", "failed"),
            (core.GaugeMetricFamily, "jobs_in_flight", "Jobs submitted and not yet completed.", "in_flight"),
        ]
        for family_type, name, doc, field_name in per_direction:
            family = family_type(f"{self._ns}_{name}", doc, labels=[*const_names, "direction"])
            for values, stats in snapshots:
                counts: dict[str, int] = getattr(stats, field_name)
                for direction in _DIRECTIONS:
                    family.add_metric([*values, direction], counts.get(direction, 0))
            yield family
        pool = [
            ("host_pool_chunks", "Chunks in the pinned host pool.", lambda s: s.num_cpu_chunks),
            ("host_pool_bytes", "Bytes of the pinned host pool.", lambda s: s.num_cpu_chunks * s.chunk_bytes),
        ]
        for name, doc, value in pool:
            family = core.GaugeMetricFamily(f"{self._ns}_{name}", doc, labels=const_names)
            for values, stats in snapshots:
                family.add_metric(list(values), value(stats))
            yield family


class _HasCacheStats(Protocol):
    def stats(self) -> Any: ...


# (metric name, help, kind, reads an OffloadCacheStats) for each cache-level series.
_CACHE_SERIES: tuple[tuple[str, str, str, Any], ...] = (
    ("cache_hits", "Keys lookups found (leading hits, any tier).", "counter", lambda s: s.hits),
    ("cache_host_hits", "Keys lookups found in the host pool.", "counter", lambda s: s.host_hits),
    ("cache_misses", "Keys lookups did not find.", "counter", lambda s: s.misses),
    ("cache_offered_keys", "Keys offered to offload.", "counter", lambda s: s.offered_keys),
    ("cache_stored_keys", "Keys stored in the host pool.", "counter", lambda s: s.stored_keys),
    ("cache_failed_store_keys", "Keys whose store copy failed (not loadable).", "counter",
     lambda s: s.failed_stores),
    ("cache_rejected_keys", "Keys the admission policy turned away.", "counter",
     lambda s: s.manager.rejected_by_admission),
    ("cache_evictions", "Keys evicted from the host pool.", "counter", lambda s: s.evictions),
    ("cache_restores", "restore calls.", "counter", lambda s: s.restores),
    ("cache_restored_keys", "Keys restored to the GPU.", "counter", lambda s: s.restored_keys),
    ("cache_restore_misses", "restore calls that restored nothing.", "counter", lambda s: s.restore_misses),
    ("cache_failed_loads", "restore calls whose load copy failed (a miss, recomputed).", "counter",
     lambda s: s.failed_loads),
    ("cache_store_bytes", "Bytes the cache's store copies moved.", "counter", lambda s: s.store_bytes),
    ("cache_load_bytes", "Bytes the cache's load copies moved.", "counter", lambda s: s.load_bytes),
    ("cache_demotions_dropped", "Blocks on their way down to a tier that were dropped (all tiers).",
     "counter", lambda s: sum(t.demotions_dropped for t in s.tiers)),
    ("cache_keys", "Keys the host pool holds (loadable).", "gauge", lambda s: s.manager.keys),
    ("cache_chunks", "Host chunks the cache owns for keys.", "gauge", lambda s: s.manager.num_chunks),
    ("cache_pending_keys", "Keys being stored.", "gauge", lambda s: s.manager.pending_keys),
    ("cache_pinned_keys", "Keys pinned by loads in flight.", "gauge", lambda s: s.manager.pinned_keys),
    ("cache_copies_in_flight", "The cache's copies submitted and not over.", "gauge", lambda s: s.in_flight),
    ("cache_staging_chunks", "Chunks kept aside to move blocks to and from the tiers.", "gauge",
     lambda s: s.staging_chunks),
    ("cache_staging_free", "Staging chunks free now.", "gauge", lambda s: s.staging_free),
)


class CacheCollector:
    """Exports an ``OffloadCache``'s own counters and occupancy (``cache.stats()``) at each
    scrape: hits and misses, offers, stores, restores, failures, evictions, bytes, keys
    held, pending and pinned, staging chunks, and blocks dropped on their way down. Keys
    count blocks (one key per block). ``labels`` are constant labels; where one registry
    exports several caches (one per rank, say), they share this collector, each under its
    own label values (``add``), since the registry refuses a second one of these names."""

    def __init__(self, cache: _HasCacheStats, *, namespace: str = "aiokv",
                 labels: Mapping[str, str] | None = None) -> None:
        _prometheus()
        self._ns = namespace
        self._caches: _Labelled[_HasCacheStats] = _Labelled("cache", labels)
        self.add(cache, labels)

    def add(self, cache: _HasCacheStats, labels: Mapping[str, str] | None = None) -> None:
        """Export another cache under other values of the same label names."""
        if not callable(getattr(cache, "stats", None)):
            raise InvalidSpec(f"expected an OffloadCache, got {type(cache).__name__}")
        self._caches.add(cache, labels)

    def discard(self, labels: Mapping[str, str] | None = None) -> bool:
        """Stop exporting the cache of these label values (one closed for good); whether any
        caches are left."""
        return self._caches.discard(labels)

    def describe(self) -> list[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        yield from self._families([(values, c.stats()) for values, c in self._caches.items()])

    def _families(self, snapshots: list[tuple[tuple[str, ...], Any]]) -> Iterator[Metric]:
        core = _prometheus().metrics_core
        for name, doc, kind, read in _CACHE_SERIES:
            family_type = core.CounterMetricFamily if kind == "counter" else core.GaugeMetricFamily
            family = family_type(f"{self._ns}_{name}", doc, labels=self._caches.names)
            for values, stats in snapshots:
                family.add_metric(list(values), read(stats))
            yield family


# (metric name, help, kind, reads a TierCacheStats) for each per-tier series.
_TIER_SERIES: tuple[tuple[str, str, str, Any], ...] = (
    ("cache_tier_hits", "Keys lookups found in this tier.", "counter", lambda t: t.hits),
    ("cache_tier_restored_bytes", "KV bytes restored from this tier.", "counter", lambda t: t.restored_bytes),
    ("cache_tier_demoted_blocks", "Blocks written to this tier as the host let them go.", "counter",
     lambda t: t.demoted),
    ("cache_tier_write_through_blocks", "Blocks written through to this tier as they were stored.",
     "counter", lambda t: t.write_throughs),
    ("cache_tier_persisted_blocks", "Host blocks written to this tier as the cache closed.",
     "counter", lambda t: t.persisted),
    ("cache_tier_demotions_dropped", "Blocks not written: the tier fell behind or refused them.", "counter",
     lambda t: t.demotions_dropped),
    ("cache_tier_read_misses", "Reads of keys asked of this tier that missed (absent, I/O, corrupt).",
     "counter", lambda t: t.read_misses),
    ("cache_tier_errors", "I/O errors, timeouts and lost connections (all became misses or drops).",
     "counter", lambda t: t.tier.errors),
    ("cache_tier_corrupt", "Values that failed verification (read as misses).", "counter",
     lambda t: t.tier.corrupt),
    ("cache_tier_held_bytes", "KV bytes the tier holds (-1: unknown).", "gauge", lambda t: t.tier.bytes_held),
    ("cache_tier_queued_blocks", "Blocks waiting to be written to the tier.", "gauge",
     lambda t: t.queued_blocks),
)


class CacheTierCollector:
    """Exports an ``OffloadCache``'s per-tier statistics (hits, bytes, drops, errors) at
    each scrape, labelled ``tier`` (the tier's name, ``name-position`` when two tiers share
    a name) plus any constant ``labels``."""

    def __init__(self, cache: _HasCacheStats, *, namespace: str = "aiokv",
                 labels: Mapping[str, str] | None = None) -> None:
        _prometheus()
        self._cache = cache
        self._ns = namespace
        self._labels = {k: str(v) for k, v in (labels or {}).items()}

    def describe(self) -> list[Metric]:
        return list(self._families(()))

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._cache.stats().tiers)

    def _families(self, tiers: Any) -> Iterator[Metric]:
        core = _prometheus().metrics_core
        names = [*self._labels, "tier"]
        for name, doc, kind, read in _TIER_SERIES:
            family_type = core.CounterMetricFamily if kind == "counter" else core.GaugeMetricFamily
            family = family_type(f"{self._ns}_{name}", doc, labels=names)
            for label, tier in zip(_tier_labels(tiers), tiers):
                family.add_metric([*self._labels.values(), label], read(tier))
            yield family


def _tier_labels(tiers: Any) -> list[str]:
    """Each tier's ``tier`` label: its name, with its 1-based position added when two tiers
    share a name (two disks), since duplicate label sets are refused by Prometheus."""
    names = [tier.name for tier in tiers]
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names, 1)]


class _Shared:
    """What the ``OffloadMetrics`` of one registry and namespace share: prometheus_client
    refuses a second collector or histogram of the same names, so several workers (``labels``
    apart, e.g. one per rank) feed one pair of histograms and one collector."""

    def __init__(self, prom: Any, registry: CollectorRegistry, namespace: str, label_names: list[str],
                 time_buckets: tuple[float, ...], size_buckets: tuple[float, ...]) -> None:
        self.shape = (sorted(label_names), tuple(time_buckets), tuple(size_buckets))
        self.label_names = label_names
        self.registry = registry
        self.namespace = namespace
        names = [*label_names, "direction"]
        self.transfer_seconds = prom.Histogram(
            f"{namespace}_transfer_seconds",
            "Seconds one job's copies took on the device (not time spent queued).",
            names, buckets=time_buckets, registry=registry,
        )
        try:
            self.transfer_size = prom.Histogram(
                f"{namespace}_transfer_size_bytes", "Bytes one successful job moved.",
                names, buckets=size_buckets, registry=registry,
            )
        except BaseException:
            registry.unregister(self.transfer_seconds)
            raise
        self.collector: WorkerCollector | None = None
        self.users = 0


# registry -> namespace -> what its OffloadMetrics share
_SHARED: weakref.WeakKeyDictionary[Any, dict[str, _Shared]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


class OffloadMetrics:
    """Prometheus metrics for one worker: a statistics collector plus per-job histograms.

    Args:
        worker: the worker whose ``statistics()`` to export; None exports histograms only.
        registry: where to register (default: prometheus_client's global ``REGISTRY``).
        namespace: metric name prefix.
        labels: constant labels on every metric, e.g. ``{"rank": "0"}``. The
            ``OffloadMetrics`` of one registry and namespace share one collector and one
            pair of histograms, so each worker needs its own label values (and all the
            same label names and buckets).
        time_buckets: buckets of the transfer time histogram, in seconds.
        size_buckets: buckets of the transfer size histogram, in bytes.

    Example::

        metrics = OffloadMetrics(worker, registry=registry)
        result = await metrics.track(worker.submit_store(job, src, dst), "store")
    """

    def __init__(
        self,
        worker: _HasStatistics | None = None,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "aiokv",
        labels: Mapping[str, str] | None = None,
        time_buckets: tuple[float, ...] = DEFAULT_TIME_BUCKETS,
        size_buckets: tuple[float, ...] = DEFAULT_SIZE_BUCKETS,
    ) -> None:
        prom = _prometheus()
        self.registry = prom.REGISTRY if registry is None else registry
        self._labels = {k: str(v) for k, v in (labels or {}).items()}
        with _SHARED_LOCK:
            spaces = _SHARED.setdefault(self.registry, {})
            shared = spaces.get(namespace)
            created = shared is None
            if shared is None:
                shared = _Shared(prom, self.registry, namespace, list(self._labels),
                                 time_buckets, size_buckets)
            elif shared.shape != (sorted(self._labels), tuple(time_buckets), tuple(size_buckets)):
                raise InvalidSpec(
                    f"metrics of namespace {namespace!r} in this registry use labels "
                    f"{shared.shape[0]} and their buckets; pass the same label names and buckets"
                )
            try:
                if worker is not None:
                    if shared.collector is None:
                        collector = WorkerCollector(worker, namespace=namespace, labels=self._labels)
                        self.registry.register(collector)
                        shared.collector = collector
                    else:
                        shared.collector.add(worker, self._labels)
            except BaseException:
                if created:  # leave the registry as it was
                    for histogram in (shared.transfer_seconds, shared.transfer_size):
                        self.registry.unregister(histogram)
                raise
            spaces[namespace] = shared
            shared.users += 1
        self._shared = shared
        self._has_worker = worker is not None
        self._registered = True
        self.transfer_seconds = shared.transfer_seconds
        self.transfer_size = shared.transfer_size
        self.collector = shared.collector if worker is not None else None

    def observe(self, result: TransferResult, direction: Direction | str) -> None:
        """Record one finished job. Failed jobs carry no time or size and are skipped here;
        the collector counts them (``transfer_failures``)."""
        label = _direction(direction)
        if not result.success:
            return
        values = {**self._labels, "direction": label}
        if result.transfer_time is not None:
            self.transfer_seconds.labels(**values).observe(result.transfer_time)
        if result.transfer_size is not None:
            self.transfer_size.labels(**values).observe(result.transfer_size)

    def track(self, future: TransferFuture, direction: Direction | str) -> TransferFuture:
        """Observe ``future``'s result once it is done; returns the future, to await as usual.

        Done callbacks run before the awaiting task wakes, and this one reads the device
        time and pools the events (docs/performance.md, "Completion"); ``observe(result,
        ...)`` after the await does not delay the wake-up."""
        label = _direction(direction)

        def _done(fut: TransferFuture) -> None:
            try:
                result = fut.result()
            except TransferFailed as exc:
                result = exc.result
            self.observe(result, label)

        future.add_done_callback(_done)
        return future

    def unregister(self) -> None:
        """Stop exporting this worker and its histogram series; the registry forgets the
        names once the last ``OffloadMetrics`` sharing them is gone (tests, short-lived
        workers). Idempotent."""
        if not self._registered:
            return
        self._registered = False
        shared = self._shared
        with _SHARED_LOCK:
            collector = shared.collector if self._has_worker else None
            if collector is not None and not collector.discard(self._labels):
                self.registry.unregister(collector)  # its last worker
                shared.collector = None
            values = [self._labels[name] for name in shared.label_names]
            for histogram in (shared.transfer_seconds, shared.transfer_size):
                for direction in _DIRECTIONS:
                    try:
                        histogram.remove(*values, direction)
                    except KeyError:
                        pass  # never observed
            shared.users -= 1
            if shared.users == 0:
                for histogram in (shared.transfer_seconds, shared.transfer_size):
                    self.registry.unregister(histogram)
                del _SHARED[self.registry][shared.namespace]
        self.collector = None
