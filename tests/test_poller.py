"""The poller's choice between spinning and sleeping, driven by fake jobs."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest

from aiokv.poller import Poller


async def _run_for(poller: Poller, seconds: float) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await anyio.sleep(seconds)
        tg.cancel_scope.cancel()


def _poller(eta: float | None, pending: int = 1) -> Poller:
    return Poller(lambda: 0, lambda: pending, expected_wait=lambda: eta,
                  spin_seconds=200e-6, poll_interval=1e-3)


@pytest.mark.anyio
async def test_idle_poller_does_not_poll() -> None:
    p = _poller(None, pending=0)
    await _run_for(p, 0.03)
    assert p.polls == 0 and p.sleeps == 0


@pytest.mark.anyio
async def test_unknown_end_sleeps_between_polls_after_the_spin() -> None:
    p = _poller(None)
    # Run until five naps were taken (a loaded machine may stall the loop for most of a short
    # fixed window), then check it napped between polls rather than spinning.
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        with anyio.move_on_after(5):
            while p.sleeps < 5:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert p.sleeps >= 5  # ~1 ms naps after a 0.2 ms spin
    assert p.polls < p.sleeps + 2000  # naps, not a busy loop


@pytest.mark.anyio
async def test_job_ending_within_one_sleep_is_spun_for() -> None:
    p = _poller(0.5e-3)  # always "half a millisecond to go"
    await _run_for(p, 0.03)
    assert p.sleeps == 0 and p.polls > 10


@pytest.mark.anyio
async def test_long_job_naps_until_just_before_its_predicted_end() -> None:
    p = _poller(0.05)  # 50 ms to go: naps are capped at 10 ms
    await _run_for(p, 0.06)
    assert 1 <= p.sleeps <= 8
    assert p.polls <= p.sleeps + 1  # no spin first: the job is known to need long


@pytest.mark.anyio
async def test_long_overdue_job_is_polled_at_the_interval_not_spun() -> None:
    p = _poller(-0.01)  # 10 ms overdue: the prediction is stale
    await _run_for(p, 0.03)
    # ~25 naps of 1 ms and 1-3 polls per nap when the machine is quiet; a busy one may stall
    # the loop for most of the window, so count polls per nap rather than naps: spinning
    # polls thousands of times in 30 ms without a nap.
    assert p.sleeps >= 1 and p.polls <= 10 * (p.sleeps + 5)


class _Pending:
    """A completion that never finishes."""

    elapsed = None
    error = None
    started_at: float | None = None  # the backend gave no stamp

    def query(self) -> bool:
        return False


class _Lane:
    next = None

    def launch(self, plan, dependency):
        return self.next if self.next is not None else _Pending()


class _Done(_Pending):
    """A completion that ended after ``elapsed`` seconds on the device."""

    def __init__(self, elapsed: float | None) -> None:
        self.elapsed = elapsed

    def query(self) -> bool:
        return True


def _finished(h, job_id: int, nbytes: int, elapsed: float | None):
    from types import SimpleNamespace

    h.lane.next = _Done(elapsed)
    h.submit(job_id, SimpleNamespace(total_bytes=nbytes), None)
    return h.pop_finished()


def test_forecast_reads_a_slightly_late_job_as_due_and_a_very_late_one_as_stale() -> None:
    from types import SimpleNamespace

    from aiokv.handler import Handler
    from aiokv.poller import CompletionForecast
    from aiokv.specs import Direction

    h = Handler(Direction.STORE, _Lane())
    forecast = CompletionForecast()
    assert forecast.expected_wait([], 0.0) is None  # nothing in flight
    h.lane.next = _Pending()
    job = h.submit(1, SimpleNamespace(total_bytes=8 << 20), None)
    assert forecast.expected_wait([job], job.submitted_at) is None  # rate not learned yet
    # Learn 1 GB/s from a finished 8 MiB job whose device time is known; small jobs teach nothing.
    other = Handler(Direction.STORE, _Lane())
    forecast.saw(_finished(other, 2, 8 << 20, (8 << 20) / 1e9))
    forecast.saw(_finished(other, 3, 4096, 1.0))
    forecast.learn()
    forecast._last_done.clear()  # as if the earlier jobs ended long ago
    start = job.submitted_at
    span = (8 << 20) / 1e9  # predicted to take ~8.4 ms
    assert forecast.expected_wait([job], start) == pytest.approx(span)
    assert forecast.expected_wait([job], start + span + 1e-3) == 0.0  # 1 ms late: under the 2 ms slack
    assert forecast.expected_wait([job], start + span + 3e-3) == pytest.approx(-3e-3)  # stale
    # A backend stamp of when the copies were handed over (after planning) moves the end.
    job.completion.started_at = start + 5e-3
    assert forecast.expected_wait([job], start) == pytest.approx(span + 5e-3)
    # A load head has no rate of its own yet: the store's prediction stays the soonest.
    load = Handler(Direction.LOAD, _Lane())
    load.lane.next = _Pending()
    load_job = load.submit(4, SimpleNamespace(total_bytes=1 << 30), None)
    assert forecast.expected_wait([job, load_job], start) == pytest.approx(span + 5e-3)


def test_forecast_falls_back_on_the_host_clock_span_and_records_detect_windows() -> None:
    from aiokv.handler import Handler
    from aiokv.poller import CompletionForecast
    from aiokv.specs import Direction

    h = Handler(Direction.LOAD, _Lane())
    forecast = CompletionForecast()
    (job,) = _finished(h, 1, 4 << 20, None)  # no device time: the host-clock span teaches
    forecast.saw([job])
    forecast.learn()
    span = job.noticed_at - job.started_at
    assert forecast._rate[Direction.LOAD] == pytest.approx((4 << 20) / span)
    (window,) = forecast.detect_windows
    assert window == job.noticed_at - job.running_seen_at and 0 <= window < 1.0


def test_forecast_learns_no_rate_from_layerwise_jobs() -> None:
    """A layerwise store's span holds the forward pass between its pushes, and a layerwise
    load runs on one stream: neither says how fast the lane copies."""
    from dataclasses import fields, replace

    from aiokv.handler import Handler, LayerJob
    from aiokv.poller import CompletionForecast
    from aiokv.specs import Direction

    (job,) = _finished(Handler(Direction.STORE, _Lane()), 1, 8 << 20, 1.0)
    layered = LayerJob(**{f.name: getattr(job, f.name) for f in fields(job)})
    forecast = CompletionForecast()
    forecast.saw([layered])
    forecast.learn()
    assert not forecast.has_rate
    forecast.saw([replace(job)])
    forecast.learn()
    assert forecast.has_rate


def test_nap_lateness_is_learned_fast_upwards_and_slowly_downwards() -> None:
    import time

    p = _poller(None)
    base = p._lateness
    p._learn_lateness(time.perf_counter() - 1e-3)  # a nap ended 1 ms late
    assert p._lateness > base + 0.2e-3
    high = p._lateness
    p._learn_lateness(time.perf_counter() + 1.0)  # ended early (a ring): says nothing
    assert p._lateness == high
    p._learn_lateness(time.perf_counter())  # on time
    assert high * 0.9 < p._lateness < high
    settled = p._lateness
    p._learn_lateness(time.perf_counter() - 1.0)  # a stalled loop, not a slow wake-up
    assert p._lateness == settled


@pytest.mark.anyio
async def test_spin_turns_yield_through_the_running_loops_own_primitive(anyio_backend_name: str) -> None:
    from aiokv.loops import loop_yield as _loop_yield

    yield_now = _loop_yield()
    await yield_now()  # it is awaitable on this loop
    if anyio_backend_name == "trio":
        import trio.lowlevel

        assert yield_now is trio.lowlevel.checkpoint
    else:  # asyncio and uvloop: the loop's own sleep(0), not anyio's per-call lookup
        assert yield_now is not anyio.lowlevel.checkpoint
        coro = yield_now()
        assert asyncio.iscoroutine(coro)
        await coro


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], indirect=True)
@pytest.mark.anyio
async def test_without_sniffio_asyncio_is_still_found(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from aiokv import loops

    monkeypatch.setattr(loops, "_sniffio", None)  # as if sniffio were not installed
    yield_now = loops.loop_yield()
    assert yield_now is not anyio.lowlevel.checkpoint
    await yield_now()
    assert isinstance(loops.loop_event(), asyncio.Event)


def test_outside_any_loop_falls_back_to_anyio(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv import loops

    assert loops.loop_library() is None
    monkeypatch.setattr(loops, "_sniffio", None)
    assert loops.loop_library() is None
    assert loops.loop_yield() is anyio.lowlevel.checkpoint


@pytest.mark.anyio
async def test_jobs_found_by_the_poll_before_a_nap_settle_after_the_woken_task(
    anyio_backend_name: str,
) -> None:
    """A ring pending when the poller is about to nap makes it poll once more; jobs that poll
    finds are settled too, once the task their future woke has run (on asyncio and uvloop)."""
    from aiokv.doorbell import Doorbell

    if not Doorbell.supported():
        pytest.skip("no doorbell on this platform")
    bell = Doorbell()
    log: list[str] = []
    found = anyio.Event()
    state = {"polls": 0, "pending": 1}

    def poll() -> int:
        state["polls"] += 1
        if state["polls"] == 2:  # the poll after draining the ring
            state["pending"] = 0
            found.set()
            log.append("found")
            return 1
        return 0

    async def waiter() -> None:
        await found.wait()
        log.append("woke")

    p = Poller(poll, lambda: state["pending"], expected_wait=lambda: 0.05,
               settle=lambda: log.append("settle"), bell=bell, arm=lambda: True,
               spin_seconds=200e-6, poll_interval=1e-3)
    bell.ring()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.01)  # the waiter is parked on the event
            tg.start_soon(p.run)
            with anyio.fail_after(5):
                while "settle" not in log:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
    finally:
        bell.close()
    assert state["polls"] == 2 and log.count("settle") == 1
    if anyio_backend_name != "trio":  # trio may run the two in either order
        assert log == ["found", "woke", "settle"]


@pytest.mark.anyio
async def test_loop_event_is_the_running_loops_own_and_wakes_a_waiter(anyio_backend_name: str) -> None:
    """Futures and the poller wait on ``loop_event()``: asyncio's own event on asyncio and
    uvloop (anyio's looks the loop up on every creation), anyio's on trio."""
    import asyncio

    from aiokv.loops import loop_event

    event = loop_event()
    if anyio_backend_name == "trio":
        assert not isinstance(event, asyncio.Event)
    else:
        assert isinstance(event, asyncio.Event)
    woke: list[bool] = []

    async def waiter() -> None:
        await event.wait()
        woke.append(event.is_set())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.lowlevel.checkpoint()
        assert not woke
        event.set()
    assert woke == [True]


def test_trio_as_a_guest_of_an_asyncio_loop_waits_on_trio_events() -> None:
    """Under trio's guest mode an asyncio loop is running in the thread, but the awaiting
    task is trio's: its events must be trio's (an asyncio future handed to trio fails)."""
    import asyncio

    import torch
    import trio

    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
    from aiokv.loops import loop_event, loop_library

    gen = torch.Generator().manual_seed(11)
    kv = torch.randint(-(2**31), 2**31 - 1, (8, 256), dtype=torch.int32, generator=gen)
    before = kv.clone()
    seen: dict[str, object] = {}

    async def trio_main() -> None:
        seen["library"] = loop_library()
        seen["asyncio_event"] = isinstance(loop_event(), asyncio.Event)
        async with AsyncOffloadingWorker(CanonicalKVCaches.from_tensors([kv]), num_cpu_chunks=4,
                                         backend="cpu") as worker:
            await worker.submit_store(1, GPULoadStoreSpec([6, 1]), CPULoadStoreSpec([2, 0]))
            kv[6].zero_()
            await worker.submit_load(2, CPULoadStoreSpec([2, 0]), GPULoadStoreSpec([6, 1]))

    async def host() -> object:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[object] = loop.create_future()
        trio.lowlevel.start_guest_run(
            trio_main, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=done.set_result,
        )
        return await done

    outcome = asyncio.run(host())
    outcome.unwrap()  # re-raises what the trio side raised
    assert seen == {"library": "trio", "asyncio_event": False}
    assert torch.equal(kv, before)
