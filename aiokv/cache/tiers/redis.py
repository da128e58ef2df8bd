"""A cache tier in Redis (or Valkey): one shared store that several servers read and write.

Each block is one Redis string, ``header + payload`` (``codec``), under a key named by the
layout fingerprint, the tenant's ``namespace`` and a digest of the block's key, so two models
or two tenants never exchange bytes; a value that does not verify reads as a miss and counts
as corrupt. Batches travel as pipelines (one round trip per group of keys; a cluster splits
them per node). Any I/O trouble (a timeout, a lost connection, a restarted server) is a miss
or a dropped write, counted in ``statistics().errors``; redis-py reopens connections on the
next call, so the tier recovers by itself. See docs/tiers.md.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Literal, cast

import anyio
import anyio.to_thread

from ...errors import InvalidSpec, TierError, UsageError
from ...extras import require
from ...loops import loop_library
from . import codec
from .base import Tier, TierStatistics, byte_view, check_capacity, positive_count, positive_seconds
from .health import FailureLog
from .redis_quota import WriteQuota
from .redis_values import (
    CORRUPT,
    FAILED,
    HIT,
    MISS,
    check_landed,
    encode_headers,
    encode_values,
    groups_of,
    land_replies,
)

if TYPE_CHECKING:
    from .redis_client import AsyncioRedis, Op, ThreadRedis

__all__ = ["RedisTier"]

# Checksums and copies of a group at least this large run on a worker thread, not the loop.
_OFFLOAD_BYTES = 256 << 10
_EXISTS_PER_ROUND_TRIP = 4096


class RedisTier(Tier):
    """Blocks in a Redis server or cluster shared by every process that names the same URL,
    layout and namespace.

    Args:
        url: ``redis://[user:pass@]host:port/db`` (AUTH through the URL), ``rediss://...``
            for TLS (``?ssl_ca_certs=...&ssl_cert_reqs=required`` as redis-py reads them),
            ``unix:///path``; ``redis+cluster://host:port`` or ``rediss+cluster://`` (or
            ``cluster=True``) for a Redis Cluster, found from any one node.
        namespace: a tenant's name, folded into every key and header: tiers of different
            namespaces never read each other's blocks.
        capacity_bytes: a bound on the KV bytes *this process* keeps in the store. The tier
            remembers what it wrote (least recently used first) and deletes its own oldest
            blocks to stay under it. None: no bound from this side; bound the server instead
            (``maxmemory`` with ``maxmemory-policy allkeys-lru``), which is the right bound
            for a store that several processes share.
        write_through: the cache also writes every block it stores here at once.
        timeout: seconds allowed for connecting and for each socket operation.
        ttl: seconds a block lives in the store (SET EX), or None to keep it until evicted.
        cluster: force cluster mode on (True) or check it is off (False); None: from the URL.
        client: "thread" (redis-py's blocking client on worker threads, any loop; GET
            replies land straight in the caller's buffers, SETs go from them),
            "asyncio" (redis-py's asyncio client, asyncio loops only) or "auto" (the thread
            client: it restores faster than the asyncio client, whose parser copies each
            value several times on the loop thread; docs/tiers.md).
        threads: worker threads and connections, so up to this many round trips of one
            batch run at once (the asyncio client checksums large values on them too); the
            thread client has as many again for reads, so a restore never waits behind SETs.
        group_bytes: value bytes per round trip; larger blocks go one per round trip, which
            read fastest on loopback (batching 2 MiB values into one reply halved the rate).
        check: PING the server at ``open`` and raise ``TierError`` with its reason if that
            fails (a wrong password, nothing listening). Off by default, so a server that is
            down when the cache starts is a miss until it is back, not a failed start;
            either way the first failure is logged (``aiokv`` logger) with the reason.
    """

    name = "redis"
    remote = True

    def __init__(
        self,
        url: str,
        *,
        namespace: str | bytes | None = None,
        capacity_bytes: int | None = None,
        write_through: bool = False,
        timeout: float = 5.0,
        ttl: float | None = None,
        cluster: bool | None = None,
        client: Literal["auto", "asyncio", "thread"] = "auto",
        threads: int = 4,
        group_bytes: int = 1 << 20,
        check: bool = False,
    ) -> None:
        self._client_module = _client_module()
        self._url, self.cluster = self._client_module.split_url(url, cluster)
        if capacity_bytes is not None:
            capacity_bytes = positive_count(capacity_bytes, "capacity_bytes")
        self.timeout = positive_seconds(timeout, "timeout")
        if ttl is not None:
            ttl = positive_seconds(ttl, "ttl")
        if client not in ("auto", "asyncio", "thread"):
            raise InvalidSpec(f"client must be 'auto', 'asyncio' or 'thread', got {client!r}")
        self._threads = positive_count(threads, "threads")
        self._group_bytes = positive_count(group_bytes, "group_bytes")
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.write_through = bool(write_through)
        self._ttl = None if ttl is None else max(1, round(ttl))
        self._client_kind = client
        self._fp = b""
        self._prefix = b""
        self._io: AsyncioRedis | ThreadRedis | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._closed = False
        self._quota = WriteQuota(capacity_bytes) if capacity_bytes else None
        self._n = dict.fromkeys(("reads", "read_hits", "read_bytes", "writes", "write_bytes",
                                 "errors", "corrupt", "evictions"), 0)
        self._check = bool(check)
        label = self._client_module.redacted(url) + (f", namespace={namespace!r}" if namespace else "")
        self._health = FailureLog(f"RedisTier({label})")

    # -- lifecycle ------------------------------------------------------------------------

    def check_block_bytes(self, block_bytes: int) -> None:
        """Refuse a ``capacity_bytes`` below one block of ``block_bytes`` (the cache calls
        this before ``open``); without ``capacity_bytes`` any size is fine."""
        check_capacity("RedisTier", self.capacity_bytes, positive_count(block_bytes, "block_bytes"))

    async def open(self, fingerprint: bytes) -> None:
        """Name this layout's key space and build the client for the calling loop. Without
        ``check`` it connects on first use (a server that is down at open is a miss later,
        and logged); with ``check=True`` it sends a PING first and raises ``TierError`` with
        the server's reason (a wrong password, a refused connection)."""
        if self._io is not None or self._closed:
            raise UsageError("RedisTier.open() is called once, before any other call")
        if not isinstance(fingerprint, bytes) or len(fingerprint) < codec.FINGERPRINT_BYTES:
            raise InvalidSpec(f"fingerprint must be {codec.FINGERPRINT_BYTES}+ bytes from "
                              "codec.layout_fingerprint")
        self._fp = codec.namespaced(fingerprint, self.namespace)
        self._prefix = b"aiokv:" + hashlib.blake2b(self._fp, digest_size=16).hexdigest().encode() + b":"
        kind = self._client_kind
        if kind == "asyncio" and loop_library() != "asyncio":
            raise UsageError("RedisTier(client='asyncio') runs on an asyncio loop only; use 'auto'")
        if kind == "asyncio":
            self._io = self._client_module.AsyncioRedis(self._url, self.cluster, self.timeout)
            self._limiter = anyio.CapacityLimiter(self._threads)
        else:
            thread_io = self._client_module.ThreadRedis(self._url, self.cluster, self.timeout,
                                                        self._threads)
            self._io, self._limiter = thread_io, thread_io.limiter
        if self._check:
            io = self._io
            try:
                await io.ping()
            except Exception as exc:
                self._io = None
                with anyio.CancelScope(shield=True):
                    await io.aclose()
                raise TierError(f"{self._health.tier} cannot serve: "
                                f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the client's connections; idempotent."""
        io, self._io, self._closed = self._io, None, True
        if io is not None:
            with anyio.CancelScope(shield=True):
                await io.aclose()

    # -- the contract ---------------------------------------------------------------------

    def holds(self, key: bytes) -> bool:
        """Always False: only a round trip can say (``exists``)."""
        return False

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a tier key in this layout and namespace (tests and tools)."""
        self._check_open()
        return self._name(codec.stored_keys([key])[0])

    def _name(self, stored: bytes) -> bytes:
        return self._prefix + hashlib.blake2b(stored, digest_size=20).hexdigest().encode()

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the store holds (unverified: a read may still miss), by pipelined
        EXISTS; a failure answers False for the keys it covered."""
        self._check_open()
        keys = codec.stored_keys(keys)
        errors = self._n["errors"]
        answers = [False] * len(keys)
        io = self._io
        for lo in range(0, len(keys), _EXISTS_PER_ROUND_TRIP):
            chunk = range(lo, min(lo + _EXISTS_PER_ROUND_TRIP, len(keys)))
            names = [self._name(keys[i]) for i in chunk]
            replies: list[object] | None
            if io is not None and io.threaded:
                thread_io = cast("ThreadRedis", io)
                try:
                    replies = await thread_io.run(functools.partial(thread_io.exists_blocking, names))
                except Exception as exc:  # as in _round_trip
                    self._health.failed(exc)
                    self._n["errors"] += 1
                    replies = None
            else:
                replies = await self._round_trip([("exists", name) for name in names])
            if replies is None:
                break
            for i, reply in zip(chunk, replies):
                if isinstance(reply, Exception):  # a per-command error (NOAUTH)
                    self._health.failed(reply)
                    self._n["errors"] += 1
                answers[i] = reply is True or reply == 1
        self._settle(errors)
        return answers

    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Fill ``out[i]`` with the verified payload of ``keys[i]``; False is a miss."""
        self._check_open()
        keys = codec.stored_keys(keys)
        if len(keys) != len(out):
            raise InvalidSpec(f"read got {len(keys)} keys and {len(out)} buffers")
        views = [byte_view(o, writable=True) for o in out]
        status = [MISS] * len(keys)
        errors = self._n["errors"]
        groups = groups_of([len(v) + codec.header_size(k) for k, v in zip(keys, views)],
                           self._group_bytes)
        await self._striped(groups, lambda stripe: self._read_stripe(keys, views, stripe, status))
        hits = self._account_reads(keys, views, status)
        self._settle(errors)
        return hits

    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        """Store each payload (SET, EX ttl if given) under its key; False: not stored."""
        self._check_open()
        keys = codec.stored_keys(keys)
        if len(keys) != len(payloads):
            raise InvalidSpec(f"write got {len(keys)} keys and {len(payloads)} payloads")
        views = [byte_view(p) for p in payloads]
        errors = self._n["errors"]
        quota = self._quota
        if quota is not None and views:
            check_capacity("RedisTier", self.capacity_bytes, max(len(v) for v in views))
        wanted = list(range(len(views))) if quota is None else quota.fitting([len(v) for v in views])
        evict = [] if quota is None else quota.make_room([keys[i] for i in wanted],
                                                         [len(views[i]) for i in wanted])
        self._n["evictions"] += len(evict)
        keys = [keys[i] for i in wanted]
        views = [views[i] for i in wanted]
        replies: list[object] = [None] * len(keys)
        groups = groups_of([len(v) + codec.header_size(k) for k, v in zip(keys, views)],
                           self._group_bytes)
        await self._striped(groups, lambda stripe: self._write_stripe(keys, views, stripe, replies))
        stored = [False] * len(payloads)
        for pos, reply in enumerate(replies):
            if isinstance(reply, Exception):
                self._health.failed(reply)
                self._n["errors"] += 1  # a per-command error (NOAUTH, OOM) or a dead node
            elif reply is True:
                stored[wanted[pos]] = True
                self._n["writes"] += 1
                self._n["write_bytes"] += len(views[pos])
                if quota is not None:
                    quota.remember(keys[pos], len(views[pos]))
        if evict:
            await self._round_trip([("del", self._name(k)) for k in evict])
        self._settle(errors)
        return stored

    async def _striped(self, groups: list[list[int]],
                       run: Callable[[list[list[int]]], Awaitable[int]]) -> None:
        """Run the groups as up to ``threads`` stripes at once (one connection each), so one
        stripe's checksums and copies overlap another's transfer; count failed round trips."""
        stripes = [groups[s::self._threads] for s in range(min(self._threads, len(groups)))]
        failures = [0] * len(stripes)

        async def one(s: int) -> None:
            failures[s] = await run(stripes[s])

        if len(stripes) == 1:
            await one(0)
        elif stripes:
            async with anyio.create_task_group() as tg:
                for s in range(len(stripes)):
                    tg.start_soon(one, s)
        self._n["errors"] += sum(failures)

    async def _read_stripe(self, keys: Sequence[bytes], views: list[memoryview],
                           groups: list[list[int]], status: list[int]) -> int:
        io = self._io
        if io is not None and io.threaded:
            thread_io = cast("ThreadRedis", io)
            return int(await thread_io.run(lambda: self._read_blocking(keys, views, groups, status),
                                           reading=True))
        return await self._read_async(keys, views, groups, status)

    async def _write_stripe(self, keys: list[bytes], views: list[memoryview],
                            groups: list[list[int]], replies: list[object]) -> int:
        """Send one stripe's groups; the number of round trips that failed as a whole."""
        io = self._io
        if io is not None and io.threaded:
            thread_io = cast("ThreadRedis", io)
            return int(await thread_io.run(
                lambda: self._write_blocking(thread_io, keys, views, groups, replies)))
        async_io = cast("AsyncioRedis", io)
        for group in groups:
            values = await anyio.to_thread.run_sync(encode_values, self._fp, keys, views, group,
                                                    limiter=self._limiter)
            try:
                answers = await async_io.round_trip(
                    [("set", self._name(keys[j]), v, self._ttl) for j, v in zip(group, values)])
            except Exception as exc:  # as in _read_blocking
                self._health.failed(exc)
                return 1
            for j, answer in zip(group, answers):
                replies[j] = answer
        return 0

    def _write_blocking(self, io: ThreadRedis, keys: list[bytes], views: list[memoryview],
                        groups: list[list[int]], replies: list[object]) -> int:
        for group in groups:
            headers = encode_headers(self._fp, keys, views, group)
            try:
                answers = io.write_from_blocking([self._name(keys[j]) for j in group], headers,
                                                 [views[j] for j in group], self._ttl)
            except Exception as exc:  # the rest would wait out the same dead server
                self._health.failed(exc)
                return 1
            for j, answer in zip(group, answers):
                replies[j] = answer
        return 0

    def statistics(self) -> TierStatistics:
        """Counters since open; ``blocks``/``bytes_held`` count what this process wrote and
        still holds when ``capacity_bytes`` is set, else -1 (a shared store cannot say)."""
        quota = self._quota
        return TierStatistics(
            name=self.name,
            blocks=-1 if quota is None else quota.blocks,
            bytes_held=-1 if quota is None else quota.bytes_held,
            **self._n,
        )

    # -- internals ------------------------------------------------------------------------

    def _settle(self, errors_before: int) -> None:
        """A call that met no error tells the failure log the tier works (again)."""
        if self._n["errors"] == errors_before:
            self._health.succeeded()

    def _check_open(self) -> None:
        if self._io is None:
            raise UsageError("RedisTier is closed" if self._closed else "call await open() first")

    async def _round_trip(self, ops: list[Op]) -> list[object] | None:
        """One pipeline; None (and one error counted) if it failed as a whole."""
        io = self._io
        try:
            if io is not None and io.threaded:
                thread_io = cast("ThreadRedis", io)
                return await thread_io.run(lambda: thread_io.round_trip_blocking(ops))
            return await cast("AsyncioRedis", io).round_trip(ops)
        except Exception as exc:  # any client failure (timeout, refused, cluster down) is a miss
            self._health.failed(exc)
            self._n["errors"] += 1
            return None

    def _read_blocking(self, keys: Sequence[bytes], views: list[memoryview],
                       groups: list[list[int]], status: list[int]) -> int:
        """Fetch, verify and copy every group on this worker thread; failed round trips."""
        io = cast("ThreadRedis", self._io)
        for group in groups:
            try:
                landed = io.read_into_blocking(
                    [self._name(keys[i]) for i in group],
                    [codec.header_size(keys[i]) for i in group], [views[i] for i in group])
            except Exception as exc:  # the rest of the batch would wait out the same dead server
                self._health.failed(exc)
                return 1
            for error in check_landed(self._fp, keys, views, group, landed, status,
                                      self._client_module.WRONG_LENGTH):
                self._health.failed(error)
        return 0

    async def _read_async(self, keys: Sequence[bytes], views: list[memoryview],
                          groups: list[list[int]], status: list[int]) -> int:
        io = cast("AsyncioRedis", self._io)
        for group in groups:
            try:
                replies = await io.round_trip([("get", self._name(keys[i])) for i in group])
            except Exception as exc:  # as in _read_blocking
                self._health.failed(exc)
                return 1
            if sum(len(views[i]) for i in group) >= _OFFLOAD_BYTES:
                errors = await anyio.to_thread.run_sync(land_replies, self._fp, keys, views, group,
                                                        replies, status, limiter=self._limiter)
            else:
                errors = land_replies(self._fp, keys, views, group, replies, status)
            for error in errors:
                self._health.failed(error)
        return 0

    def _account_reads(self, keys: Sequence[bytes], views: list[memoryview],
                       status: list[int]) -> list[bool]:
        n = self._n
        n["reads"] += len(keys)
        hits = [s == HIT for s in status]
        for i, hit in enumerate(hits):
            if hit:
                n["read_hits"] += 1
                n["read_bytes"] += len(views[i])
                if self._quota is not None:
                    self._quota.touch(keys[i])
        n["corrupt"] += status.count(CORRUPT)
        n["errors"] += status.count(FAILED)
        return hits



def _client_module() -> ModuleType:
    """``redis_client``, which imports the optional ``redis`` package: only when a tier is
    built, so ``import aiokv`` neither needs nor pays for it (``MissingExtra`` without it)."""
    require("redis")
    from . import redis_client

    return redis_client
