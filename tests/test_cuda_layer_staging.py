"""The lane's device slot for layerwise jobs whose blocks scatter (``layer_staging``), on the
simulated device: the memory a job was planned with stays allocated while any of its
layers is still to be enqueued, and the lane lets the slot go at close (never at abandon,
where copies may still use it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiokv.backends.cuda import layer_copies as copies_mod
from aiokv.backends.cuda import layer_ops as layer_ops_mod
from aiokv.backends.cuda.lane import CudaLane
from aiokv.backends.cuda.layer_staging import LayerStaging
from aiokv.backends.cuda.pieces import PieceKernel
from aiokv.specs import Direction

from .sim_device import launch_values, pitched_rows
from .test_cuda_lane import hold
from .test_cuda_layers import (
    KV_LAYOUT,
    KV_MAP,
    LAYERS,
    PAGE,
    PitchedSimDriver,
    kv_plan,
    make_lane,
    native_only,
)

pytestmark = native_only

DEVICE = [(1 << 20) + i * 16 * (PAGE // 2) for i in range(2 * LAYERS)]
POOL, SLOTS_AT, TABLE_AT = 4 << 20, 6 << 20, 7 << 20


class Slots:
    """Device memory for the slot as ``TorchSlot`` hands it out: each call a new block,
    the one before let go (torch's caching allocator may then give it to another
    allocation, or free it); ``release`` lets the last one go."""

    def __init__(self) -> None:
        self.live: tuple[int, int] | None = None
        self.released: list[tuple[int, int]] = []
        self.calls = 0

    def __call__(self, nbytes: int, stream: Any) -> int:
        if self.live is not None:
            self.released.append(self.live)
        at = SLOTS_AT + self.calls * (64 << 10)
        self.calls += 1
        self.live = (at, at + nbytes)
        return at

    def release(self) -> None:
        if self.live is not None:
            self.released.append(self.live)
        self.live = None

    def stale(self, address: int) -> bool:
        """Whether ``address`` lies in memory let go and not handed out again."""
        live = self.live is not None and self.live[0] <= address < self.live[1]
        return not live and any(lo <= address < hi for lo, hi in self.released)


class GuardedSim(PitchedSimDriver):
    """The simulated device, noting every copy or kernel launch enqueued on slot memory
    that was let go (``Slots.stale``) at the time of the call."""

    def __init__(self, mem: np.ndarray, slots: Slots) -> None:
        super().__init__(mem)
        self.slots = slots
        self.stale: list[int] = []

    def memcpy_pitched(self, ops: np.ndarray, stream: int, **kw: Any) -> None:
        for dst, src, _ in pitched_rows(np.asarray(ops, dtype=np.uint64)):
            self.stale += [a for a in (dst, src) if self.slots.stale(a)]
        super().memcpy_pitched(ops, stream, **kw)

    def launch(self, function: Any, grid: tuple[int, int, int], block: int, stream: int,
               params: Any, packed: Any = None) -> None:
        values, _ = launch_values(params)
        if self.slots.stale(values[1]):  # the image the kernel scatters from (or gathers into)
            self.stale.append(values[1])
        super().launch(function, grid, block, stream, params, packed)


def staged(mem: np.ndarray, slots: Slots, *, issue_thread: bool) -> tuple[CudaLane, GuardedSim]:
    """A load lane on the guarded device whose every layerwise job goes through the slot."""
    sim = GuardedSim(mem, slots)
    lane, _ = make_lane(Direction.LOAD, sim, recorded=False, issue_thread=issue_thread, bases=(DEVICE, POOL))
    lane.stream = lane._strategy.main_stream = sim.create_stream()
    ctx = lane.context

    def make_kernel() -> PieceKernel:
        kernel = PieceKernel(ctx.driver, None)  # type: ignore[arg-type]

        def upload(pages: np.ndarray, stream: Any, keep: bool = False) -> int:
            raw = np.ascontiguousarray(pages, dtype=np.uint64).view(np.uint8).reshape(-1)
            mem[TABLE_AT : TABLE_AT + raw.size] = raw
            return TABLE_AT

        kernel.upload = upload  # type: ignore[method-assign]
        return kernel

    lane.layer_staging = LayerStaging(KV_LAYOUT, KV_MAP, ctx.device_base, ctx.host_base, 16 * PAGE,
                                      make_kernel, slots)
    return lane, sim


@pytest.fixture
def through_the_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_ops_mod, "STAGE_ABOVE_COPY", 0.0)
    monkeypatch.setattr(layer_ops_mod, "STAGE_ABOVE_US", 0.0)
    monkeypatch.setattr(copies_mod, "prefer_staged", lambda direct, staged, nbytes: True)


@pytest.mark.usefixtures("through_the_slot")
def test_a_slot_is_never_let_go_while_queued_layers_still_use_it() -> None:
    """A small load through the slot waits on the issuer thread behind earlier work; a
    larger one is planned meanwhile. The memory the first was planned with must still be
    allocated when its layers are enqueued: let go, torch may hand it to another tensor or
    give it back to the driver (``empty_cache``), and the copies land in someone else's
    memory or fault."""
    mem = np.zeros(8 << 20, dtype=np.uint8)
    slots = Slots()
    lane, sim = staged(mem, slots, issue_thread=True)
    gate = hold(lane)
    try:
        small = lane.launch_layers(kv_plan(False, [2, 7], [5, 1])[0], None)
        assert small._ops.staged is not None and not small.enqueued(0)  # type: ignore[attr-defined]
        large = lane.launch_layers(kv_plan(False, [3, 9, 12, 0, 4, 6], [0, 2, 3, 4, 6, 8])[0], None)
        assert large._ops.staged is not None  # type: ignore[attr-defined]
    finally:
        gate.set()
    assert lane.issuer is not None and lane.issuer.drain(10)
    assert all(small.enqueued(i) and large.enqueued(i) for i in range(LAYERS))
    assert sim.stale == [], "layers were enqueued on a slot let go after they were planned"
    lane.close()


@pytest.mark.usefixtures("through_the_slot")
@pytest.mark.parametrize("ending", ["close", "abandon"])
def test_a_lane_lets_its_slot_go_at_close_and_keeps_it_when_abandoned(ending: str) -> None:
    mem = np.zeros(8 << 20, dtype=np.uint8)
    slots = Slots()
    lane, _ = staged(mem, slots, issue_thread=False)
    run = lane.launch_layers(kv_plan(False, [2, 7, 3], [5, 1, 8])[0], None)
    assert run._ops.staged is not None and slots.live is not None  # type: ignore[attr-defined]
    if ending == "close":
        lane.close()
        assert slots.live is None, "a closed lane still holds its layer slot"
        assert lane.layer_staging.slot is None and lane.layer_staging.kernel is None
    else:
        lane.abandon()  # copies may still run: the slot stays
        assert slots.live is not None and slots.released == []
