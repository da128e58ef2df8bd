"""What ``AiokvConnector`` adds to ``kv_connector_extra_config``, checked without vLLM.

The connector always runs aiokv's offloading spec, so ``spec_name`` and
``spec_module_path`` may only name it; and its loads are synchronous by default (a hit is
loaded layer by layer inside the step that computes the rest of the prompt), which vLLM's
scheduler does for hits that fit ``sync_load_budget_bytes`` per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...errors import InvalidSpec

__all__ = ["SPEC_MODULE", "SPEC_NAME", "SYNC_LOADS_UNBOUNDED", "connector_extra_config"]

SPEC_NAME = "AiokvOffloadingSpec"
SPEC_MODULE = "aiokv.integrations.vllm"
# The default sync-load budget: every hit that leaves a token to compute loads in its step.
SYNC_LOADS_UNBOUNDED = 1 << 62


def connector_extra_config(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` with the connector's spec named and its default sync-load budget (a new
    dict; the caller's is left alone).

    Raises:
        InvalidSpec: ``spec_name`` or ``spec_module_path`` names another spec,
            ``sync_load_budget_bytes`` is not a whole number of bytes >= 0, or
            ``aiokv_worker_options`` bounds the jobs in flight (``max_in_flight``).
    """
    for key, ours in (("spec_name", SPEC_NAME), ("spec_module_path", SPEC_MODULE)):
        value = extra.get(key, ours)
        if value != ours:
            raise InvalidSpec(
                f"AiokvConnector runs aiokv's own offloading spec, but kv_connector_extra_config "
                f"sets {key}={value!r}; remove {key} (or load another spec with vLLM's "
                "OffloadingConnector)"
            )
    options = extra.get("aiokv_worker_options")
    if isinstance(options, Mapping) and options.get("max_in_flight"):
        # A step's store is open until its forward pushed every layer; a submit that waits
        # for room on the same thread meanwhile would wait for itself.
        raise InvalidSpec(
            "AiokvConnector keeps a step's store open while it submits the step's loads, so a "
            "bound on jobs in flight could make the model runner wait for itself; remove "
            "max_in_flight from aiokv_worker_options"
        )
    out = {**extra, "spec_name": SPEC_NAME, "spec_module_path": SPEC_MODULE}
    budget = out.setdefault("sync_load_budget_bytes", SYNC_LOADS_UNBOUNDED)
    out["sync_load_budget_bytes"] = _bytes(budget)
    return out


def _bytes(value: Any) -> int:
    """A whole number of bytes >= 0 (JSON may carry it as ``4e9``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and value >= 0:
        return int(value)
    raise InvalidSpec(
        f"sync_load_budget_bytes must be a whole number of bytes >= 0 (0: every load "
        f"asynchronous), got {value!r}"
    )
