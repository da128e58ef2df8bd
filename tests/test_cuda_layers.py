"""Layerwise jobs on a CUDA lane against fake drivers (no GPU): a load is one program on the
lane's native issuer with one event per layer; a gate makes exactly one stream wait, on
the right event and stream, and never one on an event not recorded yet; a store is one
program per push, handed over without waiting, with its end behind the last; a failure
part way fails only the layers not reached; and, on the simulated device, round trips are
byte-exact and a gated consumer reads only after its layer landed, whatever order the
streams run in."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from aiokv.backends.base import StallMeter
from aiokv.backends.cuda import layer_copies as copies_mod
from aiokv.backends.cuda import layer_ops as layer_ops_mod
from aiokv.backends.cuda import native
from aiokv.backends.cuda.driver import JobEvents
from aiokv.backends.cuda.driver.batch import BatchCopies
from aiokv.backends.cuda.lane import CudaLane, Dependency
from aiokv.backends.cuda.layer_staging import LayerStaging
from aiokv.backends.cuda.pieces import PieceKernel
from aiokv.backends.cuda.strategy import CopyContext
from aiokv.errors import CudaCallFailed, InvalidSpec
from aiokv.handler import Handler
from aiokv.layer_plan import LayerMap, LayerPlan, plan_layers
from aiokv.layers import Layerwise
from aiokv.layout import CanonicalKVCaches
from aiokv.lifecycle import Lifecycle
from aiokv.plan import HostLayout, map_blocks
from aiokv.specs import Direction

from .conftest import NATIVE_LANES
from .native_fakes import FakeTable
from .sim_device import SimDriver
from .test_cuda_lane import hold

native_only = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")
# The fake driver is served through the helper's table on both paths, so every test here
# needs the helper built.
pytestmark = native_only

MAIN, CONSUMER = 0x40, 0x77
LAYERS, BLOCKS, PAGE = 4, 16, 256


class LogDriver:
    """Every driver call a layerwise run makes, in order; events complete when a test says
    so (``done``). (In CUDA an event never recorded reads as complete: the tests check that
    no call touches a layer's event before its record.)"""

    def __init__(self) -> None:
        self.broken: Any = None
        self.calls: list[tuple[Any, ...]] = []
        self.recorded: set[int] = set()
        self.done: set[int] = set()
        self.given: list[Any] = []
        self.fail_batch = 0  # the nth memcpy_batch raises
        self.hold_batch = 0  # the nth memcpy_batch blocks until ``release`` is set
        self.release = threading.Event()
        self.at: dict[Any, float] = {}  # device time an event's record ran at (``elapsed``)
        self.next = 0x1000

    def _handle(self) -> int:
        self.next += 1
        return self.next

    def ensure_context(self) -> None:
        pass

    def check_usable(self) -> None:
        pass

    def create_stream(self, high_priority: bool = False) -> int:
        return self._handle()

    def create_event(self, timing: bool = False, blocking: bool = False) -> int:
        return self._handle()

    def destroy_stream(self, stream: Any) -> None:
        pass

    def take_sync_event(self) -> int:
        return self._handle()

    def take_job_events(self) -> JobEvents:
        return JobEvents(self._handle(), self._handle())

    def give_sync_event(self, event: Any) -> None:
        self.given.append(event)

    def give_job_events(self, events: JobEvents) -> None:
        self.given.extend((events.start, events.stop))

    def take_timing_event(self) -> int:
        return self._handle()

    def give_timing_event(self, event: Any) -> None:
        self.given.append(event)

    def record(self, event: Any, stream: Any) -> None:
        self.calls.append(("record", event, stream))
        self.recorded.add(event)

    def stream_wait(self, stream: Any, event: Any) -> None:
        self.calls.append(("wait", stream, event))

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any,
                     **kw: Any) -> None:
        self.calls.append(("batch", dst.tolist(), stream))
        nth = sum(c[0] == "batch" for c in self.calls)
        if nth == self.hold_batch:
            assert self.release.wait(10)
        if nth == self.fail_batch:
            raise CudaCallFailed("injected", 2)

    def query(self, event: Any) -> bool:
        self.calls.append(("query", event))
        return event in self.done

    def synchronize(self, event: Any) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def elapsed(self, start: Any, stop: Any) -> float:
        """Device seconds between two events: from ``at`` (a test's clock) where it has
        both, else 2.5 ms."""
        if start in self.at and stop in self.at:
            return self.at[stop] - self.at[start]
        return 2.5e-3

    def can_ring(self) -> bool:
        return False

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


