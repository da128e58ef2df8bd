"""The CUDA bench's setup without a GPU: the baselines close the ``Driver`` they open on every
way out, and the GEMM load scripts use is public."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import aiokv.backends.cuda.driver as driver_package
from aiokv.bench import cuda_setup
from aiokv.errors import CudaCallFailed


class FakeDriver:
    """Records what the baselines open and close; its first stream is refused."""

    opened: ClassVar[list[FakeDriver]] = []

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.closed = 0
        FakeDriver.opened.append(self)

    def create_stream(self, high_priority: bool = False) -> Any:
        raise CudaCallFailed("CUDA call failed: cuStreamCreate returned CUDA_ERROR_NOT_PERMITTED (800)", 800)

    def close(self) -> None:
        self.closed += 1


def test_the_baselines_close_their_driver_when_a_measurement_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver_package, "Driver", FakeDriver)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    FakeDriver.opened.clear()
    layers = [torch.randint(0, 256, (2, 128, 2, 32), dtype=torch.uint8) for _ in range(2)]
    setup = cuda_setup.BenchSetup("tiny", layers, block_dim=1, chunks=128, seed=0)
    # Without CUDA the pinned host buffer is refused (RuntimeError); with it, the stream is.
    with pytest.raises((RuntimeError, CudaCallFailed)):
        cuda_setup.baselines(setup, reps=1, ceiling={"store": 1.0, "load": 1.0})
    assert [d.closed for d in FakeDriver.opened] == [1]


def test_the_gemm_load_is_public_for_scripts() -> None:
    import aiokv.bench

    assert aiokv.bench.Gemm is cuda_setup.Gemm and "Gemm" in aiokv.bench.__all__
