"""The CUDA lane's issue logic on a fake driver (no GPU): a job the issuer thread has not
enqueued is never reported done, doorbells asked for meanwhile are armed once it is, and
every failure path either raises at submit with the job's pooled events given back or
fails the job, never both and never neither. Those tests run on both submit paths (the
strategy's calls made from Python, with a Python issuer thread for long jobs, or recorded
as a program the lane's native issuer thread runs: there every job but a tiny one on an
idle lane goes to the thread)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from aiokv.backends.cuda.completion import CudaCompletion
from aiokv.backends.cuda.driver import JobEvents
from aiokv.backends.cuda.lane import ISSUE_THREAD_BYTES, CudaLane, Dependency
from aiokv.doorbell import Doorbell
from aiokv.errors import WorkerBroken, WorkerClosed
from aiokv.specs import Direction

from .native_fakes import FakeTable, submit_paths


class FakeDriver:
    """Streams and events as plain objects. The fake device runs every copy the moment it
    is enqueued, and, as in CUDA, an event never recorded reads as done: only the lane can
    keep a job that is not enqueued yet from looking finished."""

    def __init__(self, rings: bool = True) -> None:
        self.broken: WorkerBroken | None = None
        self.recorded: set[int] = set()
        self.given_jobs: list[JobEvents] = []
        self.given_sync: list[Any] = []
        self.armed: list[Any] = []
        self.rings = rings
        self.next = 0

    def _handle(self) -> int:
        self.next += 1
        return self.next

    def ensure_context(self) -> None:
        pass

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken

    def create_stream(self, high_priority: bool = False) -> int:
        return self._handle()

    def create_event(self, timing: bool = False, blocking: bool = False) -> int:
        return self._handle()

    def destroy_stream(self, stream: Any) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def take_job_events(self) -> JobEvents:
        return JobEvents(self._handle(), self._handle())

    def give_job_events(self, events: JobEvents) -> None:
        self.given_jobs.append(events)

    def give_sync_event(self, event: Any) -> None:
        self.given_sync.append(event)

    def record(self, event: Any, stream: Any) -> None:
        self.recorded.add(event)

    def stream_wait(self, stream: Any, event: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass

    def elapsed(self, start: Any, stop: Any) -> float:
        return 1e-3

    def can_ring(self) -> bool:
        return self.rings

    def ring_after(self, stream: Any, event: Any, bell: Any) -> bool:
        self.armed.append(event)
        bell.ring()
        return True


class FakeStrategy:
    name = "fake"
    main_stream = 0
    pitched_jobs = 0
    staged_jobs = 0

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.ctx = SimpleNamespace(runs=())
        self.hold_gil: bool | None = None
        self.fail_prepare: BaseException | None = None
        self.fail_enqueue: BaseException | None = None

    def prepare(self, plan: Any) -> Any:
        if self.fail_prepare is not None:
            raise self.fail_prepare
        return plan

    def enqueue(self, prepared: Any, dependency: Any, start: Any, stop: Any, *,
                hold_gil: bool | None = None) -> None:
        self.hold_gil = hold_gil
        self.driver.record(start, self.main_stream)
        if self.fail_enqueue is not None:
            raise self.fail_enqueue
        if getattr(prepared, "total_bytes", 0) >= ISSUE_THREAD_BYTES:
            for _ in range(8):  # a long job: a program too long to run at submit
                self.driver.stream_wait(self.main_stream, start)
        self.driver.record(stop, self.main_stream)

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        self.abandoned = True


class Bell:
    def __init__(self) -> None:
        self.rung = 0

    def ring(self) -> None:
        self.rung += 1


def make_lane(issue_thread: bool = True, rings: bool = True) -> tuple[CudaLane, FakeDriver, FakeStrategy]:
    """A lane on the fake driver, on the submit path of the test (``path``): on the native
    one the strategy's calls are recorded as programs that the lane's issuer thread runs
    through a fake table forwarding to the driver (its waiter thread uses that table too)."""
    driver = FakeDriver(rings)
    fake = FakeTable(target=driver) if PATH == "native" else None
    rec = fake.recorder(driver, 0, 0) if fake is not None else None
    strategy = FakeStrategy(rec if rec is not None else driver)  # type: ignore[arg-type]
    lane = CudaLane(driver, Direction.STORE, strategy, issue_thread=issue_thread,  # type: ignore[arg-type]
                    recorder=rec, table=fake.table if fake is not None else None)
    return lane, driver, strategy


PATH = "python"


@pytest.fixture(autouse=True, params=submit_paths())
def path(request: pytest.FixtureRequest) -> str:
    """The submit path every ``make_lane`` test runs on ("python" or "native")."""
    global PATH
    PATH = request.param
    return PATH


def plan(nbytes: int) -> Any:
    return SimpleNamespace(total_bytes=nbytes)


LONG = 1 << 30  # far above ISSUE_THREAD_BYTES: always deferred


class Resume:
    """A held native issuer's gate: ``set`` lets it go on (a no-op once the lane closed)."""

    def __init__(self, lane: CudaLane) -> None:
        self.lane = lane

    def set(self) -> None:
        try:
            assert self.lane.native is not None
            self.lane.native.resume()
        except WorkerClosed:
            pass


