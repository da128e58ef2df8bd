"""Scheduler side: vLLM's ``OffloadingManager`` over aiokv's ``ChunkManager``.

The chunk manager decides which block hash gets which host chunk (eviction policy plus
admission); this adapter speaks vLLM's vocabulary around it: ``OffloadKey``s, a
``CPULoadStoreSpec`` of chunk ids that every rank's worker reads, ``PrepareStoreOutput``
and ``OffloadingEvent``s. Behaviour follows vLLM's ``CPUOffloadingManager`` where vLLM's
tests pin it down (see docs/vllm.md for where it differs).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from vllm.v1.kv_offload.base import (
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

__all__ = ["AiokvOffloadingManager"]

_LOOKUP = {
    ChunkLookup.MISS: LookupResult.MISS,
    ChunkLookup.HIT: LookupResult.HIT,
    ChunkLookup.HIT_PENDING: LookupResult.HIT_PENDING,
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
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        policy: str = "adaptive",
        admission: str | None = None,
        enable_events: bool = False,
    ) -> None:
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise InvalidSpec(f"the host pool must hold at least one chunk, got num_chunks={num_chunks!r}")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self._policy_name = policy
        self._admission_name = admission
        self._chunks = ChunkManager(num_chunks, policy=policy, admission=admission)
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
        return self._chunks

    # -- requests ----------------------------------------------------------------------

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        return None

    # -- loads -------------------------------------------------------------------------

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        return _LOOKUP[self._chunks.lookup(key)]

    def get_load_source(self, key: Any, req_context: Any) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> CPULoadStoreSpec:
        """Pin ``keys`` until ``complete_load``; the spec holds their chunk ids in order.

        Raises:
            KeyNotLoadable: a key is missing or still being written (nothing is pinned).
        """
        keys = list(keys)
        chunk_ids = self._chunks.prepare_load(keys, touch=False)
        self._chunks.touch(_prefix_order(keys, req_context))
        return CPULoadStoreSpec(chunk_ids)

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        """Count a use of ``keys`` (vLLM 0.33's ABC has this hook; 0.34 dropped it and
        reuse is counted when a held key is offered again, see ``prepare_store``)."""
        self._chunks.touch(_prefix_order(list(keys), req_context))

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        self._chunks.complete_load(list(keys))

    # -- stores ------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> PrepareStoreOutput | None:
        """Chunks for the admitted keys not held yet, evicting others if needed.

        None, storing nothing, when they cannot all fit (every other key is pinned or
        being written). Keys of this offer are never evicted by it; those already held
        count as used.
        """
        offer = list(keys)
        ordered = _prefix_order(offer, req_context)
        # A held block offered again was reused (vLLM offers blocks its GPU prefix cache
        # served, and never calls touch()): count the use, as vLLM's CPU manager does,
        # or the prefixes reused most would age out first.
        self._chunks.touch([k for k in ordered if self._chunks.lookup(k) is ChunkLookup.HIT])
        plan = self._chunks.prepare_store(ordered)
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
        if self._failed_stores and not self._failed_stores.isdisjoint(keys):
            success = False
            self._failed_stores.difference_update(keys)
        failed = [] if success else [k for k in keys if self._chunks.lookup(k) is ChunkLookup.HIT_PENDING]
        self._chunks.complete_store(keys, success=success)
        if failed and self._events is not None:
            # Announced as metadata only, as vLLM's CPU manager does: nothing was public.
            self._events.append(
                OffloadingEvent(keys=failed, medium=self.medium, removed=True, metadata_only=True)
            )
        self._collect()

    # -- events and lifetime -------------------------------------------------------------

    def _collect(self) -> None:
        """Move the chunk manager's events into vLLM's vocabulary (always drained, so they
        never pile up when KV events are off)."""
        for event in self._chunks.take_events():
            if self._events is None:
                continue
            if isinstance(event, KeysStored):
                self._events.append(OffloadingEvent(keys=list(event.keys), medium=self.medium, removed=False))
            elif isinstance(event, KeysRemoved):
                self._events.append(OffloadingEvent(keys=list(event.keys), medium=self.medium, removed=True))

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self._events is None:
            return
        events, self._events = self._events, []
        for event in events:
            if event.metadata_only:
                # A retry may hold the key again by now: it must not read as removed.
                keys = [k for k in event.keys if self._chunks.lookup(k) is ChunkLookup.MISS]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    def reset_cache(self) -> None:
        """Forget every block. vLLM never completes jobs from before a reset, and keeps new
        stores away from chunks that in-flight jobs may still touch until they report."""
        self._chunks = ChunkManager(self.num_chunks, policy=self._policy_name, admission=self._admission_name)
        self._failed_stores.clear()