# K and V pages per layer; one description for every job (the host layout follows it).
KV = CanonicalKVCaches.from_tensors([torch.zeros(2, BLOCKS, PAGE // 2, dtype=torch.uint8)
                                     for _ in range(LAYERS)], block_dim=1)
KV_LAYOUT = HostLayout.build(KV, 1)
KV_MAP = LayerMap.build(KV, KV_LAYOUT)


def kv_plan(to_host: bool, blocks: list[int], chunks: list[int]) -> tuple[LayerPlan, HostLayout]:
    kv = KV
    layout = HostLayout.build(kv, 1)
    mapping = map_blocks(blocks, chunks, layout=layout, num_chunks=16, unique_host=to_host,
                         unique_gpu=not to_host)
    return plan_layers(mapping, layout, LayerMap.build(kv, layout)), layout


class Strategy:
    """What a lane reads of its strategy; ``ctx.pointers`` is the real one over made-up
    addresses (``bases``: each page tensor's base, and the host pool's)."""

    name = "dma"
    pitched_jobs = staged_jobs = 0

    def __init__(self, to_host: bool, bases: tuple[list[int], int] | None = None, driver: Any = None) -> None:
        device, host = bases or ([0x100000 * (i + 1) for i in range(2 * LAYERS)], 0x9000000)
        self.main_stream = MAIN
        self.ctx = SimpleNamespace(runs=(), to_host=to_host, device_base=np.array(device, dtype=np.int64),
                                   host_base=host, driver=driver)
        self.ctx.pointers = lambda plan: CopyContext.pointers(self.ctx, plan)  # type: ignore[arg-type]

    def close(self) -> None:
        pass

    def abandon(self) -> None:
        pass


def make_lane(direction: Direction, driver: Any, *, recorded: bool, issue_thread: bool = False,
              measure: bool = False, bases: Any = None) -> tuple[CudaLane, Any]:
    fake = FakeTable(target=driver if isinstance(driver, SimDriver) else None)
    rec = fake.recorder(driver, MAIN, 0) if recorded else None
    strategy = Strategy(direction.to_host, bases, driver=rec if rec is not None else driver)
    lane = CudaLane(driver, direction, strategy, issue_thread=issue_thread, recorder=rec,  # type: ignore[arg-type]
                    table=fake.table if recorded else None, measure_stalls=measure)
    NATIVE_LANES.append(lane)
    return lane, fake


def layer_events(run: Any) -> list[Any]:
    return list(run._events)


def issued(lane: CudaLane) -> CudaLane:
    """The lane once its native issuer ran what it was handed (the Python path: at once)."""
    if lane.native is not None:
        assert lane.native.drain(10)
    return lane


def main_records(lane: CudaLane, drv: Any, fake: Any) -> list[Any]:
    """The events recorded on the lane's main stream, in order, on either path."""
    if lane.native is not None:
        return [c[1] for c in fake.calls if c[0] == "cuEventRecord" and c[2] == MAIN]
    return [c[1] for c in drv.calls if c[0] == "record" and c[2] == MAIN]


# -- one call, one event per layer ------------------------------------------------------------


@native_only
def test_a_layerwise_load_is_one_program_on_the_lanes_issuer_with_one_event_per_layer() -> None:
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=True)
    plan, _ = kv_plan(False, [3, 4, 5], [0, 1, 2])
    run = lane.launch_layers(plan, Dependency(0xD1, stream=0x5))
    events = layer_events(run)
    job = run.completion._events
    # The dependency is recorded on the caller's stream at submit, on the caller's thread;
    # every other call is the issuer thread's.
    assert drv.calls == [("record", 0xD1, 0x5)] and len(set(events)) == LAYERS
    issued(lane)
    assert lane.native is not None and lane.native.stats()["issued"] == 1, "more than one program"
    calls = fake.calls
    names = [(c[0], c[1] if c[0] == "cuEventRecord" else c[-1]) for c in calls]
    assert names == [("cuStreamWaitEvent", 0), ("cuEventRecord", job.start)] + [
        step for ev in events for step in (("cuMemcpyBatchAsync", MAIN), ("cuEventRecord", ev))
    ] + [("cuEventRecord", job.stop)]
    assert calls[0][1:3] == (MAIN, 0xD1)
    assert threading.current_thread().name not in {t for t, _ in fake.threads}
    # Each layer's batch is exactly that layer's copies (device side: K and V pages).
    dst, _, _ = lane.pointers(plan)
    batches = [[d for d, _, _ in c[1]] for c in fake.calls if c[0] == "cuMemcpyBatchAsync"]
    for layer, batch in enumerate(batches):
        lo, hi = int(plan.bounds[layer]), int(plan.bounds[layer + 1])
        assert batch == dst[lo:hi].tolist()
    assert all(run.enqueued(i) for i in range(LAYERS))
    drv.done.update((*events, job.stop))
    assert run.completion.wait(10) and run.completion.error is None
    assert 0xD1 in drv.given, "the dependency's event never went back once its wait was issued"
    lane.close()


def test_the_python_path_makes_the_same_calls_one_by_one() -> None:
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False)
    plan, _ = kv_plan(False, [3, 4, 5], [0, 1, 2])
    run = lane.launch_layers(plan, Dependency(0xD1, stream=0x5))
    events, job = layer_events(run), run.completion._events
    assert [c[:2] if c[0] != "wait" else c for c in drv.calls] == [
        ("record", 0xD1), ("wait", MAIN, 0xD1), ("record", job.start)] + [
        step for ev in events for step in (("batch", drv.of("batch")[events.index(ev)][1]), ("record", ev))
    ] + [("record", job.stop)]
    assert len(drv.of("batch")) == LAYERS


# -- gates --------------------------------------------------------------------------------------


@pytest.mark.parametrize("recorded", [pytest.param(True, marks=native_only), False])
def test_a_gate_makes_exactly_one_stream_wait_on_the_layers_event(recorded: bool) -> None:
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=recorded)
    run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    events = layer_events(run)
    drv.calls.clear()
    meter = StallMeter()
    assert run.gate(2, CONSUMER, meter) is True
    assert drv.of("wait") == [("wait", CONSUMER, events[2])]
    assert [c for c in drv.calls if c[0] not in ("query", "wait")] == []
    assert meter.count == 0  # a device wait: measured only with layer_stalls
    # A layer already done: no wait at all, and no sample either (unmeasured gates that
    # found their layer done would be the only samples: a stall figure of zeros).
    drv.done.add(events[0])
    drv.calls.clear()
    assert run.gate(0, CONSUMER, meter) is True
    assert drv.of("wait") == [] and meter.count == 0


