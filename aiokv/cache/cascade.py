"""The tiers under the host pool: every copy between the host pool and the tiers, and
where each key is.

``OffloadCache`` owns one ``Cascade`` when it has lower tiers. The cascade owns the copies
end to end: blocks the host evicts, blocks it stores (for write-through tiers) and blocks
it turns away (spills) are copied off their chunks into rows and queued for the tiers'
writers (``links.py``); restores read tier blocks, or rows still on their way down, into
its staging chunks. Its task group runs the writers and the copies that finish after an
``offload`` returns control (a cancelled caller does not stop them). The copies down
themselves (``descend.py``) take room in the write queues part by part, waiting their turn
(docs/tiers.md, "How blocks move").
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence

import anyio
import anyio.abc
import numpy as np

from ..errors import InvalidSpec, UsageError
from .links import Batch, Hold, TierLink
from .manager import ChunkManager
from .pages import PageMap
from .staging import Staging, off_loop
from .tiers.base import ByteParts, PartsReader, Tier, byte_parts
from .tiers.codec import key_bytes

__all__ = ["DEFAULT_QUEUE_BYTES", "DEFAULT_QUEUE_WAIT", "Cascade", "TierLink", "tier_list"]

DEFAULT_QUEUE_BYTES = 256 << 20
"""Bytes of blocks one tier's write queue holds (reserved, being copied or written)."""
DEFAULT_QUEUE_WAIT = 1.0
"""Seconds the first offer in line waits for room in a full write queue, with no room
coming back, before that tier counts as stalled (docs/tiers.md, "Write-behind")."""

_log = logging.getLogger("aiokv")


