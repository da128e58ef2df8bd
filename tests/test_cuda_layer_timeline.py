"""A measured layerwise load's timeline (``CudaLayerRun.timeline``) against the fake driver:
it gives no copy end for a layer whose copies were never enqueued, and a timeline asked
for on another thread just as the job ends is not fixed with no copy ends at all."""

from __future__ import annotations

from typing import Any

import pytest

from aiokv.backends.base import StallMeter
from aiokv.backends.cuda import layer_copies as copies_mod
from aiokv.specs import Direction

from .test_cuda_layers import CONSUMER, LAYERS, LogDriver, kv_plan, layer_events, make_lane, native_only

# The fake driver is served through the native helper's table on both paths.
pytestmark = native_only


def gated(run: Any, drv: LogDriver, layers: range) -> None:
    """Gate ``layers`` on the consumer stream and let every mark made so far run."""
    meter = StallMeter()
    for layer in layers:
        run.gate(layer, CONSUMER, meter)
    drv.done.update(c[1] for c in drv.calls if c[0] == "record" and c[2] == CONSUMER)


def test_a_load_that_failed_part_way_has_no_copy_end_for_the_layers_never_enqueued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 2's copies fail on the issuer thread: layers 2 and 3 never ran, and their
    pooled events hold another job's times (or none). The timeline must not read them."""
    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    drv = LogDriver()
    drv.fail_batch = 3
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, measure=True)
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
        assert lane.issuer is not None and lane.issuer.drain(10)
        events = layer_events(run)
        drv.at.update({run._held.origin: 0.0, events[0]: 1e-3, events[1]: 2e-3})
        gated(run, drv, range(2))
        drv.done.update((*events[:2], run.completion._events.stop))
        assert run.completion.wait(10) and run.completion.error is not None
        tl = run.timeline()
        assert tl is not None
        assert tl.copy_done[:2] == pytest.approx((1e-3, 2e-3))
        assert tl.copy_done[2:] == (None, None), "a copy end read from events never recorded by this job"
        assert tl.last_copy_done is None
    finally:
        lane.close()


def test_a_timeline_asked_for_as_the_job_ends_still_has_its_copy_ends() -> None:
    """Another thread asks for the timeline after the job's end was seen but before its
    layer events were handed over to be read: it gets None then, and the full timeline
    after, never one fixed without copy ends."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, measure=True)
    run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    events = layer_events(run)
    drv.at[run._held.origin] = 0.0
    drv.at.update({ev: 1e-3 * (i + 1) for i, ev in enumerate(events)})
    gated(run, drv, range(LAYERS))
    early: list[Any] = []
    ended = run._ended

    def racing(landed: bool, timed: bool = False) -> None:
        early.append(run.timeline())  # the other thread, in between
        ended(landed, timed)

    run._ended = racing
    drv.done.update((*events, run.completion._events.stop))
    assert run.completion.wait(10)
    assert early == [None] or early[0].copy_done == pytest.approx((1e-3, 2e-3, 3e-3, 4e-3))
    tl = run.timeline()
    assert tl is not None and tl.copy_done == pytest.approx((1e-3, 2e-3, 3e-3, 4e-3))
    lane.close()