@pytest.mark.parametrize("measure", [False, True])
def test_gates_add_stall_samples_only_where_stalls_are_measured(measure: bool) -> None:
    """Through the core's handle: a gate that waits on the device, then two on a layer found
    done (by the run, then by its final status). Unmeasured, none adds a sample; measured,
    each does: the wait, and the first gate on the done layer (it marks the consumer's
    stream twice with no wait between: about 0 on a device, the fake's 2.5 ms here), once
    the consumer's stream passed their marks; the one that knew the layer final, 0 at once."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, measure=measure)
    layers = Layerwise(KV, HostLayout.build(KV, 1), SimpleNamespace(consumer=lambda stream: CONSUMER),  # type: ignore[arg-type]
                       threading.Lock(), Lifecycle())
    job = layers.submit(Handler(Direction.LOAD, lane), 7, kv_plan(False, [1, 2], [3, 4])[0], None)
    events = layer_events(job._run)
    assert job.gate(1) and drv.of("wait") == [("wait", CONSUMER, events[1])]
    drv.done.update(c[1] for c in drv.calls if c[0] == "record" and c[2] == CONSUMER)  # passed
    drv.done.add(events[0])
    assert job.gate(0) and job.layer_status(0) and job.gate(0)
    assert [c[0] for c in drv.calls if c[0] == "wait"] == ["wait"], "a gate waited on a layer known done"
    drv.done.update(c[1] for c in drv.calls if c[0] == "record" and c[2] == CONSUMER)  # passed
    stats = layers.statistics()
    assert stats.gates == 3
    assert sorted(stats.stalls) == ([0.0, 2.5e-3, 2.5e-3] if measure else [])
    assert stats.stalls_measured == (3 if measure else 0)


def test_a_measured_gate_brackets_its_wait_with_two_events_on_the_consumer_stream() -> None:
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, measure=True)
    run = lane.launch_layers(kv_plan(False, [1], [3])[0], None)
    event = layer_events(run)[1]
    drv.calls.clear()
    meter = StallMeter()
    assert run.gate(1, CONSUMER, meter)
    (r0, w, r1) = [c for c in drv.calls if c[0] != "query"]
    assert r0[0] == "record" and r0[2] == CONSUMER and w == ("wait", CONSUMER, event)
    assert r1[0] == "record" and r1[2] == CONSUMER
    meter.collect()
    assert meter.count == 0  # the consumer stream has not passed the second event yet
    drv.done.add(r1[1])
    meter.collect()
    assert list(meter.samples) == [2.5e-3] and {r0[1], r1[1]} <= set(drv.given)  # read, then pooled


def test_a_gate_on_a_load_still_with_the_issuer_waits_for_its_record() -> None:
    """The issuer thread holds earlier work: the layer's event is not recorded yet, so the
    gate blocks rather than wait on it (a wait on an unrecorded event passes at once)."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, issue_thread=True)
    gate = hold(lane)
    try:
        run = lane.launch_layers(kv_plan(False, [1], [3])[0], None)
        assert not run.enqueued(1) and not run.query(1)
        result: list[bool] = []
        consumer = threading.Thread(target=lambda: result.append(run.gate(1, CONSUMER, StallMeter())))
        consumer.start()
        consumer.join(0.05)
        assert consumer.is_alive() and drv.of("wait") == []
        gate.set()
        consumer.join(10)
        assert result == [True]
        event = layer_events(run)[1]
        waits = [i for i, c in enumerate(drv.calls) if c == ("wait", CONSUMER, event)]
        assert len(waits) == 1 and drv.calls.index(("record", event, MAIN)) < waits[0]
    finally:
        gate.set()
        lane.close()


@pytest.mark.parametrize("recorded", [pytest.param(True, marks=native_only), False])
def test_the_legacy_default_stream_is_a_stream_like_any_other_on_layerwise_paths(recorded: bool) -> None:
    """Stream handle 0 is CUDA's legacy default stream, where torch runs by default (the C
    planner once took it for "no stream"): a load's and a push's dependency on it are
    recorded there at submit and waited on by the lane, and a gate makes it wait."""
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=recorded)
    run = lane.launch_layers(kv_plan(False, [1], [3])[0], Dependency(0xD1, stream=0))
    assert drv.calls[0] == ("record", 0xD1, 0)
    issued(lane)
    waits = [c[1:3] for c in fake.calls if c[0] == "cuStreamWaitEvent"] if recorded else drv.of("wait")
    assert (MAIN, 0xD1) in [tuple(w[-2:]) for w in waits]
    drv.calls.clear()
    assert run.gate(1, 0, StallMeter()) and drv.of("wait") == [("wait", 0, layer_events(run)[1])]
    lane.close()
    drv = LogDriver()
    lane, fake = make_lane(Direction.STORE, drv, recorded=recorded)
    store = lane.open_layers(kv_plan(True, [1], [3])[0])
    assert store.push(2, Dependency(0xD2, stream=0)) is True
    assert drv.calls[0] == ("record", 0xD2, 0)
    issued(lane)
    waits = [c[1:3] for c in fake.calls if c[0] == "cuStreamWaitEvent"] if recorded else drv.of("wait")
    assert (MAIN, 0xD2) in [tuple(w[-2:]) for w in waits]
    lane.close()


# -- stores ---------------------------------------------------------------------------------------


