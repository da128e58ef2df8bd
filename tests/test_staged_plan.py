"""The staged strategy's host-side plan (slices, slot offsets, DMA runs) and the piece
kernel's table, checked by replaying them on numpy byte arrays against a direct copy."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv.copy.pieces import fits, piece_table
from aiokv.copy.staged import staged_job


def _pieces(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random pieces: sizes in 16-byte units, device spots anywhere, host spots packed in a
    random order with gaps, so some neighbours are host-adjacent and some are not."""
    sizes = rng.integers(1, 300, count).astype(np.int64) * 16
    dev_order = rng.permutation(count)
    dev = np.empty(count, dtype=np.int64)
    dev[dev_order] = np.cumsum(sizes[dev_order] + 32) - sizes[dev_order]
    host_order = rng.permutation(count)
    gaps = np.where(rng.random(count) < 0.3, 48, 0)
    host = np.empty(count, dtype=np.int64)
    host[host_order] = np.cumsum(sizes[host_order] + gaps) - sizes[host_order]
    return dev.astype(np.uint64), host.astype(np.uint64), sizes.astype(np.uint64)


def _replay_store(job, device_bytes: np.ndarray, host_bytes: np.ndarray, slot_bytes: int) -> None:
    """Gather each slice into a slot, then move the slot's runs to the host."""
    for s in range(job.slices):
        slot = np.full(slot_bytes, 0xA5, dtype=np.uint8)
        for i in range(job.bounds[s], job.bounds[s + 1]):
            d, o, n = int(job.device[i]), int(job.in_slot[i]), int(job.nbytes[i])
            slot[o : o + n] = device_bytes[d : d + n]
        for r in range(job.run_bounds[s], job.run_bounds[s + 1]):
            h, o, n = int(job.run_host[r]), int(job.run_slot[r]), int(job.run_bytes[r])
            host_bytes[h : h + n] = slot[o : o + n]


@pytest.mark.parametrize("seed", range(6))
def test_replayed_staged_store_matches_direct_copies(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dev, host, sizes = _pieces(rng, int(rng.integers(1, 400)))
    slot_bytes = int(sizes.max()) * int(rng.integers(1, 12))
    job = staged_job(dev, host, sizes, slot_bytes)
    device_bytes = rng.integers(1, 256, int((dev + sizes).max()), dtype=np.uint8)
    span = int((host + sizes).max()) + 64
    want = np.full(span, 0x3C, dtype=np.uint8)
    for d, h, n in zip(dev.tolist(), host.tolist(), sizes.tolist()):
        want[h : h + n] = device_bytes[d : d + n]
    got = np.full(span, 0x3C, dtype=np.uint8)
    _replay_store(job, device_bytes, got, slot_bytes)
    assert np.array_equal(got, want)  # every piece landed, gaps untouched


@pytest.mark.parametrize("seed", range(4))
def test_slices_fill_slots_greedily_and_runs_are_maximal(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    dev, host, sizes = _pieces(rng, 300)
    slot_bytes = int(sizes.max()) * 3
    job = staged_job(dev, host, sizes, slot_bytes)
    assert sorted(job.device.tolist()) == sorted(dev.tolist())
    assert np.all(np.diff(job.run_host.astype(np.int64)) > 0)  # host order
    for s in range(job.slices):
        lo, hi = job.bounds[s], job.bounds[s + 1]
        n = job.nbytes[lo:hi].astype(np.int64)
        assert hi > lo and int(n.sum()) <= slot_bytes
        assert np.array_equal(job.in_slot[lo:hi].astype(np.int64), np.cumsum(n) - n)  # packed from 0
        if hi < len(job.nbytes):  # the next piece did not fit
            assert int(n.sum()) + int(job.nbytes[hi]) > slot_bytes
        runs = slice(job.run_bounds[s], job.run_bounds[s + 1])
        assert int(job.run_bytes[runs].astype(np.int64).sum()) == int(n.sum())
        ends = (job.run_host[runs] + job.run_bytes[runs])[:-1]
        assert not np.any(ends == job.run_host[runs][1:])  # adjacent runs would have merged


def test_one_slice_when_the_job_fits_a_slot() -> None:
    dev = np.arange(8, dtype=np.uint64) * 4096
    host = (np.arange(8, dtype=np.uint64)[::-1] * 1024).copy()  # adjacent once sorted
    job = staged_job(dev, host, np.full(8, 1024, dtype=np.uint64), 1 << 20)
    assert job.slices == 1 and job.bounds == [0, 8]
    assert job.run_bytes.tolist() == [8192] and job.run_host.tolist() == [0]
    assert job.device.tolist() == dev[::-1].tolist() and job.longest == 1024


def test_piece_table_rows_are_source_destination_bytes() -> None:
    src = np.array([16, 32], dtype=np.uint64)
    dst = np.array([4096, 8192], dtype=np.uint64)
    table = piece_table(src, dst, np.array([48, 64], dtype=np.uint64))
    assert table.dtype == np.uint64 and table.flags.c_contiguous
    assert table.tolist() == [[16, 4096, 48], [32, 8192, 64]]


def test_fits_needs_16_byte_addresses_and_sizes() -> None:
    ok = np.array([0, 16, 4096], dtype=np.uint64)
    assert fits(ok, ok * 2, ok + 32)
    assert not fits(ok, ok + 8, ok)
    assert not fits(ok, ok, np.array([16, 24, 32], dtype=np.uint64))


def test_a_slice_takes_every_piece_that_fits_exactly() -> None:
    dev = np.arange(10, dtype=np.uint64) * 8192
    host = np.arange(10, dtype=np.uint64) * 2048  # gaps: no runs merge
    job = staged_job(dev, host, np.full(10, 1024, dtype=np.uint64), 4096)
    assert job.bounds == [0, 4, 8, 10]
    assert job.in_slot.tolist() == [0, 1024, 2048, 3072] * 2 + [0, 1024]
    assert job.run_bounds == [0, 4, 8, 10]
