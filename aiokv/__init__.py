"""aiokv: awaitable KV-cache offloading between GPU memory and pinned host memory."""

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
    "AiokvError",
    "AsyncOffloadingWorker",
    "CPULoadStoreSpec",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "Direction",
    "DuplicateJob",
    "GPULoadStoreSpec",
    "InvalidSpec",
    "LoadStoreSpec",
    "OffloadingWorker",
    "SyncOffloadingWorker",
    "TransferFailed",
    "TransferFuture",
    "TransferResult",
    "WorkerBroken",
    "WorkerClosed",
    "WorkerOptions",
    "WorkerStatistics",
]
