"""Writing the host's blocks to the nearest tier as the cache closes (``persist_on_close``).

A graceful restart would otherwise lose the hottest prefixes: only blocks that had already
left the host are below it. The blocks go coldest first, so on a tier that must evict to
take them the hottest are the newest, and a ``DiskTier`` reopened on the same directory and
layout finds them. The caller bounds the whole close (``drain_timeout``); progress is
logged every few seconds for a large pool (docs/tiers.md, "Warm restarts").
"""

from __future__ import annotations

import logging
import time

from .cascade import Cascade
from .links import Batch
from .manager import ChunkManager
from .restore import BATCH_BYTES

__all__ = ["persist_host"]

_log = logging.getLogger("aiokv")

PROGRESS_EVERY = 5.0
"""Seconds between two progress lines."""


async def persist_host(cascade: Cascade, mgr: ChunkManager, host_start: int) -> int:
    """Queue every loadable host block the nearest tier lacks for it, in batches, each
    waiting for room in its queue; how many were queued (the caller drains them)."""
    link = cascade.links[0]
    keys = [k for k in mgr.keys_by_eviction() if cascade.wants(link, k)]
    total, done = len(keys), 0
    per = max(1, min(BATCH_BYTES // cascade.block_bytes, link.room.step))
    began = shown = time.monotonic()
    for start in range(0, total, per):
        part = [k for k in keys[start : start + per]  # as they are now: copies may have landed
                if mgr.count_leading_hits((k,)) and cascade.wants(link, k)]
        got = await link.take_room(len(part), patient=True)
        part = part[:got]
        if not part:
            continue
        chunks = [host_start + c for c in mgr.prepare_load(part, touch=False)]
        try:
            batch = Batch([cascade.tier_key(k) for k in part], "persist")
            link.expect(batch)
            await cascade.land(link, batch, chunks)
        finally:
            mgr.complete_load(part)
        done += len(part)
        if time.monotonic() - shown >= PROGRESS_EVERY:
            shown = time.monotonic()
            _log.info("aiokv: writing the host's blocks to the %s tier before closing: %d of %d",
                      link.tier.name, done, total)
    if total:
        _log.info("aiokv: queued %d host blocks for the %s tier in %.1f s (persist_on_close)",
                  done, link.tier.name, time.monotonic() - began)
    return done
