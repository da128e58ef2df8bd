"""aiokv inside vLLM: an offloading spec that vLLM's ``OffloadingConnector`` loads by name.

Select it with ``kv_connector_extra_config={"spec_name": "AiokvOffloadingSpec",
"spec_module_path": "aiokv.integrations.vllm", "cpu_bytes_to_use": ...}`` (docs/vllm.md).
The vLLM-facing classes are imported on first access (vLLM's factory reads them with
``getattr``), so the option checks here stay importable without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import SUPPORTED_RANGE, check_vllm_version
from .options import KEYS, PluginOptions

if TYPE_CHECKING:
    from .manager import AiokvOffloadingManager
    from .spec import AiokvOffloadingSpec
    from .worker import AiokvOffloadingWorker

__all__ = [
    "KEYS",
    "SUPPORTED_RANGE",
    "AiokvOffloadingManager",
    "AiokvOffloadingSpec",
    "AiokvOffloadingWorker",
    "PluginOptions",
    "check_vllm_version",
]

_LAZY = {
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
