"""How a layerwise job's copies go on a CUDA lane: the few operations each layer takes, and
how many layers a load's submit enqueues itself before the lane's issuer thread takes over.

A layer's copies fold into pitched runs straight to the pages where the driver has 2-D
batches, or go through the lane's device slot where the blocks scatter (``layer_ops``,
``layer_staging``; docs/layerwise.md, "Few descriptors a layer"). On the Python path the
submit enqueues the first layers itself so the forward never waits on a thread hand-off
for layer 0 (``head_layers``; docs/layerwise.md, "Loads"); on the native path the whole
load is one program for the lane's issuer thread, which takes no GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ...layer_plan import LayerPlan
from ...specs import Direction
from .driver import Driver
from .issuer import Issuer
from .layer_ops import US_PER_CALL, IdFolder, LayerOps, fold_layers, may_stage, prefer_staged, worth_staging
from .layer_staging import LayerStaging, TorchSlot
from .pieces import PieceKernel
from .program import Recorder
from .strategy import CopyContext

__all__ = ["INLINE_COVER_GBPS", "INLINE_COVER_S", "INLINE_ISSUE_US", "INLINE_MAX_US", "Dependency",
           "LayerLane", "head_layers", "layer_bytes", "layer_ops"]

# A load's submit enqueues its first layers itself, the rest go from the lane's issuer
# thread. It always spends this much estimated driver time (host microseconds), and at least
# layer 0, so the forward pass never waits on a thread hand-off for its first layer; and it
# goes on, up to INLINE_MAX_US, until the layers enqueued keep the copy engine busy for
# INLINE_COVER_S at INLINE_COVER_GBPS: the issuer thread must take the GIL from the forward
# pass's thread first, which can take a switch interval (docs/layerwise.md, "Loads").
INLINE_ISSUE_US = 100.0
INLINE_MAX_US = 400.0
INLINE_COVER_S = 5e-3
INLINE_COVER_GBPS = 50.0

# A captured dependency (``lane.Dependency``: ``event``, ``pending``, ``resolve(driver)``).
Dependency = Any


class LayerLane(Protocol):
    """What a layerwise run uses of its lane (``lane.CudaLane``)."""

    direction: Direction
    stream: Any
    bell_stream: Any
    waiter: Any
    measure_stalls: bool
    last_started_at: float | None
    last_ticket: Any  # the native issuer's latest program of the lane
    layer_staging: Any  # a ``LayerStaging``, made on first use by ``layer_ops``
    layer_folder: Any  # an ``IdFolder``, made on first use by ``layer_ops``
    native: Any  # the lane's ``NativeIssuer`` (None: the Python path)

    @property
    def driver(self) -> Driver: ...
    @property
    def recorder(self) -> Recorder | None: ...
    @property
    def issuer(self) -> Issuer | None: ...
    @property
    def context(self) -> CopyContext: ...
    def layer_issuer(self) -> Issuer: ...


def layer_ops(lane: LayerLane, plan: LayerPlan) -> LayerOps:
    """The plan's copies in the lane's direction: folded into pitched runs straight to the
    pages where the driver has 2-D batches (``layer_ops.fold_layers``), or through the
    lane's device slot where those would be many (``layer_staging``, ``prefer_staged``)."""
    ctx = lane.context
    drv = ctx.driver
    pitched = bool(getattr(drv, "pitched_copies", False))
    max_pitch = int(getattr(drv, "max_pitch", 0)) if pitched else 0
    folder = lane.layer_folder
    if folder is None:  # the layout's tables, once per lane
        folder = lane.layer_folder = IdFolder(plan.layout, plan.layer_map, ctx.device_base, ctx.host_base,
                                              to_host=ctx.to_host, max_pitch=max_pitch)
    if folder.usable:
        ops = folder.fold(plan.mapping)
    else:  # several blocks a chunk, or no 2-D copies: from the page columns
        ops = fold_layers(plan, plan.bounds, ctx.device_base, ctx.host_base, to_host=ctx.to_host,
                          max_pitch=max_pitch)
    if not pitched:
        return ops
    ops = ops.with_packed(drv.pitched_ops)
    if not may_stage(ops):  # no layer's enqueue is long enough to matter: no bytes to count
        return ops
    nbytes = plan.layer_bytes()
    staging = _staging(lane, plan) if worth_staging(ops, nbytes) else None
    if staging is not None:
        staged = staging.plan(plan, lane.stream, drv.pitched_ops, ctx.to_host)
        if staged is not None and prefer_staged(ops, staged, nbytes):
            return ops.with_staged(staged)
    return ops


def _staging(lane: LayerLane, plan: LayerPlan) -> LayerStaging | None:
    """The lane's device slot for staged layers, made on first use (None: no staging)."""
    staging = lane.layer_staging
    if staging is None:
        ctx = lane.context
        slot = int(getattr(ctx, "staging_bytes", 0)) // 2
        if slot <= 0:
            return None
        kernel: list[Any] = []

        def make_kernel() -> Any:
            # On the driver itself: the table's upload runs on the submitting thread, while
            # the issuer thread may hold the lane's recorder; launches go through the
            # recorder as the layer is enqueued (``LayerStaging.emit``).
            kernel.append(PieceKernel(lane.driver, ctx.device))
            return kernel[0]

        staging = lane.layer_staging = LayerStaging(
            ctx.layout, plan.layer_map, ctx.device_base, ctx.host_base, slot, make_kernel,
            TorchSlot(ctx.device, lambda stream: kernel[0].torch_stream(stream)))
    return staging if staging.shape is not None else None


def head_layers(ops: LayerOps, layer_bytes: Sequence[int]) -> int:
    """How many layers, from layer 0, a load's submit enqueues itself (see
    ``INLINE_ISSUE_US``): at least one."""
    spent = 2 * US_PER_CALL  # the job's start, and the wait on its dependency
    covered = 0.0  # seconds of copies enqueued so far, at INLINE_COVER_GBPS
    for layer, cost in enumerate(ops.costs_us().tolist()):
        spent += cost
        if spent > INLINE_ISSUE_US and (spent > INLINE_MAX_US or covered >= INLINE_COVER_S):
            return max(1, layer)
        covered += layer_bytes[layer] / (INLINE_COVER_GBPS * 1e9)
    return ops.num_layers


def layer_bytes(plan: LayerPlan) -> list[int]:
    """Bytes each layer of the plan moves."""
    return plan.layer_bytes().tolist()
