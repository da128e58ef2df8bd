"""``aiokv bench``: transfer figures beside same-run ceilings, and the cache replay.

Public for scripts (``benchmarks/``): ``run_bench``, the report helpers, and ``Gemm``, the
GEMM load the bench runs beside its jobs, so a script loads the GPU the way the bench does."""

from __future__ import annotations

import datetime
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .cuda_setup import Gemm
from .report import BenchRow, format_table, write_json

__all__ = ["BenchRow", "Gemm", "format_table", "progress_printer", "run_bench", "write_json"]


def progress_printer(stream: Any = None) -> Callable[[str], None]:
    """Status lines with elapsed seconds, on stderr so stdout stays a clean table."""
    out = stream or sys.stderr
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=out, flush=True)

    return say


def bench_meta(backend: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if backend == "cuda":
        meta["device"] = torch.cuda.get_device_name(0)
    return meta


def run_bench(backend: str, *, quick: bool, loop: str, progress: Callable[[str], None]) -> list[BenchRow]:
    """Run the transfer benchmark on the chosen backend ("cpu" or "cuda")."""
    if backend == "cuda":
        from .cuda import run_cuda_bench

        return run_cuda_bench(quick=quick, progress=progress)
    from .transfer import run_transfer_bench

    rows = run_transfer_bench("cpu", quick=quick, progress=progress, backend=loop)
    progress("host side of a CUDA submit (every driver call a C no-op)")
    rows += hostside_rows(quick)
    return rows


def hostside_rows(quick: bool) -> list[BenchRow]:
    """What a CUDA submit costs the host on each path, measured here with every driver
    entry point a C no-op (``hostside``): no device figure, only aiokv's own work."""
    from ..backends.cuda import native
    from .hostside import host_figures

    sec = "host side of a CUDA submit (driver calls are C no-ops; no device involved)"
    if native.helper() is None:  # its no-op entry points are the helper's
        return [BenchRow(sec, "skipped", 0.0, "", None, "the native helper is not built here; its C "
                         "no-ops stand in for the driver")]
    try:
        figures = host_figures(100 if quick else 400)
    except Exception as exc:
        return [BenchRow(sec, "FAILED", 0.0, "", None, repr(exc)[:200], failed=True)]
    rows = []
    for path, values in figures.items():
        for key, value in values.items():
            unit = "us" if key.endswith(" us") else "per submit"
            note = ("counted by an LD_PRELOAD shim on PyEval_SaveThread" if unit == "per submit"
                    else "per-layer: 128 blocks x 64 pages of 32 KiB, staged" if key.startswith("per-layer")
                    else "")
            rows.append(BenchRow(sec, f"{path}: {key.removesuffix(' us')}", value, unit, None, note))
    return rows