@native_only
def test_each_push_is_a_program_handed_over_without_waiting_and_the_end_follows_the_last() -> None:
    """The forward's thread records the push's dependency on its stream and returns: with
    the issuer thread paused, the push is not issued yet (nothing of it blocks the caller).
    Once issued: the wait, the job's start (the first push's) or the layer's own, its copies,
    its event; the store's end is a program behind the last push."""
    drv = LogDriver()
    lane, fake = make_lane(Direction.STORE, drv, recorded=True)
    run = lane.open_layers(kv_plan(True, [1, 2], [3, 4])[0])
    events, job = layer_events(run), run.completion._events
    assert fake.calls == [] and not run.completion.query()
    # A gate on a layer not pushed never waits: nothing is recorded for it.
    assert not run.enqueued(1) and run.gate(1, CONSUMER, StallMeter()) is False and drv.of("wait") == []
    gate = hold(lane)
    try:
        assert run.push(1, Dependency(0xD2, stream=0x6)) is True
        assert drv.calls == [("record", 0xD2, 0x6)] and fake.calls == [], "the push waited for its issue"
        assert run.enqueued(1) and not run.query(1), "a layer reads as done before its record was issued"
    finally:
        gate.set()
    issued(lane)
    assert [(c[0], c[1]) for c in fake.calls] == [
        ("cuStreamWaitEvent", MAIN), ("cuEventRecord", job.start),
        ("cuMemcpyBatchAsync", fake.calls[2][1]), ("cuEventRecord", events[1])]
    assert fake.calls[0][2] == 0xD2
    fake.calls.clear()
    assert run.push(0, None) is True
    issued(lane)
    # No second job start: the layer's own start, its copies, its end.
    assert [(c[0], c[1]) for c in fake.calls] == [
        ("cuEventRecord", run._spans[0].start), ("cuMemcpyBatchAsync", fake.calls[1][1]),
        ("cuEventRecord", events[0])]
    run.push(2, None)
    run.push(3, None)
    assert not run.completion.query(), "a store is not done before its end is recorded"
    run.finish(None)
    issued(lane)
    assert fake.calls[-1][:2] == ("cuEventRecord", job.stop)
    assert lane.native is not None and lane.native.stats()["issued"] == 5  # four pushes, the end
    drv.done.update((*events, job.stop))
    assert run.completion.wait(10) and run.completion.error is None
    assert 0xD2 in drv.given
    lane.close()


def test_a_gate_on_a_push_still_with_the_issuer_waits_for_its_record() -> None:
    drv = LogDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False, issue_thread=True)
    gate = hold(lane)
    try:
        run = lane.open_layers(kv_plan(True, [1], [3])[0])
        assert run.push(2, Dependency(0xD3, stream=0x6)) is True  # queued behind the held work
        assert ("record", 0xD3, 0x6) in drv.calls  # its dependency taken now, on this thread
        assert run.enqueued(2) and not run.query(2)
        result: list[bool] = []
        consumer = threading.Thread(target=lambda: result.append(run.gate(2, CONSUMER, StallMeter())))
        consumer.start()
        consumer.join(0.05)
        assert consumer.is_alive() and drv.of("wait") == [], "the gate waited before the record"
        gate.set()
        consumer.join(10)
        event = layer_events(run)[2]
        assert result == [True]
        assert drv.calls.index(("record", event, MAIN)) < drv.calls.index(("wait", CONSUMER, event))
    finally:
        gate.set()
        lane.close()


def test_a_store_finished_while_its_last_pushes_wait_for_the_issuer_succeeds() -> None:
    """Every layer pushed, the last ones still queued on the issuer thread when the store
    ends: those layers were pushed, so they are not failed, and neither is the job."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False, issue_thread=True)
    run = lane.open_layers(kv_plan(True, [1], [3])[0])
    run.push(0, None)
    run.push(1, None)
    gate = hold(lane)  # the issuer is busy (a long job before them)
    try:
        run.push(2, None)
        run.push(3, None)
        run.finish(None)  # what the core does once every layer is pushed
        assert not run.query(3), "a pushed layer still with the issuer reads as over"
    finally:
        gate.set()
    assert lane.issuer is not None and lane.issuer.drain(10)
    events = layer_events(run)
    drv.done.update((*events, run.completion._events.stop))
    assert all(run.query(i) and run.error(i) is None for i in range(LAYERS))
    assert run.completion.wait(10) and run.completion.error is None
    lane.close()


@native_only
def test_a_push_whose_program_fails_on_the_issuer_fails_its_layer_and_the_store() -> None:
    """The push returned True (its program was handed over); the issuer's copy call of
    layer 2 then fails: that layer fails (a gate on it touches nothing), the others land,
    and the store ends failed behind every layer, its dependency events back once it ended."""
    drv = LogDriver()
    lane, fake = make_lane(Direction.STORE, drv, recorded=True)
    fake.fail["cuMemcpyBatchAsync"] = (3, 2)  # the third push's copies: layer 2's
    run = lane.open_layers(kv_plan(True, [1], [3])[0])
    for layer in range(LAYERS):
        assert run.push(layer, Dependency(0xD0 + layer, stream=0x6)) is True
    run.finish(None)
    issued(lane)
    drv.calls.clear()
    assert run.query(2) and isinstance(run.error(2), CudaCallFailed)
    assert run.gate(2, CONSUMER, StallMeter()) is False and drv.calls == []
    assert [run.enqueued(i) for i in range(LAYERS)] == [True] * LAYERS  # pushed: gates may wait for it
    events, job = layer_events(run), run.completion._events
    assert fake.calls[-1][:2] == ("cuEventRecord", job.stop)
    drv.done.update((*events, job.stop))
    assert run.completion.wait(10) and isinstance(run.completion.error, CudaCallFailed)
    assert [run.error(i) is None for i in range(LAYERS)] == [True, True, False, True]
    assert {0xD0 + i for i in range(LAYERS)} <= set(drv.given)
    lane.close()


def test_a_layer_failed_before_its_push_reached_the_lane_fails_alone() -> None:
    """A store held behind another could not pin a push's dependency: that layer fails, no
    call touches its event, and the job ends failed behind the layers it has."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False)
    run = lane.open_layers(kv_plan(True, [1], [3])[0])
    run.fail(2, CudaCallFailed("injected", 700))
    assert run.enqueued(2) and run.query(2) and isinstance(run.error(2), CudaCallFailed)
    assert run.gate(2, CONSUMER, StallMeter()) is False and drv.calls == []
    for layer in (0, 1, 3):
        run.push(layer, None)
    run.finish(None)
    drv.done.update((*layer_events(run), run.completion._events.stop))
    assert [run.error(i) is None for i in range(LAYERS)] == [True, True, False, True]
    assert run.completion.wait(10) and isinstance(run.completion.error, CudaCallFailed)


