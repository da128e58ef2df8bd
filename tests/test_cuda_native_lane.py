"""A CUDA lane on the native path, on a fake driver (no GPU): the caller records the
dependency and the job's program, the lane's issuer thread makes the calls; bad rows raise
at submit with everything given back; a failure part way fails the job once its end is
recorded behind what was enqueued; and doorbells are rung by the waiter thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from aiokv.backends.cuda import native
from aiokv.backends.cuda.lane import CudaLane, Dependency
from aiokv.doorbell import Doorbell
from aiokv.errors import CudaCallFailed, InvalidSpec
from aiokv.specs import Direction

from .native_fakes import FakeTable
from .test_cuda_lane import LONG, FakeDriver, FakeStrategy, hold, plan

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")


def make_native_lane() -> tuple[CudaLane, FakeDriver, Any, Any]:
    driver = FakeDriver()
    fake = FakeTable(target=driver)
    rec = fake.recorder(driver, 0, 0)
    strategy = FakeStrategy(rec)  # type: ignore[arg-type]
    strategy.main_stream = 0x40
    lane = CudaLane(driver, Direction.STORE, strategy, recorder=rec, table=fake.table)  # type: ignore[arg-type]
    return lane, driver, fake, rec


def test_the_dependency_is_recorded_at_submit_and_the_program_runs_on_the_issuer() -> None:
    """The caller's stream records the dependency on the caller's thread, at submit (the
    caller may go on to enqueue more work there at once); the job's own calls wait for the
    issuer thread."""
    lane, driver, fake, rec = make_native_lane()
    gate = hold(lane)
    try:
        c = lane.launch(plan(1024), Dependency(0xD1, stream=0x5))  # not recorded yet
        events = c._events
        assert events is not None
        assert 0xD1 in driver.recorded and fake.calls == [], "a call of the job was made at submit"
        assert not c.query()
        gate.set()
        assert c.wait(10) and c.error is None
        assert fake.calls == [("cuEventRecord", events.start, 0x40), ("cuEventRecord", events.stop, 0x40)]
        assert rec.calls == 1 and driver.given_sync == [0xD1]
        assert threading.current_thread().name not in {c[0] for c in fake.threads}
    finally:
        gate.set()
        lane.close()


def test_a_program_refused_as_bad_input_raises_at_submit_and_gives_everything_back() -> None:
    lane, driver, fake, _ = make_native_lane()
    orig = lane._strategy.enqueue

    def null_event(prepared: Any, dependency: Any, start: Any, stop: Any, **kw: Any) -> None:
        orig(prepared, dependency, 0, stop, **kw)  # a null event: the helper refuses it

    lane._strategy.enqueue = null_event  # type: ignore[method-assign]
    with pytest.raises(InvalidSpec, match="null event"):
        lane.launch(plan(1024), Dependency(0xD1, stream=0x5))
    assert fake.calls == [] and len(driver.given_jobs) == 1 and driver.given_sync == [0xD1]
    lane.close()


@pytest.mark.parametrize("how", ["driver", "strategy"])
@pytest.mark.parametrize("size", [1024, LONG])
def test_a_native_job_that_fails_part_way_fails_once_its_end_is_recorded(how: str, size: int) -> None:
    """A driver call failing on the issuer thread, or the strategy raising while it was
    recorded (what it recorded is enqueued, as the Python path would have): the job is
    failed, not raised, and its end is recorded on the main stream behind that part."""
    lane, driver, fake, _ = make_native_lane()
    if how == "driver":
        fake.fail["cuEventRecord"] = (2, 2)  # the stop record
    else:
        lane._strategy.fail_enqueue = RuntimeError("strategy broke")
    c = lane.launch(plan(size), None)
    events = c._events
    assert events is not None
    assert c.wait(10) and c.error is not None
    assert isinstance(c.error, CudaCallFailed if how == "driver" else RuntimeError)
    assert ("cuEventRecord", events.start, 0x40) in fake.calls
    assert events.stop in driver.recorded, "the failed job's end was not recorded behind it"
    lane.close()


def test_a_native_lanes_doorbells_are_rung_by_its_waiter_thread() -> None:
    lane, driver, _, _ = make_native_lane()
    bell = Doorbell()
    try:
        c = lane.launch(plan(1024), None)
        assert c.ring_when_done(bell) is True
        assert driver.armed == [], "the host-function ring was used instead of the waiter"
        deadline = time.monotonic() + 10
        while not bell.drain():
            assert time.monotonic() < deadline, "the waiter never rang"
            time.sleep(0.001)
        assert lane.waiter is not None and lane.waiter.stats()["rung"] == 1
    finally:
        lane.close()
        bell.close()
    assert lane.waiter.stats()["running"] is False


def test_a_layerwise_load_on_a_busy_issuer_never_waits_on_the_submitting_thread() -> None:
    """A layerwise load is one program handed to the native issuer. Submitted while that
    issuer cannot take it at once (held here), the submit must not wait for it on the
    submitting thread, an event loop: it returns, and the layers are issued once the native
    issuer goes on. A watchdog lets the issuer go after a while, so a submit that waits
    fails this test instead of hanging it."""
    from .test_cuda_layers import LAYERS, LogDriver, kv_plan
    from .test_cuda_layers import make_lane as make_layer_lane

    drv = LogDriver()
    lane, fake = make_layer_lane(Direction.LOAD, drv, recorded=True)
    assert lane.native is not None
    lane.native.pause()
    resumed = threading.Event()

    def watchdog_resume() -> None:
        resumed.set()
        assert lane.native is not None
        lane.native.resume()

    watchdog = threading.Timer(5.0, watchdog_resume)
    watchdog.start()
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
        assert not resumed.is_set(), "the submit waited for the native issuer to go on"
        assert not run.enqueued(0) and fake.calls == []
        watchdog.cancel()
        lane.native.resume()
        deadline = time.monotonic() + 10
        while not all(run.enqueued(i) for i in range(LAYERS)):
            assert time.monotonic() < deadline, "the load was never issued once the issuer went on"
            time.sleep(0.001)
        records = [c[1] for c in fake.calls if c[0] == "cuEventRecord"]
        assert records[-1] == run.completion._events.stop and set(run._events) <= set(records)
    finally:
        watchdog.cancel()
        lane.native.resume()
        lane.close()
