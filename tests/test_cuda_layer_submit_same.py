"""A layerwise load's program is the same after the submit's shortcuts (issue 38): the
one-kind fold (``IdFolder._fold_one``) and the whole-load rows (``copy_rows`` without
gathers or dropped rows) give the very words, buffers and record rows the general code
gives, so the issuer makes the same driver calls in the same order; checked on a fake
driver for random block and chunk ids, and the folded ops move the bytes exactly."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.backends.cuda import native
from aiokv.backends.cuda.layer_ops import IdFolder, LayerOps, PitchedRows
from aiokv.backends.cuda.layer_program import Rows, copy_rows
from aiokv.backends.cuda.program import OP_BATCH, OP_PITCHED, OP_RECORD, WORDS, batch_flags
from aiokv.layer_plan import LayerMap
from aiokv.layout import CanonicalKVCaches
from aiokv.plan import BlockMapping, HostLayout, map_blocks

from .test_cuda_layer_ops import run_ops
from .test_cuda_layer_program import run as calls_of

pytestmark = pytest.mark.skipif(native.helper() is None, reason="the native helper is not built here")

MAIN, RESCUE, END = 0x100, 0x300, 0x3E0
LAYERS, BLOCKS, CHUNKS = 4, 64, 80


def reference_copy_rows(rows: Rows, ops: LayerOps, layers: list[int], events: list[Any], stream: int,
                        to_host: bool) -> None:
    """``copy_rows`` of many layers as it was before the shortcuts (commit d70a056)."""
    these = np.asarray(layers, dtype=np.int64)
    nl = int(these.size)
    if not nl:
        return
    plo, phi = ops.pbounds[these], ops.pbounds[these + 1]
    lo, hi = ops.bounds[these], ops.bounds[these + 1]
    counts_p, counts_d = phi - plo, hi - lo
    block = np.zeros((nl, 3, WORDS), dtype=np.uint64)
    if ops.packed is not None and counts_p.any():
        buf = len(rows.buffers)
        rows.buffers.append(ops.packed)
        block[:, 0, :3] = (OP_PITCHED, stream, buf)
        block[:, 0, 3] = counts_p
        block[:, 0, 4] = plo
    if counts_d.any():
        buf = len(rows.buffers)
        rows.buffers.extend((ops.dst, ops.src, ops.sizes))
        block[:, 1, :5] = (OP_BATCH, stream, buf, buf + 1, buf + 2)
        block[:, 1, 5] = counts_d
        block[:, 1, 6] = batch_flags(True, to_host)
        block[:, 1, 7] = lo
    block[:, 2, 0] = OP_RECORD
    block[:, 2, 1] = [int(events[int(layer)]) for layer in these]
    block[:, 2, 2] = stream
    keep = np.ones((nl, 3), dtype=bool)
    keep[:, 0] = counts_p > 0
    keep[:, 1] = counts_d > 0
    at = rows.extend(block[keep])
    ends = at + np.cumsum(keep.sum(axis=1)) - 1
    rows.records.update(zip(these.tolist(), ends.tolist()))


def pack(dst: Any, dst_pitch: Any, src: Any, src_pitch: Any, width: Any, height: Any) -> np.ndarray:
    return np.stack([dst, dst_pitch, src, src_pitch, width, height, height * 3, width + 1] * 2, axis=1)


def program(ops: LayerOps, layers: list[int], to_host: bool, reference: bool) -> Rows:
    rows = Rows()
    rows.wait(MAIN, 0xD0)
    rows.record(0xAA, MAIN)
    events = [0xE00 + i for i in range(ops.num_layers)]
    (reference_copy_rows if reference else copy_rows)(rows, ops, layers, events, MAIN, to_host)
    rows.record(END, MAIN)
    return rows


def same_rows(a: Rows, b: Rows, *, run: bool = True) -> None:
    assert np.array_equal(np.asarray(a.words(), dtype=np.uint64), np.asarray(b.words(), dtype=np.uint64))
    assert a.count == b.count and a.records == b.records
    assert len(a.buffers) == len(b.buffers)
    assert all(x is y or np.array_equal(x, y) for x, y in zip(a.buffers, b.buffers))
    if run:
        assert calls_of(a) == calls_of(b)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 30), nl=st.integers(1, 6),
       kinds=st.sampled_from(["both", "pitched", "plain", "mixed", "none", "unpacked"]),
       whole=st.booleans(), to_host=st.booleans())
def test_copy_rows_gives_the_rows_it_gave(seed: int, nl: int, kinds: str, whole: bool, to_host: bool) -> None:
    rng = np.random.default_rng(seed)
    n_p = rng.integers(1, 4, nl) if kinds in ("both", "pitched", "unpacked") else \
        (rng.integers(0, 3, nl) if kinds == "mixed" else np.zeros(nl, dtype=np.int64))
    n_d = rng.integers(1, 4, nl) if kinds in ("both", "plain") else \
        (rng.integers(0, 3, nl) if kinds == "mixed" else np.zeros(nl, dtype=np.int64))
    pb, b = np.concatenate(([0], np.cumsum(n_p))), np.concatenate(([0], np.cumsum(n_d)))
    col = [rng.integers(0, 1 << 40, int(pb[-1])) for _ in range(6)]
    packed = None if kinds == "unpacked" or not pb[-1] else \
        rng.integers(0, 1 << 60, (int(pb[-1]), 14)).astype(np.uint64)
    d = [rng.integers(0, 1 << 40, int(b[-1])).astype(np.uint64) for _ in range(3)]
    ops = LayerOps(d[0], d[1], d[2], b.astype(np.int64), PitchedRows(*col), pb.astype(np.int64), packed)
    layers = list(range(nl)) if whole else sorted(rng.choice(nl, int(rng.integers(1, nl + 1)),
                                                             replace=False).tolist())
    if len(layers) == 1:
        return  # one layer goes as plain ints (a push's), untouched
    # Pitched counts with no packed rows (never made) leave a zero row, which no issuer runs.
    same_rows(program(ops, layers, to_host, False), program(ops, layers, to_host, True),
              run=kinds != "unpacked")


def kv_and_layout() -> tuple[list[torch.Tensor], CanonicalKVCaches, HostLayout, LayerMap]:
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randint(0, 256, (2, BLOCKS, 48), dtype=torch.uint8, generator=gen)
               for _ in range(LAYERS)]
    kv = CanonicalKVCaches.from_tensors(tensors, block_dim=1)
    layout = HostLayout.build(kv, 1)
    return tensors, kv, layout, LayerMap.build(kv, layout)


def load_ids(n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """The bench's kind of load: chunks in a few runs, blocks in runs placed apart, or not."""
    if rng.integers(0, 3) == 0:
        return rng.permutation(BLOCKS)[:n].tolist(), rng.integers(0, CHUNKS, n).tolist()
    c0 = int(rng.integers(0, CHUNKS - n - 8))
    chunks = np.arange(c0, c0 + n)
    chunks[n // 3:] += 3
    cuts = np.sort(rng.choice(np.arange(1, n), min(3, n - 1), replace=False)) if n > 1 else []
    pieces = np.split(np.arange(n), cuts)
    starts, at = [0] * len(pieces), 0
    for k in rng.permutation(len(pieces)).tolist():
        starts[k], at = at, at + len(pieces[k]) + int(rng.integers(0, 3))
    return np.concatenate([s + np.arange(len(p)) for s, p in zip(starts, pieces)]).tolist(), chunks.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 1 << 30), n=st.integers(1, 40), to_host=st.booleans(),
       min_height=st.integers(2, 5),
       max_pitch=st.sampled_from([1 << 20, 4096, 100]))
