"""The worker interface ``OffloadCache`` needs, declared rather than assumed."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidSpec, TransferFailed, UsageError
from ..future import TransferFuture
from ..host_layout import HostLayout
from ..specs import CPULoadStoreSpec, GPULoadStoreSpec, TransferResult

__all__ = ["DEFAULT_STAGING_CHUNKS", "CacheWorker", "check_store_ids", "check_worker", "default_staging",
           "result_or_none", "split_chunks"]

DEFAULT_STAGING_CHUNKS = 64
"""Chunks a cache with tiers keeps aside to bring lower-tier blocks up to the GPU."""


@runtime_checkable
class CacheWorker(Protocol):
    """What the cache uses of an ``AsyncOffloadingWorker`` (the async face): its facts, its
    host pool (read by lower tiers), and awaitable submits checked on the loop thread."""

    @property
    def num_cpu_chunks(self) -> int: ...

    @property
    def blocks_per_chunk(self) -> int: ...

    @property
    def num_gpu_blocks(self) -> int: ...

    @property
    def num_groups(self) -> int: ...

    @property
    def chunk_bytes(self) -> int: ...

    @property
    def host_pool(self) -> Any: ...

    @property
    def host_layout(self) -> HostLayout: ...

    def check_submittable(self, after: Any = None) -> None: ...

    def check_store(self, src_spec: Any, dst_spec: Any, *, after: Any = None) -> None: ...

    def check_load(self, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                   after: Any = None) -> None: ...

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *,
                     after: Any = None) -> TransferFuture: ...

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                    after: Any = None) -> TransferFuture: ...


def check_worker(worker: Any) -> None:
    """Refuse what is not the async face, before anything else reads it."""
    from ..sync import SyncOffloadingWorker

    if isinstance(worker, SyncOffloadingWorker) or not isinstance(worker, CacheWorker):
        raise UsageError(
            f"OffloadCache needs an AsyncOffloadingWorker (awaitable submits on an event loop); "
            f"got {type(worker).__name__}. Step-loop engines keep their own bookkeeping with "
            f"ChunkManager and a SyncOffloadingWorker"
        )
    if worker.blocks_per_chunk != 1:
        raise InvalidSpec(
            f"OffloadCache keeps one key per chunk and needs a worker with blocks_per_chunk=1, "
            f"got {worker.blocks_per_chunk}"
        )
    if worker.num_groups != 1:
        raise InvalidSpec(
            f"OffloadCache keys one block per chunk of a single KV-cache group; this worker's "
            f"layout has {worker.num_groups} groups. Use the worker's submit_store/submit_load "
            f"with group_sizes for hybrid layouts"
        )


def check_store_ids(worker: CacheWorker, blocks: list[int], after: Any) -> None:
    """The worker's checks of a store from GPU ``blocks`` (any host chunks will do), for a
    call that may submit several jobs: bad ids raise before the first is enqueued."""
    if not blocks:
        worker.check_submittable(after)
    step = worker.num_cpu_chunks
    for i in range(0, len(blocks), step):
        part = blocks[i : i + step]
        worker.check_store(GPULoadStoreSpec(part), CPULoadStoreSpec(list(range(len(part)))), after=after)


def result_or_none(fut: TransferFuture) -> TransferResult | None:
    """The result of a done future if its copy succeeded, else None."""
    try:
        res = fut.result()
    except TransferFailed:
        return None
    return res if res.success else None


def default_staging(chunks: int) -> int:
    """Staging chunks a cache of ``chunks`` chunks with tiers keeps when not told:
    ``DEFAULT_STAGING_CHUNKS``, at most a quarter of them, at least one."""
    return max(1, min(DEFAULT_STAGING_CHUNKS, chunks // 4))


def split_chunks(worker: CacheWorker, chunks: range | None, staging_chunks: int | None, *,
                 tiers: bool) -> tuple[range, range, range]:
    """The cache's chunks, the host part of them and the staging part (the last ones,
    kept for restores from tiers; empty without tiers)."""
    chunks = range(worker.num_cpu_chunks) if chunks is None else chunks
    if not isinstance(chunks, range) or chunks.step != 1 or not 0 <= chunks.start < chunks.stop <= (
        worker.num_cpu_chunks
    ):
        raise InvalidSpec(f"chunks must be a non-empty range(start, stop) within "
                          f"[0, {worker.num_cpu_chunks}), got {chunks!r}")
    if not tiers:
        return chunks, chunks, range(0)
    if staging_chunks is None:
        if len(chunks) < 2:
            raise InvalidSpec("a cache with tiers needs at least 2 chunks (one to hold blocks, one "
                              f"to stage them to and from the tiers); it has {len(chunks)}")
        n = default_staging(len(chunks))
    elif isinstance(staging_chunks, bool) or not isinstance(staging_chunks, int):
        raise InvalidSpec(f"staging_chunks must be an int, got {staging_chunks!r}")
    else:
        n = staging_chunks
    if not 1 <= n < len(chunks):
        raise InvalidSpec(f"staging_chunks must be in [1, {len(chunks)}) for a cache of "
                          f"{len(chunks)} chunks with tiers, got {n}")
    return chunks, range(chunks.start, chunks.stop - n), range(chunks.stop - n, chunks.stop)
