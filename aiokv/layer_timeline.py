"""``LayerTimeline``: when each layer of one layerwise load moved, and when its consumer
used it, as measured (device timing events on CUDA, the host clock on the CPU).

Why: a gate stall of zero cannot tell perfect overlap from none (every layer may simply
have landed long before the forward pass started). The timeline says it directly: the
forward pass overlapped the load when it reached its first gate before the last layer's
copy ended, and each layer's start (the consumer going on past its gate) comes after its
copy ended (docs/layerwise.md, "Proof on the device").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerTimeline"]


@dataclass(frozen=True)
class LayerTimeline:
    """Per layer, seconds from the job's copies' start (its first layer handed to the
    device): ``clock`` says whose (``"device"``: CUDA timing events, ``"host"``:
    ``time.perf_counter``). None where not known: a layer never gated, or not measured.

    Attributes:
        clock: ``"device"`` or ``"host"``.
        copy_done: the layer's copies ended.
        reached: the consumer reached the layer's gate (the layer was due).
        started: the consumer went on past the gate: the layer's start.
        issued: host seconds from the submit to the layer's copies being handed to the
            device (later layers go from the lane's issuer thread).
        blocked: host seconds gates on the layer blocked before its copies were handed to
            the device. On CUDA the gate marks its arrival before it blocks, so where the
            consumer's stream had caught up, the wait is in ``started - reached`` too.
    """

    clock: str
    copy_done: tuple[float | None, ...]
    reached: tuple[float | None, ...]
    started: tuple[float | None, ...]
    issued: tuple[float | None, ...]
    blocked: tuple[float, ...]

    @property
    def num_layers(self) -> int:
        return len(self.copy_done)

    @property
    def first_reached(self) -> float | None:
        """When the consumer reached its first gate: the forward pass began to need the
        prefix (before it, it ran on the new tokens alone)."""
        return _least(self.reached)

    @property
    def last_copy_done(self) -> float | None:
        """When the last layer's copies ended (None unless every layer's end is known)."""
        if any(t is None for t in self.copy_done) or not self.copy_done:
            return None
        return max(t for t in self.copy_done if t is not None)

    @property
    def overlap(self) -> float | None:
        """Seconds from the consumer's first gate to the last copy's end (positive: the
        forward pass started before the load ended; negative: the whole prefix had landed
        first). Time the consumer spent waiting at gates in between counts here too: see
        ``overlap_computing``."""
        last, first = self.last_copy_done, self.first_reached
        return None if last is None or first is None else last - first

    @property
    def overlap_computing(self) -> float | None:
        """``overlap`` less the time the consumer waited at gates within it (each gate's
        ``reached`` to ``started``): how long the forward pass computed while the prefix was
        still arriving. None where ``overlap`` is; at most 0 where it is."""
        last, first = self.last_copy_done, self.first_reached
        if last is None or first is None:
            return None
        if last <= first:
            return last - first
        waited = sum(max(0.0, min(s, last) - max(r, first)) for r, s in zip(self.reached, self.started)
                     if r is not None and s is not None)
        return last - first - waited

    def slack(self) -> list[float | None]:
        """Per layer, its start less its copy's end (never negative where gated: a layer
        starts only once it has landed; large where it landed long before it was due)."""
        return [None if s is None or c is None else s - c for s, c in zip(self.started, self.copy_done)]

    def stalls(self) -> list[float | None]:
        """Per layer, how long the consumer waited at its gate: its start less its arrival
        (the time before the layer was handed to the device included, see ``blocked``)."""
        return [None if s is None or r is None else max(0.0, s - r)
                for s, r in zip(self.started, self.reached)]


def _least(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None
