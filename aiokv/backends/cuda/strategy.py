"""Copy strategies: how one lane executes a ``CopyPlan`` on its streams, and what they share.

- ``dma``: batched memcpy on the copy engines, one job spread over several streams that
  fork from and join back into the lane's main stream (no SMs; holds up under compute).
- ``kernel``: SM gather/scatter over a UVA (zero-copy) CUDA view of the pinned pool.
- ``staged``: one kernel launch gathers a slice of the job into a staging slot laid out
  like the host chunks, then a few large DMAs move it (the reverse for loads).
- ``auto``: ``staged`` (jobs of large pieces go straight to DMA there), or ``dma`` where
  the kernel cannot load or ``staging_bytes`` is 0 (docs/performance.md, "Copy strategies").

Strategies never import cuda-python: they drive the device through ``driver.Driver`` and
torch ops on external streams. This module holds what they share: ``CopyContext`` (the
addresses of one lane's tensors and pool), the ``CopyStrategy`` interface and the small
numpy helpers that cut jobs into slices and rows. ``backend.make_strategy`` picks one (it
sits above the strategies, so that no strategy module imports back into this one).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...host_layout import HostLayout
from ...layer_plan import CopySlice
from ...layout import CanonicalKVCaches
from ...plan import CopyPlan
from ...specs import Direction
from ..base import HostPool
from .pitched import PitchedPlan, PitchedRun, pitched_runs

if TYPE_CHECKING:
    from .driver import Driver

__all__ = ["CopyContext", "CopyStrategy", "byte_splits", "copy_unit", "expand_rows"]

_log = logging.getLogger("aiokv")

# Streams one direction's DMA is spread over when the user leaves it to us. The device has
# three copy engines; more streams than engines keep each engine's queue fed.
DEFAULT_DMA_STREAMS = 16
# Pitched copies pay off when a block's pages fold into runs at least this tall on average:
# every 2D op costs the driver host time, so short runs spend it on few bytes while tall
# ones run near the ceiling (docs/performance.md, "Copy strategies").
MIN_PITCHED_HEIGHT = 8


@dataclass
class CopyContext:
    """Everything a strategy needs to address the device tensors and the host pool."""

    driver: Driver
    direction: Direction
    kv: CanonicalKVCaches
    layout: HostLayout
    pool: HostPool
    device: torch.device
    streams: int = 0
    submit_threads: int = 0
    # Device memory a ``staged`` lane gathers through (two slots); 0 = no staging.
    staging_bytes: int = 0
    # Base address of row 0 of each page tensor (device pointers), as uint64.
    device_base: np.ndarray = field(init=False)
    host_base: int = field(init=False)
    # Runs of pages that move as one pitched copy per block; empty when not worth it.
    runs: tuple[PitchedRun, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.device_base = np.array([t.tensor.data_ptr() for t in self.kv.tensors], dtype=np.int64)
        self.host_base = int(getattr(self.pool, "device_ptr", self.pool.tensor.data_ptr()))
        self.runs = ()
        if self.driver.pitched_copies:
            allocation = np.array([self.driver.allocation_base(int(a)) for a in self.device_base])
            runs = pitched_runs(self.layout, self.device_base, self.driver.max_pitch, allocation)
            pages = sum(len(r.refs) for r in runs)
            if pages >= MIN_PITCHED_HEIGHT * len(runs):
                self.runs = runs

    @property
    def to_host(self) -> bool:
        return self.direction.to_host

    def pointers(self, plan: CopyPlan | CopySlice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dst, src, sizes) as contiguous uint64 arrays, built in numpy without Python loops."""
        dev = self.device_base[plan.tensor_idx] + plan.device_offset
        host = plan.host_offset + self.host_base
        dst, src = (host, dev) if self.to_host else (dev, host)
        as_u64 = np.ascontiguousarray
        return (
            as_u64(dst, dtype=np.int64).view(np.uint64),
            as_u64(src, dtype=np.int64).view(np.uint64),
            as_u64(plan.nbytes, dtype=np.int64).view(np.uint64),
        )

    def pitched(self, plan: PitchedPlan) -> tuple[np.ndarray, np.ndarray]:
        """Packed 2D copy rows for the driver, and each one's bytes."""
        dev = plan.device_addr
        host = plan.host_offset + self.host_base
        if self.to_host:
            dst, dpitch, src, spitch = host, plan.host_pitch, dev, plan.device_pitch
        else:
            dst, dpitch, src, spitch = dev, plan.device_pitch, host, plan.host_pitch
        ops = self.driver.pitched_ops(dst, dpitch, src, spitch, plan.width, plan.height)
        return ops, plan.width * plan.height


class CopyStrategy:
    """Executes plans on a main stream whose order is the lane's order.

    ``prepare`` is host work that may raise before anything of the job is enqueued (it
    may queue one-time setup on the strategy's own streams, such as the staged ring's page
    table, which the calls of every later job are behind); its driver calls are made at
    once, also on the native path, where ``enqueue``'s are recorded and run together after;
    ``enqueue`` waits on the dependency, records ``start`` and ``stop`` (timing events) on
    the device around the copies, and leaves the main stream behind every copy it issued;
    ``stop``, recorded last on the main stream, is also the job's completion event.

    ``hold_gil`` is passed to the driver's batched copies: True keeps the GIL through every
    one of them (a lane's issuer thread, docs/performance.md "Issue thread"); None lets the
    driver decide by batch size.
    """

    name = "base"
    main_stream: Any
    ctx: CopyContext
    # Jobs that went as pitched (2D) copies, and through a staging ring (``LaneStatistics``).
    pitched_jobs: int = 0
    staged_jobs: int = 0

    def prepare(self, plan: CopyPlan) -> Any:
        raise NotImplementedError

    def enqueue(self, prepared: Any, dependency: Any, start: Any, stop: Any, *,
                hold_gil: bool | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Destroy the strategy's streams (the lane guarantees nothing is in flight)."""

    def abandon(self) -> None:
        """The worker was dropped unclosed, copies may be in flight: keep alive what they
        may still read or write that would otherwise be freed (nothing, by default)."""


def byte_splits(sizes: np.ndarray, parts: int) -> list[int]:
    """Boundaries that cut ``sizes`` into ``parts`` contiguous slices of about equal bytes."""
    n = int(sizes.shape[0])
    parts = max(1, min(parts, n))
    if parts == 1:
        return [0, n]
    if sizes[0] == sizes[-1] and (sizes == sizes[0]).all():
        return [n * i // parts for i in range(parts + 1)]  # equal copies: equal counts
    cum = np.cumsum(sizes, dtype=np.int64)
    targets = int(cum[-1]) * np.arange(1, parts, dtype=np.int64) // parts
    cuts = (np.searchsorted(cum, targets, side="left") + 1).tolist()
    return sorted({0, n, *(min(c, n) for c in cuts)})


def copy_unit(plan: CopyPlan, *extra: int) -> int:
    """The largest byte count dividing every copy's size and offsets (and ``extra``)."""
    g = 0
    for arr in (plan.nbytes, plan.device_offset, plan.host_offset):
        if arr.size:
            g = math.gcd(g, int(np.gcd.reduce(arr)))
    for x in extra:
        g = math.gcd(g, int(x))
    return g or 1


def expand_rows(offsets: np.ndarray, counts: np.ndarray, unit: int) -> np.ndarray:
    """Row indices (in ``unit``-byte rows) of every unit that copies starting at ``offsets`` cover."""
    total = int(counts.sum())
    starts = np.repeat(offsets // unit, counts)
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    return starts + (np.arange(total, dtype=np.int64) - firsts)
