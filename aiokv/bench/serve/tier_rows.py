"""The tiers under a served model: what each costs the event loop, how fast it restores
against its own ceiling, and whether it dropped blocks, all from the same run.

- **Event loop busy**: the loop thread's CPU time over the wall time of the arm's measured
  turns, and the wake-up lag of a 5 ms sleep on it (``loopwatch``), for every arm. The host
  arm is the same server without a tier, so the disk and Redis arms' figures beside it
  are what their tier's work costs the loop.
- **Host hits against the host arm**: TTFT p50 of the requests that were host hits, with
  the same hits, in both arms (target at most 1.1x): a tier's work must not slow the hits
  the host serves. Beside it, the same requests' service (their TTFT less their queue
  waits: their admission and restore, and their time on the model) against the host
  arm's, and each arm's queue wait (for admission, and for the model once restored): the
  server restores beside the model, so a tier arm's slower hits hold only themselves,
  and what they still cost its host hits (the model's time, admission slots) shows in
  the queue wait, which the TTFT ratio counts and the service ratio does not.
- **Restore against the tier's ceiling**: the restores that read at least 1k tokens from
  the tier, their time at the ceilings (the tier's bytes at the tier's ceiling measured on
  the same tier at the end of the run, disk: plain reads of its own files, Redis: redis-py
  GETs from its server; the host's bytes at the load ceiling) over the time they took, so
  a pure tier restore's figure is its rate over the tier's ceiling. Targets: 0.8 of the
  disk's, 0.7 of Redis's. Each restore's time runs from its call to its return, so
  restores that read at once each count the time they shared the tier.
- **Restores together against the ceiling**: every restore that read from the tier, their
  tier bytes over the time at least one of them ran (the union of their intervals, segment
  by segment: each segment runs on its own clock, after the one before), over
  the tier's ceiling: the rate the tier gave while it was restoring. Beside the figure per
  restore it tells a slow reader (both low) from a shared tier (this one near 1 while
  the per-restore one is low: the restores overlapped).
- **Dropped on the way down**: blocks a tier never got (target 0), with how often and how
  long offers waited for room in its write queue (backpressure) instead.
"""

from __future__ import annotations

import numpy as np

from ..report import BenchRow
from .arms import ArmResult
from .model import BLOCK_TOKENS
from .report import Ceilings, arm_ceilings

__all__ = ["TIER_TARGETS", "tier_rows", "union_seconds"]

TIER_TARGETS = {"disk": 0.8, "redis": 0.7}
"""Restore rate of each tier's arm against its ceiling, at least."""
HOST_HIT_TARGET = 1.1
"""A tiered arm's host-hit TTFT p50 against the host arm's, at most."""


def tier_rows(arms: dict[str, ArmResult], ceil: Ceilings) -> list[BenchRow]:
    section = "serve tiers: the loop, restores against each tier's ceiling, drops"
    rows = [_loop_row(section, arm) for arm in arms.values() if arm.loop.wall_s > 0]
    host = arms.get("host")
    for name in (n for n in TIER_TARGETS if n in arms):
        arm = arms[name]
        if host is not None:
            rows += _host_hit_rows(section, arm, host)
        rows += _restore_rows(section, arm, arm_ceilings(arm, ceil))
        rows += _together_rows(section, arm, arm_ceilings(arm, ceil))
        rows += _drop_rows(section, arm)
    return rows


def _loop_row(section: str, arm: ArmResult) -> BenchRow:
    watch = arm.loop
    return BenchRow(section, f"event loop busy, {arm.name} arm", 100 * watch.busy, "%",
                    note=f"loop thread CPU over {watch.wall_s:.1f} s of measured turns; a 5 ms sleep "
                         f"woke {watch.lag_ms(50):.2f} ms late at p50, {watch.lag_ms(99):.2f} ms at p99 "
                         f"(n={len(watch.lags)})",
                    extra={"arm": arm.name, "busy": watch.busy, "cpu_s": watch.cpu_s, "wall_s": watch.wall_s,
                           "lag_p50_ms": watch.lag_ms(50), "lag_p99_ms": watch.lag_ms(99)})


