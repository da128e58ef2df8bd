"""The tiers under the host pool: write-behind demotion, write-through, and where keys are.

``OffloadCache`` owns one ``Cascade`` when it has lower tiers. Blocks go down as copies
of host chunks taken on the loop thread at the moment they are decided (a chunk the host
evicts is reused by the very store that evicted it, so its bytes are copied out before
that store is submitted). Each tier has one writer task and a queue bounded in bytes: a
batch that does not fit is dropped and counted, so a slow tier never stalls the caller,
the loop or the GPU (docs/tiers.md, "Write-behind").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from ..errors import InvalidSpec, UsageError
from .manager import ChunkManager
from .pages import PageMap
from .records import TierCacheStats
from .tiers.base import Tier
from .tiers.codec import key_bytes

__all__ = ["Cascade", "TierLink"]

DEFAULT_QUEUE_BYTES = 256 << 20
"""Bytes of blocks waiting for one tier's writer before further demotions are dropped."""
INLINE_COPY_BYTES = 1 << 20
"""Evicted bytes copied off the host pool on the loop thread; more go to a worker thread
(a thread hop costs tens of microseconds, a large memcpy milliseconds)."""


@dataclass
class _Batch:
    keys: list[bytes]
    rows: np.ndarray  # (n, block_bytes) uint8: the blocks' bytes, copied off the host pool
    through: bool  # a write-through (True) or a demotion (False)


@dataclass
class TierLink:
    """One tier and the cache's counters and write queue for it."""

    tier: Tier
    limit_blocks: int
    queue: deque[_Batch] = field(default_factory=deque)
    pending: int = 0  # blocks queued or being written
    wake: anyio.Event = field(default_factory=anyio.Event)
    # Batches queued and finished so far: drain() waits for the ones queued before it was
    # called, so a steady stream of new demotions cannot hold it.
    queued_batches: int = 0
    done_batches: int = 0
    progress: anyio.Event = field(default_factory=anyio.Event)
    hits: int = 0
    restored_keys: int = 0
    restored_bytes: int = 0
    demoted: int = 0
    write_throughs: int = 0
    dropped: int = 0
    read_misses: int = 0

    def stats(self) -> TierCacheStats:
        return TierCacheStats(
            name=self.tier.name, hits=self.hits, restored_keys=self.restored_keys,
            restored_bytes=self.restored_bytes, demoted=self.demoted,
            write_throughs=self.write_throughs, demotions_dropped=self.dropped,
            read_misses=self.read_misses, queued_blocks=self.pending,
            tier=self.tier.statistics(),
        )


_Reserved = tuple[TierLink, list[tuple[bytes, int]]]
"""A tier link and the (tier key, chunk) pairs its queue has room for."""