def test_finishing_a_store_short_of_layers_fails_those_and_the_job() -> None:
    drv = LogDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False)
    run = lane.open_layers(kv_plan(True, [1], [3])[0])
    run.push(0, None)
    run.finish(RuntimeError("closing"))
    assert run.query(3) and isinstance(run.error(3), RuntimeError)
    drv.done.add(run.completion._events.stop)
    assert run.completion.wait(10) and isinstance(run.completion.error, RuntimeError)
    assert run.error(0) is None and run.gate(3, CONSUMER, StallMeter()) is False


class ClockDriver(LogDriver):
    """A device clock: each record stamps its event with the time, each batched copy takes
    ``COPY`` seconds, and the test moves the clock between pushes (the forward's compute)."""

    COPY = 1e-3

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.stamps: dict[Any, float] = {}
        self.asked: list[tuple[Any, Any]] = []

    def record(self, event: Any, stream: Any) -> None:
        super().record(event, stream)
        self.stamps[event] = self.clock

    def memcpy_batch(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any,
                     **kw: Any) -> None:
        super().memcpy_batch(dst, src, sizes, stream, **kw)
        self.clock += self.COPY

    def elapsed(self, start: Any, stop: Any) -> float:
        self.asked.append((start, stop))
        return self.stamps[stop] - self.stamps[start]


def test_a_stores_device_time_sums_its_layers_copies_not_the_gaps_between_pushes() -> None:
    """Pushes 0.25 s apart, each layer's copies 1 ms: the store took 4 ms of copies, not
    the 0.754 s from its first push to its end (TransferResult: the copies' time)."""
    drv = ClockDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False)
    run = lane.open_layers(kv_plan(True, [1, 2], [3, 4])[0])
    job = run.completion._events
    spans = list(run._spans)
    for n, layer in enumerate((2, 0, 1, 3)):  # any order: the first pushed starts at the job's start
        drv.clock += 0.25 if n else 0.0  # the forward computes the next layer meanwhile
        run.push(layer, None)
    run.finish(None)
    assert drv.stamps[job.stop] - drv.stamps[job.start] == pytest.approx(0.75 + 4 * ClockDriver.COPY)
    drv.done.add(job.stop)
    assert run.completion.query() and run.completion.error is None
    assert run.completion.elapsed == pytest.approx(4 * ClockDriver.COPY)
    events = [span.stop for span in spans]
    expected = [(job.start, events[2])] + [(spans[i].start, events[i]) for i in (0, 1, 3)]
    assert sorted(drv.asked) == sorted(expected)
    # Each layer's start is recorded after its wait on the producer, just before its copies.
    for i in (0, 1, 3):
        at = drv.calls.index(("record", spans[i].start, MAIN))
        assert drv.calls[at + 1][0] == "batch" and drv.calls[at + 2] == ("record", events[i], MAIN)
    # The pairs go back to the pool once read, the job's own pair too.
    assert {e for span in spans for e in (span.start, span.stop)} | {job.start, job.stop} <= set(drv.given)


def test_a_loads_device_time_still_runs_from_its_start_to_its_end() -> None:
    drv = ClockDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False)
    run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    job = run.completion._events
    drv.done.add(job.stop)
    assert run.completion.query() and run.completion.elapsed == pytest.approx(LAYERS * ClockDriver.COPY)
    assert drv.asked == [(job.start, job.stop)]


def test_a_failed_store_gives_its_layer_pairs_back_and_reports_no_time() -> None:
    drv = ClockDriver()
    lane, _ = make_lane(Direction.STORE, drv, recorded=False)
    run = lane.open_layers(kv_plan(True, [1], [3])[0])
    spans = list(run._spans)
    run.push(0, None)
    run.finish(RuntimeError("closing"))
    drv.done.add(run.completion._events.stop)
    assert run.completion.wait(10) and run.completion.elapsed is None and drv.asked == []
    assert {e for span in spans for e in (span.start, span.stop)} <= set(drv.given)


# -- failures ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recorded", [pytest.param(True, marks=native_only), False])
def test_a_load_that_fails_part_way_fails_only_the_layers_not_reached(recorded: bool) -> None:
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=recorded)
    if recorded:
        fake.fail["cuMemcpyBatchAsync"] = (3, 2)  # layer 2's batch
    else:
        drv.fail_batch = 3
    run = issued(lane).launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    events, job = layer_events(run), run.completion._events
    issued(lane)
    assert [run.enqueued(i) for i in range(LAYERS)] == [True, True, False, False]
    assert job.stop in main_records(lane, drv, fake), "the failed job's end was not recorded behind it"
    drv.calls.clear()
    meter = StallMeter()
    assert run.gate(2, CONSUMER, meter) is False and run.gate(3, CONSUMER, meter) is False
    assert drv.calls == [], "a gate touched a layer that was never enqueued"
    assert run.gate(1, CONSUMER, meter) is True and drv.of("wait") == [("wait", CONSUMER, events[1])]
    assert run.query(2) and isinstance(run.error(2), CudaCallFailed)
    drv.done.update((*events[:2], job.stop))
    assert run.query(0) and run.error(0) is None
    assert run.completion.wait(10) and isinstance(run.completion.error, CudaCallFailed)


