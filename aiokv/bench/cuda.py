"""The CUDA benchmark: every figure beside its ceiling, measured in the same run.

Ceilings are contiguous pinned copies of the same bytes (one direction, and both at
once). Strategy figures go through ``AsyncOffloadingWorker`` on asyncio: device GB/s of
one job (from ``TransferResult.transfer_time``), and streamed GB/s (jobs kept in flight,
bytes over wall time) idle, under a saturating GEMM and under medium GEMMs launched from
another Python thread, with each GEMM's slowdown. Completion wake-up is measured on
asyncio, and for the 4 KiB and 2 MiB-page jobs on uvloop and trio too, where installed.

The parts: ``cuda_setup`` (KV caches, jobs, ceilings, GEMM loads, baselines),
``cuda_rows`` (one strategy run's figures), ``cuda_wakeup`` (completion rows and the
event loops); this module runs them in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .cuda_rows import Conditions, strategy_rows
from .cuda_setup import BLOCKS, CHUNKS, LAYERS, BenchSetup, Contiguous, Gemm, JobIds, baselines
from .cuda_wakeup import OTHER_LOOPS, loop_available, native_rows, run_on_loop, wakeup_rows
from .report import BenchRow

__all__ = ["OTHER_LOOPS", "loop_available", "run_cuda_bench", "run_on_loop"]


def run_cuda_bench(quick: bool = False, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Run the whole CUDA benchmark and return its rows (see module docstring)."""
    say = progress or (lambda _msg: None)
    reps = 3 if quick else 7
    window = 0.6 if quick else 1.2
    torch.cuda.init()
    dev = torch.device("cuda")
    rows: list[BenchRow] = []
    say("allocating KV caches")
    per_layer = BenchSetup(
        "32 KiB pages",
        [torch.randn(2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)],
        block_dim=1, chunks=CHUNKS, seed=1,
    )
    big = BenchSetup(
        "2 MiB pages",
        [torch.randn(BLOCKS, LAYERS, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)],
        block_dim=0, chunks=CHUNKS // 2, seed=2,
    )
    contig = Contiguous(per_layer.job_bytes)
    say("ceilings")
    ceil = contig.rates(reps)
    sec = "ceilings (contiguous pinned copy, 256 MiB)"
    rows += [
        BenchRow(sec, "store D2H", ceil["store"], "GB/s"),
        BenchRow(sec, "load H2D", ceil["load"], "GB/s"),
        BenchRow(sec, "both directions at once (sum)", ceil["both"], "GB/s"),
    ]
    big_gemm, med_gemm = Gemm(8192, 8192, 8192), Gemm(4096, 4096, 14336)
    say("GEMMs alone")
    big_alone, med_alone = big_gemm.alone(window), med_gemm.alone(window)
    say(f"ceilings {ceil}")
    rows.append(BenchRow(sec, "GEMM 8192^3 bf16 alone", big_alone, "TFLOP/s"))
    rows.append(BenchRow(sec, "GEMM 4096x4096x14336 bf16 alone (thread)", med_alone, "TFLOP/s"))
    with big_gemm:
        c_big = contig.stream_rate(window)
    rows.append(BenchRow(sec, "store D2H under GEMM 8192^3", c_big, "GB/s", ceil["store"],
                         f"GEMM {100 * (1 - big_gemm.rate / big_alone):+.1f}% slower"))

    ids = JobIds()
    one_alloc = BenchSetup(
        "32 KiB pages, layers in one allocation",
        list(torch.randn(LAYERS, 2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=dev).unbind(0)),
        block_dim=1, chunks=CHUNKS, seed=1,
    )
    # (setup, strategy, streams, submit threads, issuer threads); None = the default.
    # "auto" is what a worker gets by default: staged for the 32 KiB pages, plain DMA for
    # the 2 MiB ones; "dma" beside it is one copy per page (or a pitched copy per block).
    # "issuer thread" is the default worker with WorkerOptions(issue_thread=True).
    runs: list[tuple[BenchSetup, str, int, int | None, bool]] = [
        (per_layer, "auto", 0, None, False), (per_layer, "auto", 0, None, True),
        (per_layer, "dma", 0, None, False), (per_layer, "kernel", 0, None, False),
        (one_alloc, "auto", 0, None, False), (one_alloc, "dma", 0, None, False),
        (big, "auto", 0, None, False), (big, "auto", 0, None, True), (big, "staged", 0, None, False),
        (big, "kernel", 0, None, False),
    ]
    if not quick:
        runs += [(per_layer, "dma", 0, 0, False)] + [(per_layer, "dma", n, None, False) for n in (1, 4, 32)]
    env = Conditions(ceil, big_gemm, big_alone, med_gemm, med_alone, ids, reps, window)
    for setup, name, streams, threads, issuer in runs:
        rows += strategy_rows(setup, name, streams, threads, issuer, env, say)
    say("wake-up latency")
    rows += wakeup_rows(per_layer, big, quick)
    say("submit paths: native beside python")
    rows += native_rows(per_layer, quick)
    say("baselines")
    try:
        rows += baselines(per_layer, reps, ceil)
    except Exception as exc:
        rows.append(BenchRow("baselines (32 KiB pages)", "FAILED", None, "", None, repr(exc)[:200],
                             failed=True))
    say("ceilings again")
    _raise_ceilings(rows, ceil, contig.rates(reps))
    return rows


def _raise_ceilings(rows: list[BenchRow], first: dict[str, float], again: dict[str, float]) -> None:
    """Ceilings are the better of the run's first and last measurement (shared machines
    drift); every ratio is recomputed against it, so no figure is flattered by a slow start."""
    names = {"store": "store D2H", "load": "load H2D", "both": "both directions at once (sum)"}
    for key, label in names.items():
        best = max(first[key], again[key])
        for row in rows:
            if row.ceiling == first[key]:
                row.ceiling = best
            if row.section.startswith("ceilings") and row.name == label:
                row.value = best
                row.note = f"best of start {first[key]:.2f} / end {again[key]:.2f} GB/s"
