"""Backend selection. The ``cuda`` package (whose ``driver`` module is the only one that
imports cuda-python) loads lazily, so ``import aiokv`` works on machines without CUDA."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidSpec
from ..layout import CanonicalKVCaches
from .base import Backend, Completion, HostPool, Lane, LaneStatistics

__all__ = ["Backend", "Completion", "HostPool", "Lane", "LaneStatistics", "cuda_usable", "resolve_backend"]

BACKENDS = ("auto", "cpu", "cuda")


def cuda_usable() -> bool:
    """True when torch sees a CUDA device and cuda-python imports."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from .cuda import driver  # noqa: F401  (imports cuda-python)
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

        _check_native_for_cpu(options)
        return CpuBackend()
    if not cuda_usable():
        raise InvalidSpec("backend='cuda' needs a usable CUDA device and cuda-python")
    from .cuda.backend import CudaBackend

    return CudaBackend(kv, options)


def _check_native_for_cpu(options: Any) -> None:
    """The CPU backend makes no driver calls, so the native helper does nothing for it; but
    ``native=True`` still requires the helper (docs/native.md), and a value of
    ``AIOKV_NATIVE`` nobody understands is said out loud rather than ignored."""
    import warnings

    from .cuda import native

    if getattr(options, "native", None) is True and native.helper() is None:
        _, why = native.status(True)
        raise InvalidSpec(f"WorkerOptions(native=True), but {why}; install with a C compiler (pip "
                          "reinstalls build it), or leave native at None (the CPU backend never uses it)")
    try:
        native.env_choice()
    except InvalidSpec as exc:
        warnings.warn(f"{exc} (the CPU backend never uses the native helper)", RuntimeWarning, stacklevel=3)
