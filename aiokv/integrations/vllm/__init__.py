"""aiokv inside vLLM: an offloading spec that vLLM's ``OffloadingConnector`` loads by name,
and a connector of its own that moves KV layer by layer.

Select the spec with ``kv_connector_extra_config={"spec_name": "AiokvOffloadingSpec",
"spec_module_path": "aiokv.integrations.vllm", "cpu_bytes_to_use": ...}``, the connector
with ``"kv_connector": "AiokvConnector", "kv_connector_module_path":
"aiokv.integrations.vllm"`` (docs/vllm.md). The vLLM-facing classes are imported on first
access (vLLM's factories read them with ``getattr``), so the option checks here stay
importable without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import SUPPORTED_RANGE, check_vllm_version
from .options import KEYS, PluginOptions

if TYPE_CHECKING:
    from .connector import AiokvConnector
    from .manager import AiokvOffloadingManager
    from .spec import AiokvOffloadingSpec
    from .worker import AiokvOffloadingWorker

__all__ = [
    "KEYS",
    "SUPPORTED_RANGE",
    "AiokvConnector",
    "AiokvOffloadingManager",
    "AiokvOffloadingSpec",
    "AiokvOffloadingWorker",
    "PluginOptions",
    "check_vllm_version",
]

_LAZY = {
    "AiokvConnector": ".connector",
    "AiokvOffloadingManager": ".manager",
    "AiokvOffloadingSpec": ".spec",
    "AiokvOffloadingWorker": ".worker",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module, __name__), name)
    except ImportError as exc:  # vLLM missing, or a release whose offloading API moved
        from ...errors import UsageError

        raise UsageError(
            f"aiokv.integrations.vllm.{name} needs vllm{SUPPORTED_RANGE} with its "
            f"vllm.v1.kv_offload API ({exc}); install it with pip install 'vllm{SUPPORTED_RANGE}', "
            "or pip install -e '.[vllm]' in a clone of aiokv"
        ) from exc
    globals()[name] = value
    return value