def hold(lane: CudaLane) -> Any:
    """Keep the lane's issuer thread from issuing until the returned gate is set."""
    if lane.native is not None:
        lane.native.pause()
        return Resume(lane)
    gate, held = threading.Event(), threading.Event()

    def work() -> None:
        held.set()
        gate.wait(10)

    assert lane._issuer is not None
    lane._issuer.run(work, defer=True)
    assert held.wait(10)
    return gate


def python_only(test: Any) -> Any:
    """A test of the Python path's issue logic alone (its issuer thread, its GIL choice)."""
    return pytest.mark.parametrize("path", ["python"], indirect=True)(test)


def test_a_job_not_yet_issued_is_not_done_and_its_bell_rings_once_it_is() -> None:
    """The lane-level twin of the GPU suite's ``test_awaited_job_wakes_when_issued_late``: a
    doorbell asked for while the job waits for its issuer rings once the job is issued and
    over, armed by whoever issued it (on the native path, the issuer thread, through the
    lane's waiter: ``armed`` counts its rings)."""
    lane, driver, _ = make_lane()
    gate = hold(lane)
    bell = Doorbell()
    try:
        c = lane.launch(plan(1024), Dependency(0xD0))  # small, but queued behind the held work
        assert isinstance(c, CudaCompletion)
        assert not c.query() and not c.wait(0.02)
        assert c.ring_when_done(bell) is True
        time.sleep(0.02)
        assert bell.drain() == 0 and driver.armed == []
        if lane.waiter is not None:
            assert lane.waiter.stats()["armed"] == 0
        gate.set()
        assert c.wait(10) and c.error is None
        deadline = time.monotonic() + 10
        while not bell.drain():
            assert time.monotonic() < deadline, "the bell asked for before the enqueue never rang"
            time.sleep(0.001)
        if lane.waiter is not None:
            assert lane.waiter.stats()["armed"] == 1 and driver.armed == []
        else:
            assert driver.armed, "the bell asked for before the enqueue was not armed"
        assert driver.given_sync == [0xD0]  # the dependency's event went back once enqueued
    finally:
        gate.set()
        lane.close()
        bell.close()


@python_only
def test_no_bell_is_promised_where_the_driver_cannot_ring() -> None:
    lane, _, _ = make_lane(rings=False)
    gate = hold(lane)
    try:
        c = lane.launch(plan(LONG), None)
        assert c.ring_when_done(Bell()) is False  # the poller must keep polling on a timer
    finally:
        gate.set()
        lane.close()


def test_small_job_on_an_idle_lane_is_enqueued_by_the_caller() -> None:
    lane, _, _ = make_lane()
    c = lane.launch(plan(1024), None)
    assert c.query() and lane.statistics().issued_later == 0
    c2 = lane.launch(plan(LONG), None)
    assert c2.wait(10) and lane.statistics().issued_later == 1
    lane.close()