def _host_hit_rows(section: str, arm: ArmResult, host: ArmResult) -> list[BenchRow]:
    theirs = {s.index: s for s in host.served}
    same = [s for s in arm.served if s.hit == "host" and s.index in theirs and theirs[s.index].hit == "host"
            and (s.gpu_tokens, s.host_tokens) == (theirs[s.index].gpu_tokens, theirs[s.index].host_tokens)]
    if not same:
        return []
    mine = float(np.median([s.ttft for s in same]))
    base = float(np.median([theirs[s.index].ttft for s in same]))
    ratio = mine / base if base > 0 else float("nan")
    served = float(np.median([s.service_s for s in same]))
    served_base = float(np.median([theirs[s.index].service_s for s in same]))
    queued = float(np.median([s.queue_s for s in same]))
    queued_base = float(np.median([theirs[s.index].queue_s for s in same]))
    model_wait = float(np.median([s.model_wait for s in same]))
    model_wait_base = float(np.median([theirs[s.index].model_wait for s in same]))
    return [BenchRow(section, f"host hits, {arm.name} arm / host arm", ratio, "x",
                     note=f"TTFT p50 of n={len(same)} requests that were host hits with the same hits in "
                          f"both; {mine * 1e3:.1f} vs {base * 1e3:.1f} ms",
                     extra={"n": len(same), "p50_ms": mine * 1e3, "host_p50_ms": base * 1e3},
                     target=("<=", HOST_HIT_TARGET)),
            BenchRow(section, f"host hits' service, {arm.name} arm / host arm",
                     served / served_base if served_base > 0 else float("nan"), "x",
                     note=f"the same n={len(same)} requests, their TTFT less their queue waits (their "
                          f"admission, restore and forward), p50 {served * 1e3:.1f} vs "
                          f"{served_base * 1e3:.1f} ms; their queue wait p50 {queued * 1e3:.1f} vs "
                          f"{queued_base * 1e3:.1f} ms, of it for the model once restored "
                          f"{model_wait * 1e3:.1f} vs "
                          f"{model_wait_base * 1e3:.1f} ms",
                     extra={"n": len(same), "service_p50_ms": served * 1e3,
                            "host_service_p50_ms": served_base * 1e3, "queue_p50_ms": queued * 1e3,
                            "host_queue_p50_ms": queued_base * 1e3, "model_wait_p50_ms": model_wait * 1e3,
                            "host_model_wait_p50_ms": model_wait_base * 1e3})]


