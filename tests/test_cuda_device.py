"""``aiokv info``'s device facts (``backends/cuda/device.py``) on a fake driver: every fact
comes from a ``Driver`` method, a missing one is left out, the driver is always closed,
and a driver that cannot start becomes one line instead of an error."""

from __future__ import annotations

from typing import ClassVar

import pytest

from aiokv.backends.cuda import device
from aiokv.errors import CudaCallFailed


class FakeDriver:
    closed: ClassVar[list[int]] = []

    def __init__(self, index: int) -> None:
        self.index = index
        self.driver_version = 12080
        self.batch_kind = "batch12"

    def pci_bus_id(self) -> str | None:
        return "0000:1b:00.0" if self.index == 0 else None

    def copy_engines(self) -> int | None:
        return 3 if self.index == 0 else None

    def close(self) -> None:
        FakeDriver.closed.append(self.index)


def test_facts_come_from_the_driver_and_missing_ones_are_left_out(monkeypatch) -> None:
    monkeypatch.setattr(device, "Driver", FakeDriver)
    monkeypatch.setattr(device, "_pcie_link", lambda bus: f"link of {bus}")
    FakeDriver.closed = []
    assert device.device_facts(0) == {
        "CUDA driver API": "12.8", "batched memcpy": "batch12", "PCI bus id": "0000:1b:00.0",
        "PCIe link": "link of 0000:1b:00.0", "copy engines": 3,
    }
    assert device.device_facts(1) == {"CUDA driver API": "12.8", "batched memcpy": "batch12"}
    assert FakeDriver.closed == [0, 1]


def test_a_driver_that_cannot_start_is_reported_not_raised(monkeypatch) -> None:
    def broken(index: int) -> None:
        raise CudaCallFailed("CUDA call failed: cuInit returned CUDA_ERROR_NO_DEVICE (100)", 100)

    monkeypatch.setattr(device, "Driver", broken)
    facts = device.device_facts(0)
    assert list(facts) == ["driver"] and "CUDA_ERROR_NO_DEVICE" in facts["driver"]


@pytest.mark.parametrize("bus", ["0000:00:00.0-not-a-device"])
def test_an_unknown_link_reads_unknown(bus: str) -> None:
    assert device._pcie_link(bus) == "unknown"