@python_only
def test_only_the_issuer_thread_keeps_the_gil_through_its_batched_copies() -> None:
    lane, _, strategy = make_lane()
    rec = lane._recorder
    if rec is not None:  # native: the choice goes to the job's one call, not to its batches
        commit = rec.commit

        def spy(hold_gil: bool | None = None) -> None:
            strategy.hold_gil = hold_gil
            commit(hold_gil)

        rec.commit = spy  # type: ignore[method-assign]
    assert lane.launch(plan(1024), None).query()
    assert strategy.hold_gil is None  # the caller's thread: the driver decides by batch size
    assert lane.launch(plan(LONG), None).wait(10)
    assert strategy.hold_gil is True  # the issuer thread keeps it for the whole job
    assert lane.launch(plan(1024), None).query()
    assert strategy.hold_gil is None
    lane.close()


def test_statistics_report_the_strategy_and_the_issuer_threads_work() -> None:
    from aiokv.backends.base import LaneStatistics
    from aiokv.backends.cuda.pitched import PitchedRun

    lane, _, strategy = make_lane()
    strategy.ctx = SimpleNamespace(runs=(PitchedRun(0, (0, 1, 2), 96), PitchedRun(0, (3,), 64),
                                         PitchedRun(0, (4, 5, 6), 96)))
    strategy.pitched_jobs, strategy.staged_jobs = 3, 2
    first = lane.statistics()
    assert first == LaneStatistics(strategy="fake", pitched_jobs=3, pitched_heights=(1, 3), staged_jobs=2)
    lo = time.perf_counter()
    assert lane.launch(plan(1024), None).query()
    assert lane.launch(plan(LONG), None).wait(10)
    stats = lane.statistics()
    assert stats.issued_later == 1 and stats.issue_seconds > 0 and stats.issue_cpu_seconds >= 0
    assert stats.last_started_at is not None and lo <= stats.last_started_at <= time.perf_counter()
    assert first.issued_later == 0  # a snapshot: frozen, never updated in place
    if PATH == "native":  # the thread's own lag, submit return to its first call, per job
        assert len(stats.issue_lags) == 2 and stats.issue_lags[0] == 0.0  # the first ran at submit
        assert 0 < stats.issue_lags[1] < 10
    lane.close()


@pytest.mark.parametrize("issue_thread", [True, False])
def test_a_plan_that_fails_on_the_callers_thread_raises_and_gives_everything_back(issue_thread: bool) -> None:
    lane, driver, strategy = make_lane(issue_thread)
    strategy.fail_prepare = ValueError("no plan")
    with pytest.raises(ValueError, match="no plan"):
        lane.launch(plan(1024), Dependency("dep"))
    assert len(driver.given_jobs) == 1 and driver.given_sync == ["dep"]
    lane.close()


@python_only
def test_a_plan_that_fails_on_the_issuer_thread_fails_the_job_in_order() -> None:
    lane, driver, strategy = make_lane()
    strategy.fail_prepare = ValueError("no plan")
    c = lane.launch(plan(LONG), Dependency("dep"))  # raises nothing: the caller has gone on
    assert c.wait(10)
    assert isinstance(c.error, ValueError)
    assert driver.given_sync == ["dep"]
    lane.close()


def test_a_partial_enqueue_fails_the_job_only_after_its_end_is_recorded() -> None:
    lane, driver, strategy = make_lane()
    strategy.fail_enqueue = RuntimeError("driver said no")
    c = lane.launch(plan(LONG), None)
    events = c._events
    assert events is not None
    assert c.wait(10)
    assert isinstance(c.error, RuntimeError)
    assert events.stop in driver.recorded, "the job's end was not recorded behind what was enqueued"
    lane.close()


def test_a_sticky_error_on_the_callers_thread_raises_worker_broken() -> None:
    lane, driver, strategy = make_lane()
    broken = WorkerBroken("context lost")

    def die(*_: Any, **__: Any) -> None:
        driver.broken = broken
        raise RuntimeError("sticky")

    strategy.enqueue = die  # type: ignore[method-assign]
    with pytest.raises(WorkerBroken):
        lane.launch(plan(1024), None)
    lane.close()


