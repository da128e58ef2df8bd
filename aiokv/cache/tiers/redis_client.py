"""The Redis side of ``RedisTier``: clients built from a URL, and the two ways to drive them.

``ThreadRedis`` (the default on every loop) runs redis-py's blocking client in a bounded
pool of worker threads (anyio ``to_thread`` with a ``CapacityLimiter``): each stripe of a
batch is one thread call that fetches, verifies and copies, so the loop thread only waits,
and on a standalone server GET replies land straight in the caller's buffers
(``redis_wire``). ``AsyncioRedis`` uses redis-py's asyncio client on the caller's asyncio
loop (checksums and copies of large values go to worker threads); it parses replies on the
loop thread and restores slower (docs/tiers.md), so it is opt-in (``client="asyncio"``).

Both send every batch as a pipeline (one round trip per group of keys; a cluster client
splits a pipeline per node, since one MGET may not span slots on several nodes) and bound
every socket operation with the tier's timeout. Imported only after ``extras.require``
found the ``redis`` package, so ``import aiokv`` works without it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.connection
import redis.cluster
import redis.connection
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from ...errors import InvalidSpec
from .redact import redacted  # re-exported: RedisTier labels itself with it
from .redis_wire import WRONG_LENGTH, exist, read_into, write_from

__all__ = ["WRONG_LENGTH", "AsyncioRedis", "Batch", "ThreadRedis", "client_options", "redacted",
           "split_url"]

# Bytes a hiredis reader takes from the socket per read: redis-py's 64 KiB reads a 2 MiB
# value in 32 feeds; 1 MiB reads it in a few and doubled the GET rate on loopback.
SOCKET_READ_BYTES = 1 << 20

# Operations one batch sends: ("get", key) -> bytes | None, ("set", key, value, ttl) -> bool,
# ("exists", key) -> int, ("del", key) -> int. A group is one pipeline, one round trip.
Op = tuple[Any, ...]
Batch = list[list[Op]]


def split_url(url: str, cluster: bool | None) -> tuple[str, bool]:
    """redis-py's URL and whether it names a cluster (``redis+cluster://``,
    ``rediss+cluster://`` or ``cluster=True``)."""
    if not isinstance(url, str) or "://" not in url:
        shown = redacted(url) if isinstance(url, str) else url
        raise InvalidSpec(f"a Redis URL looks like redis://[user:pass@]host:port/db, got {shown!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    from_scheme = scheme.endswith("+cluster")
    base = scheme.removesuffix("+cluster")
    if base not in ("redis", "rediss", "unix"):
        raise InvalidSpec(f"unsupported Redis URL scheme {parts.scheme!r}: use redis://, rediss://, "
                          "unix://, redis+cluster:// or rediss+cluster://")
    if cluster is False and from_scheme:
        raise InvalidSpec(f"cluster=False contradicts the URL scheme {parts.scheme!r}")
    is_cluster = from_scheme or bool(cluster)
    if is_cluster and base == "unix":
        raise InvalidSpec("a Redis cluster is reached over TCP, not a unix socket")
    plain = base + url[len(parts.scheme):]  # urlunsplit would drop unix:///'s empty host
    _check_url(plain, redacted(url))
    return plain, is_cluster


def _check_url(url: str, shown: str) -> None:
    """Refuse at construction what could never connect, or what redis-py would quietly
    read otherwise: a port out of range or not a number, a database that is not a number,
    a query option redis-py cannot parse."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidSpec(f"Redis URL {shown!r}: {exc}") from None
    if port == 0:
        raise InvalidSpec(f"Redis URL {shown!r}: port 0 cannot be connected to")
    if parts.scheme != "unix" and parts.path not in ("", "/") and not parts.path[1:].isdigit():
        raise InvalidSpec(f"Redis URL {shown!r}: the path names a database by its number "
                          f"(redis://host:port/0), got {parts.path!r}")
    try:
        given = redis.connection.parse_url(url)
    except ValueError as exc:
        raise InvalidSpec(f"Redis URL {shown!r}: {exc}") from None
    # redis-py hands every other query name to the connection class, which raises
    # TypeError on each connect: a misspelt name would leave the tier dead, not refused.
    unknown = sorted(set(given) - _connection_options())
    if unknown:
        raise InvalidSpec(f"Redis URL {shown!r}: unknown parameter(s) {unknown}: not one of redis-py's "
                          "connection options (socket_timeout, ssl_ca_certs, client_name, ...)")


@functools.cache
def _connection_options() -> frozenset[str]:
    """Every keyword redis-py's connections and pools (sync or asyncio, TCP, TLS or unix)
    take, so the names a URL may carry."""
    names: set[str] = set(redis.connection.URL_QUERY_ARGUMENT_PARSERS)
    classes = [redis.connection.Connection, redis.connection.SSLConnection,
               redis.connection.UnixDomainSocketConnection, redis.connection.ConnectionPool,
               redis.asyncio.connection.Connection, redis.asyncio.connection.SSLConnection,
               redis.asyncio.connection.UnixDomainSocketConnection, redis.asyncio.connection.ConnectionPool]
    for cls in classes:
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            with contextlib.suppress(TypeError, ValueError):
                names.update(name for name, p in inspect.signature(init).parameters.items()
                             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return frozenset(names)


def client_options(timeout: float, *, asyncio: bool = False) -> dict[str, Any]:
    """Connection options every client gets: the timeout on connect and on each socket
    operation, one immediate retry (a pooled connection the server dropped, e.g. after a
    restart, is reopened once), large socket reads and RESP2."""
    return {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "socket_read_size": SOCKET_READ_BYTES,
        "retry": (AsyncRetry if asyncio else Retry)(NoBackoff(), 1),
        "health_check_interval": 0,
        # RESP2: no push messages (RESP3's out-of-band replies) between the replies that
        # redis_wire reads itself, and no HELLO for servers or proxies that lack it.
        "protocol": 2,
    }


def _queue(pipe: Any, ops: Sequence[Op]) -> None:
    for op in ops:
        kind, key = op[0], op[1]
        if kind == "get":
            pipe.get(key)
        elif kind == "set":
            pipe.set(key, op[2], ex=op[3])
        elif kind == "exists":
            pipe.exists(key)
        else:
            pipe.delete(key)


class AsyncioRedis:
    """redis-py's asyncio client (standalone or cluster) on the loop that opened the tier."""

    threaded = False

    def __init__(self, url: str, cluster: bool, timeout: float) -> None:
        options = client_options(timeout, asyncio=True)
        self._timeout = timeout
        if cluster:
            options.pop("socket_read_size")  # redis-py 6's asyncio cluster client refuses it
            self._client: Any = redis.asyncio.cluster.RedisCluster.from_url(url, **options)
        else:
            # No connection cap: a capped pool refuses (not waits) past it, and concurrent
            # batches would read as misses; the callers' own concurrency bounds it.
            self._client = redis.asyncio.Redis.from_url(url, **options)

    async def round_trip(self, ops: Sequence[Op]) -> list[Any]:
        """Send one group as a pipeline; per-command errors come back in place."""
        with anyio.fail_after(self._timeout * 2):
            pipe = self._client.pipeline(transaction=False)
            _queue(pipe, ops)
            return list(await pipe.execute(raise_on_error=False))

    async def ping(self) -> None:
        """One PING, bounded by the timeout; raises what the client raised."""
        with anyio.fail_after(self._timeout * 2):
            await self._client.ping()

    async def aclose(self) -> None:
        await self._client.aclose()


class ThreadRedis:
    """redis-py's blocking client driven from at most ``threads`` worker threads."""

    threaded = True

    def __init__(self, url: str, cluster: bool, timeout: float, threads: int) -> None:
        options = client_options(timeout)
        if cluster:
            self._client: Any = redis.cluster.RedisCluster.from_url(
                url, **options)
        else:
            self._client = redis.Redis.from_url(url, **options)  # at most one per thread
        self.limiter = anyio.CapacityLimiter(threads)
        # GETs have threads (and so connections) of their own: a restore, which a request
        # waits for, never queues behind the SETs of blocks on their way down.
        self.read_limiter = anyio.CapacityLimiter(threads)
        self.cluster = cluster

    def round_trip_blocking(self, ops: Sequence[Op]) -> list[Any]:
        """One group as a pipeline, on the calling (worker) thread."""
        pipe = self._client.pipeline(transaction=False)
        _queue(pipe, ops)
        return list(pipe.execute(raise_on_error=False))

    def read_into_blocking(self, names: Sequence[bytes], header_sizes: Sequence[int],
                           views: Sequence[memoryview]) -> list[object]:
        """Pipelined GETs whose payloads land in ``views`` (``redis_wire.read_into``)."""
        return self._per_node(names, lambda client, picks: read_into(
            client, [names[j] for j in picks], [header_sizes[j] for j in picks],
            [views[j] for j in picks]))

    def write_from_blocking(self, names: Sequence[bytes], headers: Sequence[bytes],
                            payloads: Sequence[memoryview], ttl: int | None) -> list[object]:
        """Pipelined SETs sent from the callers' buffers (``redis_wire.write_from``)."""
        return self._per_node(names, lambda client, picks: write_from(
            client, [names[j] for j in picks], [headers[j] for j in picks],
            [payloads[j] for j in picks], ttl))

    def exists_blocking(self, names: Sequence[bytes]) -> list[object]:
        """Pipelined EXISTS, per node on a cluster (``redis_wire.exist``)."""
        return self._per_node(names, lambda client, picks: exist(client, [names[j] for j in picks]))

    def _per_node(self, names: Sequence[bytes],
                  exchange: Callable[[Any, list[int]], list[object]]) -> list[object]:
        """``exchange`` on the server, or on a cluster once per node with the keys in its
        slots, so a node that is down costs only its own keys (an exception in their
        places); a MOVED/ASK reply reloads the slot map for the next call."""
        if not self.cluster:
            return exchange(self._client, list(range(len(names))))
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for j, name in enumerate(names):
            node = self._client.get_node_from_key(name)
            by_node.setdefault(node.name, (node, []))[1].append(j)
        replies: list[object] = [None] * len(names)
        moved = False
        for node, picks in by_node.values():
            try:
                answers = exchange(self._client.get_redis_connection(node), picks)
            except Exception as exc:  # this node's keys fail; the others still go through
                answers = [exc] * len(picks)
            for j, answer in zip(picks, answers):
                replies[j] = answer
                moved = moved or (isinstance(answer, redis.ResponseError)
                                  and str(answer).startswith(("MOVED", "ASK")))
        if moved:  # slots changed hands (a reshard or failover)
            self._client.nodes_manager.initialize()
        return replies

    async def run(self, work: Callable[[], Any], *, reading: bool = False) -> Any:
        """Run ``work`` on a worker thread (of the readers' own, ``reading``). Not abandoned
        on cancellation: the socket timeouts bound it, and no thread may write into a
        caller's buffer after it left."""
        return await anyio.to_thread.run_sync(work, limiter=self.read_limiter if reading else self.limiter)

    async def ping(self) -> None:
        """One PING on a worker thread (every node of a cluster); raises what the client
        raised."""
        await self.run(self._client.ping)

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self._client.close, limiter=self.limiter)
