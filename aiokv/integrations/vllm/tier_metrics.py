"""The tier counters aiokv hands vLLM's metrics: names, what each counts, and the label.

vLLM's connector publishes what the manager's ``get_stats`` returns as Prometheus series,
but only for names the spec declared (``AiokvOffloadingSpec.build_metric_definitions``), so
both read this one table. Each counter has one label, ``tier``: the tier's place in
``aiokv_tiers`` and its kind (``0:disk``, ``1:redis``). Kept free of vLLM imports.
"""

from __future__ import annotations

__all__ = ["TIER_COUNTERS", "TIER_COUNTER_DOCS", "TIER_LABEL", "tier_label"]

TIER_LABEL = "tier"

# metric name -> the TierCounts field it reports (increments since the last step).
TIER_COUNTERS = {
    "vllm:kv_offload_aiokv_tier_found": "found",
    "vllm:kv_offload_aiokv_tier_promoted": "promoted",
    "vllm:kv_offload_aiokv_tier_promote_failed": "promote_failed",
    "vllm:kv_offload_aiokv_tier_read_bytes": "read_bytes",
    "vllm:kv_offload_aiokv_tier_demoted": "demoted",
    "vllm:kv_offload_aiokv_tier_written_through": "written_through",
    "vllm:kv_offload_aiokv_tier_write_bytes": "write_bytes",
    "vllm:kv_offload_aiokv_tier_dropped": "dropped",
    "vllm:kv_offload_aiokv_tier_promote_seconds": "promote_seconds",
}

TIER_COUNTER_DOCS = {
    "found": "Blocks host memory lacked that this aiokv tier held (reads up started).",
    "promoted": "Blocks read up from this aiokv tier into host memory.",
    "promote_failed": "Reads up from this aiokv tier that failed (missing, corrupt, I/O error); each a miss.",
    "read_bytes": "KV bytes read up from this aiokv tier into host memory.",
    "demoted": "Blocks host memory evicted that this aiokv tier took.",
    "written_through": "Blocks host memory stored that this write-through aiokv tier took.",
    "write_bytes": "KV bytes written to this aiokv tier.",
    "dropped": "Blocks meant for this aiokv tier that it never got (no room on the way down, "
               "the tier refused or failed them, or it was not open).",
    "promote_seconds": "Seconds from each read up from this aiokv tier starting to the scheduler seeing it "
                       "done (failed reads too); divided by promoted plus promote_failed, the mean.",
}


def tier_label(index: int, name: str) -> str:
    """The ``tier`` label of the tier at ``index`` of ``aiokv_tiers``."""
    return f"{index}:{name}"
