"""Restores: from the host alone (one load), or through the tiers in concurrent batches.

A restore through the tiers walks its keys in batches. Keys the host holds are pinned in
place; the others are read into staging chunks from memory (blocks still on their way
down) or from the nearest tier holding them. Every batch that has its staging chunks
starts reading at once, so the tier sees the whole request as many reads in flight (its
own I/O bound keeps them to its threads), and each batch's load to the GPU is submitted
as soon as its reads are in, beside the reads of the batches after it. The first key found
nowhere ends the restore: the keys before it arrive, the rest are misses, never wrong
bytes (a batch past it that was read already is loaded and waited for, not counted). Pins
and staging chunks go back in the load's done callback, or at once if the batch never
reached a submit (cancelled, refused, or a miss). Nothing here counts: a restore returns
its ``Outcome`` and ``OffloadCache`` counts it once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import overload

import anyio
import numpy as np

from ..errors import KeyNotLoadable, TransferFailed
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec
from .cascade import Cascade
from .jobs import Submit
from .keys import unhashable
from .links import TierLink
from .manager import ChunkManager
from .pages import aligned_rows
from .records import RestoreResult
from .staging import Staging, off_loop

__all__ = ["BATCH_BYTES", "BATCH_KEYS", "Outcome", "restore_from_host", "restore_through_tiers"]

BATCH_BYTES = 16 << 20
"""Bytes one pipelined batch reads from the tiers: large enough to keep a disk or a Redis
connection busy, small enough that the first copy to the GPU starts early."""
BATCH_KEYS = 64


@dataclass(frozen=True)
class Outcome:
    """What one restore did: its result, how many of its loads failed on the device, and
    where each restored key came from (a tier's link, or None for the host)."""

    result: RestoreResult
    failed_loads: int = 0
    sources: tuple[TierLink | None, ...] = ()


async def restore_from_host(keys: Sequence[Hashable], blocks: list[int], *, mgr: ChunkManager,
                            host_start: int, submit: Submit) -> Outcome:
    """All or nothing from the host: one load if every key is loadable, else a miss."""
    try:
        # Pins nothing unless every key is loadable; a use is counted once the load is taken.
        chunks = mgr.prepare_load(keys, touch=False)
    except KeyNotLoadable:
        try:  # an unhashable key raises even behind a miss
            for key in keys:
                hash(key)
        except TypeError as exc:
            raise unhashable(exc) from exc
        await anyio.lowlevel.checkpoint()
        return Outcome(RestoreResult(0, len(keys)))
    pinned = list(keys)
    try:
        future = submit(CPULoadStoreSpec([host_start + c for c in chunks]), blocks)
    except BaseException:
        mgr.complete_load(pinned)
        raise
    mgr.touch(pinned)
    future.add_done_callback(lambda _fut: mgr.complete_load(pinned))
    try:
        res = await future
    except TransferFailed:
        return Outcome(RestoreResult(0, len(keys)), failed_loads=1)
    if not res.success:
        return Outcome(RestoreResult(0, len(keys)), failed_loads=1)
    return Outcome(RestoreResult(len(keys), len(keys), from_host=len(keys)), sources=(None,) * len(keys))


async def restore_through_tiers(keys: Sequence[Hashable], blocks: list[int], *, mgr: ChunkManager,
                                cascade: Cascade, host_start: int, submit: Submit) -> Outcome:
    """Bring ``keys`` into ``blocks`` from the host, memory on its way down, and the tiers."""
    staging = cascade.staging
    # At least four batches fit the staging chunks at once, so their reads overlap.
    per_batch = max(1, min(BATCH_KEYS, BATCH_BYTES // cascade.block_bytes, staging.total // 4))
    ticket = cascade.ticket()  # a disk reads this restore's batches before later restores'
    slots: list[_Slot] = []
    run = _Run(len(keys))
    pos = 0
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        try:
            while pos < run.end:
                batch = list(keys[pos : min(pos + per_batch, run.end)])
                need = sum(1 for k in batch if not mgr.count_leading_hits((k,)))
                taken = await staging.take_some(need, ticket) if need else []
                if pos >= run.end:  # a batch read meanwhile missed before this one
                    staging.give(taken)
                    break
                # Others may have run while this waited: where each key is, now.
                in_host = [mgr.count_leading_hits((k,)) == 1 for k in batch]
                staged = [i for i, h in enumerate(in_host) if not h]
                if len(staged) > len(taken):  # cut before the first key without a chunk
                    batch, in_host = batch[: staged[len(taken)]], in_host[: staged[len(taken)]]
                    staged = staged[: len(taken)]
                staging.give(taken[len(staged):])
                taken = taken[: len(staged)]
                slot = _Slot(pos, batch, in_host, blocks[pos : pos + len(batch)], host_start, mgr, taken)
                slots.append(slot)
                if staged:
                    tg.start_soon(_fill, slot, cascade, [batch[i] for i in staged], run, mgr, submit,
                                  (ticket, pos))
                else:
                    slot.submit(mgr, staging, submit)
                pos += len(batch)
        except Exception as exc:  # raised below as itself, not inside an exception group
            error = exc
            tg.cancel_scope.cancel()
    error = error or next((slot.error for slot in slots if slot.error is not None), None)
    if error is not None:
        # The loads already submitted write the caller's GPU blocks: they are over before
        # the error reaches the caller, as a restore that returns waits for its loads.
        with anyio.CancelScope(shield=True):
            for slot in slots:
                if slot.future is not None:
                    await _landed(slot.future)
        raise error
    return await _settle(slots, len(keys))


async def _landed(future: TransferFuture) -> None:
    try:
        await future
    except TransferFailed:
        pass


class _Run:
    """What the batches of one restore share: where its leading run ends (``end``: the
    first key known to be found nowhere, else the request's length)."""

    def __init__(self, end: int) -> None:
        self.end = end


async def _fill(slot: _Slot, cascade: Cascade, keys: list[Hashable], run: _Run, mgr: ChunkManager,
                submit: Submit, order: tuple[int, int]) -> None:
    """Read one batch's staged keys into its chunks (or rows put in host order off the
    loop), then submit its load, unless a batch before it missed. Errors are kept on the
    slot (the restore raises the first), so they never end up in an exception group.
    ``order``: the restore's ticket and the batch's position, its place in a disk's reads."""
    staging = cascade.staging
    try:
        found, rows, in_rows = await _read(cascade, keys, slot.staged, order)
        end = slot.cut_at_miss(found, mgr, staging)
        if slot.cut:
            run.end = min(run.end, slot.pos + end)
        if not end or slot.pos >= run.end:
            slot.release(mgr, staging)
            return
        in_rows = [i for i in in_rows if i < len(slot.staged)]
        if rows is not None and in_rows:
            # Not abandoned on cancel: the copy writes staging chunks, which go back only after.
            picked = rows[: len(slot.staged)] if len(in_rows) == len(slot.staged) else rows[in_rows]
            await off_loop(picked.nbytes, cascade.pages.scatter, cascade.pool,
                           [slot.staged[i] for i in in_rows], picked)
    except Exception as exc:
        slot.release(mgr, staging)
        slot.error = exc
        run.end = min(run.end, slot.pos)
        return
    except BaseException:
        slot.release(mgr, staging)
        raise
    try:
        slot.submit(mgr, staging, submit)
    except Exception as exc:
        slot.error = exc
        run.end = min(run.end, slot.pos)


class _Slot:
    """One batch on its way to the GPU: its chunks, pins and, once submitted, its load."""

    def __init__(self, pos: int, batch: list[Hashable], in_host: list[bool], blocks: list[int],
                 host_start: int, mgr: ChunkManager, staged: list[int]) -> None:
        self.pos = pos
        self.pinned = [k for k, h in zip(batch, in_host) if h]
        host_chunks = iter(mgr.prepare_load(self.pinned))
        staged_chunks = iter(staged)
        self.src = [host_start + next(host_chunks) if h else next(staged_chunks) for h in in_host]
        self.in_host = in_host
        self.blocks = blocks
        self.staged = staged
        self.sources: list[TierLink | None] = [None] * len(batch)
        self.future: TransferFuture | None = None
        self.error: Exception | None = None
        self.cut = False  # a key of it was found nowhere: nothing after it counts
        self._released = False

    def cut_at_miss(self, found: list[TierLink | None], mgr: ChunkManager, staging: Staging) -> int:
        """Keep the batch up to its first miss; give back the pins and chunks after it."""
        staged = [i for i, h in enumerate(self.in_host) if not h]
        end = len(self.in_host)
        for i, link in zip(staged, found):
            if link is None:
                end = i
                self.cut = True
                break
            self.sources[i] = link
        kept_staged = sum(1 for i in staged if i < end)
        at = [i for i, h in enumerate(self.in_host) if h]
        mgr.complete_load([k for k, i in zip(self.pinned, at) if i >= end])
        staging.give(self.staged[kept_staged:])
        self.pinned = [k for k, i in zip(self.pinned, at) if i < end]
        self.staged = self.staged[:kept_staged]
        self.src, self.blocks, self.in_host = self.src[:end], self.blocks[:end], self.in_host[:end]
        self.sources = self.sources[:end]
        return end

    def submit(self, mgr: ChunkManager, staging: Staging, submit: Submit) -> None:
        """Submit the load; its pins and staging chunks go back when it is over (or now, if
        the worker refuses it)."""
        try:
            future = submit(CPULoadStoreSpec(self.src), self.blocks)
        except BaseException:
            self.release(mgr, staging)
            raise
        future.add_done_callback(lambda _fut: self.release(mgr, staging))
        self.future = future

    def release(self, mgr: ChunkManager, staging: Staging) -> None:
        if self._released:
            return
        self._released = True
        mgr.complete_load(self.pinned)
        staging.give(self.staged)


async def _read(cascade: Cascade, keys: list[Hashable], chunks: list[int],
                order: tuple[int, int]) -> tuple[list[TierLink | None], np.ndarray | None, list[int]]:
    """Read ``keys`` straight into the staging ``chunks``: whole when the host keeps pages
    in portable order, else page by page where a tier reads in parts (the disk). What
    arrived otherwise (from memory on its way down, from Redis) is in rows (returned, with
    the indices of the keys whose bytes are there) to be put in host order."""
    if not keys:
        return [], None, []
    pages, pool = cascade.pages, cascade.pool
    if pages.identity:
        bb = pages.chunk_bytes
        views = [memoryview(pool[c * bb : c * bb + pages.payload_bytes].data) for c in chunks]
        return await cascade.read(keys, views, order), None, []
    rows = _Rows(len(keys), pages.payload_bytes)
    found, placed = await cascade.read_placed(keys, rows, [cascade.chunk_parts(c) for c in chunks], order)
    in_rows = [i for i, (link, p) in enumerate(zip(found, placed)) if link is not None and not p]
    return found, rows.array, in_rows


class _Rows(Sequence[memoryview]):
    """Rows for the blocks that cannot be read in place (from memory, from Redis),
    allocated on first use: a restore from the disk alone never touches them."""

    def __init__(self, n: int, row_bytes: int) -> None:
        self._n = n
        self._row_bytes = row_bytes
        self.array: np.ndarray | None = None

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> memoryview: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[memoryview]: ...
    def __getitem__(self, i: int | slice) -> memoryview | Sequence[memoryview]:
        if self.array is None:  # page-aligned: direct I/O reads into them
            self.array = aligned_rows(self._n, self._row_bytes)
        if isinstance(i, slice):
            return [memoryview(r.data) for r in self.array[i]]
        return memoryview(self.array[i].data)


async def _settle(slots: list[_Slot], requested: int) -> Outcome:
    """Await the loads in order; the leading run of successful ones is what was restored."""
    restored = failed = 0
    sources: list[TierLink | None] = []
    leading = True
    for slot in slots:  # in key order
        if slot.future is None:  # a miss, a failed read or placing copy: nothing after counts
            leading = False
            continue
        try:
            ok = (await slot.future).success
        except TransferFailed:
            ok = False
        if not ok:
            failed += 1
            leading = False
        if leading:
            restored += len(slot.src)
            sources += slot.sources
        if slot.cut:
            leading = False
    from_tiers = sum(1 for s in sources if s is not None)
    result = RestoreResult(restored, requested, from_host=restored - from_tiers, from_tiers=from_tiers)
    return Outcome(result, failed, tuple(sources))