@native_only
def test_a_program_refused_as_bad_input_raises_at_submit_and_gives_everything_back() -> None:
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=True)
    take = drv.take_sync_event
    drv.take_sync_event = lambda: 0 if len(drv.given) == 0 and drv.next > 0x1004 else take()  # type: ignore[method-assign]
    with pytest.raises(InvalidSpec, match="null event"):
        lane.launch_layers(kv_plan(False, [1], [3])[0], Dependency(0xD1, stream=0x5))
    assert fake.calls == [] and 0xD1 in drv.given and len(drv.given) == LAYERS + 3  # layers, job pair, dep


# -- later layers from the issuer thread -------------------------------------------------------------


@native_only
def test_a_native_load_marks_each_layer_as_the_issuer_passes_its_record() -> None:
    """The whole load is one program: the submit returns before any of it is issued. With
    the issuer held inside layer 2's copy call, layers 0 and 1 are marked (``rows_done``
    passed their records), a gate on layer 2 blocks and waits on nothing, and goes once the
    issuer passed layer 2's record; a second load queues behind the first's end. Each
    layer's issue time is the issuer's, in order."""
    drv = LogDriver()
    lane, fake = make_lane(Direction.LOAD, drv, recorded=True, measure=True)
    fake.hold["cuMemcpyBatchAsync"] = (3, drv.release)
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], Dependency(0xD1, stream=0x5))
        assert run.head == LAYERS and lane.issuer is None, "a Python thread took part of the load"
        events = layer_events(run)
        from .test_cuda_layer_issue import until

        assert until(lambda: run.enqueued(1)) and not run.enqueued(2)
        result: list[bool] = []
        consumer = threading.Thread(target=lambda: result.append(run.gate(2, CONSUMER, StallMeter())))
        consumer.start()
        consumer.join(0.1)
        assert consumer.is_alive() and ("wait", CONSUMER, events[2]) not in drv.calls
        second = lane.launch_layers(kv_plan(False, [5], [6])[0], None)  # queued behind the first
        drv.release.set()
        consumer.join(10)
        assert result == [True] and ("wait", CONSUMER, events[2]) in drv.calls
        issued(lane)
        assert all(run.enqueued(i) for i in range(LAYERS)) and all(second.enqueued(i) for i in range(LAYERS))
        records = main_records(lane, drv, fake)
        job, job2 = run.completion._events, second.completion._events
        assert records.index(job.stop) < records.index(job2.start), "the second load went ahead of the first"
        assert [records.index(e) for e in events] == sorted(records.index(e) for e in events)
        times = run._issue_times()
        assert all(t is not None and t > 0 for t in times) and times == sorted(times)  # type: ignore[type-var]
        assert run._blocked[2] > 0.05
        drv.done.update((*events, job.stop))
        assert run.completion.wait(10) and run.completion.error is None
    finally:
        drv.release.set()
        lane.close()


def test_a_load_past_the_inline_budget_issues_its_later_layers_from_the_issuer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The submit enqueues layer 0 (and the dependency, the start) and returns; layers 1-3
    go from the issuer thread, each marked as its record is enqueued: a gate on layer 2 while
    layer 2 is held in its copy call blocks, waits on nothing, and goes once it is issued. A
    second load on the lane queues behind the first's last layer."""
    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    drv = LogDriver()
    drv.hold_batch = 3  # layer 2's copies
    lane, fake = make_lane(Direction.LOAD, drv, recorded=False)
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], Dependency(0xD1, stream=0x5))
        assert run.head == 1 and run.enqueued(0)
        assert lane.issuer is not None, "no issuer took the later layers"
        result: list[bool] = []
        consumer = threading.Thread(target=lambda: result.append(run.gate(2, CONSUMER, StallMeter())))
        consumer.start()
        consumer.join(0.1)
        events = layer_events(run)
        assert consumer.is_alive() and not run.enqueued(2) and ("wait", CONSUMER, events[2]) not in drv.calls
        second = lane.launch_layers(kv_plan(False, [5], [6])[0], None)  # queued behind the first
        drv.release.set()
        consumer.join(10)
        assert result == [True] and lane.issuer.drain(10)
        assert all(run.enqueued(i) for i in range(LAYERS)) and all(second.enqueued(i) for i in range(LAYERS))
        records = main_records(lane, drv, fake)
        job, job2 = run.completion._events, second.completion._events
        assert records.index(job.stop) < records.index(job2.start), "the second load went ahead of the first"
        assert [records.index(e) for e in events] == sorted(records.index(e) for e in events)
        issued = run._issued_at
        assert all(t is not None for t in issued) and issued == sorted(issued)  # type: ignore[type-var]
        drv.done.update((*events, job.stop))
        assert run.completion.wait(10) and run.completion.error is None
    finally:
        drv.release.set()
        lane.close()


def test_a_failure_in_the_issuers_layers_fails_those_layers_and_the_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    drv = LogDriver()
    drv.fail_batch = 3  # layer 2's copies, on the issuer thread
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False)
    try:
        run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
        assert lane.issuer is not None and lane.issuer.drain(10)
        assert [run.enqueued(i) for i in range(LAYERS)] == [True, True, False, False]
        assert run.gate(3, CONSUMER, StallMeter()) is False
        assert ("record", run.completion._events.stop, MAIN) in drv.calls, "no end behind the part enqueued"
        drv.done.update((*layer_events(run)[:2], run.completion._events.stop))
        assert run.completion.wait(10) and isinstance(run.completion.error, CudaCallFailed)
        assert run.error(0) is None and isinstance(run.error(3), CudaCallFailed)
    finally:
        lane.close()


