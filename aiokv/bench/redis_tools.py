"""The bench's dealings with Redis: is a user's server there, remove what the bench wrote,
or start a server of its own for one run.

Every bench tier writes under a namespace of its own; before the tier closes, the bench
deletes every key under that namespace's prefix, so a run leaves the server as it found it.
A server the bench starts (``local_server``: a GPU host with no Redis installed, given a
``redis-server`` binary) listens on loopback only, keeps nothing on disk and is stopped
when the run ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio.to_thread

from ..cache.tiers.base import Tier
from ..errors import MissingExtra
from ..extras import require

__all__ = ["clear_namespace", "local_server", "ping"]

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


@contextmanager
def local_server(binary: str, *, maxmemory: int, timeout: float = 15.0) -> Iterator[str]:
    """Run ``binary`` (a ``redis-server``) on a free loopback port for the block, without
    persistence, its memory bounded by ``maxmemory`` bytes (least recently used keys go
    first); its URL. Stopped (SIGTERM, then SIGKILL after 10 s) when the block ends.
    Raises ValueError, with the server's log, if it does not answer within ``timeout``."""
    try:
        require("redis")
    except MissingExtra as exc:
        raise ValueError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="aiokv-redis-") as workdir:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = os.path.join(workdir, "redis.log")
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", workdir, "--logfile", log, "--maxmemory", str(int(maxmemory)),
               "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"]
        try:
            process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:
            raise ValueError(f"--redis-server {binary}: cannot start it ({exc})") from None
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    ping(url)
                    break
                except ValueError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        text = open(log, errors="replace").read()[-2000:] if os.path.exists(log) else ""
                        raise ValueError(f"--redis-server {binary} did not answer on port {port}"
                                         f" (exit code {process.poll()}): {text or 'no log'}") from None
                    time.sleep(0.05)
            yield url
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
