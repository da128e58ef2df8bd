"""The poller's choice between spinning and sleeping, driven by fake jobs."""

from __future__ import annotations

import anyio
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


@pytest.mark.anyio
async def test_long_overdue_job_is_polled_at_the_interval_not_spun() -> None:
    p = _poller(-0.01)  # 10 ms overdue: the prediction is stale
    await _run_for(p, 0.03)
    assert p.sleeps >= 3
