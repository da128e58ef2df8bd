"""Transfer vocabulary: where bytes are, which queue a job takes, what a finished
transfer reports. Errors live in ``aiokv.errors``."""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidSpec

__all__ = [
    "CPULoadStoreSpec",
    "Direction",
    "GPULoadStoreSpec",
    "LayerStatus",
    "LoadStoreSpec",
    "TransferResult",
]


class Direction(enum.Enum):
    """One handler's queue. Expedited loads have their own queue so they never wait
    behind ordinary loads."""

    STORE = "store"
    LOAD = "load"
    EXPEDITED_LOAD = "expedited_load"

    @property
    def to_host(self) -> bool:
        """True when bytes move from the device to the host pool."""
        return self is Direction.STORE

    @property
    def transfer_type(self) -> tuple[str, str]:
        """(source medium, destination medium), as vLLM names them."""
        return ("GPU", "CPU") if self is Direction.STORE else ("CPU", "GPU")

    @staticmethod
    def of_load(expedited: Any) -> Direction:
        """A load's queue (``expedited`` checked by ``flag``)."""
        return Direction.EXPEDITED_LOAD if flag("expedited", expedited) else Direction.LOAD


def flag(name: str, value: Any) -> bool:
    """A submit's bool flag (``expedited``, ``layerwise``), checked the one way for every
    flag of both faces: a bool (numpy's too), since a string such as "no" would otherwise
    read as True. Raises ``InvalidSpec`` before anything is enqueued."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidSpec(f"{name} must be a bool, got {value!r}")
    return bool(value)


class LayerStatus(enum.Enum):
    """What a layerwise job's per-layer wait or gate found. Only ``READY`` is true, so
    ``if job.gate(i):`` reads as "the layer can be used"."""

    # The layer's copies are over (a wait), or the consumer's stream now waits for them
    # (a gate): its blocks may be read (load) or overwritten (store) in stream order.
    READY = "ready"
    # Its copies failed or will never run: recompute ``job.failed_blocks()`` (a load), or
    # count those blocks not stored (a store). Never raised inside a forward pass.
    FAILED = "failed"
    # A timed wait ran out first, or (``layer_status``) the copies are still running.
    PENDING = "pending"

    def __bool__(self) -> bool:
        return self is LayerStatus.READY


def as_count(value: Any, what: str) -> int:
    """``value`` as a Python int: any integral type (numpy's too, via ``operator.index``),
    never a bool (True is no count) nor a float."""
    if type(value) is int:  # the common case, at once
        return value
    if isinstance(value, (bool, np.bool_)):
        raise InvalidSpec(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidSpec(f"{what} must be an int, got {type(value).__name__}") from None


def as_job_id(job_id: Any) -> int:
    """A job id as a Python int (numpy integers accepted, bools refused): both faces key
    their bookkeeping by it, and results report it as given."""
    return as_count(job_id, "job_id")


# Which side a spec class's name says it describes, by class (engines' specs included).
_SIDES: dict[type, str | None] = {}


def side_of(spec: Any) -> str | None:
    """"GPU" or "CPU" when the spec's class says which side it describes (ours, or an
    engine's class named like ``GPULoadStoreSpec`` / ``CPULoadStoreSpec``), else None."""
    cls = type(spec)
    try:
        return _SIDES[cls]
    except KeyError:
        pass
    side: str | None
    if issubclass(cls, GPULoadStoreSpec):
        side = "GPU"
    elif issubclass(cls, CPULoadStoreSpec):
        side = "CPU"
    else:
        name = cls.__name__.upper()
        gpu, cpu = "GPU" in name or "CUDA" in name, "CPU" in name
        side = "GPU" if gpu and not cpu else "CPU" if cpu and not gpu else None
    _SIDES[cls] = side
    return side


class LoadStoreSpec:
    """Marker base of "where the bytes are". Workers read specs by attribute, not class."""


class GPULoadStoreSpec(LoadStoreSpec):
    """GPU block ids of every KV-cache group, concatenated in group order.

    Args:
        block_ids: block ids; ``group_sizes[g]`` of them belong to group ``g``.
        group_sizes: blocks per group (default: one group holding all).
        block_indices: logical index, within the request, of each group's first block;
            ``block_indices[g] % blocks_per_chunk`` sub-blocks of the first host chunk are
            skipped, so a transfer need not start on a chunk boundary (default: zeros).
    """

    def __init__(
        self,
        block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        self.block_ids = block_ids
        self.group_sizes = group_sizes
        self.block_indices = block_indices

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={list(np.asarray(self.block_ids).tolist())}, "
            f"group_sizes={self.group_sizes}, block_indices={self.block_indices})"
        )


class CPULoadStoreSpec(LoadStoreSpec):
    """Chunk ids in the worker's pinned host pool, concatenated in group order.

    One chunk holds ``blocks_per_chunk`` consecutive GPU blocks of every layer of a group.
    """

    def __init__(self, chunk_ids: Sequence[int] | np.ndarray) -> None:
        self.block_ids = chunk_ids

    @property
    def chunk_ids(self) -> Sequence[int] | np.ndarray:
        return self.block_ids

    def __repr__(self) -> str:
        return f"CPULoadStoreSpec(chunk_ids={list(np.asarray(self.block_ids).tolist())})"


class _Later:
    """A device time not read yet: ``read()`` returns it (the same value if two threads race)."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], float | None]) -> None:
        self.read = read


class _DeviceTime:
    """The ``transfer_time`` field: a value, or a ``_Later`` replaced by its value on first
    access. Kept in the instance ``__dict__`` under the field's own name, as a plain frozen
    dataclass keeps it, so pickles of either kind load into the other."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: object, owner: type | None = None) -> float | None:
        if obj is None:
            return None  # the field's default, as dataclasses ask for it
        value = obj.__dict__.get(self._name)
        if isinstance(value, _Later):
            value = value.read()
            obj.__dict__[self._name] = value
        return value

    def __set__(self, obj: object, value: float | _Later | None) -> None:
        obj.__dict__[self._name] = value


@dataclass(frozen=True)
class TransferResult:
    """What one finished job reports.

    ``transfer_size`` is bytes moved; ``transfer_time`` is seconds the copies took on the
    device (not time spent queued). Of jobs in a pipeline, each gets its share: from when
    the jobs before it are off its copy stream to its own end (a staged store's gather
    that overlapped the job before is not counted twice). Both are None when the job
    failed. ``transfer_type`` is (source medium, destination medium): ``("GPU", "CPU")``
    for a store, ``("CPU", "GPU")`` for a load, the field vLLM's later ``TransferResult``
    added (its statistics group transfers by it).

    The worker reads the device time after the awaiting task was woken, not before (on the
    CUDA backend that read and the events' return to their pool cost microseconds per job
    the wake-up need not wait for; docs/performance.md, "Completion"), so
    ``transfer_time`` may be computed on first access.
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = _DeviceTime()  # type: ignore[assignment]
    transfer_type: tuple[str, str] | None = None

    @classmethod
    def timed_later(
        cls, job_id: int, transfer_size: int, timer: Callable[[], float | None],
        transfer_type: tuple[str, str] | None = None,
    ) -> TransferResult:
        """A successful result whose ``transfer_time`` is ``timer()``, read on first access
        (``timer`` must return the same value if two threads race to call it).

        Built field by field into the instance dict, as the frozen dataclass's ``__init__``
        stores them (``object.__setattr__`` per field) but at a quarter of its cost: this
        runs once per finished job, between the copy's end and its waiter's wake-up."""
        result = object.__new__(cls)
        fields = result.__dict__
        fields["job_id"] = job_id
        fields["success"] = True
        fields["transfer_size"] = transfer_size
        fields["transfer_time"] = _Later(timer)
        fields["transfer_type"] = transfer_type
        return result

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["transfer_time"] = self.transfer_time  # pickle and copy the value, not the timer
        return state
