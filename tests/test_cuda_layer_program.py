"""A layerwise job's rows for the native issuer (``layer_program``), run through the helper
on a fake driver (no GPU): per layer its pitched call, its batched call and its event, in
layer order, each call reading exactly that layer's ops; a layer with nothing to copy only
records its event; a push's one layer names only its own slices of the tables; and the
record rows are those whose ``rows_done`` marks the layer enqueued."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv.backends.cuda import native
from aiokv.backends.cuda.layer_ops import LayerOps, PitchedRows
from aiokv.backends.cuda.layer_program import Rows, copy_rows
from aiokv.backends.cuda.native import NativeIssuer

from .native_fakes import ATTRS, FakeTable

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

MAIN, RESCUE, END = 0x100, 0x300, 0x3E0
U64 = np.uint64


def ops_of() -> LayerOps:
    """Three layers: 0 has two pitched ops and two descriptors, 1 nothing, 2 one of each."""
    pitched = PitchedRows(*(np.arange(3, dtype=np.int64) + k for k in (100, 200, 300, 400, 500, 600)))
    packed = np.arange(3 * 14, dtype=U64).reshape(3, 14) + 7000
    bounds = np.array([0, 2, 2, 3])
    return LayerOps(np.array([1, 2, 3], dtype=U64), np.array([11, 12, 13], dtype=U64),
                    np.array([64, 64, 64], dtype=U64), bounds, pitched, bounds.copy(), packed)


def run(rows: Rows) -> list[tuple]:
    fake = FakeTable()
    issuer = NativeIssuer(fake.table)
    try:
        ticket = issuer.submit(rows.words(), tuple(rows.buffers), MAIN, RESCUE, END, False)
        assert ticket.wait(10) and ticket.result() == (rows.count, 0, 0, True)
    finally:
        issuer.close()
    return fake.calls


def test_a_loads_rows_move_each_layer_then_record_its_event() -> None:
    ops, events = ops_of(), [0xE0, 0xE1, 0xE2]
    rows = Rows()
    rows.record(0xAA, MAIN)  # the job's start
    copy_rows(rows, ops, [0, 1, 2], events, MAIN, to_host=True)
    calls = run(rows)
    packed = ops.packed
    assert packed is not None
    assert calls == [
        ("cuEventRecord", 0xAA, MAIN),
        ("cuMemcpy3DBatchAsync", packed[0:2].tolist(), 0, MAIN),
        ("cuMemcpyBatchAsync", [(1, 11, 64), (2, 12, 64)], ATTRS[3], [0], MAIN),
        ("cuEventRecord", 0xE0, MAIN),
        ("cuEventRecord", 0xE1, MAIN),
        ("cuMemcpy3DBatchAsync", packed[2:3].tolist(), 0, MAIN),
        ("cuMemcpyBatchAsync", [(3, 13, 64)], ATTRS[3], [0], MAIN),
        ("cuEventRecord", 0xE2, MAIN),
    ]
    # Layer i is enqueued once the rows up to its record ran.
    assert rows.records == {0: 3, 1: 4, 2: 7}
    assert len(rows.buffers) == 4  # the whole tables, once


def test_a_pushs_rows_name_only_its_layers_slices() -> None:
    ops = ops_of()
    rows = Rows()
    copy_rows(rows, ops, [2], [0xE0, 0xE1, 0xE2], MAIN, to_host=False, sliced=True)
    assert [len(b) for b in rows.buffers] == [1, 1, 1, 1] and rows.records == {2: 2}
    packed = ops.packed
    assert packed is not None
    assert run(rows) == [("cuMemcpy3DBatchAsync", packed[2:3].tolist(), 0, MAIN),
                         ("cuMemcpyBatchAsync", [(3, 13, 64)], ATTRS[1], [0], MAIN),
                         ("cuEventRecord", 0xE2, MAIN)]
    assert isinstance(rows.words(), list)  # a push's rows stay plain ints