def test_a_load_whose_later_layers_find_no_thread_enqueues_them_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issuer could not take the later layers (no thread could start): the submit
    enqueues them itself, so the job still ends behind every layer."""
    from aiokv.backends.cuda.issuer import Issuer

    monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
    monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    plain = Issuer.run

    def no_thread(self: Issuer, work: Any, defer: bool) -> bool:
        if defer:
            raise RuntimeError("can't start new thread")
        return plain(self, work, defer)

    monkeypatch.setattr(Issuer, "run", no_thread)
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False)
    run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    assert run.head == 1 and all(run.enqueued(i) for i in range(LAYERS))  # type: ignore[attr-defined]
    assert drv.calls[-1] == ("record", run.completion._events.stop, MAIN)
    lane.close()


def test_a_measured_load_gives_its_timeline_in_device_time_then_its_events_back() -> None:
    """Layer events are timing events placed from the job's origin; each gate's marks say
    when the consumer reached and passed it. The timeline waits for the job's end and for
    every gate's second mark, then gives the origin and the layer events back."""
    drv = LogDriver()
    lane, _ = make_lane(Direction.LOAD, drv, recorded=False, measure=True)
    run = lane.launch_layers(kv_plan(False, [1, 2], [3, 4])[0], None)
    events, job = layer_events(run), run.completion._events
    origin = run._held.origin  # type: ignore[union-attr]
    assert ("record", origin, MAIN) in drv.calls
    meter = StallMeter()
    marks = []
    for layer in range(LAYERS):
        assert run.gate(layer, CONSUMER, meter)
        marks.append([c[1] for c in drv.calls if c[0] == "record" and c[2] == CONSUMER][-2:])
    # The device: layer i lands at 1 + i ms; the consumer reaches gate i at 0.5 + 1.2 i ms.
    drv.at[origin] = 0.0
    for layer, (arrive, leave) in enumerate(marks):
        drv.at[events[layer]] = 1e-3 * (1 + layer)
        drv.at[arrive] = 1e-3 * (0.5 + 1.2 * layer)
        drv.at[leave] = max(drv.at[arrive], drv.at[events[layer]])
    drv.done.update((*events, job.stop))
    assert run.completion.wait(10)
    assert run.timeline() is None, "a timeline before its gates' marks ran"
    drv.done.update(m for pair in marks for m in pair)
    tl = run.timeline()
    assert tl is not None and tl.clock == "device"
    assert tl.copy_done == pytest.approx((1e-3, 2e-3, 3e-3, 4e-3))
    assert tl.reached == pytest.approx(tuple(1e-3 * (0.5 + 1.2 * i) for i in range(LAYERS)))
    assert tl.started == pytest.approx((1e-3, 2e-3, 3e-3, 4.1e-3))
    assert tl.first_reached == pytest.approx(0.5e-3) and tl.overlap == pytest.approx(3.5e-3)
    assert sorted(meter.samples) == pytest.approx(sorted([0.5e-3, 0.3e-3, 0.1e-3, 0.0]))
    assert origin in drv.given and set(events) <= set(drv.given)
    assert run.timeline() is tl


# -- the simulated device: bytes and ordering -----------------------------------------------------------


class SimLaneDriver(SimDriver):
    """The simulated device with what a lane asks of a driver besides streams and events."""

    broken = None

    def check_usable(self) -> None:
        pass

    def take_sync_event(self) -> int:
        return self.create_event()

    def take_job_events(self) -> JobEvents:
        return JobEvents(self.create_event(), self.create_event())

    def give_sync_event(self, event: Any) -> None:
        pass

    def give_job_events(self, events: Any) -> None:
        pass

    def take_timing_event(self) -> int:
        return self.create_event()

    def give_timing_event(self, event: Any) -> None:
        pass

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass

    def can_ring(self) -> bool:
        return False


class PitchedSimDriver(SimLaneDriver):
    """The simulated device where the driver has 2-D batches (``cuMemcpy3DBatchAsync``)."""

    pitched_copies = True
    max_pitch = 1 << 20
    pitched_ops = staticmethod(BatchCopies.pitched_ops)


# (blocks stored, blocks loaded into, chunks): scattered ids, then a run of five blocks and
# chunks that advance together (one pitched op a page tensor) beside a lone block.
SIM_JOBS = {"scattered": ([2, 7, 3], [9, 12, 0], [5, 1, 8]),
            "runs": ([2, 3, 4, 5, 6, 11], [8, 9, 10, 11, 12, 0], [5, 6, 7, 8, 9, 1])}


SLOT_AT, TABLE_AT = 6 << 20, (6 << 20) + (1 << 19)


def staged_lane(lane: CudaLane, mem: np.ndarray, at: int) -> None:
    """Give ``lane`` a device slot of two blocks of a layer (so jobs go in slices) at
    ``at``, its page table written straight into the simulated memory."""
    ctx = lane.context

    def make_kernel() -> PieceKernel:
        kernel = PieceKernel(ctx.driver, None)  # type: ignore[arg-type]

        def upload(pages: np.ndarray, stream: Any, keep: bool = False) -> int:
            raw = np.ascontiguousarray(pages, dtype=np.uint64).view(np.uint8).reshape(-1)
            mem[at + TABLE_AT - SLOT_AT : at + TABLE_AT - SLOT_AT + raw.size] = raw
            return at + TABLE_AT - SLOT_AT

        kernel.upload = upload  # type: ignore[method-assign]
        return kernel

    lane.layer_staging = LayerStaging(KV_LAYOUT, KV_MAP, ctx.device_base, ctx.host_base, 2 * PAGE,
                                      make_kernel, lambda nbytes, stream: at)


