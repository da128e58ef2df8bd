"""The doorbell pipe, the deferred (driver-run) ring, and the poller napping on it."""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time

import anyio
import pytest

from aiokv.doorbell import Doorbell
from aiokv.poller import Poller


def _readable(bell: Doorbell) -> bool:
    return bool(select.select([bell.fileno()], [], [], 0)[0])


def test_ring_makes_it_readable_until_drained() -> None:
    bell = Doorbell()
    try:
        assert not _readable(bell) and bell.drain() == 0
        bell.ring()
        bell.ring()
        assert _readable(bell)
        assert bell.drain() == 2
        assert not _readable(bell)
    finally:
        bell.close()


def test_ringing_a_full_or_closed_bell_is_harmless() -> None:
    bell = Doorbell()
    for _ in range(200_000):  # far past a pipe's 64 KiB
        bell.ring()
    assert bell.drain() >= 4096
    bell.close()
    bell.close()
    bell.ring()  # a late ring after close does nothing (the fd number may be reused)
    assert bell.drain() == 0


def test_a_deferred_ring_rings_only_when_the_host_function_runs() -> None:
    """What the driver does: call ``host_function()`` with the handle, from its thread."""
    bell = Doorbell()
    fn = Doorbell.host_function()
    assert fn  # glibc is loadable on every machine we run on
    host_fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(fn)
    fds_before = len(os.listdir("/proc/self/fd"))
    handles = [bell.deferred_ring() for _ in range(3)]
    assert not _readable(bell)  # the byte sits in the FILE's buffer
    done = threading.Thread(target=host_fn, args=(handles[0],))
    done.start()
    done.join()
    assert bell.drain() == 1
    Doorbell.cancel_deferred(handles[1])  # one the driver refused: closed silently
    assert not _readable(bell)
    host_fn(handles[2])
    assert bell.drain() == 1
    assert len(os.listdir("/proc/self/fd")) == fds_before  # each FILE closed its dup
    bell.close()


class _Job:
    """One pending job that a thread finishes (and rings for) when told to."""

    def __init__(self, bell: Doorbell) -> None:
        self.bell = bell
        self.done = threading.Event()
        self.armed = 0
        self.popped = False

    def arm(self) -> bool:
        self.armed += 1
        return True

    def poll(self) -> int:
        if self.done.is_set() and not self.popped:
            self.popped = True
            return 1
        return 0

    def pending(self) -> int:
        return 0 if self.popped else 1

    def finish(self) -> None:
        self.done.set()
        self.bell.ring()


def _long_napper(job: _Job) -> Poller:
    """Naps of up to a minute: only the bell (or a submit) can end them within a test."""
    return Poller(job.poll, job.pending, bell=job.bell, arm=job.arm, spin_seconds=200e-6,
                  poll_interval=60.0, max_nap=60.0)


async def _until_popped(job: _Job) -> None:
    with anyio.fail_after(10):
        while job.pending():
            await anyio.sleep(0.001)


async def _until_napping(p: Poller, naps: int = 1) -> None:
    """Until the poller has begun ``naps`` naps (a loaded host may take a while)."""
    with anyio.fail_after(10):
        while p.sleeps < naps:
            await anyio.sleep(0.001)


@pytest.mark.anyio
@pytest.mark.parametrize("ended_by", ["ring", "submit"])
async def test_a_bell_nap_ends_on_a_ring_or_a_submit(ended_by: str) -> None:
    job = _Job(Doorbell())
    p = _long_napper(job)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await _until_napping(p)
        await anyio.sleep(0.05)
        assert p.sleeps == 1 and job.armed == 1  # one long nap on the bell
        polls = p.polls
        if ended_by == "ring":
            await anyio.to_thread.run_sync(job.finish)  # from another thread, as a lane does
        else:
            job.done.set()  # finished without ringing: only the submit's wake ends the nap
            p.wake()
        await _until_popped(job)
        assert p.polls > polls
        tg.cancel_scope.cancel()
    job.bell.close()


