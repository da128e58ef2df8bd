"""Backend selection. ``cuda.py`` (the only module that calls cuda-python) loads lazily,
so ``import aiokv`` works on machines without CUDA."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidSpec
from ..layout import CanonicalKVCaches
from .base import Backend, Completion, HostPool, Lane

__all__ = ["Backend", "Completion", "HostPool", "Lane", "cuda_usable", "resolve_backend"]

BACKENDS = ("auto", "cpu", "cuda")


def cuda_usable() -> bool:
    """True when torch sees a CUDA device and cuda-python imports."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cuda.bindings.driver  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(name: str, kv: CanonicalKVCaches, options: Any = None) -> Backend:
    """Pick the backend: ``auto`` follows where the KV tensors live."""
    if name not in BACKENDS:
        raise InvalidSpec(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        on_gpu = any(t.tensor.device.type == "cuda" for t in kv.tensors)
        name = "cuda" if on_gpu else "cpu"
    if name == "cpu":
        from .cpu import CpuBackend

        return CpuBackend()
    if not cuda_usable():
        raise InvalidSpec("backend='cuda' needs a usable CUDA device and cuda-python")
    from .cuda import CudaBackend

    return CudaBackend(kv, options)
