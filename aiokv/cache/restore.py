"""Restoring through the tiers: lower-tier reads into staging chunks, pipelined with the
copies of earlier batches to the GPU.

A restore walks its keys in batches. Keys the host holds are pinned in place; the others
are read from the nearest tier holding them into staging chunks (a range of the cache's
chunks the host bookkeeping never hands out, so nothing else writes them). Each batch's
load is submitted as soon as its reads are verified and the next batch's reads start while
it copies. The first key that no tier returns ends the restore: the keys before it arrive,
the rest are misses, never wrong bytes. Pins and staging chunks go back in the load's done
callback, or at once if the batch never reached a submit (cancelled, refused, or a miss).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import anyio
import anyio.to_thread
import numpy as np

from ..errors import KeyNotLoadable, TransferFailed
from ..future import TransferFuture
from ..specs import CPULoadStoreSpec
from .cascade import Cascade, TierLink
from .counters import Counters
from .jobs import Submit
from .keys import unhashable
from .manager import ChunkManager
from .protocol import result_or_none
from .records import RestoreResult

__all__ = ["BATCH_BYTES", "Staging", "restore_from_host", "restore_through_tiers"]

BATCH_BYTES = 16 << 20
"""Bytes one pipelined batch reads from the tiers: large enough to keep a disk or a Redis
connection busy, small enough that the first copy to the GPU starts early."""
BATCH_KEYS = 64


class Staging:
    """The staging chunks of one cache: taken by a batch, given back when its load is over."""

    def __init__(self, chunks: range) -> None:
        self.chunks = chunks
        self.free: list[int] = list(chunks)
        self._freed = anyio.Event()

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def give(self, chunks: Sequence[int]) -> None:
        if chunks:
            self.free.extend(chunks)
            self._freed.set()

    async def wait(self) -> None:
        """Until some chunk is given back."""
        if self._freed.is_set():
            self._freed = anyio.Event()
        await self._freed.wait()


class _Load:
    def __init__(self, future: TransferFuture, count: int, from_host: int,
                 sources: list[TierLink | None]) -> None:
        self.future = future
        self.count = count
        self.from_host = from_host
        self.sources = sources


async def restore_from_host(keys: Sequence[Hashable], blocks: list[int], *, mgr: ChunkManager,
                            counters: Counters, host_start: int, submit: Submit) -> RestoreResult:
    """All or nothing from the host: one load if every key is loadable, else a miss."""
    try:
        chunks = mgr.prepare_load(keys)  # pins nothing unless every key is loadable
    except KeyNotLoadable:
        try:  # an unhashable key raises even behind a miss
            for key in keys:
                hash(key)
        except TypeError as exc:
            raise unhashable(exc) from exc
        counters.restores += 1
        counters.restore_misses += 1
        await anyio.lowlevel.checkpoint()
        return RestoreResult(0, len(keys))
    pinned = list(keys)
    try:
        future = submit(CPULoadStoreSpec([host_start + c for c in chunks]), blocks)
    except BaseException:
        mgr.complete_load(pinned)
        raise  # refused (bad block ids among them): not counted as a restore
    counters.restores += 1

    def finish(fut: TransferFuture) -> None:
        mgr.complete_load(pinned)
        if result_or_none(fut) is None:
            counters.failed_loads += 1
        else:
            counters.restored += len(pinned)

    future.add_done_callback(finish)
    try:
        await future
    except TransferFailed:
        return RestoreResult(0, len(keys))
    return RestoreResult(len(keys), len(keys), from_host=len(keys))


async def restore_through_tiers(
    keys: Sequence[Hashable],
    blocks: list[int],
    *,
    mgr: ChunkManager,
    cascade: Cascade,
    staging: Staging,
    pool: np.ndarray,
    host_start: int,
    submit: Submit,
) -> tuple[RestoreResult, int]:
    """Bring ``keys`` into ``blocks`` from the host and the tiers; the result and the number
    of loads that failed on the device."""
    bb = cascade.block_bytes
    per_batch = max(1, min(BATCH_KEYS, BATCH_BYTES // bb))
    slots: list[_Slot] = []
    pos = 0
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        try:
            while pos < len(keys):
                batch = list(keys[pos : pos + per_batch])
                in_host = [mgr.count_leading_hits((k,)) == 1 for k in batch]
                need = in_host.count(False)
                while need and not staging.free:
                    await staging.wait()
                    in_host = [mgr.count_leading_hits((k,)) == 1 for k in batch]  # others ran meanwhile
                    need = in_host.count(False)
                taken = staging.take(need)
                if len(taken) < need:  # cut the batch before the first key without a staging chunk
                    cut = [i for i, h in enumerate(in_host) if not h][len(taken)]
                    batch, in_host = batch[:cut], in_host[:cut]
                host_keys = [k for k, h in zip(batch, in_host) if h]
                host_chunks = iter(mgr.prepare_load(host_keys)) if host_keys else iter(())
                staged = [i for i, h in enumerate(in_host) if not h]
                src = [0] * len(batch)
                for i, chunk in zip(staged, taken):
                    src[i] = chunk
                for i, h in enumerate(in_host):
                    if h:
                        src[i] = host_start + next(host_chunks)
                try:
                    found, rows = await _read(cascade, pool, [batch[i] for i in staged], taken)
                except BaseException:
                    mgr.complete_load(host_keys)
                    staging.give(taken)
                    raise
                sources: list[TierLink | None] = [None] * len(batch)
                end = len(batch)
                for i, link in zip(staged, found):
                    if link is None:
                        end = i
                        break
                    sources[i] = link
                mgr.complete_load([k for k, h in zip(batch[end:], in_host[end:]) if h])
                staging.give([src[i] for i in staged if i >= end])
                if end:
                    slot = _Slot(
                        src[:end], blocks[pos : pos + end],
                        [k for k, h in zip(batch[:end], in_host[:end]) if h],
                        [src[i] for i in staged if i < end], sources[:end],
                    )
                    slots.append(slot)
                    if rows is None:
                        slot.submit(mgr, staging, submit)
                    else:  # put the pages in host order off the loop while the next batch reads
                        hit = len(slot.staged)
                        tg.start_soon(_place_and_submit, slot, cascade, pool, rows[:hit], mgr, staging,
                                      submit)
                pos += end
                if end < len(batch) or not batch:
                    break
        except Exception as exc:  # raised below as itself, not inside an exception group
            error = exc
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    for slot in slots:
        if slot.error is not None:
            raise slot.error
    return await _settle([s.load for s in slots if s.load is not None], len(keys), bb)


class _Slot:
    """One batch on its way to the GPU: its chunks, pins and, once submitted, its load."""

    def __init__(self, src: list[int], blocks: list[int], pinned: list[Hashable], staged: list[int],
                 sources: list[TierLink | None]) -> None:
        self.src, self.blocks, self.pinned, self.staged, self.sources = src, blocks, pinned, staged, sources
        self.load: _Load | None = None
        self.error: BaseException | None = None

    def submit(self, mgr: ChunkManager, staging: Staging, submit: Submit) -> None:
        """Submit the load; its pins and staging chunks go back when it is over (or now, if
        the worker refuses it)."""
        try:
            future = submit(CPULoadStoreSpec(self.src), self.blocks)
        except BaseException:
            self.release(mgr, staging)
            raise
        future.add_done_callback(lambda _fut: self.release(mgr, staging))
        self.load = _Load(future, len(self.src), len(self.pinned), self.sources)

    def release(self, mgr: ChunkManager, staging: Staging) -> None:
        mgr.complete_load(self.pinned)
        staging.give(self.staged)


async def _place_and_submit(slot: _Slot, cascade: Cascade, pool: np.ndarray, rows: np.ndarray,
                            mgr: ChunkManager, staging: Staging, submit: Submit) -> None:
    try:
        # Not abandoned on cancel: the thread writes staging chunks, which return only after.
        await anyio.to_thread.run_sync(cascade.pages.scatter, pool, slot.staged, rows)
    except BaseException:
        slot.release(mgr, staging)
        raise
    try:
        slot.submit(mgr, staging, submit)
    except Exception as exc:  # raised by the restore, not as a task group's exception group
        slot.error = exc


async def _read(cascade: Cascade, pool: np.ndarray, keys: list[Hashable],
                chunks: list[int]) -> tuple[list[TierLink | None], np.ndarray | None]:
    """Read ``keys``: straight into the staging ``chunks`` when the host keeps pages in
    portable order, else into rows (returned, hits first) to be put in host order."""
    if not keys:
        return [], None
    pages = cascade.pages
    if pages.identity:
        bb = pages.chunk_bytes
        views = [memoryview(pool[c * bb : c * bb + pages.payload_bytes].data) for c in chunks]
        return await cascade.read(keys, views), None
    rows = np.empty((len(keys), pages.payload_bytes), dtype=np.uint8)
    found = await cascade.read(keys, [memoryview(r.data) for r in rows])
    return found, rows


async def _settle(loads: list[_Load], requested: int, block_bytes: int) -> tuple[RestoreResult, int]:
    """Await the loads in order; the leading run of successful ones is what was restored."""
    restored = from_host = from_tiers = failed = 0
    leading = True
    for load in loads:
        try:
            res = await load.future
            ok = res.success
        except TransferFailed:
            ok = False
        if not ok:
            failed += 1
            leading = False
        if not leading:
            continue
        restored += load.count
        from_host += load.from_host
        for link in load.sources:
            if link is not None:
                link.restored_keys += 1
                link.restored_bytes += block_bytes
                from_tiers += 1
    return RestoreResult(restored, requested, from_host=from_host, from_tiers=from_tiers), failed
