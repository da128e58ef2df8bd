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
    await _run_for(p, 0.05)
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
    assert p.sleeps >= 3


class _Pending:
    """A completion that never finishes."""

    elapsed = None
    error = None
    started_at: float | None = None  # the backend gave no stamp

    def query(self) -> bool:
        return False


class _Lane:
    def launch(self, plan, dependency):
        return _Pending()


def test_handler_reads_a_slightly_late_job_as_due_and_a_very_late_one_as_stale() -> None:
    from types import SimpleNamespace

    from aiokv.handler import Handler
    from aiokv.specs import Direction

    h = Handler(Direction.STORE, _Lane())
    assert h.expected_wait(0.0) is None  # nothing in flight
    job = h.submit(1, SimpleNamespace(total_bytes=8 << 20), None)
    assert h.expected_wait(job.submitted_at) is None  # rate not learned yet
    h._rate = 1e9  # 8 MiB at 1 GB/s: predicted to take ~8.4 ms
    start = job.submitted_at
    span = (8 << 20) / 1e9
    assert h.expected_wait(start) == pytest.approx(span)
    assert h.expected_wait(start + span + 1e-3) == 0.0  # 1 ms late: under the 2 ms slack
    assert h.expected_wait(start + span + 3e-3) == pytest.approx(-3e-3)  # stale
    # A backend stamp of when the copies were handed over (after planning) moves the end.
    job.completion.started_at = start + 5e-3
    assert h.expected_wait(start) == pytest.approx(span + 5e-3)


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
    from aiokv.poller import _loop_yield

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
    import sys

    from aiokv.poller import _loop_yield

    monkeypatch.setitem(sys.modules, "sniffio", None)  # "import sniffio" now raises
    yield_now = _loop_yield()
    assert yield_now is not anyio.lowlevel.checkpoint
    await yield_now()


def test_outside_any_loop_falls_back_to_anyio(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from aiokv.poller import _loop_yield

    monkeypatch.setitem(sys.modules, "sniffio", None)
    assert _loop_yield() is anyio.lowlevel.checkpoint


def _handler_with_rate(rate: float):
    from aiokv.handler import Handler
    from aiokv.specs import Direction

    h = Handler(Direction.STORE, _Lane())
    h._rate = rate
    return h


def test_end_bias_settles_near_the_earliest_ends_from_closely_seen_jobs() -> None:
    """Jobs end 40-100 us after the rate's prediction and each end is seen within 5 us:
    the bias moves towards the early ends, so the spin before them starts that much later."""
    import random
    from types import SimpleNamespace

    rng = random.Random(7)
    h = _handler_with_rate(50e9)
    nbytes = 256 << 20  # ~5.4 ms at 50 GB/s
    for i in range(400):
        job = SimpleNamespace(started_at=float(i), nbytes=nbytes)
        end = i + nbytes / 50e9 + rng.uniform(40e-6, 100e-6)
        h._learn_bias(job, end - 5e-6, end + 5e-6)
    assert 35e-6 < h._bias < 75e-6
    head = h.submit(1, SimpleNamespace(total_bytes=nbytes), None)
    assert h.expected_wait(head.started_at) == pytest.approx(nbytes / 50e9 + h._bias)


def test_end_bias_ignores_jobs_seen_late_and_stays_bounded() -> None:
    from types import SimpleNamespace

    h = _handler_with_rate(50e9)
    job = SimpleNamespace(started_at=0.0, nbytes=256 << 20)
    predicted = job.nbytes / 50e9
    for _ in range(50):  # caught after a nap: running long before, seen long after
        h._learn_bias(job, predicted - 2e-3, predicted + 2e-3)
    assert h._bias == 0.0
    for _ in range(500):  # surely ending 5 ms late, again and again: capped at 0.5 ms
        h._learn_bias(job, predicted + 5e-3, predicted + 5.01e-3)
    assert h._bias == pytest.approx(0.5e-3)
    small = h.submit(1, SimpleNamespace(total_bytes=2 << 20), None)  # ~42 us of work
    span = small.nbytes / 50e9
    assert h.expected_wait(small.started_at) == pytest.approx(1.25 * span)  # a quarter at most
    h._fifo.clear()
    for _ in range(100):  # ending before the prediction pulls it down, fast
        h._learn_bias(job, predicted - 30e-6, predicted - 20e-6)
    assert -30e-6 < h._bias < 0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _TimedCompletion:
    """Handed to the device at ``start``, which starts ``delay`` later and takes ``span``."""

    error = None

    def __init__(self, clock: _Clock, start: float, span: float, delay: float) -> None:
        self.clock, self.started_at, self.elapsed = clock, start, span
        self.end = start + delay + span

    def query(self) -> bool:
        return self.clock.now >= self.end


def test_end_bias_through_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-to-back 8 MiB jobs polled every 10 us; now and then a poll comes late and finds
    two jobs done. The second of those must not count (its prediction would start at the
    first one's pop): with ends exactly as the rate predicts, the bias stays ~0. Then the
    device starts each job 60 us after it is handed over: the bias climbs to about that."""
    from types import SimpleNamespace

    import aiokv.handler as handler_module
    from aiokv.handler import Handler
    from aiokv.specs import Direction

    clock = _Clock()
    monkeypatch.setattr(handler_module, "time", clock)
    span = (8 << 20) / 50e9

    class Lane:
        device_free = 0.0  # the device runs one job after another
        delay = 0.0

        def launch(self, plan, dependency):
            done = _TimedCompletion(clock, max(clock.now, self.device_free), span, self.delay)
            self.device_free = done.end
            return done

    lane = Lane()
    h = Handler(Direction.STORE, lane)
    h._rate = 50e9

    def run_pairs(n: int) -> None:
        for i in range(n):
            for job_id in (2 * i, 2 * i + 1):
                job = h.submit(job_id, SimpleNamespace(total_bytes=8 << 20), None)
                job.launched_at = clock.now  # its default stamp reads the real clock
            while h.in_flight:
                h.pop_finished()
                clock.now += 10e-6 if i % 3 else 3 * span  # every third pair: one late poll

    run_pairs(200)
    assert abs(h._bias) < 15e-6
    lane.delay = 60e-6
    run_pairs(200)
    assert 40e-6 < h._bias < 75e-6