class Cascade:
    """The lower tiers of one cache, in order, with their write queues.

    Args:
        tiers: the tiers, nearest first.
        pages: where a block's pages sit in a host chunk and in the portable payload.
        queue_bytes: per tier, bytes of blocks allowed to wait for its writer.
    """

    def __init__(self, tiers: Sequence[Tier], *, pages: PageMap,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        bad = [type(t).__name__ for t in tiers if not isinstance(t, Tier)]
        if bad:
            raise InvalidSpec(f"tiers must be aiokv Tier objects (DiskTier, RedisTier, ...); got {bad}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise InvalidSpec("a tier appears twice in tiers=")
        if queue_bytes < 0:
            raise InvalidSpec(f"queue_bytes must be >= 0, got {queue_bytes}")
        self.pages = pages
        self.block_bytes = block_bytes = pages.payload_bytes
        for tier in tiers:
            tier.check_block_bytes(block_bytes)  # a tier that holds no block fails here
        limit = max(1, queue_bytes // block_bytes)
        self.links = [TierLink(t, limit) for t in tiers]
        self._writing = False
        self.local = [link for link in self.links if not link.tier.remote]
        self.remote = [link for link in self.links if link.tier.remote]
        # Demotions go to the nearest tier that does not already get every block.
        self._demote_to = next((link for link in self.links if not link.tier.write_through), None)
        self._through = [link for link in self.links if link.tier.write_through]
        self._tier_keys: dict[Hashable, bytes] = {}

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self, fingerprint: bytes, tg: anyio.abc.TaskGroup) -> None:
        """Open every tier for this layout and start their writers in ``tg``."""
        opened: list[Tier] = []
        try:
            for link in self.links:
                await link.tier.open(fingerprint)
                opened.append(link.tier)
        except BaseException:
            with anyio.CancelScope(shield=True):
                for tier in opened:
                    await tier.aclose()
            raise
        for link in self.links:
            tg.start_soon(self._writer, link)
        self._writing = True

    async def aclose(self) -> None:
        """Close every tier (the writers were stopped by the caller's task group); blocks
        still queued are dropped and counted."""
        self._writing = False
        for link in self.links:
            link.dropped += sum(len(b.keys) for b in link.queue)
            link.queue.clear()
            link.pending = 0
        with anyio.CancelScope(shield=True):
            for link in self.links:
                await link.tier.aclose()

    async def drain(self) -> None:
        """Wait until every block queued so far is written (or dropped); blocks queued
        meanwhile are not waited for, so a busy server does not hold it."""
        targets = [(link, link.queued_batches) for link in self.links]
        for link, target in targets:
            while self._writing and link.done_batches < target:
                await link.progress.wait()
        await anyio.lowlevel.checkpoint()

    # -- keys -----------------------------------------------------------------------------

    def tier_key(self, key: Hashable) -> bytes:
        """The tier key of a cache key (cached: lookups of one prefix repeat)."""
        found = self._tier_keys.get(key)
        if found is None:
            if len(self._tier_keys) > 1 << 20:  # a bound, not an LRU: rebuilding is cheap
                self._tier_keys.clear()
            found = self._tier_keys[key] = key_bytes(key)
        return found

    def local_holder(self, key: Hashable) -> TierLink | None:
        """The nearest local tier holding ``key`` (no I/O)."""
        if not self.local:
            return None
        tk = self.tier_key(key)
        for link in self.local:
            if link.tier.holds(tk):
                return link
        return None

    def local_run(self, mgr: ChunkManager, keys: Sequence[Hashable]) -> tuple[int, int]:
        """Leading keys held in the host or a local tier (no I/O), and how many of them
        the host holds; each tier's hits are counted."""
        n = host = 0
        for key in keys:
            if mgr.count_leading_hits((key,)):
                host += 1
            elif (holder := self.local_holder(key)) is not None:
                holder.hits += 1
            else:
                break
            n += 1
        return n, host

    async def leading_run(self, mgr: ChunkManager, keys: Sequence[Hashable]) -> tuple[int, int]:
        """``local_run`` that also counts keys held only in a remote tier, and goes on past
        them through keys the host or a local tier holds, as a restore would; remote tiers
        are asked once each (batched) about the keys from the first local miss on."""
        n = host = 0
        remote: list[TierLink | None] | None = None
        first = 0
        for i, key in enumerate(keys):
            if mgr.count_leading_hits((key,)):
                host += 1
            elif (holder := self.local_holder(key)) is not None:
                holder.hits += 1
            else:
                if remote is None:
                    first = i
                    remote = await self.remote_leading(keys[i:])
                if (link := remote[i - first]) is None:
                    break
                link.hits += 1
            n += 1
        if remote is None or not self.remote:
            await anyio.lowlevel.checkpoint()  # no round trip: still a checkpoint, as awaited
        return n, host

    # -- writing down ---------------------------------------------------------------------

    def demote(self, pool: np.ndarray, keys: Sequence[Hashable], chunks: Sequence[int]) -> None:
        """Queue ``keys`` (their bytes in absolute ``chunks``) for the nearest tier that does
        not already hold them, copying the bytes now on the calling thread."""
        link = self._demote_to
        if link is not None and keys:
            self._enqueue(link, pool, self._demotable(link, keys, chunks), through=False)

    async def demote_evicted(self, pool: np.ndarray, keys: Sequence[Hashable], chunks: Sequence[int]) -> None:
        """``demote`` for blocks the host evicts: the caller reuses their chunks once this
        returns. Copies over ``INLINE_COPY_BYTES`` run on a worker thread, so evicting many
        large blocks never stalls the event loop; the caller shields this from cancellation."""
        reserved = self.reserve_demotion(keys, chunks)
        if reserved is not None:
            await self.copy_demotion(pool, reserved)

    def reserve_demotion(self, keys: Sequence[Hashable], chunks: Sequence[int]) -> _Reserved | None:
        """Room in the demotion tier's queue for ``keys`` not held there (None: no room or
        nothing to demote); ``copy_demotion`` follows. Counted at once, so a ``drain``
        called before the copy is over waits for it."""
        link = self._demote_to
        if link is None or not keys:
            return None
        pairs = self._reserve(link, self._demotable(link, keys, chunks))
        return (link, pairs) if pairs else None

    async def copy_demotion(self, pool: np.ndarray, reserved: _Reserved) -> None:
        """Copy the reserved blocks off the host pool (a worker thread for large copies)
        and hand them to the writer."""
        link, pairs = reserved
        at = [c for _, c in pairs]
        try:
            if self.copies_inline(len(pairs)):
                rows = self.pages.gather(pool, at)
            else:
                rows = await anyio.to_thread.run_sync(self.pages.gather, pool, at)
        except BaseException:
            link.dropped += len(pairs)
            self._batch_over(link, len(pairs))
            raise
        self._push(link, pairs, rows, through=False)

    def push_demotion(self, pool: np.ndarray, reserved: _Reserved) -> None:
        """``copy_demotion`` on the calling thread."""
        link, pairs = reserved
        self._push(link, pairs, self.pages.gather(pool, [c for _, c in pairs]), through=False)

    def copies_inline(self, blocks: int) -> bool:
        """Whether copying ``blocks`` off the host pool is small enough for the loop thread."""
        return blocks * self.block_bytes <= INLINE_COPY_BYTES

    def _demotable(self, link: TierLink, keys: Sequence[Hashable],
                   chunks: Sequence[int]) -> list[tuple[bytes, int]]:
        pairs = [(self.tier_key(k), c) for k, c in zip(keys, chunks)]
        if not link.tier.remote:
            pairs = [(tk, c) for tk, c in pairs if not link.tier.holds(tk)]
        return pairs

    def wants_spill(self, key: Hashable) -> bool:
        """Whether a key the host turned away should go to the demotion tier (not held there)."""
        link = self._demote_to
        return link is not None and (link.tier.remote or not link.tier.holds(self.tier_key(key)))

    def count_spill_dropped(self, n: int) -> None:
        if n and self._demote_to is not None:
            self._demote_to.dropped += n

    def write_through(self, pool: np.ndarray, keys: Sequence[Hashable], chunks: Sequence[int]) -> None:
        """Queue stored ``keys`` (in absolute ``chunks``) for every write-through tier,
        copying the bytes now on the calling thread."""
        reserved = self.reserve_through(keys, chunks)
        if reserved:
            self.push_through(reserved, self.pages.gather(pool, list(chunks)[: _widest(reserved)]))

    def reserve_through(self, keys: Sequence[Hashable],
                        chunks: Sequence[int]) -> list[tuple[TierLink, list[tuple[bytes, int]]]]:
        """Room in each write-through tier's queue for stored ``keys`` (a prefix of them
        where a queue is nearly full); ``push_through`` or ``cancel_through`` follows."""
        if not self._through or not keys:
            return []
        pairs = [(self.tier_key(k), c) for k, c in zip(keys, chunks)]
        return [(link, got) for link in self._through if (got := self._reserve(link, list(pairs)))]

    def push_through(self, reserved: list[tuple[TierLink, list[tuple[bytes, int]]]],
                     rows: np.ndarray) -> None:
        """Hand the copied ``rows`` (one per reserved key, in order) to the writers."""
        for link, pairs in reserved:
            self._push(link, pairs, rows[: len(pairs)], through=True)

    def cancel_through(self, reserved: list[tuple[TierLink, list[tuple[bytes, int]]]]) -> None:
        for link, pairs in reserved:
            link.dropped += len(pairs)
            self._batch_over(link, len(pairs))

    def _enqueue(self, link: TierLink, pool: np.ndarray, pairs: list[tuple[bytes, int]],
                 *, through: bool) -> None:
        pairs = self._reserve(link, pairs)
        if pairs:
            rows = self.pages.gather(pool, [c for _, c in pairs])  # a copy, in portable order
            self._push(link, pairs, rows, through=through)

    def _reserve(self, link: TierLink, pairs: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """The pairs that fit the tier's queue, counted in it as one batch (the rest are
        dropped and counted), before their bytes are copied."""
        room = link.limit_blocks - link.pending
        if len(pairs) > room:
            link.dropped += len(pairs) - max(room, 0)
            pairs = pairs[: max(room, 0)]
        if pairs:
            link.pending += len(pairs)
            link.queued_batches += 1
        return pairs

    def _push(self, link: TierLink, pairs: list[tuple[bytes, int]], rows: np.ndarray, *,
              through: bool) -> None:
        if not self._writing:  # closed while the bytes were copied: no writer would take it
            link.dropped += len(pairs)
            self._batch_over(link, len(pairs))
            return
        link.queue.append(_Batch([tk for tk, _ in pairs], rows, through))
        link.wake.set()

    @staticmethod
    def _batch_over(link: TierLink, n: int) -> None:
        link.pending -= n
        link.done_batches += 1
        progress, link.progress = link.progress, anyio.Event()
        progress.set()

    async def _writer(self, link: TierLink) -> None:
        while True:
            if not link.queue:
                await link.wake.wait()
                link.wake = anyio.Event()
                continue
            batch = link.queue.popleft()
            try:
                done = await link.tier.write(batch.keys, [memoryview(r) for r in batch.rows])
            except Exception:  # a tier that broke its contract: its blocks are dropped
                done = [False] * len(batch.keys)
            finally:
                self._batch_over(link, len(batch.keys))
            ok = sum(1 for d in done if d)
            if batch.through:
                link.write_throughs += ok
            else:
                link.demoted += ok
            link.dropped += len(batch.keys) - ok

    # -- reading up -----------------------------------------------------------------------

    async def read(self, keys: Sequence[Hashable], views: Sequence[memoryview]) -> list[TierLink | None]:
        """Fill ``views[i]`` from the nearest tier holding ``keys[i]``; which tier did, or
        None for a miss. Local tiers are asked only for keys they hold; remote tiers for
        whatever is still missing."""
        found: list[TierLink | None] = [None] * len(keys)
        tks = [self.tier_key(k) for k in keys]
        for link in self.links:
            want = [i for i in range(len(keys)) if found[i] is None
                    and (link.tier.remote or link.tier.holds(tks[i]))]
            if not want:
                continue
            try:
                got = await link.tier.read([tks[i] for i in want], [views[i] for i in want])
            except (UsageError, InvalidSpec):
                raise  # misuse (a closed tier, a bad buffer) is the caller's to see
            except Exception:  # a tier that broke its contract: a miss, not a crash
                got = [False] * len(want)
            for i, ok in zip(want, got):
                if ok:
                    found[i] = link
                elif not link.tier.remote:
                    link.read_misses += 1
            if all(f is not None for f in found):
                break
        return found

    async def remote_leading(self, keys: Sequence[Hashable]) -> list[TierLink | None]:
        """Which remote tier holds each key, asking each remote tier once, batched."""
        found: list[TierLink | None] = [None] * len(keys)
        for link in self.remote:
            want = [i for i in range(len(keys)) if found[i] is None]
            if not want:
                break
            try:
                held = await link.tier.exists([self.tier_key(keys[i]) for i in want])
            except (UsageError, InvalidSpec):
                raise
            except Exception:
                held = [False] * len(want)
            for i, h in zip(want, held):
                if h:
                    found[i] = link
        return found


def _widest(reserved: list[tuple[TierLink, list[tuple[bytes, int]]]]) -> int:
    return max(len(pairs) for _, pairs in reserved)
