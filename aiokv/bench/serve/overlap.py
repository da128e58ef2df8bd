"""The layerwise arm's overlap, request by request, from each load's ``LayerTimeline``.

A gate stall of zero cannot tell perfect overlap from none: every layer may have landed
before the forward pass began. So per load: the host time its submit took; how long after
the submit's call the forward reached its first gate (the issue's target: the forward
starts <= 1 ms after the submit; host clock, both ends on it) and where that went (the
submit, the hand-over to the model thread, layer 0's work before its first gate), for the
loads submitted at their forward's start only: a load submitted early, in its restore
stage while the model was busy or others were ahead, waits for the model after its
submit, and that wait is queueing (its own row says how long its copy ran first); when
the forward reached that gate after the job's copies began (device time on CUDA);
whether that was before the last layer landed and by how much, with and without the time
the forward then spent waiting at gates (the overlap, and what of it the forward
computed); and when the lane handed its last layer to the device. ``--plot`` draws one
load layer by layer: each layer's copy end against the forward's arrival at its gate and
its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...layer_timeline import LayerTimeline
from ..report import BenchRow
from .arms import ArmResult
from .served import Served

__all__ = ["forward_start_rows", "overlap_rows", "plot_timeline", "timeline_extra"]

# Timing events resolve the device clock to about half a microsecond.
CLOCK_SLACK = 2e-6
# The issue's target: the forward starts within this long of the submit (ms).
FORWARD_START_TARGET_MS = 1.0


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def timeline_extra(s: Served) -> dict[str, Any]:
    """One load's timeline for the JSON (milliseconds from the job's copies' start)."""
    tl = s.timeline
    assert tl is not None
    return {"index": s.index, "host_tokens": s.host_tokens, "clock": tl.clock, "submit_us": s.submit_s * 1e6,
            "copy_done_ms": [_ms(t) for t in tl.copy_done], "reached_ms": [_ms(t) for t in tl.reached],
            "started_ms": [_ms(t) for t in tl.started], "issued_ms": [_ms(t) for t in tl.issued],
            "blocked_ms": [b * 1e3 for b in tl.blocked]}


