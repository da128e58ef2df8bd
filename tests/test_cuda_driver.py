"""The CUDA driver facade without a GPU: which error codes break the worker, what binds
where the bindings are older than the driver, that a pin refused for lack of memory says
what to ask for, and that a dropped worker hands its pool over before it warns."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
from cuda.bindings import driver as cu

from aiokv.backends.cuda.driver import Driver, translate
from aiokv.errors import CudaCallFailed, HostMemoryError, WorkerBroken


@pytest.mark.parametrize("name", ["CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_CONTAINED",
                                  "CUDA_ERROR_TENSOR_MEMORY_LEAK", "CUDA_ERROR_MPS_CLIENT_TERMINATED"])
def test_errors_that_leave_the_process_unusable_break_the_worker(name: str) -> None:
    if not hasattr(cu.CUresult, name):
        pytest.skip(f"these bindings have no {name}")
    assert isinstance(translate(int(getattr(cu.CUresult, name)), "cuEventQuery"), WorkerBroken)


@pytest.mark.parametrize(("code", "raised"), [
    (cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, "WorkerBroken"),
    (cu.CUresult.CUDA_ERROR_INVALID_VALUE, "InvalidSpec"),
    (cu.CUresult.CUDA_ERROR_NOT_PERMITTED, "CudaCallFailed"),
])
def test_a_translated_error_keeps_the_raw_driver_error_as_its_cause(code: Any, raised: str) -> None:
    import aiokv.errors

    err = translate(int(code), "cuEventQuery")
    assert type(err) is getattr(aiokv.errors, raised)
    raw = err.__cause__
    assert isinstance(raw, aiokv.errors.DriverError)
    assert (raw.code, raw.what, raw.name) == (int(code), "cuEventQuery", code.name)
    assert f"cuEventQuery returned {code.name} ({int(code)})" in str(err)


def test_bindings_older_than_the_driver_copy_one_call_per_copy(monkeypatch) -> None:
    """cuda-python 12.6-12.7 has no CUmemcpyAttributes: a 12.8 driver's batched call cannot
    be described with them, so copies go one cuMemcpyAsync at a time."""
    drv = object.__new__(Driver)
    drv.driver_version = 13000
    # The driver has both entry points (never called here; a fake address stands in).
    monkeypatch.setattr(cu, "cuGetProcAddress", lambda *_: (cu.CUresult.CUDA_SUCCESS, 0x1000))
    assert drv._load_batch()[1] == "batch13"
    drv.batch_kind = "batch13"
    assert drv._load_batch3d() is not None
    monkeypatch.delattr(cu, "CUmemcpyAttributes")
    assert drv._load_batch() == (None, "loop")
    monkeypatch.delattr(cu, "CUmemcpy3DOperandType")
    assert drv._load_batch3d() is None


def test_threads_building_the_copy_attributes_at_once_all_pass_the_kept_one(monkeypatch) -> None:
    """The first batched copies of a driver may come from several threads (lanes, the DMA
    submit threads), each finding no attributes yet. Every address handed to the driver
    must be that of the object the driver keeps: another one is freed while in use."""
    built = []

    class SlowAttributes:  # a thread switch lands inside the construction
        def __init__(self) -> None:
            built.append(self)
            time.sleep(0.05)

        def getPtr(self) -> int:  # cuda-python's name
            return id(self)

    monkeypatch.setattr(cu, "CUmemcpyAttributes", SlowAttributes)
    drv = object.__new__(Driver)
    drv._attrs, drv._attr_ptrs = {}, {}
    seen: list[int] = []
    threads = [threading.Thread(target=lambda: seen.append(drv._attr_at(True, None))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) > 1, "the threads should have raced"
    kept = drv._attrs[(True, None)]
    assert seen == [id(kept)] * 4


@pytest.mark.parametrize(("code", "raised"), [
    (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, HostMemoryError),
    (cu.CUresult.CUDA_ERROR_NOT_PERMITTED, CudaCallFailed),
])
def test_a_pin_refused_for_lack_of_memory_raises_host_memory_error(monkeypatch, code, raised) -> None:
    drv = object.__new__(Driver)
    drv.broken = None
    calls: list[tuple[int, int]] = []

    def register(address: int, nbytes: int, flags: Any) -> tuple[Any]:
        calls.append((address, nbytes))
        return (code,)

    monkeypatch.setattr(cu, "cuMemHostRegister", register)
    with pytest.raises(raised) as info:
        drv.host_register(0x10000, 3 << 30)
    assert calls == [(0x10000, 3 << 30)]
    if raised is HostMemoryError:
        message = str(info.value)
        assert str(3 << 30) in message and "fewer chunks" in message and "ulimit -l" in message
        assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value.__cause__)
        assert isinstance(info.value, MemoryError)  # what a caller may already catch


def test_a_dropped_worker_hands_its_pool_over_before_it_warns(monkeypatch) -> None:
    from aiokv import AsyncOffloadingWorker
    from aiokv.backends.cpu import CpuHostPool
    from tests.conftest import make_layers

    seen: list[str] = []
    monkeypatch.setattr(CpuHostPool, "abandon", lambda self: seen.append("pool"))
    worker = AsyncOffloadingWorker(make_layers(num_blocks=8).kv, num_cpu_chunks=4, backend="cpu")
    with pytest.warns(ResourceWarning):
        del worker
        gc.collect()
    assert seen == ["pool"]
