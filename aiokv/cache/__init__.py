"""Scheduler-side KV-cache metadata: chunk allocation, eviction, admission."""

from ..errors import KeyNotLoadable
from .admission import (
    AdaptiveAdmission,
    AdmissionPolicy,
    AdmitAll,
    SecondOfferAdmission,
    available_admissions,
    make_admission,
    register_admission,
)
from .manager import (
    CacheStats,
    ChunkManager,
    KeysRemoved,
    KeysStored,
    LookupResult,
    StorePlan,
)
from .policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    available_policies,
    make_policy,
    register_policy,
)

__all__ = [
    "ARCPolicy",
    "AdaptiveAdmission",
    "AdmissionPolicy",
    "AdmitAll",
    "CacheStats",
    "ChunkManager",
    "EvictionPolicy",
    "KeyNotLoadable",
    "KeysRemoved",
    "KeysStored",
    "LRUPolicy",
    "LookupResult",
    "PrefixLRUPolicy",
    "SecondOfferAdmission",
    "StorePlan",
    "available_admissions",
    "available_policies",
    "make_admission",
    "make_policy",
    "register_admission",
    "register_policy",
]
