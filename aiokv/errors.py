"""Every error aiokv raises, in one tree.

Each class also derives from the builtin a caller would already catch, so ``except
ValueError`` around a submit keeps working::

    AiokvError
     +-- InvalidSpec (ValueError)          bad input: ids, lengths, devices, dtypes, options;
     |    |                                nothing was enqueued, the worker stays usable
     |    +-- DuplicateJob                 a job id that is still in flight
     |    +-- KeyNotLoadable               a cache key that is missing or still being written
     +-- UsageError (RuntimeError)         a call in the wrong state or from the wrong thread
     |    +-- WorkerClosed                 you closed the worker (or never opened it)
     |    +-- QueueFull                    ``max_in_flight`` jobs are in flight already
     |    +-- MissingExtra (ImportError)   an optional package is not installed; the
     |                                     message names the extra that brings it
     +-- WorkerBroken (RuntimeError)       the device failed under you (sticky CUDA error)
     +-- HostMemoryError (MemoryError)     the host pool cannot be allocated or pinned
     +-- CudaCallFailed (RuntimeError)     a driver call failed: neither bad input nor broken
     +-- DriverError                       the raw driver code behind one of the CUDA errors
     |                                     above (their ``__cause__``; never raised alone)
     +-- TransferFailed                    one transfer failed; ``.result`` says which
     +-- TierError (OSError)               a lower cache tier (disk, Redis) failed; the cache
                                           turns it into a miss, never into wrong bytes

Only the CUDA driver package turns driver return codes into these (``raise ... from`` a
``DriverError``); nothing else catches cuda-python errors. This module imports nothing of
aiokv: it is the bottom floor of the import graph.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AiokvError",
    "CudaCallFailed",
    "DriverError",
    "DuplicateJob",
    "HostMemoryError",
    "InvalidSpec",
    "KeyNotLoadable",
    "MissingExtra",
    "QueueFull",
    "TierError",
    "TransferFailed",
    "UsageError",
    "WorkerBroken",
    "WorkerClosed",
]


class AiokvError(Exception):
    """Base of every error aiokv raises."""


class InvalidSpec(AiokvError, ValueError):
    """Bad input, rejected before anything was enqueued; the worker stays usable."""


class DuplicateJob(InvalidSpec):
    """The job id is still in flight; ids may be reused only after they are reported."""


class KeyNotLoadable(InvalidSpec):
    """A cache load named a key that is missing or still being written."""


class UsageError(AiokvError, RuntimeError):
    """A call made in the wrong state (entered twice, closed from the loop by another thread) or from the
    wrong thread. Unlike ``InvalidSpec`` the arguments were fine; the call site is not."""


class WorkerClosed(UsageError):
    """The worker is closed (or was never opened with ``async with``)."""


class QueueFull(UsageError):
    """``WorkerOptions.max_in_flight`` jobs are in flight already; nothing was enqueued.
    Wait for room (``await worker.wait_for_room()`` on the async face) and submit again."""


class MissingExtra(UsageError, ImportError):
    """An optional package a feature needs is not installed (``aiokv.extras``); the message
    names the extra that brings it and the command that installs it. Also an
    ``ImportError``, so ``except ImportError`` around an optional feature keeps working."""


class WorkerBroken(AiokvError, RuntimeError):
    """The device failed under the worker (a sticky CUDA error); every pending job failed."""


class HostMemoryError(AiokvError, MemoryError):
    """The host pool could not be allocated or pinned: ask for fewer chunks or bytes."""


class CudaCallFailed(AiokvError, RuntimeError):
    """A driver call failed for a reason that is neither bad input nor a broken context."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class DriverError(AiokvError):
    """The raw CUDA driver failure: which call (``what``), its return ``code`` and the code's
    ``name``. Kept as the ``__cause__`` of the error raised to the caller (``WorkerBroken``,
    ``InvalidSpec``, ``CudaCallFailed`` or ``HostMemoryError``), never raised on its own."""

    def __init__(self, code: int, what: str, name: str) -> None:
        super().__init__(f"{what} returned {name} ({code})")
        self.code = code
        self.what = what
        self.name = name


class TransferFailed(AiokvError):
    """A transfer failed on the device; ``result`` is its ``aiokv.TransferResult`` (with
    ``success=False``). Typed as ``Any`` here so that the error tree imports nothing."""

    result: Any

    def __init__(self, result: Any, reason: str = "") -> None:
        self.result = result
        self.reason = reason
        super().__init__(f"job {result.job_id} failed" + (f": {reason}" if reason else ""))


class TierError(AiokvError, OSError):
    """A lower cache tier failed (I/O error, timeout, lost connection, a value that does not
    verify). Caches count it and treat the key as a miss."""
