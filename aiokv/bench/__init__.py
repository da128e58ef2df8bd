"""``aiokv bench``: transfer figures beside same-run ceilings, and the cache replay.

Public for scripts (``benchmarks/``): ``run_bench``, the report helpers, ``Gemm``, the
GEMM load the bench runs beside its jobs, so a script loads the GPU the way the bench does,
and ``disk_read_ceiling``, the disk tier's ceiling the serve bench holds restores to."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .ceilings import disk_read_ceiling
from .cuda_setup import Gemm
from .report import BenchRow, format_table, write_json

__all__ = ["BenchRow", "Gemm", "disk_read_ceiling", "format_table", "progress_printer", "run_bench",
           "write_json"]


def progress_printer(stream: Any = None) -> Callable[[str], None]:
    """Status lines with elapsed seconds, on stderr so stdout stays a clean table."""
    out = stream or sys.stderr
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=out, flush=True)

    return say


def source_commit() -> tuple[str | None, bool | None]:
    """The git commit of the checkout aiokv runs from, and whether tracked files differ
    from it; (None, None) where aiokv is not a git checkout (an installed wheel) or git
    cannot say. A figure is tied to the code that produced it."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None, None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), (bool(status.stdout.strip()) if status.returncode == 0 else None)


def bench_meta(backend: str) -> dict[str, Any]:
    """The run's ``meta`` block: when, what code (aiokv's version and git commit, null
    outside a checkout; ``dirty`` when tracked files differ from it), on what."""
    commit, dirty = source_commit()
    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "aiokv": __version__,
        "commit": commit,
        "dirty": dirty,
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
        return [BenchRow.skipped(sec, "host side: skipped", "the native helper is not built here; its C "
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
