"""A layerwise load whose enqueue goes from the lane's issuer thread (``CudaLayerRun``):
each layer is marked enqueued as soon as its record is (on the native path, as the
ticket's rows pass it), so a gate on an early layer never waits for the job's later
layers to be handed to the device."""

from __future__ import annotations

import threading
import time

import pytest

from aiokv.backends.base import StallMeter
from aiokv.backends.cuda import layer_copies as copies_mod
from aiokv.errors import WorkerClosed
from aiokv.specs import Direction

from .test_cuda_lane import hold
from .test_cuda_layers import (
    CONSUMER,
    LAYERS,
    LogDriver,
    issued,
    kv_plan,
    layer_events,
    main_records,
    make_lane,
    native_only,
)

# The fake driver is served through the native helper's table on both paths.
pytestmark = native_only


def until(check: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("recorded", [pytest.param(True, marks=native_only), False])
def test_a_load_queued_behind_other_work_marks_each_layer_as_it_is_enqueued(
        recorded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issuer is busy when the load is submitted, so all of it goes from the issuer
    thread. Layer 2's copies then take long in the driver: layers 0 and 1 are marked
    before that, and a gate on layer 0 goes through, waiting on layer 0's event alone.
    (Several loads submitted in one engine step: every one after the first is such a load,
    and on a driver without 2-D batches a layer is thousands of descriptors.)"""
    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=recorded, issue_thread=True)
    if recorded:
        fake.hold["cuMemcpyBatchAsync"] = (3, drv.release)
    else:
        drv.hold_batch = 3
    busy = hold(lane)
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
        assert not run.enqueued(0)
        busy.set()
        assert until(lambda: run.enqueued(1)), "layers 0 and 1 unmarked while layer 2 is enqueued"
        assert not run.enqueued(2)
        result: list[bool] = []
        consumer = threading.Thread(target=lambda: result.append(run.gate(0, CONSUMER, StallMeter())))
        consumer.start()
        consumer.join(5)
        assert result == [True], "a gate on layer 0 waited for the job's later layers"
        assert ("wait", CONSUMER, layer_events(run)[0]) in drv.calls
        drv.release.set()
        if recorded:
            issued(lane)
        else:
            assert lane.issuer is not None and lane.issuer.drain(10)
        assert all(run.enqueued(i) for i in range(LAYERS))
        records = main_records(lane, drv, fake)
        job = run.completion._events
        assert records[-1] == job.stop and records.index(job.start) < records.index(layer_events(run)[0])
    finally:
        busy.set()
        drv.release.set()
        lane.close()


@pytest.mark.parametrize("recorded", [pytest.param(True, marks=native_only), False])
def test_abandoning_a_load_ends_the_gates_and_waits_on_layers_not_issued(
        recorded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker closed with the load still being issued (its issuer held inside layer 1's
    copy call, as a driver call stuck behind a hung device would be): a gate and a wait on
    layer 3, blocked until its record is issued, end at once, failed, on either path (the
    native one blocks in ``wait_rows``, which the abandon cannot signal)."""
    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=recorded, issue_thread=not recorded)
    if recorded:
        fake.hold["cuMemcpyBatchAsync"] = (2, drv.release)
    else:
        drv.hold_batch = 2
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
        assert until(lambda: run.enqueued(0)) and not run.enqueued(1)
        gated: list[bool] = []
        waited: list[bool] = []
        gate = threading.Thread(target=lambda: gated.append(run.gate(3, CONSUMER, StallMeter())))
        wait = threading.Thread(target=lambda: waited.append(run.wait(3)))
        gate.start()
        wait.start()
        gate.join(0.1)
        assert gate.is_alive() and wait.is_alive()
        run.abandon(WorkerClosed("closed with the load in flight"))
        gate.join(5)
        wait.join(5)
        assert not gate.is_alive() and not wait.is_alive(), "abandoning the load left a waiter blocked"
        assert gated == [False] and waited == [False]
        assert not run.enqueued(3) and ("wait", CONSUMER, layer_events(run)[3]) not in drv.calls
    finally:
        drv.release.set()
        lane.close()
