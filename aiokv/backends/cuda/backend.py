"""The CUDA backend: a ``cudaHostRegister``'d host pool and one lane per direction, each on
dedicated streams, with the copy strategy ``WorkerOptions.strategy`` picks."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ...errors import AiokvError, InvalidSpec, WorkerBroken
from ...host_layout import HostLayout
from ...layout import CanonicalKVCaches
from ...options import WorkerOptions
from ...specs import Direction
from ..base import Backend, HostPool, Lane
from . import native
from .dma import DmaCopy
from .driver import Driver
from .host_pool import PinnedHostPool
from .kernel import KernelCopy
from .lane import CudaLane, Dependency
from .program import Recorder
from .staged import StagedCopy
from .strategy import CopyContext, CopyStrategy

__all__ = ["CudaBackend", "make_strategy"]

_log = logging.getLogger("aiokv")

# torch's raw-handle lookup (what its compiler uses) costs a few microseconds, where
# ``torch.cuda.current_stream(index)`` costs tens, a large share of a small job's submit.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    """The calling thread's current torch stream on device ``index``, as a raw handle."""
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)



class CudaBackend(Backend):
    """Copies between CUDA KV tensors and a ``cudaHostRegister``'d host pool."""

    name = "cuda"

    def __init__(self, kv: CanonicalKVCaches, options: Any = None) -> None:
        self.options = WorkerOptions.coerce(options)
        devices = {t.tensor.device for t in kv.tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise InvalidSpec(
                f"the CUDA backend needs every KV tensor on one CUDA device; got {sorted(map(str, devices))}"
            )
        dev = next(iter(devices))
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        torch.cuda.init()  # WorkerOptions checked the options already
        self.driver = Driver(self.torch_device.index)
        self._lanes: list[CudaLane] = []
        self._capture_stream: Any = None  # where a caller's event is waited on (see capture)
        # The native helper's driver table (None: every driver call is made from Python).
        self.native_table: Any = None
        self.native_why = ""
        self.plans_ids = False
        try:
            self._open_native()
        except BaseException:
            self.driver.close()
            raise

    def _open_native(self) -> None:
        wanted = self.options.native
        usable, why = native.status(wanted)
        if usable:
            try:
                self.native_table = native.helper().Table(*self.driver.native_procs())
            except Exception as exc:  # e.g. a driver without an entry point the helper takes
                usable, why = False, f"the native helper refused this driver ({exc})"
        self.native_why = why
        if wanted and not usable:
            raise InvalidSpec(f"WorkerOptions(native=True), but {why}; install with a C compiler "
                              "(pip reinstalls build it), or leave native at None")
        if not usable and wanted is None and native.env_choice():
            _log.warning("aiokv: %s=%s asks for the native helper, but %s: CUDA jobs are issued from "
                         "Python", native.ENV, os.environ.get(native.ENV), why)
        elif not usable:
            _log.debug("aiokv: CUDA jobs are issued from Python (%s)", why)

    def check_caches(self, kv: CanonicalKVCaches) -> None:
        for i, t in enumerate(kv.tensors):
            if t.tensor.device != self.torch_device:
                raise InvalidSpec(f"tensors[{i}] is on {t.tensor.device}, expected {self.torch_device}")

    def allocate_pool(self, nbytes: int, file: str | None = None) -> HostPool:
        return PinnedHostPool(nbytes, self.driver, file)

    def capture(self, after: Any) -> Any:
        """Record (or take) the event a copy waits on, on the submitting thread."""
        drv = self.driver
        drv.ensure_context()
        drv.check_usable()
        what = self._waitable(after)
        if what is None:
            return None
        kind, handle = what
        # Recorded by the lane on this thread as it launches the job (on the native path,
        # as the first rows of the job's one call): see ``Dependency``.
        if kind == "event":
            # The caller may record its event again before the copy's stream waits on it
            # (long jobs are enqueued later, by the lane's issuer thread): wait on its
            # record at submit, from a side stream, and hand the copy an event of ours.
            if self._capture_stream is None:
                self._capture_stream = drv.create_stream()
            return Dependency(drv.take_sync_event(), self._capture_stream, drv.wrap_event(handle))
        return Dependency(drv.take_sync_event(), handle)

    def check_after(self, after: Any) -> None:
        if after is not None:
            self._waitable(after)

    def consumer(self, stream: Any) -> int:
        """The stream a layer gate makes wait: ``stream`` as ``after=`` takes one (a
        ``torch.cuda.Stream``, ``__cuda_stream__``, a raw handle), None for the calling
        thread's current stream. An event is refused: a gate makes a stream wait."""
        if isinstance(stream, torch.cuda.Event):
            raise InvalidSpec("a gate makes a stream wait: pass the consumer's stream (or None for the "
                              "current one), not an event")
        return (self._waitable(stream) or ("stream", 0))[1]

    def _waitable(self, after: Any) -> tuple[str, int] | None:
        """What ``after`` asks a copy to wait for, without touching the device: a stream to
        record on, an event to wait on (``("stream" | "event", handle)``), or None."""
        if after is None:
            return "stream", _current_stream(self.torch_device.index)
        if isinstance(after, torch.cuda.Event):
            handle = int(after.cuda_event) if getattr(after, "cuda_event", 0) else 0
            # Never recorded: nothing to wait for (torch does the same).
            return ("event", handle) if handle else None
        if isinstance(after, torch.cuda.Stream):
            return "stream", int(after.cuda_stream)
        proto = getattr(after, "__cuda_stream__", None)
        if proto is not None:
            value = proto() if callable(proto) else proto
            try:
                handle = int(value[1]) if isinstance(value, tuple) else int(value)
            except (TypeError, ValueError, IndexError) as exc:
                raise InvalidSpec(f"after.__cuda_stream__ returned {value!r}, not (version, handle)") from exc
            return "stream", handle
        if isinstance(after, int) and not isinstance(after, bool):
            if after < 0:
                raise InvalidSpec(f"after= stream handle must be >= 0, got {after}")
            return "stream", after
        raise InvalidSpec(
            f"after= must be None, a torch.cuda.Event, a torch.cuda.Stream, an object with "
            f"__cuda_stream__ or a raw stream handle (int); got {type(after).__name__}"
        )

    def open_lane(
        self, direction: Direction, kv: CanonicalKVCaches, layout: HostLayout, pool: HostPool
    ) -> Lane:
        self.driver.ensure_context()
        table = self.native_table
        # The torch index ops of ``kernel`` go on the stream as they are called, so that
        # strategy's own driver calls cannot wait to be issued together: it stays on Python.
        recorder = None
        if table is not None and self.options.strategy != "kernel":
            recorder = Recorder(self.driver, table, 0, 0, self.driver.fail)
        ctx = CopyContext(
            driver=recorder if recorder is not None else self.driver,  # type: ignore[arg-type]
            direction=direction,
            kv=kv,
            layout=layout,
            pool=pool,
            device=self.torch_device,
            streams=self.options.streams_per_direction,
            # One native call per job: its batches go in it rather than to submit threads.
            submit_threads=0 if recorder is not None else self.options.submit_threads,
            staging_bytes=self.options.staging_bytes,
        )
        lane = CudaLane(self.driver, direction, make_strategy(self.options.strategy, ctx),
                        issue_thread=self.options.issue_thread, recorder=recorder, table=table,
                        measure_stalls=self.options.layer_stalls)
        self._lanes.append(lane)
        # The core hands a lane with a planner the job's ids to plan in C (``plan.IdPlan``).
        self.plans_ids = self.plans_ids or lane.planner is not None
        return lane

    def close(self) -> None:
        if self._capture_stream is not None:
            self.driver.destroy_stream(self._capture_stream)
        self.driver.close()


def make_strategy(name: str, ctx: CopyContext) -> CopyStrategy:
    """Build the named strategy for one lane (``auto`` resolves here)."""
    if name == "auto":
        # Staged where the piece kernel loads and staging is allowed: under GEMM load, small
        # pages move near the ceiling that way where one DMA per page loses a third of it
        # (docs/performance.md, "Copy strategies"); jobs of large pieces still go straight
        # to DMA there.
        if ctx.staging_bytes > 0:
            try:
                return StagedCopy(ctx, only_where_it_gains=True)
            except AiokvError as exc:  # e.g. the driver cannot compile the kernel for this GPU
                if isinstance(exc, WorkerBroken):
                    raise
                _log.warning("staged copies unavailable (%s); using dma", exc)
        name = "dma"
    if name == "dma":
        return DmaCopy(ctx)
    if name == "kernel":
        return KernelCopy(ctx)
    if name == "staged":
        if ctx.staging_bytes <= 0:
            raise InvalidSpec("strategy='staged' needs staging_bytes > 0")

        return StagedCopy(ctx)
    raise InvalidSpec(f"unknown strategy {name!r}")