def test_a_loads_program_is_the_same_for_random_ids(seed: int, n: int, to_host: bool, min_height: int,
                                                    max_pitch: int) -> None:
    """The whole load's program (the fold, packed, and its rows) from the shortcuts and
    from the general code: the same words and buffers, so the same driver calls."""
    _, kv, layout, lmap = kv_and_layout()
    blocks, chunks = load_ids(n, np.random.default_rng(seed))
    if to_host:
        chunks = list(dict.fromkeys(chunks))
        blocks = blocks[:len(chunks)]
    m = map_blocks(blocks, chunks, layout=layout, num_chunks=CHUNKS, unique_host=to_host,
                   unique_gpu=not to_host)
    base = np.array([(1 << 24) * (i + 1) for i in range(len(kv.tensors))], dtype=np.int64)
    folder = IdFolder(layout, lmap, base, 1 << 40, to_host=to_host, max_pitch=max_pitch,
                      min_height=min_height)
    assert folder._one is not None
    fast = folder.fold(m).with_packed(pack)
    one, folder._one = folder._one, None
    slow = folder.fold(m).with_packed(pack)
    folder._one = one
    layers = list(range(LAYERS))
    same_rows(program(fast, layers, to_host, False), program(slow, layers, to_host, True))
    if seed % 2:  # and without the planner's host order
        m2 = BlockMapping(m.gpu_blocks, m.host_slots)
        same_rows(program(folder.fold(m2).with_packed(pack), layers, to_host, False),
                  program(slow, layers, to_host, True))


