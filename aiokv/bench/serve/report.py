"""The serve bench's rows: TTFT per arm, hit class and prefix length beside each arm's
computed lower bound, prefill rate, model utilisation, model FLOP utilisation, GPU-seconds
saved and, for the layerwise arm, how long the forward waited on its layers.

The lower bound of a request is the same server with each transfer and forward cut to
what the hardware allows: its host-restored bytes at the load ceiling and its
disk-restored bytes at the slower of the disk read and load ceilings, from its arrival
(restores run beside other requests' forwards, each at the full ceiling), then the
prefill seconds the arm measured for it on the one model, which takes the earliest
arrival among the requests whose restore is over, as the server does (the oracle moves
nothing, so its bound is its prefill alone; a layerwise load runs from the request's
arrival, beside its wait for the model and its forward, as the server submits a queued
request's load at admission: its forward, counted without its waits on layers, ends no
sooner than the load lands). Each segment starts from an empty queue as the arms serve
it, so queueing is in the bound as in the figure.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..report import BenchRow
from .arms import ArmResult
from .config import ARM_TEXT
from .model import BLOCK_TOKENS, ModelConfig
from .overlap import overlap_rows, plot_timeline
from .served import HIT_CLASSES, Served

__all__ = ["BUCKETS", "Ceilings", "arm_bounds", "arm_rows", "bucket_of", "lower_bounds", "percentiles",
           "utilisation"]

BUCKETS = ((0, 0, "0"), (1, 1023, "1-1023"), (1024, 4095, "1k-4k"), (4096, 16383, "4k-16k"),
           (16384, 1 << 62, ">=16k"))
"""Prefix-length buckets (tokens some earlier request had computed: the reusable prefix)."""
CLASS_LABELS = {"miss": "misses", "gpu": "GPU hits", "host": "host hits", "disk": "disk hits"}
TIER_OF = {"redis": "redis"}
"""The tier a tiered arm's lower-tier hits came from, where it is not the disk (the class
``disk`` holds every request that read a lower tier)."""


def class_label(arm: str, cls: str) -> str:
    """A hit class as one arm's rows name it (the Redis arm's tier hits are Redis hits)."""
    return f"{TIER_OF[arm]} hits" if cls == "disk" and arm in TIER_OF else CLASS_LABELS[cls]


def arm_ceilings(arm: ArmResult, ceil: Ceilings) -> Ceilings:
    """The run's ceilings with this arm's own tier ceiling where it has one (Redis)."""
    return replace(ceil, disk_gbps=arm.disk_ceiling) if arm.name in TIER_OF else ceil


@dataclass(frozen=True)
class Ceilings:
    """The run's measured limits: load GB/s, GEMM FLOP/s, and the disk tier's read GB/s."""

    load_gbps: float
    load_name: str
    peak_flops: float
    peak_name: str
    block_bytes: int
    disk_gbps: float | None = None


def bucket_of(tokens: int) -> str:
    return next(name for lo, hi, name in BUCKETS if lo <= tokens <= hi)


def lower_bounds(served: Sequence[Served], ceil: Ceilings, *, moves: bool = True,
                 overlap: bool = False) -> dict[int, float]:
    """Per request index, its TTFT in the same server at the ceilings (module docs)."""
    load = ceil.load_gbps * 1e9
    disk = min(ceil.disk_gbps, ceil.load_gbps) * 1e9 if ceil.disk_gbps else load
    per_token = ceil.block_bytes / BLOCK_TOKENS
    out: dict[int, float] = {}
    for k in sorted({s.segment for s in served}):
        # (ready, arrival, order, its forward's seconds, index, its load landed), by when
        # its restore is over
        due = []
        part = sorted((s for s in served if s.segment == k), key=lambda s: (s.arrival, s.start))
        for n, s in enumerate(part):
            transfer = (s.host_tokens * per_token / load + s.disk_tokens * per_token / disk) if moves else 0.0
            if overlap:  # the load runs from its arrival, beside its wait for the model and its forward
                due.append((s.arrival, s.arrival, n, s.compute_s, s.index, s.arrival + transfer))
            else:
                due.append((s.arrival + transfer, s.arrival, n, s.compute_s, s.index, s.arrival + transfer))
        due.sort()
        ready: list[tuple[float, int, float, int, float]] = []  # a heap by arrival
        clock, i = float("-inf"), 0
        while i < len(due) or ready:
            if not ready:
                clock = max(clock, due[i][0])
            while i < len(due) and due[i][0] <= clock:
                heapq.heappush(ready, due[i][1:])
                i += 1
            arrival, _, seconds, index, landed = heapq.heappop(ready)
            clock = max(clock + seconds, landed)  # a forward ends no sooner than its last layer lands
            out[index] = clock - arrival
    return out


def arm_bounds(arm: ArmResult, ceil: Ceilings) -> dict[int, float]:
    """``lower_bounds`` as the arm moves its blocks."""
    return lower_bounds(arm.served, arm_ceilings(arm, ceil), moves=arm.name != "oracle",
                        overlap=arm.name == "layerwise")


def utilisation(served: Sequence[Served]) -> float:
    """The model's busy seconds (``Served.busy``: its forwards, not the restores beside
    them) over the seconds the segments lasted (first arrival to last first token of
    each): the load the arm actually carried."""
    busy = sum(s.busy for s in served)
    span = 0.0
    for k in {s.segment for s in served}:
        part = [s for s in served if s.segment == k]
        span += max(s.first_token for s in part) - min(s.arrival for s in part)
    return busy / span if span > 0 else float("nan")


def percentiles(values: Sequence[float], qs: tuple[int, ...] = (50, 90, 99)) -> list[float]:
    arr = np.asarray(values, dtype=float)
    return [float(np.percentile(arr, q)) for q in qs] if arr.size else [float("nan")] * len(qs)


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values]


def _ttft_rows(section: str, label: str, group: Sequence[Served], bounds: dict[int, float],
               extra: dict[str, object] | None = None) -> list[BenchRow]:
    ttft = _ms([s.ttft for s in group])
    bound = _ms([bounds[s.index] for s in group])
    p, b = percentiles(ttft), percentiles(bound)
    return [BenchRow(section, f"TTFT p{q} {label}".rstrip(), p[i], "ms", b[i],
                     note=f"n={len(group)}" if i == 0 else "",
                     extra=(extra or {}) if i == 0 else {}, bound=True)
            for i, q in enumerate((50, 90, 99))]


def arm_rows(arm: ArmResult, ceil: Ceilings, config: ModelConfig, *, recompute: ArmResult | None,
             mirrors: str | None = None) -> list[BenchRow]:
    """Every figure of one arm (see the module docs for the bound)."""
    served = arm.served
    text = ARM_TEXT[arm.name] + (f" ({mirrors})" if mirrors else "")
    section = f"serve arm: {arm.name}, {text}"
    bounds = arm_bounds(arm, ceil)
    rows = _ttft_rows(section, "", served, bounds, extra={
        "arm": arm.name, "ttft_ms": _ms([s.ttft for s in served]),
        "bound_ms": _ms([bounds[s.index] for s in served]),
        "hit": [s.hit for s in served], "index": [s.index for s in served],
        "prefill_ms": _ms([s.prefill_s for s in served]), "busy_ms": _ms([s.busy for s in served]),
        "restore_wait_ms": _ms([s.restore_wait for s in served]),
        "model_wait_ms": _ms([s.model_wait for s in served]), "queue_ms": _ms([s.queue_s for s in served]),
        "load_ms": _ms([s.load_s for s in served]), "stall_ms": _ms([s.stall_s for s in served]),
        "segment": [s.segment for s in served], "arrival_ms": _ms([s.arrival for s in served]),
        "wall_s": [s.wall for s in served],
        "tokens": [[s.gpu_tokens, s.host_tokens, s.disk_tokens, s.computed] for s in served]})
    rows[0].note = f"n={len(served)}; beside each TTFT, this arm's lower bound (>=)"
    for cls in HIT_CLASSES:
        group = [s for s in served if s.hit == cls]
        if group:
            rows.append(_class_row(section, class_label(arm.name, cls), group, bounds))
    for _, _, name in BUCKETS:
        group = [s for s in served if bucket_of(s.reusable) == name]
        if group:
            rows.append(_class_row(section, f"prefix {name}", group, bounds))
    computed = sum(s.computed for s in served)
    prefill = sum(s.prefill_s for s in served)
    prompt = sum(s.prompt for s in served)
    reused = {k: sum(getattr(s, f"{k}_tokens") for s in served) for k in ("gpu", "host", "disk")}
    rows.append(BenchRow(section, "prefill tokens/s", computed / prefill if prefill else 0.0, "tok/s",
                         note=f"{computed:,} computed of {prompt:,} prompt tokens; reused: "
                              + ", ".join(f"{TIER_OF.get(arm.name, k) if k == 'disk' else k} "
                                          f"{v / max(1, prompt):.1%}" for k, v in reused.items()),
                         extra={"computed_tokens": computed, "prompt_tokens": prompt, **reused}))
    busy = sum(s.busy for s in served)
    rows.append(BenchRow(section, "model utilisation", 100 * utilisation(served), "%",
                         note="model busy (the model taking a request to its first token; restores run "
                              "beside it) over the segments' spans"))
    if recompute is not None and arm.name != "recompute":
        base = sum(s.busy for s in recompute.served)
        rows.append(BenchRow(section, "GPU-seconds saved vs recompute", base - busy, "s",
                             note=f"model busy {busy:.2f} s vs {base:.2f} s"))
    if arm.name == "recompute":
        flops = sum(config.prefill_flops(s.computed, s.prompt - s.computed) for s in served)
        achieved = flops / prefill if prefill else 0.0
        rows.append(BenchRow(section, "model FLOP utilisation", 100 * achieved / ceil.peak_flops, "%",
                             note=f"{achieved / 1e12:.3g} TFLOP/s of {ceil.peak_flops / 1e12:.3g} "
                                  f"(peak: {ceil.peak_name})"))
    rows += _restore_rows(section, arm, arm_ceilings(arm, ceil))
    raised = [s for s in served if s.restore_error]
    if raised:
        rows.append(BenchRow(section, "restores that raised", float(len(raised)), "restores",
                             note=f"served by computing their {sum(s.recomputed for s in raised):,} tokens; "
                                  f"the first: {raised[0].restore_error}"))
    if arm.name == "layerwise":
        rows += _stall_rows(section, arm)
        rows += overlap_rows(section, arm)
    return rows


def _stall_rows(section: str, arm: ArmResult) -> list[BenchRow]:
    """How long the forward waited on a layer after it was due (per gate) and per request."""
    rows = []
    late = sum(s.late_failure for s in arm.served)
    recomputed = [s for s in arm.served if s.recomputed]
    if late or recomputed:
        rows.append(BenchRow(section, "layerwise loads that failed", float(late + len(recomputed)), "loads",
                             note=f"{len(recomputed)} failed at a gate (their tokens recomputed); "
                                  f"{late} after their gates passed: THOSE OUTPUTS READ WRONG BYTES",
                             failed=late > 0))
    if not arm.stalls:
        return rows
    us = [v * 1e6 for v in arm.stalls]
    p50, p99 = (float(np.percentile(us, q)) for q in (50, 99))
    loaded = [s for s in arm.served if s.host_tokens]
    per_req = percentiles(_ms([s.stall_s for s in loaded]), (50, 99))
    share = sum(s.stall_s for s in loaded) / max(1e-12, sum(s.prefill_s for s in loaded))
    return rows + [BenchRow(section, "layer stall p50", p50, "us",
                     note=f"{len(us)} gates; waited on a layer after it was due "
                          f"(statistics().layers: device time on CUDA, host time blocked on the CPU)",
                     extra={"stalls_us": us}),
            BenchRow(section, "layer stall p99", p99, "us"),
            BenchRow(section, "stall per request p50", per_req[0], "ms",
                     note=f"n={len(loaded)} layerwise loads; p99 {per_req[1]:.2f} ms; "
                          f"{share:.1%} of their prefill time")]


def _class_row(section: str, label: str, group: Sequence[Served], bounds: dict[int, float]) -> BenchRow:
    p = percentiles(_ms([s.ttft for s in group]))
    b = percentiles(_ms([bounds[s.index] for s in group]))
    return BenchRow(section, f"TTFT p50 {label}", p[0], "ms", b[0],
                    note=f"n={len(group)}; p90 {p[1]:.1f}, p99 {p[2]:.1f} ms",
                    extra={"n": len(group), "p90_ms": p[1], "p99_ms": p[2],
                           "bound_p90_ms": b[1], "bound_p99_ms": b[2]}, bound=True)


def _restore_rows(section: str, arm: ArmResult, ceil: Ceilings) -> list[BenchRow]:
    """Restore GB/s (bytes over the wall time of ``restore``) of 1k tokens or more."""
    rows = []
    per_token = ceil.block_bytes / BLOCK_TOKENS
    for where, pick in (("host", lambda s: s.host_tokens and not s.disk_tokens),
                        (TIER_OF.get(arm.name, "disk"), lambda s: s.disk_tokens)):
        loads = [s for s in arm.served if pick(s) and s.load_s > 0]
        if not loads:
            continue
        big = [s for s in loads if s.host_tokens + s.disk_tokens >= 1024]
        group, label = (big, ">= 1k tokens") if big else (loads, "all sizes")
        nbytes = sum((s.host_tokens + s.disk_tokens) * per_token for s in group)
        seconds = sum(s.load_s for s in group)
        ceiling = ceil.load_gbps if where == "host" else min(ceil.disk_gbps or ceil.load_gbps, ceil.load_gbps)
        how = ("the loads' copy time (TransferResult.transfer_time): their wall time overlaps the forward"
               if arm.name == "layerwise" else "await to return")
        rows.append(BenchRow(section, f"restore GB/s, {where} hits, {label}", nbytes / seconds / 1e9, "GB/s",
                             ceiling, note=f"{len(group)} restores, {how}"
                             + ("" if big else "; none of >= 1k tokens")))
    if arm.cache is not None:
        st = arm.cache
        tiers = "; ".join(f"{t.name}: demoted {t.demoted}, dropped {t.demotions_dropped}, "
                          f"read misses {t.read_misses}" for t in st.tiers)
        rows.append(BenchRow(section, "cache hit rate (keys, lookup)", 100 * st.hit_rate, "%",
                             note=f"stored {st.stored_keys:,}, evicted {st.evictions:,}, "
                                  f"GPU evictions {arm.gpu_evictions:,}" + (f"; {tiers}" if tiers else "")))
    return rows


def plot_cdfs(rows: Sequence[BenchRow], path: str, title: str) -> None:
    """TTFT CDF per arm (log time axis) and, with the layerwise arm, one load's layers
    (``overlap.plot_timeline``); needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = any(row.extra.get("timelines") for row in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(15 if timed else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    if timed:
        plot_timeline(axes[0][1], rows)
    for row in rows:
        values = row.extra.get("ttft_ms")
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=str(row.extra.get("arm")))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
