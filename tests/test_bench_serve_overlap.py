"""The layerwise arm's overlap figures (``bench/serve/overlap.py``) and the timeline they
read (``LayerTimeline``): the forward's start is measured from the submit on the host
clock and judged against issue 38's 1 ms; the overlap is reported with and without the
time the forward spent waiting at gates within it, so a stall never reads as overlap."""

from __future__ import annotations

import pytest

from aiokv import LayerTimeline
from aiokv.bench.serve.arms import ArmResult
from aiokv.bench.serve.overlap import overlap_rows
from aiokv.bench.serve.served import Served

MS = 1e-3


def timeline(copy: list[float], reached: list[float], started: list[float]) -> LayerTimeline:
    n = len(copy)
    return LayerTimeline(clock="device", copy_done=tuple(x * MS for x in copy),
                         reached=tuple(x * MS for x in reached), started=tuple(x * MS for x in started),
                         issued=tuple(0.0 for _ in range(n)), blocked=tuple(0.0 for _ in range(n)))


def test_the_computing_overlap_leaves_out_the_waits_at_gates_within_it() -> None:
    # Copies end at 2, 4, 6, 8 ms; the forward reaches gate 0 at 1 ms and waits there until
    # 2, computes to 3, waits at gate 1 until 4, then finds layers 2 and 3 landed.
    tl = timeline([2, 4, 6, 8], [1, 3, 6.5, 9], [2, 4, 6.5, 9])
    assert tl.overlap == pytest.approx(7 * MS)
    assert tl.overlap_computing == pytest.approx(5 * MS)  # 7 less the 1 + 1 waited
    # A forward that only waits at each gate until its layer lands, the last one included.
    waiting = timeline([2, 4], [1, 2], [2, 4])
    assert waiting.overlap == pytest.approx(3 * MS) and waiting.overlap_computing == pytest.approx(0.0)
    # A wait that runs past the last copy's end counts only up to it.
    late = timeline([2, 4], [1, 3.5], [1, 5])
    assert late.overlap_computing == pytest.approx(2.5 * MS)
    # No overlap at all: the prefix had landed before the forward needed it.
    landed = timeline([1, 2], [3, 4], [3, 4])
    assert landed.overlap == landed.overlap_computing == pytest.approx(-1 * MS)


def served(index: int, submit_us: float, start_ms: float | None, tl: LayerTimeline | None) -> Served:
    return Served(index, 1000, 900, 0.0, 0.0, 0.01, 1, host_tokens=512, submit_s=submit_us * 1e-6,
                  forward_start_s=None if start_ms is None else start_ms * MS, timeline=tl)


def test_the_rows_judge_the_forward_start_against_1_ms_and_report_both_overlaps() -> None:
    tl = timeline([2, 4, 6, 8], [1, 3, 6.5, 9], [2, 4, 6.5, 9])
    loads = [served(0, 150, 0.6, tl), served(1, 170, 0.8, tl), served(2, 160, 0.7, tl)]
    arm = ArmResult("layerwise", loads, 0)
    rows = {r.name: r for r in overlap_rows("s", arm)}
    start = rows["forward start after the submit p50"]
    assert start.value == pytest.approx(0.7) and start.unit == "ms"
    assert start.target == ("<=", 1.0) and start.target_met is True
    assert rows["layerwise submit p50"].value == pytest.approx(160)
    assert rows["forward ran while the prefix arrived p50"].value == pytest.approx(7.0)
    assert rows["forward computed while the prefix arrived p50"].value == pytest.approx(5.0)
    slow = ArmResult("layerwise", [served(0, 150, 3.0, tl), served(1, 150, 4.0, tl)], 0)
    late = {r.name: r for r in overlap_rows("s", slow)}["forward start after the submit p50"]
    assert late.value == pytest.approx(3.5) and late.target_met is False
