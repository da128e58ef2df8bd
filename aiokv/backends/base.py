"""What a backend provides: a host pool, dependency capture, and one ordered lane per
direction whose launches hand back completions (and, for layerwise jobs, a ``LayerRun``:
one end per layer). Nothing here knows about event loops."""

from __future__ import annotations

import abc
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..doorbell import Doorbell
from ..errors import InvalidSpec
from ..host_layout import HostLayout
from ..layer_plan import LayerPlan
from ..layer_timeline import LayerTimeline
from ..layout import CanonicalKVCaches
from ..plan import CopyPlan
from ..specs import Direction

__all__ = ["Backend", "Completion", "FailedCompletion", "HostPool", "Lane", "LaneStatistics", "LayerRun",
           "StallMeter"]


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
        issue_lags: for the latest jobs of a native lane (up to 4096, oldest first), seconds
            from ``submit`` returning to its issuer thread's first driver call for the job,
            timed by that thread (0 for a job run at submit); empty elsewhere.
    """

    strategy: str | None = None
    pitched_jobs: int = 0
    pitched_heights: tuple[int, ...] = ()
    staged_jobs: int = 0
    issued_later: int = 0
    issue_seconds: float = 0.0
    issue_cpu_seconds: float = 0.0
    last_started_at: float | None = None
    issue_lags: tuple[float, ...] = ()


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


class FailedCompletion(Completion):
    """A job that failed before its copies reached the device (nothing to wait for)."""

    def __init__(self, error: BaseException) -> None:
        self._error, self._elapsed = error, None

    def query(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return True


# Stalls kept for statistics (the most recent), and measurements still being taken.
_STALLS_KEPT = 4096
_PENDING_KEPT = 1024


class StallMeter:
    """How long consumers waited on layers after they were due: one sample per gate or
    wait. Samples known at once are ``add``-ed; a device-side one (two events on the
    consumer's stream, readable once it ran) is handed over as ``later(read, drop)`` and
    read when done, oldest first. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.samples: deque[float] = deque(maxlen=_STALLS_KEPT)
        self.count = 0
        self._pending: deque[tuple[Callable[[], tuple[bool, float | None]], Callable[[], None]]] = deque()

    def add(self, seconds: float) -> None:
        with self._lock:
            self.samples.append(max(0.0, seconds))
            self.count += 1

    def later(self, read: Callable[[], tuple[bool, float | None]], drop: Callable[[], None]) -> None:
        """A sample readable later: ``read()`` says (whether it is done, its seconds or None
        if lost); ``drop()`` lets its resources go (after a read, or unread at close)."""
        with self._lock:
            self._pending.append((read, drop))
            full = len(self._pending) > _PENDING_KEPT
        self.collect()
        if full:  # never read (a consumer stream that stopped): bound what is held
            with self._lock:
                _, drop_oldest = self._pending.popleft()
            drop_oldest()

    def collect(self) -> None:
        """Read every pending sample that is done, oldest first (stops at the first not done)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                read, drop = self._pending[0]
            try:
                done, value = read()
            except Exception:
                done, value = True, None
            if not done:
                return
            with self._lock:
                if self._pending and self._pending[0][0] is read:
                    self._pending.popleft()
                    if value is not None:
                        self.samples.append(max(0.0, value))
                        self.count += 1
            drop()

    def close(self) -> None:
        """Let go of what is still pending (the device's events go with the backend)."""
        with self._lock:
            pending, self._pending = self._pending, deque()
        for _, drop in pending:
            try:
                drop()
            except Exception:
                pass


class LayerRun(abc.ABC):
    """One layerwise job on a lane: ``completion`` is its end (after every layer), and each
    layer has an end of its own that consumers wait on. A load's layers are all enqueued
    at launch; a store's come one by one through ``push`` and end with ``finish``.

    Nothing here ever waits on a layer whose copies are not enqueued yet (on CUDA a wait on
    an event never recorded would pass at once): ``enqueued`` says which are."""

    completion: Completion
    num_layers: int
    # Set when the worker abandoned the job at close: layers not known done then failed.
    abandoned: BaseException | None = None
    # Whether a gate's stall is measured (CUDA: only with ``layer_stalls``). Where it is
    # not, a gate adds no sample at all: zeros from layers found done, and nothing from
    # the gates that did wait, would read as no stall.
    measures_gates: bool = True

    @abc.abstractmethod
    def query(self, layer: int) -> bool:
        """True once the layer's copies are over, or will never run (``error`` says which);
        never blocks. False while a store layer is not pushed yet."""

    @abc.abstractmethod
    def error(self, layer: int) -> BaseException | None:
        """Why the layer failed, once ``query(layer)`` is True; None when it succeeded."""

    @abc.abstractmethod
    def enqueued(self, layer: int) -> bool:
        """Whether the layer's copies have been handed to the device (a gate may wait on them)."""

    @abc.abstractmethod
    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until ``query(layer)`` (for a store layer, through its push); False if
        ``timeout`` passed first."""

    @abc.abstractmethod
    def gate(self, layer: int, consumer: Any, meter: StallMeter) -> bool:
        """Make the consumer wait for the layer: on CUDA its stream waits on the layer's
        event (no host block), on the CPU the calling thread blocks until the layer is
        done. Adds the stall to ``meter`` (where ``measures_gates``). False when the layer
        failed (nothing waits);
        never raises for a failure. Only called once ``enqueued(layer)`` (or, for a load,
        while its enqueue is still to come)."""

    def ring_when_done(self, layer: int, bell: Doorbell) -> bool:
        """Have ``bell`` rung once the layer is over; False if this run cannot."""
        return False

    def push(self, layer: int, dependency: Any) -> bool:
        """A store: enqueue the layer's copies behind ``dependency`` (captured by
        ``Backend.capture``). False when that failed (the layer then reports the error);
        never raises for a device failure."""
        raise InvalidSpec("only a layerwise store takes pushed layers")

    def fail(self, layer: int, error: BaseException) -> None:
        """A store: the layer was pushed but cannot be enqueued (its dependency could not be
        taken); it ends failed with ``error``, and so does the job."""
        raise InvalidSpec("only a layerwise store takes pushed layers")

    def finish(self, error: BaseException | None) -> None:
        """A store: no more pushes. Layers never pushed fail with ``error``; the job ends
        behind the layers pushed, and fails if any layer did. Idempotent."""

    def abandon(self, error: BaseException) -> None:
        """The worker closed without this job ending: waiters stop waiting."""
        self.abandoned = error

    def timeline(self) -> LayerTimeline | None:
        """When each layer moved and was used, once the job ended and its gates' marks
        were read; None before, or where not measured (CUDA without ``layer_stalls``)."""
        return None


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

    def launch_layers(self, plan: LayerPlan, dependency: Any) -> LayerRun:
        """A layerwise load: enqueue every layer now, behind everything launched before and
        ``dependency``, each layer's end marked behind its copies. Raises only before
        anything was enqueued."""
        raise InvalidSpec(f"the {type(self).__name__} lane has no layerwise jobs")

    def open_layers(self, plan: LayerPlan) -> LayerRun:
        """A layerwise store: enqueue nothing yet; layers come through ``LayerRun.push``."""
        raise InvalidSpec(f"the {type(self).__name__} lane has no layerwise jobs")

    def fix(self, dependency: Any) -> None:
        """Pin a captured dependency now, on the calling thread, for a launch made later
        from another thread (a job held behind a layerwise store)."""

    def run_in_order(self, work: Callable[[], None]) -> None:
        """Run ``work`` in this lane's enqueue order (behind jobs an issuer thread still
        holds); at once where nothing is queued."""
        work()

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
    def allocate_pool(self, nbytes: int, file: str | None = None) -> HostPool:
        """Allocate (and, on CUDA, pin) ``nbytes`` of host memory; under the name ``file``,
        mapped shared, when given (``WorkerOptions.host_pool_file``)."""

    @abc.abstractmethod
    def capture(self, after: Any) -> Any:
        """Capture, on the submitting thread, what a copy must wait for.

        ``after=None`` means the caller's current stream. The value returned is opaque
        and handed to ``Lane.launch``. Raises ``InvalidSpec`` for an unusable ``after``.
        """

    @abc.abstractmethod
    def check_after(self, after: Any) -> None:
        """Raise what ``capture`` would raise for ``after``, touching nothing."""

    def consumer(self, stream: Any) -> Any:
        """What a layer gate makes wait: on CUDA a stream (None: the calling thread's current
        one). Raises ``InvalidSpec`` for anything unusable."""
        if stream is not None:
            raise InvalidSpec(f"the {self.name} backend's gates block the calling thread; pass stream=None")
        return None

    @abc.abstractmethod
    def open_lane(
        self, direction: Direction, kv: CanonicalKVCaches, layout: HostLayout, pool: HostPool
    ) -> Lane:
        """Create the lane for one direction."""

    def close(self) -> None:
        """Release backend-wide resources after every lane closed."""
