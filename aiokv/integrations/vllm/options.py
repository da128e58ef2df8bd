"""The ``aiokv_`` keys of vLLM's ``kv_connector_extra_config``, read and checked once.

Kept free of vLLM imports so the checks are testable wherever aiokv is installed.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...backends import BACKENDS
from ...cache import available_admissions, available_policies
from ...errors import HostMemoryError, InvalidSpec
from ...host_layout import CHUNK_ALIGN
from ...host_memory import available_host_memory
from ...options import STRATEGIES, WorkerOptions
from .tier_urls import TierURL, parse_tier_urls

__all__ = ["CPU_SPEC_KEYS", "KEYS", "MAX_CHUNKS", "PluginOptions", "read_cpu_bytes", "size_host_pool"]

# vLLM carries chunk ids as numpy int32 (its CPULoadStoreSpec), so no pool may hold more.
MAX_CHUNKS = 2**31 - 1

# Every aiokv_ key the plug-in reads, with what it sets (docs/vllm.md lists the same).
KEYS = {
    "aiokv_policy": "eviction policy of the scheduler-side chunk manager",
    "aiokv_admission": "admission policy (default: the eviction policy's own pairing)",
    "aiokv_strategy": "CUDA copy strategy",
    "aiokv_backend": "where copies run: auto, cuda or cpu",
    "aiokv_worker_options": "further WorkerOptions fields, as a JSON object",
    "aiokv_tiers": "tiers below host memory, nearest first, as URLs (file:///dir?capacity=64GiB, redis://...)",
}

# Keys only vLLM's CPUOffloadingSpec reads: with this spec they would do nothing, so a
# config carried over from the CPU spec is refused rather than silently run differently.
CPU_SPEC_KEYS = {
    "eviction_policy": "aiokv_policy",
    "cache_policy_module_path": "aiokv_policy",
    "store_threshold": "aiokv_admission (second-offer stores a block on its second offer)",
    "max_tracker_size": "aiokv_admission",
}


@dataclass(frozen=True)
class PluginOptions:
    """aiokv's settings for one vLLM instance (defaults: adaptive policy, auto strategy)."""

    policy: str = "adaptive"
    admission: str | None = None
    strategy: str = "auto"
    backend: str = "auto"
    worker_options: WorkerOptions = field(default_factory=WorkerOptions)
    tiers: tuple[TierURL, ...] = ()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> PluginOptions:
        """Read the ``aiokv_`` keys of ``extra``; other keys belong to vLLM and are left alone.

        Raises:
            InvalidSpec: an unknown ``aiokv_`` key or a bad value; the message names the
                valid keys or values.
            MissingExtra: a Redis tier in ``aiokv_tiers`` without the ``redis`` package.
        """
        unknown = sorted(k for k in extra if isinstance(k, str) and k not in KEYS and _looks_like_ours(k))
        if unknown:
            guesses = "; ".join(f"{k!r}: did you mean {_closest(k)!r}?" for k in unknown)
            raise InvalidSpec(
                f"unknown kv_connector_extra_config keys {unknown} ({guesses}); aiokv reads {sorted(KEYS)}"
            )
        ignored = sorted(k for k in CPU_SPEC_KEYS if k in extra)
        if ignored:
            instead = "; ".join(f"{k}: use {CPU_SPEC_KEYS[k]}" for k in ignored)
            raise InvalidSpec(
                f"kv_connector_extra_config keys {ignored} belong to vLLM's CPUOffloadingSpec and "
                f"AiokvOffloadingSpec would ignore them ({instead})"
            )
        policy = _choice(extra, "aiokv_policy", "adaptive", available_policies())
        admission = extra.get("aiokv_admission")
        if admission is not None:
            admission = _choice(extra, "aiokv_admission", None, available_admissions())
        strategy = _choice(extra, "aiokv_strategy", "auto", STRATEGIES)
        backend = _choice(extra, "aiokv_backend", "auto", BACKENDS)
        raw = extra.get("aiokv_worker_options", {})
        if not isinstance(raw, Mapping):
            raise InvalidSpec(f"aiokv_worker_options must be a JSON object, got {raw!r}")
        if "strategy" in raw:
            raise InvalidSpec("set the copy strategy with aiokv_strategy, not inside aiokv_worker_options")
        if "host_pool_file" in raw:
            raise InvalidSpec("aiokv_worker_options cannot set host_pool_file: with aiokv_tiers the "
                              "workers share their pools with the scheduler by themselves")
        worker_options = WorkerOptions.coerce({**dict(raw), "strategy": strategy})
        tiers = parse_tier_urls(extra.get("aiokv_tiers"))
        return cls(policy, admission, strategy, backend, worker_options, tiers)