def test_a_sticky_error_on_the_issuer_thread_fails_the_job() -> None:
    lane, driver, _ = make_lane()
    gate = hold(lane)
    c = lane.launch(plan(LONG), None)
    driver.broken = WorkerBroken("context lost")
    assert c.query() and isinstance(c.error, WorkerBroken)  # every pending job fails at once
    gate.set()
    lane.close()


def test_launch_on_a_closed_lane_raises_worker_closed_and_gives_events_back() -> None:
    lane, driver, _ = make_lane()
    lane.close()
    with pytest.raises(WorkerClosed):
        lane.launch(plan(1024), Dependency("dep"))
    assert len(driver.given_jobs) == 1 and driver.given_sync == ["dep"]


@python_only
def test_an_issuer_thread_that_cannot_start_gives_the_events_back_once() -> None:
    lane, driver, _ = make_lane()

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    real = threading.Thread.start
    threading.Thread.start = refuse  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="start new thread"):
            lane.launch(plan(LONG), Dependency("dep"))  # deferred: it needs the thread
    finally:
        threading.Thread.start = real  # type: ignore[method-assign]
    assert len(driver.given_jobs) == 1 and driver.given_sync == ["dep"]
    lane.close()


@pytest.mark.parametrize("case", ["event sync works", "event sync fails too", "sticky"])
def test_a_failed_query_reports_the_job_only_after_its_copies_are_waited_out(case: str) -> None:
    """A query error that leaves the context usable says nothing of the copies: the job is
    failed only after a wait on its end event (or, failing that, its stream), so its memory
    is not handed back while they may still run. A sticky error fails it at once."""
    lane, driver, _ = make_lane(issue_thread=False)
    c = lane.launch(plan(1024), None)
    events = c._events
    assert events is not None
    waited: list[tuple[str, Any]] = []

    def query(event: Any) -> bool:
        if case == "sticky":
            driver.broken = WorkerBroken("context lost")
            raise driver.broken
        raise RuntimeError("cuEventQuery: CUDA_ERROR_INVALID_HANDLE")

    def synchronize(event: Any) -> None:
        if case == "event sync fails too":
            raise RuntimeError("cuEventSynchronize: CUDA_ERROR_INVALID_HANDLE")
        waited.append(("event", event))

    driver.query = query  # type: ignore[method-assign]
    driver.synchronize = synchronize  # type: ignore[method-assign]
    driver.stream_synchronize = lambda stream: waited.append(("stream", stream))  # type: ignore[method-assign]
    assert c.query() and c.error is not None
    want = {"event sync works": [("event", events.done)],
            "event sync fails too": [("stream", lane.bell_stream)], "sticky": []}[case]
    assert waited == want
    lane.close()


def test_an_abandoned_lane_keeps_its_strategys_buffers_and_lets_the_issuer_end() -> None:
    """The Python issuer runs what it holds; the native one drops what is still queued
    (nobody waits for it: the job fails ``WorkerClosed``, nothing of it ran) and ends."""
    lane, driver, strategy = make_lane()
    gate = hold(lane)  # the issuer thread holds work
    c = lane.launch(plan(LONG), None)
    if lane.native is not None:
        native_issuer = lane.native
        lane.abandon()
        assert getattr(strategy, "abandoned", False)
        assert c.wait(10) and isinstance(c.error, WorkerClosed)
        assert not (c._events and c._events.stop in driver.recorded)  # never issued
        assert native_issuer.stats() == {"running": False}
        return
    assert lane._issuer is not None
    thread = lane._issuer._thread
    assert thread is not None
    lane.abandon()  # returns at once: a finalizer must not block on the device
    assert getattr(strategy, "abandoned", False)
    gate.set()
    thread.join(10)
    assert not thread.is_alive() and c.wait(10) and c.error is None


def test_close_waits_for_what_an_interrupted_enqueue_left_on_the_stream() -> None:
    """A KeyboardInterrupt mid-enqueue on the caller's thread raises through ``launch``, so
    no job tracks the copies it enqueued: closing the lane still waits for its stream."""
    lane, driver, strategy = make_lane(issue_thread=False)
    strategy.fail_enqueue = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        lane.launch(plan(1024), None)
    synced: list[Any] = []
    driver.stream_synchronize = synced.append  # type: ignore[method-assign]
    lane.close()
    assert lane.stream in synced
