"""``aiokv_tiers``: the lower tiers under vLLM's host pool, as URLs, read and checked once.

A tier is named by one URL, nearest first::

    file:///var/cache/aiokv?capacity=64GiB            a DiskTier in that directory
    redis://host:6379/0?namespace=llama8b             a RedisTier (rediss:// for TLS,
    redis+cluster://host:7000?namespace=...           unix:///path, a cluster)

Query parameters set the tier's own keywords (``capacity``, ``namespace``, ...); a Redis URL
keeps every other parameter for redis-py (``ssl_ca_certs`` and the like). Kept free of vLLM
imports so the checks are testable wherever aiokv is installed; building a tier object is
left to the scheduler's manager (``TierURL.build``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from ...cache import available_policies
from ...cache.tiers.base import Tier
from ...cache.tiers.redact import redacted
from ...errors import InvalidSpec

__all__ = ["DISK_PARAMS", "REDIS_PARAMS", "TierURL", "parse_size", "parse_tier_urls"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)

DISK_PARAMS = {
    "capacity": "KV bytes the directory holds at most, e.g. 64GiB (required)",
    "write_through": "1: also write every block the host stores, not only those it evicts",
    "io_threads": "threads doing file I/O at once (default 4)",
    "direct": "auto, 1 or 0: O_DIRECT reads and writes (default auto)",
    "fsync": "1: each block is on stable storage before it counts as written",
    "policy": "which blocks the directory evicts first (default lru)",
}
REDIS_PARAMS = {
    "namespace": "a tenant's name folded into every key: other namespaces never read these blocks",
    "capacity": "KV bytes this process keeps in the store at most (default: no bound from this side)",
    "write_through": "1: also write every block the host stores, not only those it evicts",
    "ttl": "seconds a block lives in the store",
    "timeout": "seconds allowed for connecting and for each socket operation (default 5)",
    "threads": "connections (and threads) one batch uses at once (default 4)",
    "check": "1: PING the server when the tiers open and log why it failed",
}
_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class TierURL:
    """One tier of ``aiokv_tiers``: its kind, where it lives and its keywords."""

    kind: str  # "disk" or "redis"
    shown: str  # the URL without its password, for messages
    target: str = field(repr=False)  # the disk tier's directory, or the URL handed to RedisTier
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def write_through(self) -> bool:
        return bool(self.options.get("write_through", False))

    def for_data_parallel(self, index: int, size: int) -> TierURL:
        """This tier for data-parallel engine ``index`` of ``size``: a disk tier takes the
        subdirectory ``dp<index>`` and ``1/size`` of the capacity (a directory serves one
        engine at a time, and ``capacity`` stays what the whole directory holds); a Redis
        tier is shared by every engine as written."""
        if self.kind != "disk" or size <= 1:
            return self
        options = {**self.options, "capacity_bytes": max(1, self.options["capacity_bytes"] // size)}
        return replace(self, target=os.path.join(self.target, f"dp{int(index)}"), options=options)

    def build(self) -> Tier:
        """A new, unopened tier object (``MissingExtra`` for Redis without its package)."""
        if self.kind == "disk":
            from ...cache.tiers import DiskTier

            return DiskTier(self.target, **self.options)
        from ...cache.tiers import RedisTier

        return RedisTier(self.target, **self.options)


def parse_tier_urls(value: Any) -> tuple[TierURL, ...]:
    """``aiokv_tiers`` as tier descriptions, nearest first (empty when absent).

    Raises:
        InvalidSpec: not a list of URL strings, a scheme aiokv has no tier for, a parameter
            the tier does not take or a bad value, a disk directory that is relative or
            cannot be written, or one directory named twice; the message names the URL.
        MissingExtra: a Redis URL without the ``redis`` package installed.
    """
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        shown = redacted(value) if isinstance(value, str) and "://" in value else value
        raise InvalidSpec(f"aiokv_tiers must be a list of tier URLs, nearest first (e.g. "
                          f'["file:///var/cache/aiokv?capacity=64GiB"]), got {shown!r}')
    tiers = [_parse_one(url) for url in value]
    disks = [t.target for t in tiers if t.kind == "disk"]
    if len(set(disks)) != len(disks):
        raise InvalidSpec(f"aiokv_tiers names one directory twice: {disks}")
    for tier in tiers:
        tier.build()  # the tier checks its own keywords (and Redis its URL) without I/O
    return tuple(tiers)


def parse_size(text: str, what: str) -> int:
    """``64GiB``, ``500MB``, ``1e9`` or plain bytes as a positive whole number of bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidSpec(f"{what} must be bytes with an optional unit (64GiB, 500MB, 1e9), got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise InvalidSpec(f"{what} must be a positive whole number of bytes, got {text!r}")
    return int(value)


def _parse_one(url: Any) -> TierURL:
    if not isinstance(url, str) or "://" not in url:
        raise InvalidSpec(f"each aiokv_tiers entry is a URL such as file:///var/cache/aiokv?capacity=64GiB "
                          f"or redis://host:6379/0, got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    shown = redacted(url)
    if scheme == "file":
        return _disk(parts, shown)
    if scheme in _REDIS_SCHEMES:
        return _redis(parts, scheme, shown)
    raise InvalidSpec(f"aiokv_tiers: {shown}: no tier for the scheme {parts.scheme!r}; use file:// for a "
                      f"directory or one of {', '.join(s + '://' for s in _REDIS_SCHEMES)}")


def _query(parts: Any, shown: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise InvalidSpec(f"aiokv_tiers: {shown}: cannot read its query ({exc})") from None
    out: dict[str, str] = {}
    for name, value in pairs:
        if name in out:
            raise InvalidSpec(f"aiokv_tiers: {shown}: {name} is given twice")
        out[name] = value
    return out


def _disk(parts: Any, shown: str) -> TierURL:
    if parts.netloc not in ("", "localhost"):
        raise InvalidSpec(f"aiokv_tiers: {shown}: a file:// tier is a local directory; write "
                          f"file:///absolute/path (three slashes), not a host {parts.netloc!r}")
    path = unquote(parts.path)
    if not path or not os.path.isabs(path) or path == "/":
        raise InvalidSpec(f"aiokv_tiers: {shown}: give the disk tier a directory of its own, as an "
                          "absolute path (file:///var/cache/aiokv)")
    params = _query(parts, shown)
    _known(params, DISK_PARAMS, shown)
    if "capacity" not in params:
        raise InvalidSpec(f"aiokv_tiers: {shown}: a disk tier needs capacity=..., the KV bytes it may "
                          "hold (e.g. capacity=64GiB)")
    options: dict[str, Any] = {"capacity_bytes": parse_size(params["capacity"], f"{shown}: capacity")}
    _read(params, options, shown, {"write_through": _flag, "io_threads": _count, "fsync": _flag,
                                   "policy": _policy, "direct": _direct})
    _check_writable(path, shown)
    return TierURL("disk", shown, os.path.normpath(path), options)


def _redis(parts: Any, scheme: str, shown: str) -> TierURL:
    params = _query(parts, shown)
    ours = {k: params.pop(k) for k in list(params) if k in REDIS_PARAMS}
    options: dict[str, Any] = {}
    if "capacity" in ours:
        options["capacity_bytes"] = parse_size(ours.pop("capacity"), f"{shown}: capacity")
    if "namespace" in ours:
        options["namespace"] = ours.pop("namespace")
    _read(ours, options, shown, {"write_through": _flag, "ttl": _seconds, "timeout": _seconds,
                                 "threads": _count, "check": _flag})
    # Every other parameter (ssl_ca_certs=..., ...) is redis-py's; RedisTier checks them.
    # Joined by hand: urlunsplit drops unix:///path's empty host, which redis-py needs.
    target = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{urlencode(params)}" if params else "")
    return TierURL("redis", shown, target, options)


def _known(params: Mapping[str, str], known: Mapping[str, str], shown: str) -> None:
    unknown = sorted(set(params) - set(known))
    if unknown:
        listed = "; ".join(f"{k}: {v}" for k, v in known.items())
        raise InvalidSpec(f"aiokv_tiers: {shown}: unknown parameter(s) {unknown}; this tier takes {listed}")


def _read(params: Mapping[str, str], options: dict[str, Any], shown: str,
          readers: Mapping[str, Callable[[str], Any]]) -> None:
    for name, read in readers.items():
        if name not in params:
            continue
        try:
            options[name] = read(params[name])
        except ValueError:
            raise InvalidSpec(f"aiokv_tiers: {shown}: {name}={params[name]!r} is not a valid value "
                              f"({_HINTS.get(read, 'see docs/vllm.md')})") from None


def _flag(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _direct(text: str) -> bool | None:
    return None if text.strip().lower() == "auto" else _flag(text)


def _policy(text: str) -> str:
    if text.lower() not in [p.lower() for p in available_policies()]:
        raise ValueError(text)
    return text.lower()


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return value


_HINTS: dict[Callable[[str], Any], str] = {
    _flag: "1 or 0", _direct: "auto, 1 or 0", _count: "a whole number >= 1",
    _seconds: "a positive number of seconds", _policy: f"one of {sorted(available_policies())}",
}


def _check_writable(path: str, shown: str) -> None:
    """The directory, or the nearest existing one above it, must take new files."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(probe) else "cannot be written by this process"
        raise InvalidSpec(f"aiokv_tiers: {shown}: {probe!r} {what}")