class Cascade:
    """The lower tiers of one cache, in order, with their queues and the staging chunks.

    Args:
        tiers: the tiers, nearest first.
        pages: where a block's pages sit in a host chunk and in the portable payload.
        staging: the chunks kept aside for restores and spills (absolute ids).
        queue_bytes: per tier, bytes of blocks its write queue holds.
        queue_wait: seconds a tier may free no room while an offer waits first in line,
            before it counts as stalled.
    """

    def __init__(self, tiers: Sequence[Tier], *, pages: PageMap, staging: range,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 queue_wait: float = DEFAULT_QUEUE_WAIT) -> None:
        bad = [type(t).__name__ for t in tiers if not isinstance(t, Tier)]
        if bad:
            raise InvalidSpec(f"tiers must be aiokv Tier objects (DiskTier, RedisTier, ...); got {bad}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise InvalidSpec("a tier appears twice in tiers=")
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise InvalidSpec(f"queue_bytes must be an int >= 0, got {queue_bytes!r}")
        if isinstance(queue_wait, bool) or not (isinstance(queue_wait, (int, float)) and queue_wait >= 0):
            raise InvalidSpec(f"queue_wait must be seconds >= 0, got {queue_wait!r}")
        self.pages = pages
        self.block_bytes = block_bytes = pages.payload_bytes
        for tier in tiers:
            tier.check_block_bytes(block_bytes)  # a tier that holds no block fails here
        limit = max(1, queue_bytes // block_bytes)
        self.links = [TierLink(t, _room(t, limit, block_bytes), float(queue_wait)) for t in tiers]
        self.local = [link for link in self.links if not link.tier.remote]
        self.remote = [link for link in self.links if link.tier.remote]
        # Demotions go to the nearest tier that does not already get every block.
        self.demote_to = next((link for link in self.links if not link.tier.write_through), None)
        self.through = [link for link in self.links if link.tier.write_through]
        self.staging = Staging(staging)
        self._tier_keys: dict[Hashable, bytes] = {}
        self._pool: np.ndarray | None = None
        self._parts: dict[int, ByteParts] = {}  # staging chunks' pages, made and checked once
        self._tg: anyio.abc.TaskGroup | None = None
        self._copies: dict[int, anyio.Event] = {}  # copy tasks running, by start number
        self._started = 0
        self._tickets = itertools.count()

    @property
    def pool(self) -> np.ndarray:
        """The worker's host pool as bytes (once opened)."""
        if self._pool is None:
            raise UsageError("the cascade is not open")
        return self._pool

    def chunk_parts(self, chunk: int) -> ByteParts:
        """Staging ``chunk``'s pages in portable order (``PageMap.parts``), made and
        checked once per chunk: a restore reads thousands of blocks into the same few
        chunks."""
        parts = self._parts.get(chunk)
        if parts is None:
            parts = self._parts[chunk] = byte_parts(self.pages.parts(self.pool, chunk))
        return parts

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self, fingerprint: bytes, pool: np.ndarray) -> None:
        """Open every tier for this layout (an error is raised as itself, and the tiers
        opened before it are closed), then start the writers."""
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
        self._pool = pool
        tg = self._tg = anyio.create_task_group()
        await tg.__aenter__()
        for link in self.links:
            link.tg = tg  # its write calls run here, each shielded until stop() cancels it

    async def drain(self) -> None:
        """Wait for the copies started so far, then for the blocks on their way down by then
        to be written (or dropped); those started meanwhile are not waited for, so a busy
        server does not hold it."""
        for event in list(self._copies.values()):
            await event.wait()
        batches = {batch for link in self.links for batch, _ in link.inflight.values()}
        for batch in batches:
            await batch.written.wait()
        await anyio.lowlevel.checkpoint()

    async def stop(self) -> None:
        """Stop the write calls (what they did not write is dropped and counted) and close
        every tier. Call it at the task group's nesting level (the cache's exit does)."""
        for link in self.links:
            link.stop()
        tg, self._tg = self._tg, None
        self._parts.clear()  # views of the pool: none outlive the cache
        try:
            if tg is not None:
                await tg.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                for link in self.links:
                    await link.tier.aclose()

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
        """The nearest local tier holding ``key`` or receiving it (no I/O)."""
        tk = self.tier_key(key)
        for link in self.local:
            if link.on_way(tk) or link.tier.holds(tk):
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
        """``local_run`` that also counts keys only a remote tier holds (or receives), and
        goes on past them through keys the host or a local tier holds, as a restore would;
        remote tiers are asked once each (batched) about the keys from the first local miss."""
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
                    remote = await self._remote_holders(keys[i:])
                if (link := remote[i - first]) is None:
                    break
                link.hits += 1
            n += 1
        if remote is None or not self.remote:
            await anyio.lowlevel.checkpoint()  # no round trip: still a checkpoint, as awaited
        return n, host

    async def _remote_holders(self, keys: Sequence[Hashable]) -> list[TierLink | None]:
        """Which remote tier holds or receives each key, asking each remote tier once."""
        found: list[TierLink | None] = [None] * len(keys)
        tks = [self.tier_key(k) for k in keys]
        for link in self.remote:
            want = [i for i in range(len(keys)) if found[i] is None]
            for i in want:
                if link.on_way(tks[i]):
                    found[i] = link
            want = [i for i in want if found[i] is None]
            if not want:
                break
            try:
                held = await link.tier.exists([tks[i] for i in want])
            except (UsageError, InvalidSpec):
                raise
            except Exception:
                held = [False] * len(want)
            for i, h in zip(want, held):
                if h:
                    found[i] = link
        return found

    # -- writing down ---------------------------------------------------------------------

    def wants(self, link: TierLink, key: Hashable) -> bool:
        """Whether ``link`` should get ``key``: not on its way there, nor held there."""
        return self.wants_key(link, self.tier_key(key))

    def wants_key(self, link: TierLink, tk: bytes) -> bool:
        """Whether ``link`` should get tier key ``tk``: not on its way there, nor held there."""
        return not link.on_way(tk) and (link.tier.remote or not link.tier.holds(tk))

    def count_restored(self, sources: Sequence[TierLink | None]) -> None:
        """Count restored keys against the tier (or memory on its way to it) they came from."""
        for link in sources:
            if link is not None:
                link.restored_keys += 1
                link.restored_bytes += self.block_bytes

    # -- copies ---------------------------------------------------------------------------

    async def land(self, link: TierLink, batch: Batch, chunks: list[int]) -> None:
        """Copy ``chunks`` off the pool into the batch's rows and hand it to the writer
        (the batch is listed in flight already)."""
        try:
            rows = await off_loop(len(chunks) * self.block_bytes, self.pages.gather, self.pool, chunks)
        except BaseException:
            link.abandon(batch)
            raise
        link.push(batch, rows)

    def start(self, work: Callable[[], Awaitable[None]], done: anyio.Event) -> bool:
        """Run ``work`` in the task group, shielded (a copy is not abandoned half way), and
        set ``done`` after; False (nothing started) once the cascade is stopped. A failing
        ``work`` drops its own batches and is logged: it never cancels the task group, whose
        scope holds the caller's code inside ``async with cache``."""
        if self._tg is None:
            return False
        seq = self._started
        self._started += 1
        self._copies[seq] = done

        async def run() -> None:
            try:
                with anyio.CancelScope(shield=True):
                    await work()
            except Exception:  # its batches are dropped, counted; the caller's code goes on
                _log.warning("aiokv: copying blocks off the host pool for the tiers failed; "
                             "they were dropped", exc_info=True)
            finally:
                del self._copies[seq]
                done.set()

        self._tg.start_soon(run)
        return True

    # -- reading up -----------------------------------------------------------------------

    def ticket(self) -> int:
        """A restore's place in the tiers' read order, and in line for staging chunks
        (where a spill round takes one too): asked in the order they start."""
        return next(self._tickets)

    async def read(self, keys: Sequence[Hashable], views: Sequence[memoryview],
                   order: tuple[int, int] | None = None) -> list[TierLink | None]:
        """Fill ``views[i]`` with ``keys[i]``'s block: from memory if it is on its way down
        (never waiting for a writer), else from the nearest tier holding it; which tier, or
        None for a miss. Local tiers are asked only for keys they hold; ``order`` as in
        ``read_placed``."""
        found, _ = await self.read_placed(keys, views, None, order)
        return found

    async def read_placed(self, keys: Sequence[Hashable], views: Sequence[memoryview],
                          parts: Sequence[Sequence[memoryview]] | None,
                          order: tuple[int, int] | None = None,
                          ) -> tuple[list[TierLink | None], list[bool]]:
        """``read``, but a tier that reads in parts (the disk) puts ``keys[i]``'s block
        into ``parts[i]`` (its staging chunk's pages, in portable order) instead of
        ``views[i]``: where the block is, and whether it landed in its parts (True) or in
        its view, which the caller then copies into place. ``order`` (the restore's
        ``ticket``, the batch's position) goes to such a tier: it reads earlier restores
        first."""
        found: list[TierLink | None] = [None] * len(keys)
        placed = [False] * len(keys)
        tks = [self.tier_key(k) for k in keys]
        await self._read_inflight(tks, views, found)
        for link in self.links:
            want = [i for i in range(len(keys)) if found[i] is None
                    and (link.tier.remote or link.tier.holds(tks[i]))]
            if not want:
                continue
            # One protocol check a tier (it costs microseconds): in its parts, else whole.
            reader = link.tier if isinstance(link.tier, PartsReader) else None
            in_parts = parts is not None and reader is not None
            try:
                if reader is not None:
                    got = await reader.read_parts(
                        [tks[i] for i in want],
                        [parts[i] for i in want] if parts is not None else [(views[i],) for i in want],
                        order=order)
                else:
                    got = await link.tier.read([tks[i] for i in want], [views[i] for i in want])
            except (UsageError, InvalidSpec):
                raise  # misuse (a closed tier, a bad buffer) is the caller's to see
            except Exception:  # a tier that broke its contract: a miss, not a crash
                got = [False] * len(want)
            for i, ok in zip(want, got):
                if ok:
                    found[i] = link
                    placed[i] = in_parts
                elif not link.tier.remote:
                    link.read_misses += 1
            if all(f is not None for f in found):
                break
        return found, placed

    async def _read_inflight(self, tks: list[bytes], views: Sequence[memoryview],
                             found: list[TierLink | None]) -> None:
        hits: list[tuple[int, TierLink, Batch, int]] = []
        held: list[tuple[int, TierLink, Hold, int]] = []
        for i, tk in enumerate(tks):
            for link in self.links:
                if (entry := link.find(tk)) is not None:
                    hits.append((i, link, *entry))
                    break
                if (wait := link.waiting.get(tk)) is not None:
                    wait[0].enter()  # now, before any await: its offer waits for this copy
                    held.append((i, link, *wait))
                    break
        if held:
            await self._read_held(held, views, found)
        if not hits:
            return
        for _, _, batch, _ in hits:
            await batch.landed.wait()  # a copy off the pool, never a write
        pairs = [(i, link, row) for i, link, batch, j in hits if (row := batch.row(j)) is not None]

        def copy() -> None:
            for i, _, row in pairs:
                np.frombuffer(views[i], dtype=np.uint8)[:] = row

        await off_loop(len(pairs) * self.block_bytes, copy)
        for i, link, _ in pairs:
            found[i] = link


    async def _read_held(self, held: list[tuple[int, TierLink, Hold, int]], views: Sequence[memoryview],
                         found: list[TierLink | None]) -> None:
        """Copy evicted blocks that wait their turn for room out of their host chunks (each
        ``Hold`` entered already: the offer keeps the chunks until this copy is over)."""
        def copy() -> None:
            rows = self.pages.gather(self.pool, [chunk for *_, chunk in held])
            for (i, *_), row in zip(held, rows):
                np.frombuffer(views[i], dtype=np.uint8)[:] = row

        try:
            await off_loop(len(held) * self.block_bytes, copy)
        finally:
            for _, _, hold, _ in held:
                hold.leave()
        for i, link, _, _ in held:
            found[i] = link


def _room(tier: Tier, limit: int, block_bytes: int) -> int:
    """Blocks that may be on their way down to ``tier``: ``limit``, but never more than the
    tier holds. Beyond that the tier must refuse writes until earlier ones land, and the
    refused blocks, still found in memory, would make what the cache finds depend on how
    fast the tier writes (docs/tiers.md, "Write-behind")."""
    capacity = tier.capacity_bytes
    return limit if capacity is None else max(1, min(limit, capacity // block_bytes))


def tier_list(tiers: Sequence[Tier]) -> list[Tier]:
    """``tiers=`` as a list; one tier or a non-sequence is refused rather than iterated."""
    if isinstance(tiers, (Tier, str, bytes)) or not isinstance(tiers, (Sequence, tuple, list)):
        raise InvalidSpec(f"tiers must be a sequence of tiers, nearest first (tiers=[DiskTier(...)]); "
                          f"got {type(tiers).__name__}")
    return list(tiers)