@pytest.mark.anyio
async def test_an_unarmed_head_falls_back_to_timer_naps() -> None:
    bell = Doorbell()
    p = Poller(lambda: 0, lambda: 1, bell=bell, arm=lambda: False, spin_seconds=200e-6,
               poll_interval=1e-3, max_nap=60.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert p.sleeps >= 5  # ~1 ms naps, not one minute-long one
    bell.close()


def test_the_alarm_makes_it_readable_once_it_goes_off() -> None:
    bell = Doorbell()
    try:
        assert bell.has_alarm  # Linux: timerfd
        assert bell.set_alarm(0.02)
        assert not _readable(bell)
        assert select.select([bell.fileno()], [], [], 5.0)[0]
        assert bell.drain() == 0  # no ring, only the alarm
        assert not _readable(bell)
        assert bell.set_alarm(0.01) and bell.set_alarm(0)  # cleared before it went off
        assert not select.select([bell.fileno()], [], [], 0.03)[0]
    finally:
        bell.close()
    assert not bell.set_alarm(0.01)  # closed


@pytest.mark.anyio
async def test_poller_wakes_on_the_alarm_before_a_predicted_end() -> None:
    """A job predicted to end in 50 ms that ends then without ringing: only the alarm set
    for just before that end can wake a poller whose timer naps last a minute."""
    bell = Doorbell()
    deadline = [0.0]
    done = [False]

    def poll() -> int:
        if not done[0] and time.perf_counter() >= deadline[0]:
            done[0] = True
            return 1
        return 0

    p = Poller(poll, lambda: 0 if done[0] else 1, bell=bell, arm=lambda: True,
               expected_wait=lambda: deadline[0] - time.perf_counter(),
               spin_seconds=200e-6, poll_interval=60.0, max_nap=60.0)
    deadline[0] = time.perf_counter() + 0.05
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        with anyio.fail_after(10):
            while not done[0]:
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    assert p.sleeps >= 1
    bell.close()


@pytest.mark.anyio
async def test_a_ring_between_a_poll_and_the_nap_is_not_lost() -> None:
    """The job ends (and rings) right after a poll saw it running; the nap drains the
    pipe first, so it must look again rather than sleep through the backstop."""
    bell = Doorbell()
    state = {"calls": 0, "done": False, "popped": False}

    def poll() -> int:
        state["calls"] += 1
        if state["done"] and not state["popped"]:
            state["popped"] = True
            return 1
        if state["calls"] == 1:  # ends just after this "not yet"
            state["done"] = True
            bell.ring()
        return 0

    p = Poller(poll, lambda: 0 if state["popped"] else 1, bell=bell, arm=lambda: True,
               spin_seconds=0.0, poll_interval=60.0, max_nap=60.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        with anyio.fail_after(10):
            while not state["popped"]:
                await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    bell.close()


@pytest.mark.anyio
async def test_on_asyncio_the_bell_stays_watched_while_the_poller_runs(anyio_backend_name: str) -> None:
    """asyncio and uvloop keep the bell registered with the loop (no register/unregister
    per nap): a ring while the poller spins is drained by the loop, and once the poller
    stops nothing watches the bell any more. Trio watches it only while napping."""
    bell = Doorbell()
    p = Poller(lambda: 0, lambda: 1, bell=bell, arm=lambda: True, expected_wait=lambda: 0.0,
               spin_seconds=60.0, poll_interval=60.0, max_nap=60.0)  # "due now": it spins
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await anyio.sleep(0.01)
        bell.ring()
        await anyio.sleep(0.01)
        drained_while_spinning = not _readable(bell)
        tg.cancel_scope.cancel()
    assert p.sleeps == 0
    assert drained_while_spinning is (anyio_backend_name != "trio")
    bell.drain()
    bell.ring()
    await anyio.sleep(0.01)
    assert _readable(bell)  # stopped: nobody drains it
    bell.close()


@pytest.mark.anyio
async def test_an_alarm_left_set_by_a_rung_nap_does_not_disturb_later_naps() -> None:
    """A ring ends a nap before its alarm; the alarm is not cleared and goes off later,
    while the poller is idle. The next job's nap must still last until its own ring."""
    job = _Job(Doorbell())
    p = Poller(job.poll, job.pending, bell=job.bell, arm=job.arm,
               expected_wait=lambda: 0.03 if not job.done.is_set() else None,
               spin_seconds=0.0, poll_interval=60.0, max_nap=60.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await _until_napping(p)  # napping, the alarm set ~30 ms out
        assert p.sleeps == 1
        await anyio.to_thread.run_sync(job.finish)
        await _until_popped(job)
        await anyio.sleep(0.06)  # the stale alarm goes off with nothing in flight
        second = _Job(job.bell)
        job.__dict__.update(done=second.done, popped=False)  # a new job in the same slot
        before = p.sleeps
        p.wake()
        await _until_napping(p, before + 1)
        await anyio.sleep(0.05)
        assert job.pending()
        assert p.sleeps - before <= 4  # ~30 ms naps on the new alarm, not a busy loop
        await anyio.to_thread.run_sync(job.finish)
        await _until_popped(job)
        tg.cancel_scope.cancel()
    job.bell.close()


@pytest.mark.anyio
async def test_a_stale_ring_pending_when_a_nap_begins_does_not_end_it() -> None:
    """A job's ring can land after the job was already seen done by a poll (the driver's
    callback thread is slower than a spinning poll), while the next job is submitted. The
    next nap must not end on that ring: on the GPU host it split every nap in two."""
    bell = Doorbell()
    bell.ring()  # the previous job's ring, late
    end = time.perf_counter() + 0.5
    p = Poller(lambda: 0, lambda: 1, bell=bell, arm=lambda: True,
               expected_wait=lambda: end - time.perf_counter(),
               spin_seconds=0.0, poll_interval=60.0, max_nap=60.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await _until_napping(p)
        await anyio.sleep(0.03)
        tg.cancel_scope.cancel()
    assert p.sleeps == 1
    bell.close()


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], indirect=True)
@pytest.mark.anyio
async def test_a_loop_that_cannot_keep_the_bell_registered_naps_through_anyio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An asyncio loop whose add_reader is not implemented for the poller (as on Windows'
    proactor loop) still gets bell naps, watched only while napping."""
    import asyncio

    from aiokv import poller

    def unsupported(self: poller._ReaderNaps) -> None:
        raise NotImplementedError

    monkeypatch.setattr(poller._ReaderNaps, "start", unsupported)
    job = _Job(Doorbell())
    p = _long_napper(job)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await anyio.sleep(0.05)
        assert isinstance(p._naps, poller._BellNaps) and p.sleeps == 1
        await anyio.to_thread.run_sync(job.finish)
        await _until_popped(job)
        tg.cancel_scope.cancel()
    assert p._naps is None
    assert not asyncio.get_running_loop().remove_reader(job.bell.fileno())  # never registered
    job.bell.close()


@pytest.mark.anyio
async def test_releasing_the_bell_while_the_poller_runs_unwatches_it() -> None:
    """What a close interrupted mid-drain does before closing the bell: the still-running
    poller stops watching it and falls back to timer naps."""
    bell = Doorbell()
    p = Poller(lambda: 0, lambda: 1, bell=bell, arm=lambda: True, spin_seconds=0.0,
               poll_interval=1e-3, max_nap=60.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(p.run)
        await anyio.sleep(0.01)
        p.release_bell()
        bell.ring()
        before = p.sleeps
        await anyio.sleep(0.03)
        assert _readable(bell)  # nobody drains it any more
        assert p.sleeps - before >= 5  # ~1 ms timer naps, not one long bell nap
        tg.cancel_scope.cancel()
    bell.close()
