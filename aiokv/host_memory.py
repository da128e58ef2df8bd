"""How much host memory there is, and the refusal of a host pool larger than that, asked
before the pool is allocated (a pinned allocation that cannot fit fails late and slowly,
or takes the host into swap)."""

from __future__ import annotations

import os

from .errors import HostMemoryError

__all__ = ["available_host_memory", "check_pool_fits"]


def available_host_memory() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` where /proc/meminfo has it,
    else free pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_pool_fits(num_chunks: int, chunk_bytes: int) -> None:
    """Refuse a host pool larger than the memory available, before asking for it."""
    wanted = num_chunks * chunk_bytes
    available = available_host_memory()
    if available is not None and wanted > available:
        raise HostMemoryError(
            f"a host pool of {num_chunks} chunks of {chunk_bytes} bytes ({wanted / 2**30:.3g} GiB) "
            f"was asked for, but only {available / 2**30:.3g} GiB of host memory is available; "
            "ask for fewer chunks (num_cpu_chunks=) or bytes (cpu_bytes=)"
        )