def _p(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def overlap_rows(section: str, arm: ArmResult) -> list[BenchRow]:
    """The submit's host time and the overlap figures of the arm's layerwise loads."""
    loads = [s for s in arm.served if s.host_tokens and s.submit_s > 0]
    if not loads:
        return []
    submit = [s.submit_s * 1e6 for s in loads]
    rows = [BenchRow(section, "layerwise submit p50", _p(submit, 50), "us",
                     note=f"n={len(loads)} loads; p99 {_p(submit, 99):.0f} us; host time of the "
                          "submit_load call (the native path hands the whole load to the lane's issuer "
                          "thread; the Python path enqueues the first layers, its issuer thread the rest)",
                     extra={"submit_us": submit})]
    rows += forward_start_rows(section, loads)
    timed: list[tuple[Served, LayerTimeline, float, float]] = []
    for s in loads:
        tl = s.timeline
        if tl is not None and tl.first_reached is not None and tl.last_copy_done is not None:
            timed.append((s, tl, tl.first_reached * 1e3, tl.last_copy_done * 1e3))
    if not timed:
        return rows + [BenchRow(section, "forward at its first gate after the copies began p50", float("nan"),
                                "ms", note="no load timeline (on CUDA: WorkerOptions(layer_stalls=True))")]
    clock = timed[0][1].clock
    first = [f for _, _, f, _ in timed]
    copy = [c for _, _, _, c in timed]
    over = [c - f for c, f in zip(copy, first)]
    computing = [(tl.overlap_computing or 0.0) * 1e3 for _, tl, _, _ in timed]
    overlapped = sum(o > 0 for o in over)
    last_issue = [tl.issued[-1] * 1e3 for _, tl, _, _ in timed if tl.issued and tl.issued[-1] is not None]
    waited = gated = 0
    early = 0
    for _, tl, _, _ in timed:
        for r, c in zip(tl.reached, tl.copy_done):
            if r is not None and c is not None:
                gated += 1
                waited += r < c
        early += sum(x is not None and x < -CLOCK_SLACK for x in tl.slack())
    rows += [
        BenchRow(section, "forward at its first gate after the copies began p50", _p(first, 50), "ms",
                 note=f"n={len(timed)} timed loads ({clock} clock); p90 {_p(first, 90):.2f} ms; "
                      "the forward's arrival at layer 0's gate less the job's first copy; "
                      f"{sum(s.early_submit for s, _, _, _ in timed)} of them submitted early, their wait "
                      "for the model in it"),
        BenchRow(section, "forward ran while the prefix arrived p50", _p(over, 50), "ms",
                 note=f"last layer's copy end less the forward's first gate, time it waited at gates "
                      f"included; {overlapped} of {len(timed)} loads overlapped; whole load p50 "
                      f"{_p(copy, 50):.2f} ms; last layer issued p50 {_p(last_issue, 50):.2f} ms after "
                      "the submit",
                 extra={"overlapped": overlapped, "loads": len(timed), "copy_ms": copy,
                        "first_gate_ms": first},
                 failed=bool(early)),
        BenchRow(section, "forward computed while the prefix arrived p50", _p(computing, 50), "ms",
                 note="the row above less the time the forward waited at its gates within it "
                      "(LayerTimeline.overlap_computing)",
                 extra={"computing_ms": computing}),
        BenchRow(section, "gates that arrived before their layer landed", 100.0 * waited / max(1, gated), "%",
                 note=f"{waited} of {gated} gates: the forward caught up with the copy there"
                      + (f"; {early} LAYERS STARTED BEFORE THEIR COPY ENDED" if early else ""),
                 extra={"timelines": [timeline_extra(s) for s, _, _, _ in timed]}),
    ]
    return rows


def forward_start_rows(section: str, loads: Sequence[Served]) -> list[BenchRow]:
    """The forward's start after the submit, and where it went: (a) the submit's host time,
    (b) its return to the model thread beginning the forward (the hand-over), (c) that to
    the first gate (layer 0's work before it reads the prefix); a + b + c is the start.
    Loads submitted at their forward's start only; the early ones get a row of their own."""
    started = [s for s in loads if s.forward_start_s is not None]
    timed = [s for s in started if not s.early_submit]
    early = _early_rows(section, [s for s in started if s.early_submit], len(started))
    if not timed:
        return early
    total = [s.forward_start_s * 1e3 for s in timed]  # type: ignore[operator]
    split = [s for s in timed if s.handover_s is not None and s.first_gate_s is not None]
    parts = {"submit": [s.submit_s * 1e3 for s in split],
             "hand-over": [s.handover_s * 1e3 for s in split],  # type: ignore[operator]
             "to the first gate": [s.first_gate_s * 1e3 for s in split]}  # type: ignore[operator]
    note = (f"n={len(timed)} of {len(started)} loads: those submitted at their forward's start (the model "
            f"idle, none ahead); p90 {_p(total, 90):.2f} ms; host clock, from the submit_load call to the "
            "forward's call of its first gate (the block table and the inputs are ready before)")
    extra: dict[str, Any] = {"forward_start_ms": total}
    if split:
        note += ("; it is (a) + (b) + (c), p50 / p90 ms: "
                 + ", ".join(f"({k}) {name} {_p(v, 50):.2f} / {_p(v, 90):.2f}"
                             for k, (name, v) in zip("abc", parts.items())))
        extra.update(submit_ms=parts["submit"], handover_ms=parts["hand-over"],
                     to_first_gate_ms=parts["to the first gate"])
    rows = [BenchRow(section, "forward start after the submit p50", _p(total, 50), "ms", note=note,
                     extra=extra, target=("<=", FORWARD_START_TARGET_MS))]
    notes = {
        "hand-over": "(b) from the submit's return to the server's model thread beginning the forward "
                     "(its wake-up from the queue it sleeps on, and the GIL)",
        "to the first gate": "(c) from that to the forward's first gate: layer 0's work before it reads "
                             "the prefix (on CUDA its kernels' launches; on the CPU their compute)",
    }
    for name, why in notes.items():
        if split:
            rows.append(BenchRow(section, f"forward start: {name} p50", _p(parts[name], 50), "ms",
                                 note=f"n={len(split)}; p90 {_p(parts[name], 90):.2f} ms; {why}"))
    return rows + early


def _early_rows(section: str, early: Sequence[Served], started: int) -> list[BenchRow]:
    """Loads submitted in their restore stage: submit to their forward's first gate, which
    is mostly their wait for the model (the head start their copy had), not a start."""
    if not early:
        return []
    ahead = [s.forward_start_s * 1e3 for s in early]  # type: ignore[operator]
    return [BenchRow(section, "early submit to its forward's first gate p50", _p(ahead, 50), "ms",
                     note=f"n={len(early)} of {started} loads: submitted in their restore stage, the model "
                          f"busy or others ahead; p90 {_p(ahead, 90):.2f} ms; their wait for the model is in "
                          "it (queueing, not a forward start): the head start their copy had",
                     extra={"early_submit_to_first_gate_ms": ahead})]


def plot_timeline(ax: Any, rows: Sequence[BenchRow]) -> bool:
    """Draw the largest timed load's layers on ``ax``; False when no row has a timeline."""
    timelines = [t for row in rows for t in row.extra.get("timelines", ())]
    if not timelines:
        return False
    top = max(t["host_tokens"] for t in timelines)
    pick = [t for t in timelines if t["host_tokens"] == top]
    tl = pick[len(pick) // 2]
    layers = np.arange(len(tl["copy_done_ms"]))
    marks = (("copy_done_ms", "o-", "copy ended"), ("reached_ms", "x", "forward reached the gate"),
             ("started_ms", "|", "layer started"))
    for key, style, label in marks:
        values = np.array([np.nan if v is None else v for v in tl[key]], dtype=float)
        ax.plot(values, layers, style, label=label, markersize=4)
    issued = np.array([np.nan if v is None else v for v in tl["issued_ms"]], dtype=float)
    ax.plot(issued, layers, ":", color="grey", label="handed to the device (host clock)")
    ax.set_xlabel(f"ms since the job's first copy ({tl['clock']} clock)")
    ax.set_ylabel("layer")
    ax.set_title(f"one layerwise load of {tl['host_tokens']:,} tokens (request {tl['index']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return True
