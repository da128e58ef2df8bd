"""Worker options and copy-strategy names: the knobs both the core and the backends read.

Low in the house (it imports only the error tree and the spec vocabulary), so the core,
the CPU backend and the CUDA package can all depend on it without importing each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import InvalidSpec
from .specs import as_count

__all__ = ["MIN_STAGING_BYTES", "STRATEGIES", "WorkerOptions", "chunk_count"]

# CUDA copy strategies (docs/concepts.md says what each does); the CPU backend ignores them.
STRATEGIES = ("auto", "dma", "kernel", "staged")

MIN_STAGING_BYTES = 1024


@dataclass(frozen=True)
class WorkerOptions:
    """Knobs beyond the constructor's keywords. A dict with these keys is accepted too."""

    # Copy strategy on CUDA: "auto", "dma", "kernel" or "staged" (ignored on the CPU).
    strategy: str = "auto"
    # CUDA streams one job's copies are spread over (several copy engines); 0 = auto.
    streams_per_direction: int = 0
    # Host threads that issue a large DMA job's per-stream batches in parallel (the
    # driver spends host time on every descriptor and drops the GIL, so several
    # threads keep several copy engines fed); 0 issues them from the submitting thread.
    # Only jobs of >= 1024 descriptors use them (docs/performance.md, "Submit threads").
    submit_threads: int = 4
    # Device memory per lane (store, load, expedited load) that the staged strategy (and
    # ``auto``) gathers small pages through, in two slots; allocated on the lane's first
    # job that uses it. A slot's DMA should outlast the longest compute kernel beside it,
    # or the gather waits for SMs between slots; 128 MiB outlasts a large GEMM's kernels
    # (docs/performance.md, "Staging size"). 0 turns staging off (``auto`` is then
    # ``dma``).
    staging_bytes: int = 128 << 20
    # After a completion or a submit (unless the oldest job is predicted to need longer),
    # and before a predicted end, the poller yields to the loop for this long.
    spin_seconds: float = 200e-6
    # Timer nap between polls when the oldest job cannot ring the doorbell (asyncio rounds
    # short sleeps up, docs/performance.md, "Doorbell"); with the doorbell, naps last until
    # a ring (10 ms backstop).
    poll_interval: float = 1e-3
    # Async face: while napping, have each direction's oldest job ring a pipe the loop
    # sleeps on when it ends (on CUDA a host function writes it, no Python involved), so a
    # job that ends away from its predicted time is noticed when it ends, not after a
    # timer nap the loop rounds up (docs/performance.md, "Doorbell").
    doorbell: bool = True
    # CUDA: enqueue jobs of 8 MiB or more (and any job behind one) from each lane's own
    # thread, so ``submit`` returns once the job is planned and its dependency captured,
    # without waiting for the driver calls. Off by default: the thread takes
    # the GIL for the driver calls instead, so the loop still waits for them, a GEMM loop
    # in another Python thread slows more, and the round trip grows by the hand-off
    # (docs/performance.md, "Issue thread").
    issue_thread: bool = False
    # CUDA: plan each job in C and hand it to each lane's native issuer thread, which makes
    # the driver calls without the GIL; ring the doorbell from the native waiter thread.
    # None: where the helper is built, unless ``AIOKV_NATIVE=0``; True: require it
    # (InvalidSpec where it is missing, on the CPU backend too, which never uses it);
    # False: issue the driver calls from Python (docs/native.md).
    native: bool | None = None
    # CUDA: bracket each layer gate with two timing events on the consumer's stream, so the
    # gate's stall (how long that stream waited for the layer after it was due) is read in
    # device time into ``WorkerStatistics.layers.stalls``. Costs two event records per
    # gate; the CPU backend always measures (host time blocked in the gate).
    layer_stalls: bool = False
    # Jobs in flight (all directions) past which ``submit_*`` refuses with ``QueueFull``
    # before enqueueing; 0 = unbounded. Submits never wait for a copy, so without a bound a
    # tight loop can queue thousands of jobs in a blink and ``aclose()`` / ``shutdown()``
    # then drains them all. The async face's ``await worker.wait_for_room()`` returns once a
    # slot is free; the sync face's ``submit_*`` blocks until one is.
    max_in_flight: int = 0
    # Seconds a closing drain waits while no job in flight ends before it gives up on them
    # (an ``after=`` event nobody sets, a hung device): it warns naming the jobs, fails
    # their futures/results, and keeps the host memory their copies may still write.
    # ``math.inf`` waits for ever.
    drain_timeout: float = 30.0
    # An absolute file name (on a memory filesystem such as /dev/shm) to make the host pool
    # from, mapped shared, so another process can map the same chunks (vLLM's scheduler
    # moves blocks between them and lower tiers); made anew, and removed when the worker
    # closes. None: private memory (backends/shared_file.py).
    host_pool_file: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise InvalidSpec(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("streams_per_direction", "submit_threads", "staging_bytes", "max_in_flight"):
            value = getattr(self, name)
            count = as_count(value, name)
            if count < 0:
                raise InvalidSpec(f"{name} must be an int >= 0, got {value!r}")
            object.__setattr__(self, name, count)  # numpy ints become ints
        if 0 < self.staging_bytes < MIN_STAGING_BYTES:  # two slots of 512-byte multiples
            raise InvalidSpec(
                f"staging_bytes must be 0 (no staging) or at least {MIN_STAGING_BYTES}, "
                f"got {self.staging_bytes}"
            )
        for name in ("doorbell", "issue_thread", "layer_stalls"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSpec(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.native is not None and not isinstance(self.native, bool):
            raise InvalidSpec(f"native must be None, True or False, got {self.native!r}")
        for name in ("spin_seconds", "poll_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidSpec(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self.drain_timeout_or(None)
        if self.host_pool_file is not None and (
                not isinstance(self.host_pool_file, str) or not os.path.isabs(self.host_pool_file)):
            raise InvalidSpec(f"host_pool_file must be None or an absolute file name, "
                              f"got {self.host_pool_file!r}")

    def drain_timeout_or(self, given: Any) -> float:
        """``given`` (an ``aclose`` / ``shutdown`` argument) if not None, else the option;
        raises ``InvalidSpec`` unless it is a number of seconds > 0 (``math.inf`` too)."""
        value = self.drain_timeout if given is None else given
        if not _seconds(value) or not value > 0:
            raise InvalidSpec(f"drain_timeout must be a number of seconds > 0 (math.inf: no bound), "
                              f"got {value!r}")
        return float(value)

    def with_strategy(self, strategy: str) -> WorkerOptions:
        """A copy with another copy strategy (validated)."""
        return replace(self, strategy=strategy)

    @classmethod
    def coerce(cls, value: WorkerOptions | Mapping[str, Any] | None) -> WorkerOptions:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            if unknown:
                raise InvalidSpec(f"unknown worker options {sorted(unknown)}; known: {sorted(known)}")
            return cls(**value)
        raise InvalidSpec(f"options must be a WorkerOptions, a dict or None, got {type(value).__name__}")


def _seconds(value: Any) -> bool:
    """A real number of seconds (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def chunk_count(num_cpu_chunks: Any, cpu_bytes: Any, chunk_bytes: int) -> int:
    """Exactly one of the two sizes: a chunk count, or bytes rounded down to chunks."""
    if (num_cpu_chunks is None) == (cpu_bytes is None):
        raise InvalidSpec("pass exactly one of num_cpu_chunks= and cpu_bytes=")
    if num_cpu_chunks is not None:
        chunks = _positive(num_cpu_chunks)
        if chunks is None:
            raise InvalidSpec(f"num_cpu_chunks must be a positive int, got {num_cpu_chunks!r}")
        return chunks
    nbytes = _positive(cpu_bytes)
    if nbytes is None or nbytes < chunk_bytes:
        raise InvalidSpec(
            f"cpu_bytes must be an int of at least one chunk ({chunk_bytes} bytes), got {cpu_bytes!r}"
        )
    return nbytes // chunk_bytes


def _positive(value: Any) -> int | None:
    """``value`` as a positive int (numpy integers too), or None."""
    try:
        count = as_count(value, "size")
    except InvalidSpec:
        return None
    return count if count >= 1 else None
