"""What one measured request of ``aiokv bench serve`` saw (``Served``): its stamps from
arrival to first token, where its reused tokens came from, and the waits its TTFT splits
into, as the server records them and the report reads them."""

from __future__ import annotations

from dataclasses import dataclass

from ...layer_timeline import LayerTimeline

__all__ = ["HIT_CLASSES", "Served"]

HIT_CLASSES = ("miss", "gpu", "host", "disk")
"""A request's class is the lowest tier any of its reused blocks came from."""

@dataclass
class Served:
    """What one measured request saw; times in seconds on the compressed trace clock (the
    measured part's first arrival is 0), in the segment it was served in.

    ``arrival`` <= ``start`` (admission took it up: its service began) <= ``ready`` (its
    lookup, block table and restore done) <= ``model_start`` (the model took it) <=
    ``first_token``. ``ready`` and ``model_start`` default to the stamp before them."""

    index: int
    prompt: int
    reusable: int
    arrival: float
    start: float
    first_token: float
    token: int
    gpu_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    prefill_s: float = 0.0
    load_s: float = 0.0
    segment: int = 0
    stall_s: float = 0.0  # of prefill_s, waiting on layerwise loads' layers
    recomputed: int = 0  # tokens a failed load (or a restore that raised) was to bring, computed
    wall: float = 0.0  # when its service began, in seconds since the arms opened
    late_failure: bool = False  # a layerwise load failed after the forward had read it
    submit_s: float = 0.0  # host seconds a layerwise load's submit took
    forward_start_s: float | None = None  # host seconds from that submit to the forward's first gate
    early_submit: bool = False  # its load was submitted in the restore stage, the model busy or others ahead
    # forward_start_s = submit_s + handover_s + first_gate_s (host clock; a load submitted at
    # its forward's start only: an early one's start is mostly its wait for the model):
    handover_s: float | None = None  # the submit's return to the model thread beginning the forward
    first_gate_s: float | None = None  # that to the first gate (layer 0's work before the prefix)
    timeline: LayerTimeline | None = None  # a layerwise load's, once it ended
    ready: float | None = None  # its restore over: it could take the model
    model_start: float | None = None  # the model took it (its inputs, then its forward)
    restore_error: str = ""  # what its restore raised (then served by recompute)
    blocks_wait: float = 0.0  # of its admission, waiting for blocks other requests held
    load_at: float | None = None  # its awaited restore's start (it ran load_s from there)

    @property
    def compute_s(self) -> float:
        """Prefill seconds less the time it waited on layers: the model's own work."""
        return self.prefill_s - self.stall_s

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def ready_at(self) -> float:
        return self.start if self.ready is None else self.ready

    @property
    def model_at(self) -> float:
        return self.ready_at if self.model_start is None else self.model_start

    @property
    def busy(self) -> float:
        """Seconds the model was taken by this request: its inputs, its forward (with any
        recompute after a failed load) to its first token. Restores are not in it."""
        return self.first_token - self.model_at

    @property
    def restore_wait(self) -> float:
        """Admission's start to its restore's end: lookup, block table, restore (the wait
        for blocks that other requests held left out: that is queueing)."""
        return self.ready_at - self.start - self.blocks_wait

    @property
    def model_wait(self) -> float:
        """Its restore's end to the model taking it: queued behind other forwards."""
        return self.model_at - self.ready_at

    @property
    def queue_s(self) -> float:
        """Time it waited on other requests: for admission (a slot, the head's blocks),
        and for the model once restored."""
        return self.start - self.arrival + self.blocks_wait + self.model_wait

    @property
    def service_s(self) -> float:
        """Its TTFT less its queue waits: its own admission and restore, and its time on
        the model."""
        return self.ttft - self.queue_s

    @property
    def computed(self) -> int:
        return self.prompt - self.gpu_tokens - self.host_tokens - self.disk_tokens

    @property
    def hit(self) -> str:
        if self.disk_tokens:
            return "disk"
        if self.host_tokens:
            return "host"
        return "gpu" if self.gpu_tokens else "miss"