def _restore_rows(section: str, arm: ArmResult, ceil: Ceilings) -> list[BenchRow]:
    per_token = ceil.block_bytes / BLOCK_TOKENS
    big = [s for s in arm.served if s.disk_tokens >= 1024 and s.load_s > 0]
    label = ">= 1k tokens from the tier"
    if not big:
        big = [s for s in arm.served if s.disk_tokens and s.load_s > 0]
        label = "any size (none read >= 1k tokens from the tier)"
    if not big:
        return []
    tier_bytes = sum(s.disk_tokens * per_token for s in big)
    host_bytes = sum(s.host_tokens * per_token for s in big)
    seconds = sum(s.load_s for s in big)
    rate = tier_bytes / seconds / 1e9  # the tier's own bytes: host bytes load at the load ceiling
    target = TIER_TARGETS[arm.name]
    name = f"restore / tier ceiling, {arm.name} arm"
    extra = {"restores": len(big), "tier_bytes": tier_bytes, "bytes": tier_bytes + host_bytes,
             "seconds": seconds, "gbps": rate, "ceiling_gbps": arm.disk_ceiling}
    how = (f"per restore: {len(big)} restores of {label}, {tier_bytes / (tier_bytes + host_bytes):.0%} of "
           "their bytes from the tier, each timed from its await to its return")
    if not arm.disk_ceiling:
        return [BenchRow(section, name, None, "x", extra=extra,
                         note=f"{rate:.2f} GB/s of the tier's bytes; {how}; "
                              f"no ceiling: {arm.disk_ceiling_error}")]
    # The restores' time against their time at the ceilings, as ``report.lower_bounds`` moves
    # them: the tier's bytes at its ceiling, the host's at the load ceiling. A host's bytes
    # counted at the tier's rate would lift a slow tier's figure past its ceiling.
    at_ceilings = (tier_bytes / (min(arm.disk_ceiling, ceil.load_gbps) * 1e9)
                   + host_bytes / (ceil.load_gbps * 1e9))
    extra["seconds_at_ceilings"] = at_ceilings
    return [BenchRow(section, name, at_ceilings / seconds, "x", extra=extra, target=(">=", target),
                     note=f"{at_ceilings * 1e3:.1f} ms at the ceilings of {seconds * 1e3:.1f} ms taken; the "
                          f"tier's bytes at {rate:.2f} GB/s of {arm.disk_ceiling:.2f} GB/s "
                          f"({arm.ceiling_name}), the host's at the load ceiling; {how}")]


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``intervals`` (start, end)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _together_rows(section: str, arm: ArmResult, ceil: Ceilings) -> list[BenchRow]:
    per_token = ceil.block_bytes / BLOCK_TOKENS
    runs = [s for s in arm.served if s.disk_tokens and s.load_s > 0 and s.load_at is not None]
    if not runs:
        return []
    # Each segment runs after the one before, on the trace clock from its own first
    # arrival: one segment's late restores may seem to overlap the next one's, so the
    # union is taken segment by segment.
    union = sum(union_seconds([(s.load_at, s.load_at + s.load_s) for s in runs
                               if s.segment == k and s.load_at is not None])
                for k in {s.segment for s in runs})
    tier_bytes = sum(s.disk_tokens * per_token for s in runs)
    rate = tier_bytes / union / 1e9 if union > 0 else float("nan")
    overlap = sum(s.load_s for s in runs) / union if union > 0 else float("nan")
    name = f"restores together / tier ceiling, {arm.name} arm"
    extra = {"restores": len(runs), "tier_bytes": tier_bytes, "union_s": union, "gbps": rate,
             "ceiling_gbps": arm.disk_ceiling, "overlap": overlap}
    how = (f"all {len(runs)} restores that read from the tier (any size): their tier bytes over the "
           f"{union * 1e3:.1f} ms in which at least one ran (the union of their intervals), "
           f"{overlap:.2f} of them at once on average")
    if not arm.disk_ceiling:
        return [BenchRow(section, name, None, "x", extra=extra, note=f"{rate:.2f} GB/s; {how}")]
    ceiling = min(arm.disk_ceiling, ceil.load_gbps)
    return [BenchRow(section, name, rate / ceiling, "x", extra=extra,
                     note=f"{rate:.2f} GB/s of {ceiling:.2f} GB/s ({arm.ceiling_name}); {how}")]


def _drop_rows(section: str, arm: ArmResult) -> list[BenchRow]:
    if arm.cache is None or not arm.cache.tiers:
        return []
    st = arm.cache.tiers[0]
    written = st.demoted + st.write_throughs + st.persisted
    return [BenchRow(section, f"blocks dropped on the way down, {arm.name} arm", float(st.demotions_dropped),
                     "blocks", note=f"of {written + st.demotions_dropped:,} sent down ({written:,} written); "
                                    f"copies waited their turn for room {st.room_waits:,} times, "
                                    f"{st.room_wait_seconds:.2f} s in all",
                     extra={"dropped": st.demotions_dropped, "written": written, "room_waits": st.room_waits,
                            "room_wait_s": st.room_wait_seconds}, target=("<=", 0))]
