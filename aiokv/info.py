"""``aiokv info``: what a worker on this machine would run on."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
from typing import Any

import torch

from . import __version__
from .backends import cuda_usable


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cuda_python_version() -> str:
    """cuda-python's version, or that of cuda-bindings where only the bindings are installed."""
    version = _version("cuda-python")
    if version == "not installed" and _version("cuda-bindings") != "not installed":
        return f"cuda-bindings {_version('cuda-bindings')}"
    return version


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 0 or n >= 2**62:
        return "unlimited"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _submit_path(cuda: bool) -> str:
    """Which way a CUDA worker would issue its jobs here, and why (docs/native.md); and,
    where this machine would run the CPU backend, that it never uses the helper."""
    from .backends.cuda.native import env_choice, status
    from .errors import InvalidSpec

    try:
        usable, why = status()
        asked = env_choice()
    except InvalidSpec as exc:
        return f"refused: {exc}"
    path = f"native issuer thread, jobs planned in C ({why})" if usable else f"python ({why})"
    if not cuda and (usable or asked):
        path += "; not used here: the CPU backend this machine runs makes no driver calls"
    return path


def collect_info() -> dict[str, Any]:
    """Facts as a dict (also what the tests check)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cuda = cuda_usable()
    info: dict[str, Any] = {
        "aiokv": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda-python": _cuda_python_version(),
        "anyio": _version("anyio"),
        "backend (auto)": "cuda" if cuda else "cpu",
        "CUDA submit path": _submit_path(cuda),
        "host memory available": _fmt_bytes(_mem_available()),
        "locked-memory limit (ulimit -l)": _fmt_bytes(soft if soft != resource.RLIM_INFINITY else -1),
        "cpu cores": os.cpu_count(),
    }
    if cuda:
        from .backends.cuda.device import device_facts

        info["device"] = torch.cuda.get_device_name(0)
        info["torch CUDA"] = torch.version.cuda
        info.update(device_facts())
    else:
        info["device"] = "none usable (CPU backend: device tensors are CPU tensors)"
    return info


def print_info() -> None:
    info = collect_info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
