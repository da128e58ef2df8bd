"""``TransferFuture`` on its own: results and failures, callbacks, many waiters, and
cancelling one waiter without touching the others (every loop of the matrix)."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest

from aiokv import TransferFailed, TransferFuture, TransferResult, UsageError

pytestmark = pytest.mark.anyio

OK = TransferResult(7, True, 4096, 1e-3, ("GPU", "CPU"))
FAILED = TransferResult(7, False, transfer_type=("CPU", "GPU"))


async def test_a_pending_future_has_no_result_yet() -> None:
    fut = TransferFuture(7)
    assert not fut.done() and repr(fut) == "<TransferFuture job=7 pending>"
    with pytest.raises(UsageError, match="job 7 is still in flight"):
        fut.result()
    fut._resolve(OK)
    assert fut.done() and fut.result() is OK and await fut is OK
    assert repr(fut) == "<TransferFuture job=7 done>"


async def test_a_failed_future_raises_a_fresh_transfer_failed_with_its_cause_each_time() -> None:
    fut = TransferFuture(7)
    cause = OSError("the device said no")
    fut._resolve(FAILED, cause)
    errors = []
    for _ in range(2):
        with pytest.raises(TransferFailed, match="job 7 failed: OSError") as info:
            await fut
        errors.append(info.value)
    assert errors[0] is not errors[1]
    assert all(e.result is FAILED and e.__cause__ is cause for e in errors)
    assert repr(fut) == "<TransferFuture job=7 failed>"


async def test_many_waiters_wake_once_and_a_cancelled_waiter_leaves_the_others() -> None:
    fut = TransferFuture(3)
    results: list[TransferResult] = []

    async def waiter() -> None:
        results.append(await fut)

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(waiter)
        with anyio.move_on_after(0.02) as scope:
            await fut  # this waiter gives up
        assert scope.cancelled_caught and len(fut._waiters) == 5
        fut._resolve(OK)
    assert results == [OK] * 5 and fut._waiters == []


async def test_callbacks_run_once_in_order_and_a_raising_one_costs_the_others_nothing(caplog) -> None:
    fut = TransferFuture(4)
    calls: list[str] = []
    fut.add_done_callback(lambda f: calls.append("first"))
    fut.add_done_callback(lambda f: (_ for _ in ()).throw(ValueError("user bug")))
    fut.add_done_callback(lambda f: calls.append(f"third saw {f.result().job_id}"))
    with caplog.at_level(logging.ERROR, logger="aiokv"):
        fut._resolve(OK)
    assert calls == ["first", "third saw 7"]
    assert "done callback of job 4 raised ValueError('user bug')" in caplog.text
    fut.add_done_callback(lambda f: calls.append("late"))  # done: runs at once
    assert calls[-1] == "late"


async def test_a_keyboard_interrupt_in_a_callback_propagates_after_every_callback_ran() -> None:
    fut = TransferFuture(5)
    calls: list[int] = []

    def interrupt(f: TransferFuture) -> None:
        raise KeyboardInterrupt

    fut.add_done_callback(interrupt)
    fut.add_done_callback(lambda f: calls.append(1))
    with pytest.raises(KeyboardInterrupt):
        fut._resolve(OK)
    assert calls == [1] and fut.done() and fut.result() is OK


async def test_awaiting_on_another_thread_is_a_usage_error_not_a_hang() -> None:
    fut = TransferFuture(6)
    caught: list[BaseException] = []

    def elsewhere() -> None:
        try:
            anyio.run(lambda: fut._wait())
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(10)
    assert len(caught) == 1 and isinstance(caught[0], UsageError) and "another thread" in str(caught[0])
    fut._resolve(OK)
    assert await fut is OK