@pytest.mark.parametrize("seed", range(6))
def test_the_shortcut_folds_move_the_bytes_exactly(seed: int) -> None:
    """A store of random ids into a pool and a load back into other blocks, through the
    one-kind fold's ops: byte for byte the blocks' pages, nothing else touched."""
    tensors, kv, layout, lmap = kv_and_layout()
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 30))
    blocks, chunks = load_ids(n, rng)
    chunks = list(dict.fromkeys(chunks))
    blocks = blocks[:len(chunks)]
    host = np.zeros(CHUNKS * layout.chunk_bytes, dtype=np.uint8)
    base = np.array([t.tensor.data_ptr() for t in kv.tensors], dtype=np.int64)
    store = IdFolder(layout, lmap, base, host.ctypes.data, to_host=True, max_pitch=1 << 20)
    load = IdFolder(layout, lmap, base, host.ctypes.data, to_host=False, max_pitch=1 << 20)
    assert store._one is not None and load._one is not None
    before = [t.clone() for t in tensors]
    run_ops(store.fold(map_blocks(blocks, chunks, layout=layout, num_chunks=CHUNKS, unique_host=True)))
    other = [(b + BLOCKS // 2) % BLOCKS for b in blocks]
    run_ops(load.fold(map_blocks(other, chunks, layout=layout, num_chunks=CHUNKS, unique_gpu=True)))
    for t, b in zip(tensors, before):
        assert torch.equal(t[:, other], b[:, blocks])
        untouched = [x for x in range(BLOCKS) if x not in other]
        assert torch.equal(t[:, untouched], b[:, untouched])


@settings(max_examples=200, deadline=None)
@given(plain=st.lists(st.integers(0, 140), min_size=1, max_size=6),
       pitched=st.lists(st.integers(0, 40), min_size=6, max_size=6))
def test_the_cheap_staging_test_agrees_with_the_layers_costs(plain: list[int], pitched: list[int]) -> None:
    """``may_stage`` (bounds first, no costs) says yes exactly where some layer's estimated
    enqueue exceeds ``STAGE_ABOVE_US``, the one case ``worth_staging`` may say yes."""
    from aiokv.backends.cuda.layer_ops import STAGE_ABOVE_US, may_stage
    nl = len(plain)
    b = np.concatenate(([0], np.cumsum(plain))).astype(np.int64)
    pb = np.concatenate(([0], np.cumsum(pitched[:nl]))).astype(np.int64)
    empty = np.zeros(0, dtype=np.int64)
    ops = LayerOps(empty, empty, empty, b, PitchedRows(*[empty] * 6), pb)
    assert may_stage(ops) == bool((ops.costs_us() > STAGE_ABOVE_US).any())


@pytest.mark.parametrize("pooled", [0, 3, 40])
def test_a_jobs_layer_events_come_as_one_at_a_time(pooled: int) -> None:
    """``take_sync_events(n)`` gives the events ``n`` calls of ``take_sync_event`` give, in
    their order, from the pool first and then new ones."""
    import threading

    from aiokv.backends.cuda.driver.facade import Driver as Facade

    class Stub:
        def __init__(self) -> None:
            self._pool_lock = threading.Lock()
            self._sync_pool = list(range(100, 100 + pooled))
            self.made = 0

        def create_event(self) -> int:
            self.made += 1
            return 1000 + self.made

    a, b = Stub(), Stub()
    many = Facade.take_sync_events(a, 33)  # type: ignore[arg-type]
    one_by_one = [Facade.take_sync_event(b) for _ in range(33)]  # type: ignore[arg-type]
    assert many == one_by_one and a._sync_pool == b._sync_pool and a.made == b.made


@pytest.mark.parametrize("ids", [
    [3, 1, 2], (5, 4), [np.int32(4), 5], [np.int64(7), 2], [True, 3], [3, True], [1 << 40, 0],
    [True, False], [np.True_, 2], [1.0, 2], [2, 1.5], [np.float64(1), 2], [1 << 63, 1], [np.uint64(1 << 63)],
    [[1, 2]], ["1", 2], [-1, 4], list(range(300)),
])
def test_ids_read_the_quick_way_read_as_before(ids: list[Any]) -> None:
    """``_as_ids`` reads a list of ints as C int64s; whatever it returns or raises is what
    the numpy reading (the way it took before) returns or raises."""
    from aiokv.errors import InvalidSpec
    from aiokv.plan import _as_ids

    def before(ids: Any) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise InvalidSpec("bad")
        if arr.dtype.kind == "u" and int(arr.max()) > (1 << 63) - 1:
            raise InvalidSpec("big")
        return np.array(arr, dtype=np.int64)

    try:
        want: Any = before(ids)
    except (InvalidSpec, ValueError, OverflowError) as exc:
        want = type(exc)
    try:
        got: Any = _as_ids(ids, "ids")
    except (InvalidSpec, ValueError, OverflowError) as exc:
        got = type(exc)
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == np.int64 and np.array_equal(got, want)
    else:
        assert got is want