def _normal(key: str) -> str:
    """``key`` lower-cased with every run of separators as one underscore."""
    return re.sub(r"[^a-z0-9]+", "_", key.lower())


def _looks_like_ours(key: str) -> bool:
    """A key meant for aiokv (``aiokv_policy`` misspelled as ``aiokv-policy``,
    ``AIOKV_POLICY``, ``aiokv_polcy``): refused, since vLLM would ignore it silently."""
    return _normal(key).startswith("aiokv")


def _closest(key: str) -> str:
    """The aiokv key ``key`` most likely means."""
    normal = _normal(key)
    if normal in KEYS:
        return normal
    close = difflib.get_close_matches(normal, list(KEYS), n=1, cutoff=0.0)
    return close[0]


def _choice(extra: Mapping[str, Any], key: str, default: str | None, valid: Any) -> str:
    value = extra.get(key, default)
    names = [str(v).lower() for v in valid]
    if not isinstance(value, str) or value.lower() not in names:
        raise InvalidSpec(f"{key} must be one of {sorted(names)}, got {value!r}")
    return value.lower()


def read_cpu_bytes(extra: Mapping[str, Any]) -> int:
    """``cpu_bytes_to_use`` as vLLM's CPU spec reads it: host bytes for all ranks together.

    JSON may carry it as an int, an integral float (``4e9``) or a numeric string.
    """
    raw = extra.get("cpu_bytes_to_use")
    if raw is None:
        raise InvalidSpec("cpu_bytes_to_use must be set in kv_connector_extra_config (host bytes, all ranks)")
    value: float
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise InvalidSpec(f"cpu_bytes_to_use must be a positive whole number of bytes, got {raw!r}")
    return int(value)


def size_host_pool(cpu_bytes: int, kv_bytes_per_block_chunk: int, world_size: int) -> tuple[int, int]:
    """``(bytes of one chunk, chunks)`` of each rank's pool for ``cpu_bytes`` over all ranks.

    A chunk is laid out as the worker will: every group shares one chunk size and chunks
    start on aligned offsets (aiokv.plan). ``kv_bytes_per_block_chunk`` is vLLM's
    ``worker_kv_bytes_per_block`` times ``blocks_per_chunk``; 0 (nothing offloadable)
    gives no chunks, which the spec reports when asked for a manager or worker.

    Raises:
        InvalidSpec: the pool holds no chunk, or more than vLLM's int32 chunk ids address.
        HostMemoryError: one rank's pool exceeds the memory this host has available.
    """
    if not kv_bytes_per_block_chunk:
        return 0, 0
    chunk_bytes = -(-kv_bytes_per_block_chunk // CHUNK_ALIGN) * CHUNK_ALIGN
    num_chunks = cpu_bytes // (chunk_bytes * world_size)
    if num_chunks < 1:
        raise InvalidSpec(
            f"cpu_bytes_to_use={cpu_bytes} holds no chunk: one chunk takes "
            f"{chunk_bytes} bytes on each of {world_size} rank(s)"
        )
    if num_chunks > MAX_CHUNKS:
        raise InvalidSpec(
            f"cpu_bytes_to_use={cpu_bytes} makes {num_chunks} host chunks of {chunk_bytes} bytes "
            f"per rank, more than vLLM's int32 chunk ids address ({MAX_CHUNKS}); lower "
            "cpu_bytes_to_use (host bytes for all ranks together)"
        )
    per_rank = num_chunks * chunk_bytes
    available = available_host_memory()
    if available is not None and per_rank > available:
        raise HostMemoryError(
            f"cpu_bytes_to_use={cpu_bytes} gives each of {world_size} rank(s) a host pool of "
            f"{per_rank / 2**30:.3g} GiB, but this host has {available / 2**30:.3g} GiB available; "
            "lower cpu_bytes_to_use (host bytes for all ranks together)"
        )
    return chunk_bytes, num_chunks
