"""Scheduler side: vLLM's ``OffloadingManager`` over aiokv's ``ChunkManager``.

The chunk manager decides which block hash gets which host chunk (eviction policy plus
admission); this adapter speaks vLLM's vocabulary around it: ``OffloadKey``s, a
``CPULoadStoreSpec`` of chunk ids that every rank's worker reads, ``PrepareStoreOutput``
and ``OffloadingEvent``s. Behaviour follows vLLM's ``CPUOffloadingManager`` where vLLM's
tests pin it down (see docs/vllm.md for where it differs).

With ``aiokv_tiers`` the chunks are ``TieredChunks``: a key the host lacks is looked up in
the tiers below (``HIT_PENDING`` while it is read up, ``RETRY`` while a remote tier is
asked), and what the host evicts goes down, all on the tiers' own thread
(``tier_io.TierIO``), which reaches the workers' pools through shared memory
(``shared_pool``) once they are published.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...cache import ChunkManager, KeysRemoved, KeysStored
from ...cache import LookupResult as ChunkLookup
from ...errors import InvalidSpec
from .shared_pool import PoolView, attach, pool_file
from .tier_io import TierIO
from .tier_metrics import TIER_COUNTERS, tier_label
from .tier_urls import TierURL
from .tiered_chunks import TierCounts, TieredChunks, Where

__all__ = ["AiokvOffloadingManager"]

_log = logging.getLogger("aiokv")

_ATTACH_PATIENCE = 120.0  # seconds before a pool never published is worth a warning

_LOOKUP = {
    Where.MISS: LookupResult.MISS,
    Where.HIT: LookupResult.HIT,
    Where.HIT_PENDING: LookupResult.HIT_PENDING,
    Where.RETRY: LookupResult.RETRY,
}


def _prefix_order(keys: list[Any], req_context: Any) -> list[Any]:
    """``keys`` in prefix order across KV-cache groups: by the token position vLLM recorded
    for each key, then by group.

    Why: vLLM offers and loads a request's keys group by group, but a block serves a hit
    only while every group holds it. aiokv's policies read a call's keys as a prefix (later
    keys go first), so group-major order would evict one group's whole prefix before the
    other group's tail. Keys without a recorded position keep the order given.
    """
    position = getattr(req_context, "get_offload_key_position", None)
    if position is None or len(keys) < 2:
        return keys
    ends = [position(k) for k in keys]
    if any(e is None for e in ends):
        return keys
    order = sorted(range(len(keys)), key=lambda i: (ends[i], get_offload_group_idx(keys[i])))
    return [keys[i] for i in order]


class AiokvOffloadingManager(OffloadingManager):
    """Tracks which ``OffloadKey`` lives in which of ``num_chunks`` host chunks.

    Args:
        num_chunks: chunks in each rank's host pool (the workers are built with the same
            count, so the chunk ids this manager hands out are valid on every rank).
        policy: eviction policy name (``aiokv.available_policies()``).
        admission: admission policy name, or None for the policy's own pairing.
        enable_events: collect ``OffloadingEvent``s for vLLM's KV-event publisher.
        tiers: ``aiokv_tiers``, nearest first (none: the host pool alone).
        engine_id: names the workers' shared pools (with tiers).
        world_size: ranks whose pools hold each chunk (with tiers).
        fingerprint: the tiers' layout fingerprint, from the mapped pools (with tiers).
        spare_chunks: chunks kept aside for evicted blocks on their way down (with tiers;
            default ``tiered_chunks.default_spare``).
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        policy: str = "adaptive",
        admission: str | None = None,
        enable_events: bool = False,
        tiers: Sequence[TierURL] = (),
        engine_id: str = "",
        world_size: int = 1,
        fingerprint: Callable[[PoolView], bytes] | None = None,
        spare_chunks: int | None = None,
    ) -> None:
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise InvalidSpec(f"the host pool must hold at least one chunk, got num_chunks={num_chunks!r}")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self._policy_name = policy
        self._admission_name = admission
        self._tier_urls = tuple(tiers)
        self._io = TierIO([t.build() for t in tiers]) if tiers else None
        self._tiered = TieredChunks(num_chunks, policy=policy, admission=admission, io=self._io,
                                    group_of=get_offload_group_idx, spare=spare_chunks)
        self._engine_id = engine_id
        self._world_size = world_size
        self._fingerprint = fingerprint
        self._attach_failed = False
        self._attach_warn_at = time.monotonic() + _ATTACH_PATIENCE
        self._reported = [TierCounts() for _ in tiers]
        # The request whose prefix is being looked up, and the keys found held so far: a
        # read up for a later key must not evict them.
        self._scan_req: Any = None
        self._scan: set[Any] = set()
        # req_id -> {key: the tier it was read up from}: the loads reads up served, which
        # get_load_source reports for that request only (later loads are host hits).
        self._load_sources: dict[Any, dict[Any, int]] = {}
        self._attach()  # vLLM builds its workers first: their pools are published by now
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # Keys whose store job failed, told by a caller before vLLM completes the job
        # (vLLM 0.33 completes every store as a success; see fail_store).
        self._failed_stores: set[Any] = set()
        # The scheduler enters this around every call; reentrant, so a caller that nests
        # two regions of one step cannot deadlock itself.
        self._lock = threading.RLock()

    @property
    def lock(self) -> AbstractContextManager[Any]:
        return self._lock

    @property
    def chunks(self) -> ChunkManager:
        """The chunk manager underneath (for statistics and tests)."""
        return self._tiered.chunks

    @property
    def tiers(self) -> TieredChunks:
        """The host chunks with the tiers below them (counters, tests)."""
        return self._tiered

    @property
    def tier_io(self) -> TierIO | None:
        """The tiers' thread (None without ``aiokv_tiers``)."""
        return self._io

    def _attach(self) -> None:
        """Start the tiers once every worker has published its shared pool (vLLM builds the
        workers first, so at the manager's construction); until then a look costs a stat."""
        io = self._io
        if io is None or io.view is not None or self._attach_failed:
            return
        missing = [r for r in range(self._world_size)
                   if not os.path.exists(f"{pool_file(self._engine_id, r)}.json")]
        if missing:
            if time.monotonic() > self._attach_warn_at:
                self._attach_warn_at = float("inf")
                _log.warning("aiokv: the tiers stay off until rank(s) %s publish their host pools in %s; "
                             "every rank must run on the scheduler's host (docs/vllm.md, Tiers below "
                             "host memory)", missing, os.path.dirname(pool_file(self._engine_id, 0)))
            return
        try:
            view = attach(self._engine_id, self._world_size, self.num_chunks)
        except (OSError, ValueError) as exc:
            _log.error("aiokv: cannot map the workers' host pools (%s); the tiers stay off", exc)
            self._attach_failed = True
            return
        if view is None:
            return
        fingerprint = self._fingerprint(view) if self._fingerprint is not None else b"aiokv-vllm-tiers"
        io.start(view, fingerprint)

    # -- requests ----------------------------------------------------------------------

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        if self._load_sources:
            self._load_sources.pop(getattr(req_context, "req_id", None), None)

    # -- loads -------------------------------------------------------------------------

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        """HIT, HIT_PENDING (being stored, or read up from a tier), RETRY (a remote tier is
        being asked) or MISS; never waits for a tier."""
        if self._io is None:
            return _LOOKUP[self._tiered.lookup(key)]
        self._attach()
        req = getattr(req_context, "req_id", None)
        if req != self._scan_req:
            self._scan_req, self._scan = req, set()
        where = self._tiered.lookup(key, self._scan)
        if where is Where.HIT or where is Where.HIT_PENDING:
            self._scan.add(key)
        return _LOOKUP[where]

    def get_load_source(self, key: Any, req_context: Any) -> CacheHitSource:
        """HOST, or, for the request whose load a read up from a tier served, where it came
        from: DISK for a local tier, EXTERNAL_UNSPECIFIED for a remote one (vLLM has no
        member for a remote store). vLLM asks after ``prepare_load``."""
        tier = self._load_sources.get(getattr(req_context, "req_id", None), {}).get(key)
        if tier is None or self._io is None:
            return CacheHitSource.HOST
        return CacheHitSource.EXTERNAL_UNSPECIFIED if self._io.tiers[tier].remote else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> CPULoadStoreSpec:
        """Pin ``keys`` until ``complete_load``; the spec holds their chunk ids in order.

        Raises:
            KeyNotLoadable: a key is missing or still being written (nothing is pinned).
        """
        keys = list(keys)
        chunk_ids = self._tiered.prepare_load(keys, touch=False)
        self.chunks.touch(_prefix_order(keys, req_context))
        sources = self._tiered.sources
        if sources:  # the first load of a block read up is that tier's hit; later ones, the host's
            served = {k: sources.pop(k) for k in keys if k in sources}
            if served:
                self._load_sources.setdefault(getattr(req_context, "req_id", None), {}).update(served)
        return CPULoadStoreSpec(chunk_ids)

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        """Count a use of ``keys`` (vLLM 0.33's ABC has this hook; 0.34 dropped it and
        reuse is counted when a held key is offered again, see ``prepare_store``)."""
        self.chunks.touch(_prefix_order(list(keys), req_context))

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        self.chunks.complete_load(list(keys))

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> PrepareStoreOutput | None:
        """Chunks for the admitted keys not held yet, evicting others if needed.

        None, storing nothing, when they cannot all fit (every other key is pinned or
        being written). Keys of this offer are never evicted by it; those already held
        count as used.
        """
        self._attach()
        offer = list(keys)
        ordered = _prefix_order(offer, req_context)
        chunks = self.chunks
        # A held block offered again was reused (vLLM offers blocks its GPU prefix cache
        # served, and never calls touch()): count the use, as vLLM's CPU manager does,
        # or the prefixes reused most would age out first.
        chunks.touch([k for k in ordered if chunks.lookup(k) is ChunkLookup.HIT])
        plan = self._tiered.prepare_store(ordered)
        self._collect()
        if plan is None:
            return None
        # vLLM reads the chunk ids in its own offer order (group by group), not in the
        # prefix order the policy was given.
        chunk_of = dict(zip(plan.keys_to_store, plan.chunk_ids))
        to_store = [k for k in dict.fromkeys(offer) if k in chunk_of]
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=CPULoadStoreSpec([chunk_of[k] for k in to_store]),
            evicted_keys=list(plan.evicted),
        )

    def fail_store(self, keys: Collection[Any]) -> None:
        """The store job of ``keys`` failed: their next ``complete_store`` is a failure
        whatever it says (vLLM 0.33's scheduler completes failed jobs as successes; the
        aiokv connector, which sees the failure, calls this first)."""
        self._failed_stores.update(keys)

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        """Make stored keys loadable; on failure free the chunks of those still pending."""
        keys = list(keys)
        self._tiered.poll()
        if self._failed_stores and not self._failed_stores.isdisjoint(keys):
            success = False
            self._failed_stores.difference_update(keys)
        failed = [] if success else [k for k in keys if self.chunks.lookup(k) is ChunkLookup.HIT_PENDING]
        self._tiered.complete_store(keys, success=success)
        if failed and self._events is not None:
            # Announced as metadata only, as vLLM's CPU manager does: nothing was public.
            self._events.append(
                OffloadingEvent(keys=failed, medium=self.medium, removed=True, metadata_only=True)
            )
        self._collect()

    # -- events and lifetime -------------------------------------------------------------

    def _collect(self) -> None:
        """Move the chunk manager's and the tiers' events into vLLM's vocabulary (always
        drained, so they never pile up when KV events are off)."""
        tier_events, self._tiered.events = self._tiered.events, []
        for event in self.chunks.take_events():
            if self._events is None:
                continue
            keys = [k for k in event.keys if not _placeholder(k)]
            if isinstance(event, KeysStored) and keys:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False))
            elif isinstance(event, KeysRemoved) and keys:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=True))
        if self._events is None or self._io is None:
            return
        for tier_event in tier_events:
            tier = self._io.tiers[tier_event.tier]
            self._events.append(OffloadingEvent(
                keys=list(tier_event.keys), medium=Medium.STORAGE, removed=not tier_event.stored,
                locality=Locality.REMOTE if tier.remote else Locality.LOCAL,
                ownership=f"aiokv:{tier_label(tier_event.tier, tier.name)}"))

    def take_events(self) -> Iterator[OffloadingEvent]:
        self._tiered.poll()
        self._collect()
        if self._events is None:
            return
        events, self._events = self._events, []
        for event in events:
            if event.metadata_only:
                # A retry may hold the key again by now: it must not read as removed.
                keys = [k for k in event.keys if self.chunks.lookup(k) is ChunkLookup.MISS]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    def reset_cache(self) -> None:
        """Forget every host block (the tiers keep theirs). vLLM never completes jobs from
        before a reset, and keeps new stores away from chunks that in-flight jobs may still
        touch until they report; chunks the tiers' thread still touches are fenced off, and
        reads up wait for ``on_reset_flushed`` (a late copy may still write a freed chunk)."""
        self._tiered.reset()
        self._failed_stores.clear()
        self._load_sources.clear()

    def on_reset_flushed(self) -> None:
        """vLLM's workers reported every job in flight at the last reset: reads up from the
        tiers, held since the reset, may fill freed chunks again."""
        self._tiered.reset_flushed()

    # -- tiers ---------------------------------------------------------------------------

    def on_schedule_end(self, context: Any) -> None:
        """Take the tiers' answers at the end of each step, so blocks read up meanwhile are
        hits at the next one."""
        self._attach()
        self._scan_req, self._scan = None, set()
        self._tiered.poll()

    def has_pending_work(self) -> bool:
        """True while tier reads or lookups are in flight: vLLM keeps stepping."""
        return self._tiered.busy

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The tiers' counters since the last call, labelled by tier (``tier_metrics``)."""
        io = self._io
        if io is None:
            return None
        stats = OffloadingConnectorStats()
        for i, (now, before) in enumerate(zip(self._tiered.counts, self._reported)):
            label = (tier_label(i, io.tiers[i].name),)
            for name, field in TIER_COUNTERS.items():
                delta = getattr(now, field) - getattr(before, field)
                if delta:
                    stats.increase_counter(name, delta, label)
            self._reported[i] = replace(now)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Finish or drop the tier work in flight (bounded) and close the tiers."""
        if self._io is not None:
            self._io.close()


def _placeholder(key: Any) -> bool:
    """A key ``TieredChunks`` holds a fenced chunk by (never one of vLLM's)."""
    return isinstance(key, tuple) and len(key) == 2 and key[0] == "aiokv-fence"
