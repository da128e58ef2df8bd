"""Whether the disk tier reads through its native reader (``_diskread``, built from
``_diskread.c`` at install time where a C compiler and zlib's headers are), and why.

The reader opens, reads and checksums many block files in one call without the GIL, so a
restore's reads do not wait for the GIL after every system call and every page's crc32
while the event loop or the model's thread runs Python (docs/tiers.md, "The restore
read"). Where it is not built, or ``AIOKV_DISK_NATIVE=0``, the tier reads from Python with
the same results.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ...errors import InvalidSpec

__all__ = ["ENV", "reader", "status"]

ENV = "AIOKV_DISK_NATIVE"
_ABI = 3  # raise with ``ABI`` in _diskread.c whenever its calls or rows change

try:
    _ext: Any = importlib.import_module(f"{__package__}._diskread")
except ImportError as exc:  # not built (no compiler or zlib headers), or for another Python
    _ext = None
    missing = isinstance(exc, ModuleNotFoundError) and exc.name == f"{__package__}._diskread"
    _WHY = "not built" if missing else f"failed to load ({exc})"
else:
    if getattr(_ext, "ABI", None) != _ABI:  # an in-place build left from older sources
        _WHY = (f"built from other sources (ABI {getattr(_ext, 'ABI', None)}, this aiokv speaks "
                f"{_ABI}): rebuild it (python3 setup.py build_ext --inplace, or reinstall)")
        _ext = None
    else:
        _WHY = "built"


def _wanted() -> bool:
    value = (os.environ.get(ENV) or "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidSpec(f"{ENV}={os.environ.get(ENV)!r}: use 1 or 0")


def reader() -> Any:
    """The native reader module to read with now, or None (not built, or turned off by
    ``AIOKV_DISK_NATIVE=0``; read when a tier opens). A value it does not understand
    raises ``InvalidSpec`` even where the reader is not built: a typo must not pass."""
    return _ext if _wanted() else None


def status() -> str:
    """How a disk tier opened now reads, in words."""
    if not _wanted():
        return f"python ({ENV}=0)"
    return "native reader" if _ext is not None else f"python ({_WHY})"
