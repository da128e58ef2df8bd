"""A layerwise job's enqueue as one program for its lane's native issuer (program.py,
"Issuing"): rows built in numpy from the job's folded ops, whatever the number of layers.

Why: on the native path the submit hands a whole layerwise load to the lane's issuer
thread as one program, its first layer's rows first, and marks layer ``i`` enqueued once
the ticket's ``rows_done`` passes the row of layer ``i``'s record; a store's push is one
small program of its own. So the caller spends only the planning (tens of microseconds at
16k tokens) and never waits for a driver call or the issuer thread. Rows are built here
from the ops' tables at once; a job through the device slot records its layers through
the lane's ``Recorder`` instead (``layer_staging.emit``: kernel launches and their
parameters), a layer at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .layer_ops import LayerOps
from .program import OP_BATCH, OP_LAUNCH, OP_PITCHED, OP_RECORD, OP_WAIT, WORDS, batch_flags

__all__ = ["Rows", "copy_rows", "staged_rows"]


class Rows:
    """A program being built: its rows (runs of plain ints, or ``(n, WORDS)`` uint64 blocks
    for many layers at once), the buffers they name, and the row of each layer's record.
    A push's few rows stay plain ints: numpy's per-call cost would be most of the push."""

    __slots__ = ("_parts", "buffers", "count", "records")

    def __init__(self) -> None:
        self._parts: list[list[int] | np.ndarray] = []
        self.buffers: list[Any] = []
        self.count = 0
        self.records: dict[int, int] = {}  # layer -> its record's row

    def add(self, *row: int) -> int:
        """One row (opcode first, then its words; the rest are 0); its index."""
        words = [*row, *(0,) * (WORDS - len(row))]
        parts = self._parts
        if parts and isinstance(parts[-1], list):
            parts[-1].extend(words)
        else:
            parts.append(words)
        self.count += 1
        return self.count - 1

    def wait(self, stream: int, event: int) -> None:
        self.add(OP_WAIT, stream, event)

    def record(self, event: int, stream: int) -> int:
        return self.add(OP_RECORD, event, stream)

    def extend(self, block: np.ndarray) -> int:
        """Rows at once; the index of the first."""
        at = self.count
        self._parts.append(block)
        self.count += int(block.shape[0])
        return at

    def words(self) -> list[int] | np.ndarray:
        """Every row (what ``Issuer.submit`` takes: a list of ints, or a buffer of them)."""
        parts = self._parts
        if len(parts) == 1:
            return parts[0]
        if all(isinstance(p, list) for p in parts):
            return [w for p in parts for w in p]
        return np.concatenate([np.asarray(p, dtype=np.uint64).reshape(-1, WORDS) for p in parts])


def copy_rows(rows: Rows, ops: LayerOps, layers: Sequence[int], events: Sequence[Any], stream: int,
              to_host: bool, *, sliced: bool = False) -> None:
    """Append, for each of ``layers`` in order, its pitched call (if any), its batched call
    (if any) and its event's record; ``rows.records`` gets each record's row. ``sliced``:
    the buffers are the layers' own slices of the tables (a push: the issuer copies only
    what it reads), else the whole tables (a load: one copy of each)."""
    if len(layers) == 1:
        _one_layer(rows, ops, int(layers[0]), events, stream, to_host, sliced)
        return
    nl = len(layers)
    if not nl:
        return
    assert not sliced, "a sliced program moves one layer"
    if nl == ops.num_layers and list(layers) == list(range(nl)):  # a whole load: slices, no gathers
        these: Any = range(nl)
        plo, phi = ops.pbounds[:-1], ops.pbounds[1:]
        lo, hi = ops.bounds[:-1], ops.bounds[1:]
    else:
        these = np.asarray(layers, dtype=np.int64)
        plo, phi = ops.pbounds[these], ops.pbounds[these + 1]
        lo, hi = ops.bounds[these], ops.bounds[these + 1]
    counts_p, counts_d = phi - plo, hi - lo  # never negative: a max and a min tell any and all
    any_p, any_d = int(counts_p.max()) > 0, int(counts_d.max()) > 0
    # Every layer with the same calls (the usual case): each layer's rows side by side, no
    # row to drop; else a row a call slot, the empty ones dropped.
    pitched = ops.packed is not None and any_p
    uniform = (pitched == any_p and (not any_p or int(counts_p.min()) > 0)
               and (not any_d or int(counts_d.min()) > 0))
    if uniform:
        slots = [0] * pitched + [1] * any_d + [2]
        at_ = {k: i for i, k in enumerate(slots)}
        block = np.zeros((nl, len(slots), WORDS), dtype=np.uint64)
    else:
        at_ = {0: 0, 1: 1, 2: 2}
        block = np.zeros((nl, 3, WORDS), dtype=np.uint64)
    if pitched:
        buf = len(rows.buffers)
        rows.buffers.append(ops.packed)
        row = block[:, at_[0]]
        row[:, :3] = (OP_PITCHED, stream, buf)
        row[:, 3] = counts_p
        row[:, 4] = plo
    if any_d:
        buf = len(rows.buffers)
        rows.buffers.extend((ops.dst, ops.src, ops.sizes))
        row = block[:, at_[1]]
        row[:, :5] = (OP_BATCH, stream, buf, buf + 1, buf + 2)
        row[:, 5] = counts_d
        row[:, 6] = batch_flags(True, to_host)
        row[:, 7] = lo
    row = block[:, at_[2]]
    row[:, 0] = OP_RECORD
    row[:, 1] = [int(events[layer]) for layer in layers]
    row[:, 2] = stream
    if uniform:
        k = block.shape[1]
        at = rows.extend(block.reshape(-1, WORDS))
        keys = list(these) if isinstance(these, range) else these.tolist()
        rows.records.update(zip(keys, range(at + k - 1, at + k * nl, k)))
        return
    keep = np.ones((nl, 3), dtype=bool)
    keep[:, 0] = counts_p > 0
    keep[:, 1] = counts_d > 0
    at = rows.extend(block[keep])
    ends = at + np.cumsum(keep.sum(axis=1)) - 1
    rows.records.update(zip(np.asarray(these).tolist(), ends.tolist()))


def _one_layer(rows: Rows, ops: LayerOps, layer: int, events: Sequence[Any], stream: int, to_host: bool,
               sliced: bool) -> None:
    """``copy_rows`` of one layer, in plain ints (a push's)."""
    plo, phi = int(ops.pbounds[layer]), int(ops.pbounds[layer + 1])
    lo, hi = int(ops.bounds[layer]), int(ops.bounds[layer + 1])
    if phi > plo and ops.packed is not None:
        rows.buffers.append(ops.packed[plo:phi] if sliced else ops.packed)
        rows.add(OP_PITCHED, stream, len(rows.buffers) - 1, phi - plo, 0 if sliced else plo)
    if hi > lo:
        buf = len(rows.buffers)
        if sliced:
            rows.buffers.extend((ops.dst[lo:hi], ops.src[lo:hi], ops.sizes[lo:hi]))
        else:
            rows.buffers.extend((ops.dst, ops.src, ops.sizes))
        flags = batch_flags(True, to_host)
        rows.add(OP_BATCH, stream, buf, buf + 1, buf + 2, hi - lo, flags, 0 if sliced else lo)
    rows.records[layer] = rows.record(int(events[layer]), stream)


def staged_rows(rows: Rows, rec: Any, emit: Any, layers: Sequence[int], events: Sequence[Any],
                stream: int) -> None:
    """Append layers that go through the device slot: each recorded through the lane's
    ``Recorder`` (``emit(rec, layer)``: its 2-D copies and kernel launches), then its
    event's record."""
    program = rec.open()
    try:
        for layer in layers:
            emit(rec, layer)
            program.record(events[layer], stream)
            rows.records[layer] = rows.count + len(program) - 1
    finally:
        rec.program = None
    if len(program):
        block = np.array(program.words, dtype=np.uint64).reshape(-1, WORDS)
        shift = len(rows.buffers)  # the program's buffers follow those named so far
        for op, fields in ((OP_BATCH, (2, 3, 4)), (OP_PITCHED, (2,)), (OP_LAUNCH, (5, 6))):
            mine = block[:, 0] == op
            for f in fields:
                block[mine, f] += shift
        rows.buffers.extend(program.buffers)
        rows.extend(block)
