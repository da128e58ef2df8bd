"""The bench's dealings with a user's Redis: is it there, and remove what the bench wrote.

Every bench tier writes under a namespace of its own; before the tier closes, the bench
deletes every key under that namespace's prefix, so a run leaves the server as it found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from ..cache.tiers.base import Tier
from ..errors import MissingExtra
from ..extras import require

__all__ = ["clear_namespace", "ping"]

TIMEOUT = 5.0


def _client(url: str) -> Any:
    try:
        redis = require("redis")
    except MissingExtra as exc:  # the bench CLI prints a ValueError without a traceback
        raise ValueError(str(exc)) from None
    scheme, sep, rest = url.partition("://")
    if scheme.lower().endswith("+cluster"):
        return redis.RedisCluster.from_url(f"{scheme.lower().removesuffix('+cluster')}{sep}{rest}",
                                           socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
    return redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)


def ping(url: str) -> None:
    """Raise ValueError, saying why, unless the server at ``url`` answers."""
    try:
        client = _client(url)
        try:
            client.ping()
        finally:
            client.close()
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"--redis-url {url}: the server does not answer ({type(exc).__name__}: "
                         f"{exc}); start it or fix the URL") from None


async def clear_namespace(url: str, tiers: Sequence[Tier]) -> int:
    """Delete every key under the prefix of the open Redis tiers among ``tiers``; how many."""
    prefixes = []
    for tier in tiers:
        redis_key = getattr(tier, "redis_key", None)
        if tier.remote and callable(redis_key):
            key = bytes(redis_key(b"prefix"))
            prefixes.append(key[: key.rindex(b":") + 1])
    if not prefixes:
        return 0

    def clear() -> int:
        client = _client(url)
        per_key = "+cluster" in url.partition("://")[0].lower()  # keys of one call share a slot
        removed = 0
        try:
            for prefix in prefixes:
                batch: list[bytes] = []
                for key in client.scan_iter(match=prefix + b"*", count=1000):
                    batch.append(key)
                    if per_key or len(batch) >= 1000:
                        removed += client.unlink(*batch)
                        batch.clear()
                if batch:
                    removed += client.unlink(*batch)
        finally:
            client.close()
        return removed

    try:
        return await anyio.to_thread.run_sync(clear)
    except Exception as exc:  # the server went away during the run
        raise ValueError(f"--redis-url {url}: could not delete the bench's keys under "
                         f"{prefixes[0].decode()} ({type(exc).__name__}: {exc})") from None
