"""Which vLLM releases the plug-in was tested against, checked without importing vLLM.

vLLM's offloading API (``vllm.v1.kv_offload``) is marked experimental and changes between
minor releases, so a release outside the tested range is refused with a clear message
instead of failing later inside the engine.
"""

from __future__ import annotations

import re

from ...errors import UsageError

__all__ = ["SUPPORTED_RANGE", "check_vllm_version"]

SUPPORTED_RANGE = ">=0.33,<0.35"
_MIN = (0, 33)
_MAX = (0, 35)  # exclusive

_RELEASE = re.compile(r"^\s*v?(\d+)\.(\d+)")


def check_vllm_version(version: str) -> None:
    """Raise ``UsageError`` unless ``version`` (vLLM's ``__version__``) is in the tested range.

    Development builds such as ``0.33.1.dev3+g1234`` count as their release.
    """
    match = _RELEASE.match(str(version))
    if match is None:
        raise UsageError(
            f"cannot read vLLM's version {version!r}; aiokv's vLLM plug-in supports vllm{SUPPORTED_RANGE}"
        )
    release = (int(match.group(1)), int(match.group(2)))
    if not _MIN <= release < _MAX:
        raise UsageError(
            f"aiokv's vLLM plug-in was tested with vllm{SUPPORTED_RANGE} but vLLM {version} is "
            f"installed; install a supported release (pip install 'vllm{SUPPORTED_RANGE}', or "
            "pip install -e '.[vllm]' in a clone of aiokv) or use vLLM's own CPUOffloadingSpec"
        )
