"""What a backend provides: a host pool, dependency capture, and one ordered lane per
direction whose launches hand back completions. Nothing here knows about event loops."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from ..doorbell import Doorbell
from ..layout import CanonicalKVCaches
from ..plan import CopyPlan, HostLayout
from ..specs import Direction

__all__ = ["Backend", "Completion", "HostPool", "Lane", "LaneStatistics"]


@dataclass(frozen=True)
class LaneStatistics:
    """What one lane did so far (counters only grow): the record the bench and tools read.

    Attributes:
        strategy: the copy strategy the lane runs ("dma", "kernel", "staged"); None where
            the backend has no strategies (the CPU).
        pitched_jobs: jobs sent as pitched (2D) copies, one per block and run of pages.
        pitched_heights: pages per run that a pitched copy may move in this layout (empty:
            no uniform device pitch, so no job can go pitched).
        staged_jobs: jobs gathered through the staging ring (the rest went as plain DMA).
        issued_later: jobs the lane's issuer thread enqueued after ``submit`` returned
            (``WorkerOptions.issue_thread``).
        issue_seconds: host seconds the issuer thread spent enqueueing those jobs.
        issue_cpu_seconds: CPU seconds the issuer thread spent doing so.
        last_started_at: ``time.perf_counter()`` just before the latest job's copies were
            handed to the device (None before the first, or where unknown).
    """

    strategy: str | None = None
    pitched_jobs: int = 0
    pitched_heights: tuple[int, ...] = ()
    staged_jobs: int = 0
    issued_later: int = 0
    issue_seconds: float = 0.0
    issue_cpu_seconds: float = 0.0
    last_started_at: float | None = None


class Completion(abc.ABC):
    """The end of one launched job. ``query`` never blocks; ``wait`` may."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the job's copies are over, successfully or not."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block (off the event loop) until done; False if ``timeout`` passed first."""

    def ring_when_done(self, bell: Doorbell) -> bool:
        """Have ``bell`` rung once the job is over (at once if it is); False if this
        backend cannot, and the caller must keep polling on a timer."""
        return False

    # Set by the backend when the job is over.
    _error: BaseException | None
    _elapsed: float | None
    # Host clock (perf_counter) just before the first copy was enqueued, when known.
    _started: float | None = None

    @property
    def started_at(self) -> float | None:
        """When the copies were handed to the device: they cannot have begun earlier."""
        return self._started

    @property
    def error(self) -> BaseException | None:
        """Why the job failed, once ``query()`` is True; None on success."""
        return self._error

    @property
    def elapsed(self) -> float | None:
        """Seconds the copies took on the device, when measured (settles first)."""
        self.settle()
        return self._elapsed

    def settle(self) -> None:
        """Finish what telling the waiter did not need (CUDA: read the device time, pool the
        events). Called once the waiter was woken, or on first use of ``elapsed``; cheap
        and idempotent. Nothing to do where the time is known at the end."""


class HostPool(abc.ABC):
    """Host memory that holds the chunks, as one flat byte tensor."""

    tensor: torch.Tensor

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory. Only called once nothing in flight can touch it."""

    def abandon(self) -> None:
        """The worker was dropped unclosed: copies may still touch the memory, so a pool
        the device writes keeps it for the rest of the process (nothing to do here)."""


class Lane(abc.ABC):
    """One direction's ordered queue of copies on the device."""

    direction: Direction

    @abc.abstractmethod
    def launch(self, plan: CopyPlan, dependency: Any) -> Completion:
        """Enqueue the plan after everything launched before it and after ``dependency``.

        Never waits for the copy. Raises only before anything was enqueued.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Free the lane's resources. Only called once every completion is done."""

    def statistics(self) -> LaneStatistics:
        """A snapshot of what the lane did (a lane without strategies reports no counters)."""
        return LaneStatistics()

    def abandon(self) -> None:
        """The worker was dropped without a close: free what is safe to free without
        calling the device (nothing, unless a lane says otherwise; a CPU lane lets its
        thread finish what is queued and waits for it, a few seconds at most)."""


class Backend(abc.ABC):
    """A place copies run: CPU worker threads, or CUDA streams."""

    name: str

    @abc.abstractmethod
    def check_caches(self, kv: CanonicalKVCaches) -> None:
        """Raise ``InvalidSpec`` when the KV tensors cannot be served by this backend."""

    @abc.abstractmethod
    def allocate_pool(self, nbytes: int) -> HostPool:
        """Allocate (and, on CUDA, pin) ``nbytes`` of host memory."""

    @abc.abstractmethod
    def capture(self, after: Any) -> Any:
        """Capture, on the submitting thread, what a copy must wait for.

        ``after=None`` means the caller's current stream. The value returned is opaque
        and handed to ``Lane.launch``. Raises ``InvalidSpec`` for an unusable ``after``.
        """

    @abc.abstractmethod
    def check_after(self, after: Any) -> None:
        """Raise what ``capture`` would raise for ``after``, touching nothing."""

    @abc.abstractmethod
    def open_lane(
        self, direction: Direction, kv: CanonicalKVCaches, layout: HostLayout, pool: HostPool
    ) -> Lane:
        """Create the lane for one direction."""

    def close(self) -> None:
        """Release backend-wide resources after every lane closed."""
