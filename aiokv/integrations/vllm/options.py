"""The ``aiokv_`` keys of vLLM's ``kv_connector_extra_config``, read and checked once.

Kept free of vLLM imports so the checks are testable wherever aiokv is installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...cache import available_admissions, available_policies
from ...errors import InvalidSpec
from ...options import STRATEGIES, WorkerOptions

__all__ = ["BACKENDS", "CPU_SPEC_KEYS", "KEYS", "PluginOptions", "read_cpu_bytes"]

BACKENDS = ("auto", "cuda", "cpu")

# Every aiokv_ key the plug-in reads, with what it sets (docs/vllm.md lists the same).
KEYS = {
    "aiokv_policy": "eviction policy of the scheduler-side chunk manager",
    "aiokv_admission": "admission policy (default: the eviction policy's own pairing)",
    "aiokv_strategy": "CUDA copy strategy",
    "aiokv_backend": "where copies run: auto, cuda or cpu",
    "aiokv_worker_options": "further WorkerOptions fields, as a JSON object",
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

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> PluginOptions:
        """Read the ``aiokv_`` keys of ``extra``; other keys belong to vLLM and are left alone.

        Raises:
            InvalidSpec: an unknown ``aiokv_`` key or a bad value; the message names the
                valid keys or values.
        """
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("aiokv_") and k not in KEYS)
        if unknown:
            raise InvalidSpec(f"unknown kv_connector_extra_config keys {unknown}; aiokv reads {sorted(KEYS)}")
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
        worker_options = WorkerOptions.coerce({**dict(raw), "strategy": strategy})
        return cls(policy, admission, strategy, backend, worker_options)


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
