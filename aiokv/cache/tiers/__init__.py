"""Lower cache tiers under the host pool: the contract, the value codec, and the tiers.

``DiskTier`` and ``RedisTier`` import lazily; ``RedisTier`` needs the optional ``redis``
extra only when one is constructed (``aiokv.extras``; ``MissingExtra`` names the command).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
        from .redis import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
