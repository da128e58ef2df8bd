"""The payload checksum of ``codec``, computed by ISA-L when it is installed.

``codec.checksum`` is zlib's crc32, which ran at 2.5-4 GB/s on the development VM: on a
Redis restore it cost as much CPU per byte as redis-py's whole GET, and held the tier to
about half of that ceiling. ISA-L's crc32 (``pip install isal``, in the ``redis`` extra)
computes the same function with SIMD at tens of GB/s. It is used only after it agreed with
``codec.checksum`` on a probe at import, so a codec that changes its checksum falls back to
``codec.checksum`` instead of reading every value as corrupt.
"""

from __future__ import annotations

from collections.abc import Callable

from . import codec

__all__ = ["FAST", "checksum"]


def _pick() -> tuple[Callable[[memoryview | bytes], int], bool]:
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return codec.checksum, False
    probe = bytes(range(256)) * 37 + b"aiokv"

    def fast(payload: memoryview | bytes) -> int:
        return int(crc32(payload)) & 0xFFFFFFFF

    if fast(probe) != codec.checksum(probe) or fast(probe[:1]) != codec.checksum(probe[:1]):
        return codec.checksum, False
    return fast, True


checksum, FAST = _pick()
