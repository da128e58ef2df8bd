"""Lower cache tiers under the host pool: the contract, the value codec, and the tiers.

``DiskTier`` and ``RedisTier`` import lazily: ``RedisTier`` needs the optional ``redis``
package (``pip install 'aiokv[redis]'``) only when one is constructed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...errors import UsageError
from . import codec
from .base import Tier, TierStatistics

if TYPE_CHECKING:
    from .disk import DiskTier
    from .redis import RedisTier

__all__ = ["DiskTier", "RedisTier", "Tier", "TierStatistics", "codec"]


def __getattr__(name: str) -> Any:
    if name == "DiskTier":
        from .disk import DiskTier

        return DiskTier
    if name == "RedisTier":
        try:
            from .redis import RedisTier
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in ("redis", "hiredis"):
                raise
            return _missing_redis(exc)
        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _missing_redis(exc: ImportError) -> type:
    """A stand-in that exists without the optional package and says how to get it."""

    class RedisTier:
        """Needs ``pip install 'aiokv[redis]'``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise UsageError(
                "RedisTier needs the optional redis package: pip install 'aiokv[redis]'"
            ) from exc

    return RedisTier
