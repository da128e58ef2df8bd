"""The contract every lower cache tier (disk, Redis, ...) implements.

A tier stores whole blocks (one value per key, every layer of one GPU block, exactly
``block_bytes`` long) under stable ``bytes`` keys that the cache derives from its own keys
(``codec.key_bytes``). Tiers never raise for I/O trouble: a failed, timed-out or corrupt
value is a miss (``False``) and is counted in ``statistics()``; only misuse raises
(``UsageError``/``InvalidSpec``). See docs/tiers.md.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ...errors import InvalidSpec
from ...specs import as_count

__all__ = ["ByteParts", "PartsReader", "Tier", "TierStatistics", "byte_parts", "byte_view", "check_capacity",
           "positive_count", "positive_seconds"]


def positive_count(value: Any, what: str) -> int:
    """``value`` as a positive Python int, by the rule every count in aiokv follows
    (``specs.as_count``: numpy integers yes, bools and floats no); every tier checks its
    sizes and thread counts with it."""
    count = as_count(value, what)
    if count <= 0:
        raise InvalidSpec(f"{what} must be positive, got {value!r}")
    return count


def positive_seconds(value: Any, what: str) -> float:
    """``value`` as a positive, finite number of seconds (not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise InvalidSpec(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TierStatistics:
    """Counters of one tier since it was opened; the cache and Prometheus read them.

    ``blocks``/``bytes_held`` count KV payload only (no headers or padding); a remote tier
    that cannot know them reports what this process wrote, or -1. ``errors`` are I/O
    failures, timeouts and lost connections; ``corrupt`` are values that failed
    verification. Both became misses (reads) or drops (writes), never wrong bytes.
    """

    name: str
    blocks: int
    bytes_held: int
    reads: int
    read_hits: int
    read_bytes: int
    writes: int
    write_bytes: int
    errors: int
    corrupt: int
    evictions: int


def byte_view(buffer: Any, *, writable: bool = False) -> memoryview:
    """A caller's buffer as flat bytes, by the one rule every tier follows; a buffer the
    tier cannot use (not a buffer, not C-contiguous, read-only where it must be filled) is
    misuse (``InvalidSpec``)."""
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise InvalidSpec(f"tier buffers are memoryviews of bytes, got {type(buffer).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidSpec("tier buffers must be contiguous (in C order)")
    if writable and view.readonly:
        raise InvalidSpec("read() needs writable buffers to fill")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_capacity(tier: str, capacity_bytes: int | None, block_bytes: int) -> None:
    """Refuse a tier bound that holds no whole block (it would silently store nothing)."""
    if capacity_bytes is not None and capacity_bytes < block_bytes:
        raise InvalidSpec(
            f"{tier}: capacity_bytes={capacity_bytes} holds no {block_bytes}-byte block; "
            f"give it at least one block (N * {block_bytes} holds N blocks)")


class ByteParts(tuple[memoryview, ...]):
    """A block's parts checked once (``byte_parts``): flat, writable, C-contiguous byte
    views, ``nbytes`` in all. A restore reads into the same staging chunks again and
    again, so a tier takes these as they are instead of checking every page each time
    on the event loop."""

    nbytes: int


def byte_parts(views: Sequence[Any]) -> ByteParts:
    """``views`` as writable flat bytes (``byte_view``), checked once: a ``ByteParts``."""
    parts = ByteParts(byte_view(v, writable=True) for v in views)
    parts.nbytes = sum(v.nbytes for v in parts)
    return parts


@runtime_checkable
class PartsReader(Protocol):
    """A tier that reads a block into several buffers, one after another (``DiskTier``):
    a restore then reads it straight into its staging chunk's pages, whatever order the
    host keeps them in, instead of into a row it copies from."""

    async def read_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]], *,
                         order: tuple[int, int] | None = None) -> list[bool]:
        """Like ``Tier.read``, with ``parts[i]`` taking ``keys[i]``'s payload in order.
        ``order`` (restore ticket, position of the batch in it) lets the tier serve the
        reads of an earlier restore before a later one's; a tier may ignore it."""
        ...


class Tier(abc.ABC):
    """A store of KV blocks below the host pool, driven by ``OffloadCache``.

    Subclasses set ``name`` and ``remote`` as class attributes and take ``write_through``
    as a constructor keyword (default False): when True the cache also writes every block
    it stores into this tier at once, not only blocks the host evicts.

    Lifecycle: the cache calls ``await open(fingerprint)`` once before any other call and
    ``await aclose()`` when it closes. Every call runs on the cache's event loop; I/O must
    not block that loop (thread pool or an async client) and must carry a timeout. Calls
    overlap: the cache starts each batch's ``write`` as soon as its bytes are copied (never
    two writes of one key at once), so a tier bounds its own concurrency.
    """

    name: str = "tier"
    remote: bool = False
    write_through: bool = False
    capacity_bytes: int | None = None
    """KV payload bytes the tier holds at most, if it has a bound (the cache keeps no more
    than that on their way down to it)."""

    def check_block_bytes(self, block_bytes: int) -> None:
        """Refuse (``InvalidSpec``) a configuration that cannot hold one block of
        ``block_bytes``; the cache calls it when it is built, before ``open``. A tier that
        has no bound of its own keeps this default, which accepts any size."""

    @abc.abstractmethod
    async def open(self, fingerprint: bytes) -> None:
        """Get ready to serve blocks of the layout that ``fingerprint`` names.

        Args:
            fingerprint: 16 or more bytes from ``codec.layout_fingerprint``; the tier
                namespaces its keys or files by it (and by its own ``namespace=``), so
                blocks of another layout are never read as hits.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections, threads and files; later calls are misuse."""

    @abc.abstractmethod
    def holds(self, key: bytes) -> bool:
        """Whether the key is held, answered without I/O; remote tiers return False.

        The one call made off the cache's loop too (vLLM's scheduler asks it from its own
        thread, ``integrations/vllm/tier_io.py``): it only reads, and a stale answer costs a
        miss at most, since every read verifies."""

    @abc.abstractmethod
    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are held, in one batched round trip (a failure answers False)."""

    @abc.abstractmethod
    async def read(self, keys: Sequence[bytes], out: Sequence[memoryview]) -> list[bool]:
        """Fill ``out[i]`` (exactly ``block_bytes`` long) with the verified payload of
        ``keys[i]``. False is a miss (absent, failed, corrupt, timed out) and leaves
        ``out[i]`` undefined. Never raises for I/O problems. Nothing writes ``out`` once
        this returns or is cancelled: the cache hands the buffers to other work then."""

    @abc.abstractmethod
    async def write(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bool]:
        """Store each payload under its key, atomically per key. False means not stored
        (full, I/O error, timeout). The payload views are only read until this returns.
        Never raises for I/O problems."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Count ``keys`` as used now, in order, where the tier holds them or is writing
        them (no I/O, never raises for I/O). The cache calls it for blocks the host lets go
        again while their first copy is still on its way down, so a tier with an order of
        its own orders them as if that write had landed already. The default does nothing
        (a remote tier, or one without an order)."""

    @abc.abstractmethod
    def statistics(self) -> TierStatistics:
        """A snapshot of this tier's counters."""
