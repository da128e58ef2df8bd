"""aiokv: awaitable KV-cache offloading between GPU memory and pinned host memory."""

from .cache import (
    AdmissionPolicy,
    CacheStats,
    ChunkManager,
    EvictionPolicy,
    KeyNotLoadable,
    LookupResult,
    available_admissions,
    available_policies,
    register_admission,
    register_policy,
)
from .cache.offload import OffloadCache, OffloadCacheStats, OffloadResult
from .core import WorkerOptions, WorkerStatistics
from .future import TransferFuture
from .layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from .specs import (
    AiokvError,
    CPULoadStoreSpec,
    Direction,
    DuplicateJob,
    GPULoadStoreSpec,
    InvalidSpec,
    LoadStoreSpec,
    TransferFailed,
    TransferResult,
    WorkerBroken,
    WorkerClosed,
)
from .sync import OffloadingWorker, SyncOffloadingWorker
from .worker import AsyncOffloadingWorker

__version__ = "0.1.0"

__all__ = [
    "AdmissionPolicy",
    "AiokvError",
    "AsyncOffloadingWorker",
    "CPULoadStoreSpec",
    "CacheStats",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "ChunkManager",
    "Direction",
    "DuplicateJob",
    "EvictionPolicy",
    "GPULoadStoreSpec",
    "InvalidSpec",
    "KeyNotLoadable",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadCache",
    "OffloadCacheStats",
    "OffloadResult",
    "OffloadingWorker",
    "SyncOffloadingWorker",
    "TransferFailed",
    "TransferFuture",
    "TransferResult",
    "WorkerBroken",
    "WorkerClosed",
    "WorkerOptions",
    "WorkerStatistics",
    "available_admissions",
    "available_policies",
    "register_admission",
    "register_policy",
]
