"""``WorkerOptions``: every knob is checked when a worker is built (a typo or a wrong type is
``InvalidSpec``, never a silent default), and ``drain_timeout`` also where it is passed to
``aclose`` / ``shutdown``."""

from __future__ import annotations

import math

import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidSpec,
)
from tests.conftest import make_layers

pytestmark = pytest.mark.anyio


def test_constructor_rejects_bad_options() -> None:
    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="strategy must be one of"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, strategy="fastest")
    with pytest.raises(InvalidSpec, match="submit_threads"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"submit_threads": -1})
    for bad in (-1, 1.5, True, 100):
        with pytest.raises(InvalidSpec, match="staging_bytes"):
            AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"staging_bytes": bad})
    with pytest.raises(InvalidSpec, match="poll_interval"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"poll_interval": "1ms"})
    for name in ("poll_interval", "spin_seconds"):  # inf made the closing drain sleep for good
        for bad in (float("inf"), float("nan")):
            with pytest.raises(InvalidSpec, match=f"{name} must be a finite"):
                AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={name: bad})
    with pytest.raises(InvalidSpec, match="doorbell must be a bool"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"doorbell": "yes"})
    with pytest.raises(InvalidSpec, match="issue_thread must be a bool"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"issue_thread": 1})
    with pytest.raises(InvalidSpec, match="unknown worker options"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"nope": 1})
    with pytest.raises(InvalidSpec, match="unknown worker options"):  # removed in 0.1.0's lifetime
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"wait_threads": True})


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "30", True])
async def test_a_drain_timeout_that_is_no_positive_number_is_invalid_spec(bad: object) -> None:
    from aiokv import SyncOffloadingWorker

    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="drain_timeout must be"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, options={"drain_timeout": bad})
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="drain_timeout must be"):
            await worker.aclose(drain_timeout=bad)  # type: ignore[arg-type]
        assert (await worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))).success
    sync = SyncOffloadingWorker(kv.kv, num_cpu_chunks=4)
    with pytest.raises(InvalidSpec, match="drain_timeout must be"):
        sync.shutdown(drain_timeout=bad)  # type: ignore[arg-type]
    assert sync.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    sync.shutdown(drain_timeout=math.inf)
    assert [r.success for r in sync.get_finished()] == [True]
