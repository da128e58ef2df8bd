"""The worker interface ``OffloadCache`` needs, declared rather than assumed."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..future import TransferFuture

__all__ = ["CacheWorker"]


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

    def check_submittable(self, after: Any = None) -> None: ...

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any, *,
                     after: Any = None) -> TransferFuture: ...

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *, expedited: bool = False,
                    after: Any = None) -> TransferFuture: ...