@pytest.mark.parametrize("path", ["python", pytest.param("native", marks=native_only)])
@pytest.mark.parametrize(("job", "mode", "split"), [
    ("scattered", "plain", False), ("runs", "pitched", False), ("runs", "pitched", True),
    ("runs", "plain", True), ("scattered", "staged", False), ("runs", "staged", True)])
@pytest.mark.parametrize("seed", range(2))
def test_on_the_simulated_device_round_trips_are_byte_exact_and_gated_reads_wait(
        seed: int, job: str, mode: str, split: bool, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores pushed in any order and a load, its later layers from the issuer thread
    (``split``) or all at once, with runs folded into pitched ops, or through a device slot
    and the piece kernel, or plain: every page lands where it belongs, and a read gated on
    layer 1 runs only after that layer landed."""
    if split:  # the submit enqueues layer 0 alone
        monkeypatch.setattr(copies_mod, "INLINE_ISSUE_US", 0.0)
        monkeypatch.setattr(copies_mod, "INLINE_MAX_US", 0.0)
    if mode == "staged":  # every job through the slot, however few its descriptors
        monkeypatch.setattr(layer_ops_mod, "STAGE_ABOVE_COPY", 0.0)
        monkeypatch.setattr(layer_ops_mod, "STAGE_ABOVE_US", 0.0)
        monkeypatch.setattr(copies_mod, "prefer_staged", lambda direct, staged, nbytes: True)
    pitched = mode != "plain"
    rng = np.random.default_rng(seed)
    mem = np.zeros(8 << 20, dtype=np.uint8)
    sim = (PitchedSimDriver if pitched else SimLaneDriver)(mem)
    device = [(1 << 20) + i * BLOCKS * (PAGE // 2) for i in range(2 * LAYERS)]  # 2 pages a layer
    pool = 4 << 20
    mem[: 2 << 20] = rng.integers(0, 256, 2 << 20, dtype=np.uint8)
    original = mem.copy()
    # Streams are created in this order on both lanes, so MAIN is not the sim's: read it back.
    recorded = path == "native"
    store, fake = make_lane(Direction.STORE, sim, recorded=recorded, bases=(device, pool))
    load, _ = make_lane(Direction.LOAD, sim, recorded=recorded, bases=(device, pool))
    for i, lane in enumerate((store, load)):
        lane.stream = lane._strategy.main_stream = sim.create_stream()
        if lane.recorder is not None:
            lane.recorder.bind(lane.stream, sim.create_event())
        if mode == "staged":
            staged_lane(lane, mem, SLOT_AT + i * (64 << 10))
    src, dst, chunks = SIM_JOBS[job]
    plan, layout = kv_plan(True, src, chunks)
    run = store.open_layers(plan)
    # Staged: a 2-D op a chunk run (cut where a slice of two blocks ends), a launch a slice.
    ops = {"plain": 2 * len(src), "pitched": 4, "staged": 5 if job == "scattered" else 7}[mode]
    assert [run.layer_descriptors(i) for i in range(LAYERS)] == [ops] * LAYERS
    for layer in rng.permutation(LAYERS).tolist():  # pushed in any order
        run.push(layer, None)
    run.finish(None)
    issued(store)
    sim.run(rng)
    page = PAGE // 2

    def block_page(t: int, b: int) -> np.ndarray:
        """Page tensor ``t``'s page of block ``b`` as it was before any copy."""
        return original[device[t] + b * page : device[t] + (b + 1) * page]

    for layer in range(LAYERS):
        for part in range(2):
            t = 2 * layer + part
            offset = layout.page_offsets[0][t]
            for b, c in zip(src, chunks):
                host = pool + c * layout.chunk_bytes + offset
                assert np.array_equal(mem[host : host + page], block_page(t, b))
    # Load into other blocks; a consumer stream reads layer 1 of dst[0] into scratch after a gate.
    lplan, _ = kv_plan(False, dst, chunks)
    lrun = load.launch_layers(lplan, None)
    assert lrun.head == (1 if split and not recorded else LAYERS)  # type: ignore[attr-defined]
    consumer = sim.create_stream()
    assert lrun.gate(1, consumer, StallMeter()) is True  # not run yet: a real wait
    scratch = 7 << 20
    sim.memcpy(scratch, device[2] + dst[0] * page, page, consumer)  # layer 1's K page
    if split and not recorded:
        assert load.issuer is not None and load.issuer.drain(10)
    issued(load)
    assert all(lrun.enqueued(i) for i in range(LAYERS))
    sim.run(rng)
    for layer in range(LAYERS):
        for part in range(2):
            t = 2 * layer + part
            for b_src, b_dst in zip(src, dst):
                got = mem[device[t] + b_dst * page : device[t] + (b_dst + 1) * page]
                assert np.array_equal(got, block_page(t, b_src))
    assert np.array_equal(mem[scratch : scratch + page], block_page(2, src[0])), \
        "the gated read ran before its layer landed"
    if recorded and mode == "pitched":
        assert fake.names().count("cuMemcpy3DBatchAsync") == LAYERS  # a call a layer, one op a page tensor
    if recorded and mode == "staged":
        assert "cuMemcpyBatchAsync" not in fake.names() and "cuLaunchKernel" in fake.names()
    load.close()
    store.close()
