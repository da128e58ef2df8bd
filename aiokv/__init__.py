"""aiokv: awaitable KV-cache offloading between GPU memory and pinned host memory."""

from .backends.base import LaneStatistics
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
from .cache.records import RestoreResult, TierCacheStats
from .cache.tiers import DiskTier, RedisTier, Tier, TierStatistics
from .core import WorkerStatistics
from .errors import (
    AiokvError,
    CudaCallFailed,
    DriverError,
    DuplicateJob,
    HostMemoryError,
    InvalidSpec,
    MissingExtra,
    QueueFull,
    TierError,
    TransferFailed,
    UsageError,
    WorkerBroken,
    WorkerClosed,
)
from .future import TransferFuture
from .layer_future import LayerwiseFuture
from .layer_timeline import LayerTimeline
from .layers import LayerStatistics, LayerwiseJob
from .layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from .options import WorkerOptions
from .poller import PollerStatistics
from .specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, LayerStatus, LoadStoreSpec, TransferResult
from .sync import OffloadingWorker, SyncOffloadingWorker
from .worker import AsyncOffloadingWorker

__version__ = "0.1.0"

__all__ = [
    "DiskTier",
    "RedisTier",
    "RestoreResult",
    "Tier",
    "TierCacheStats",
    "TierStatistics",
    "AdmissionPolicy",
    "AiokvError",
    "AsyncOffloadingWorker",
    "CPULoadStoreSpec",
    "CacheStats",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "ChunkManager",
    "CudaCallFailed",
    "Direction",
    "DriverError",
    "DuplicateJob",
    "EvictionPolicy",
    "GPULoadStoreSpec",
    "HostMemoryError",
    "InvalidSpec",
    "KeyNotLoadable",
    "LaneStatistics",
    "LayerStatistics",
    "LayerStatus",
    "LayerTimeline",
    "LayerwiseFuture",
    "LayerwiseJob",
    "LoadStoreSpec",
    "LookupResult",
    "MissingExtra",
    "OffloadCache",
    "OffloadCacheStats",
    "OffloadResult",
    "OffloadingWorker",
    "PollerStatistics",
    "QueueFull",
    "SyncOffloadingWorker",
    "TierError",
    "TransferFailed",
    "TransferFuture",
    "TransferResult",
    "UsageError",
    "WorkerBroken",
    "WorkerClosed",
    "WorkerOptions",
    "WorkerStatistics",
    "available_admissions",
    "available_policies",
    "register_admission",
    "register_policy",
]
