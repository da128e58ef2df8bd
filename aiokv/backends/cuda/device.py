"""Device facts for ``aiokv info``: driver version, batched copies, copy engines, PCIe link.

Asks the driver only through ``Driver`` methods, and sysfs for the link.
"""

from __future__ import annotations

from typing import Any

from .driver import Driver

__all__ = ["device_facts"]


def device_facts(index: int = 0) -> dict[str, Any]:
    """Driver version, batched-copy support and the PCIe link, for ``aiokv info``.

    Every fact is best effort: a missing one is left out rather than failing.
    """
    facts: dict[str, Any] = {}
    try:
        drv = Driver(index)
    except Exception as exc:  # info must print something useful even on a broken setup
        return {"driver": f"unusable ({exc})"}
    try:
        v = drv.driver_version
        facts["CUDA driver API"] = f"{v // 1000}.{(v % 1000) // 10}"
        facts["batched memcpy"] = drv.batch_kind or "no (one cuMemcpyAsync per copy)"
        bus_id = drv.pci_bus_id()
        if bus_id is not None:
            facts["PCI bus id"] = bus_id
            facts["PCIe link"] = _pcie_link(bus_id)
        engines = drv.copy_engines()
        if engines is not None:
            facts["copy engines"] = engines
    finally:
        drv.close()
    return facts


def _pcie_link(bus_id: str) -> str:
    """Current link speed and width from sysfs (Linux); "unknown" elsewhere."""
    base = f"/sys/bus/pci/devices/{bus_id}"
    try:
        with open(f"{base}/current_link_speed") as fh:
            speed = fh.read().strip()
        with open(f"{base}/current_link_width") as fh:
            width = fh.read().strip()
    except (OSError, ValueError):
        return "unknown"
    return f"{speed} x{width}"
