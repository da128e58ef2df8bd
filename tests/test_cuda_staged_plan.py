"""The staged strategy's host-side plans (the piece kernel's page table and block rows,
slices, DMA runs), replayed on one numpy byte array that stands for device, host and
staging memory: each slice's kernel is run as the PTX reads its table and rows, each run
as one copy."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv.backends.cuda.pieces import fits
from aiokv.backends.cuda.staged import StagedJob, block_job, piece_job

SLOTS_AT = 1 << 22  # staging slots live here in the replayed address space


def _replay(job: StagedJob, space: np.ndarray, slot_bytes: int, to_device: bool,
            page_rows: np.ndarray | None = None) -> None:
    """Run the job as the lane would: slice by slice through two alternating slots. A block
    job's page table is the lane's (``page_rows``), not the job's."""
    bases = SLOTS_AT + (np.arange(job.slices) % 2) * slot_bytes
    table = job.pages if job.pages is not None else page_rows
    assert table is not None
    pages = table.astype(np.int64)

    def kernel(s: int) -> None:
        (p0, p1), rows = job.span(s)
        for z, row in enumerate(rows.astype(np.int64).tolist()):
            image = int(bases[s]) + z * job.image_step
            for base, stride, n, off in pages[p0:p1]:
                dev, stg = base + row * stride, image + off
                src, dst = (stg, dev) if to_device else (dev, stg)
                space[dst : dst + n] = space[src : src + n]

    def dma(s: int) -> None:
        for r in range(job.run_bounds[s], job.run_bounds[s + 1]):
            h, o, n = int(job.run_host[r]), int(bases[s] + job.run_slot[r]), int(job.run_bytes[r])
            src, dst = (h, o) if to_device else (o, h)
            space[dst : dst + n] = space[src : src + n]

    for s in range(job.slices):
        space[bases[s] : bases[s] + slot_bytes] = 0xA5  # whatever the last slice left there
        first, second = (dma, kernel) if to_device else (kernel, dma)
        first(s)
        second(s)


def _space(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(1, 256, SLOTS_AT + (4 << 20), dtype=np.uint8)


def _random_pieces(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces in 16-byte units; device spots below 1 MiB, host spots from 2 MiB, packed in a
    random order with gaps, so some neighbours are host-adjacent and some are not."""
    sizes = rng.integers(1, 100, count).astype(np.int64) * 16
    dev_order = rng.permutation(count)
    dev = np.empty(count, dtype=np.int64)
    dev[dev_order] = np.cumsum(sizes[dev_order] + 32) - sizes[dev_order]
    host_order = rng.permutation(count)
    gaps = np.where(rng.random(count) < 0.3, 48, 0)
    host = np.empty(count, dtype=np.int64)
    host[host_order] = (2 << 20) + np.cumsum(sizes[host_order] + gaps) - sizes[host_order]
    return dev.astype(np.uint64), host.astype(np.uint64), sizes.astype(np.uint64)


@pytest.mark.parametrize("seed", range(5))
def test_piece_job_store_then_load_moves_every_piece(seed: int) -> None:
    rng = np.random.default_rng(seed)
    dev, host, sizes = _random_pieces(rng, int(rng.integers(1, 300)))
    slot_bytes = int(sizes.max()) * int(rng.integers(1, 12))
    job = piece_job(dev, host, sizes, slot_bytes)
    space = _space(rng)
    want = space.copy()
    for d, h, n in zip(dev.tolist(), host.tolist(), sizes.tolist()):
        want[h : h + n] = want[d : d + n]
    _replay(job, space, slot_bytes, to_device=False)
    assert np.array_equal(space[: SLOTS_AT], want[: SLOTS_AT])  # pieces landed, nothing else moved
    for d, n in zip(dev.tolist(), sizes.tolist()):  # wipe the device side, load it back
        space[d : d + n] = 0
    _replay(job, space, slot_bytes, to_device=True)
    assert np.array_equal(space[: SLOTS_AT], want[: SLOTS_AT])


@pytest.mark.parametrize("seed", range(3))
def test_piece_job_slices_fill_slots_greedily_and_runs_are_maximal(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    dev, host, sizes = _random_pieces(rng, 300)
    slot_bytes = int(sizes.max()) * 3
    job = piece_job(dev, host, sizes, slot_bytes)
    assert sorted(job.pages[:, 0].tolist()) == sorted(dev.tolist()) and not job.by_block
    assert np.all(np.diff(job.run_host.astype(np.int64)) > 0)  # host order
    for s in range(job.slices):
        lo, hi = job.bounds[s], job.bounds[s + 1]
        n = job.pages[lo:hi, 2].astype(np.int64)
        assert hi > lo and int(n.sum()) <= slot_bytes
        assert np.array_equal(job.pages[lo:hi, 3].astype(np.int64), np.cumsum(n) - n)  # packed from 0
        if hi < job.pages.shape[0]:  # the next piece did not fit
            assert int(n.sum()) + int(job.pages[hi, 2]) > slot_bytes
        runs = slice(job.run_bounds[s], job.run_bounds[s + 1])
        assert int(job.run_bytes[runs].astype(np.int64).sum()) == int(n.sum())
        ends = (job.run_host[runs] + job.run_bytes[runs])[:-1]
        assert not np.any(ends == job.run_host[runs][1:])  # adjacent runs would have merged


def test_a_slice_takes_every_piece_that_fits_exactly() -> None:
    dev = np.arange(10, dtype=np.uint64) * 8192
    host = np.arange(10, dtype=np.uint64) * 2048  # gaps: no runs merge
    job = piece_job(dev, host, np.full(10, 1024, dtype=np.uint64), 4096)
    assert job.bounds == [0, 4, 8, 10]
    assert job.pages[:, 3].tolist() == [0, 1024, 2048, 3072] * 2 + [0, 1024]
    assert job.run_bounds == [0, 4, 8, 10]


def _block_layout(rng: np.random.Generator, pages: int) -> tuple[np.ndarray, int]:
    """Page rows (device base, row stride, bytes, offset in the block) of ``pages`` page
    tensors of 32 rows each, sizes in 16-byte units, tiling the block in host order."""
    sizes = rng.integers(1, 40, pages).astype(np.int64) * 16
    strides = sizes + 16 * rng.integers(0, 3, pages)
    bases = np.cumsum(32 * strides + 64) - 32 * strides
    rows = np.empty((pages, 4), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = bases, strides, sizes
    rows[:, 3] = np.cumsum(sizes) - sizes
    return rows, int(sizes.sum())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("padding", [0, 48])
@pytest.mark.parametrize("hint", ["none", "true", "false"])
def test_block_job_store_then_load_moves_every_page(seed: int, padding: int, hint: str) -> None:
    """Blocks to chunks; chunks are back to back (``padding`` 0, so runs merge) or padded.
    ``hint``: ``in_host_order`` left unset, passed on host-sorted input (``by_host``'s
    promise), or passed on input that breaks it, which may lose merges but no bytes."""
    rng = np.random.default_rng(seed)
    page_rows, block_bytes = _block_layout(rng, int(rng.integers(1, 9)))
    chunk_bytes = block_bytes + padding
    n = int(rng.integers(1, 32))
    rows = rng.choice(32, n, replace=False)
    chunks = rng.choice(40, n, replace=False)
    if seed % 2:
        chunks = np.sort(chunks)[::-1]  # more neighbours on the host, listed descending
    host = ((2 << 20) + chunks * chunk_bytes).astype(np.uint64)
    slot_bytes = block_bytes * int(rng.integers(1, 6)) + 16 * int(rng.integers(0, 4))
    if hint == "true":
        order = np.argsort(host, kind="stable")
        rows, host = rows[order], host[order]
    job = block_job(rows, host, page_rows, block_bytes, slot_bytes, in_host_order=hint != "none")
    per_slice = max(hi - lo for lo, hi in zip(job.bounds, job.bounds[1:]))
    assert job.by_block and job.pages is None and per_slice * job.image_step <= slot_bytes
    space = _space(rng)
    want = space.copy()
    for row, h in zip(rows.tolist(), host.tolist()):
        for base, stride, size, off in page_rows.astype(np.int64).tolist():
            d = base + row * stride
            want[h + off : h + off + size] = want[d : d + size]
    _replay(job, space, slot_bytes, to_device=False, page_rows=page_rows)
    assert np.array_equal(space[: SLOTS_AT], want[: SLOTS_AT])
    for row in rows.tolist():  # wipe the blocks' pages, load them back
        for base, stride, size, _ in page_rows.astype(np.int64).tolist():
            space[base + row * stride : base + row * stride + size] = 0
    _replay(job, space, slot_bytes, to_device=True, page_rows=page_rows)
    assert np.array_equal(space[: SLOTS_AT], want[: SLOTS_AT])
    if padding:
        assert job.run_bytes.tolist() == [block_bytes] * n  # padded chunks never merge


def test_block_job_merges_neighbouring_chunks_within_a_slice() -> None:
    page_rows = np.array([[0, 64, 32, 0], [4096, 64, 32, 32]], dtype=np.uint64)
    host = np.array([704, 64, 768, 640], dtype=np.uint64)  # chunks 11, 1, 12, 10
    job = block_job(np.arange(4), host, page_rows, 64, 128)
    assert job.bounds == [0, 2, 4]
    assert job.rows.tolist() == [1, 3, 0, 2]  # host order: chunks 1, 10 | 11, 12
    assert job.image_step == 64
    assert job.run_host.tolist() == [64, 640, 704] and job.run_bytes.tolist() == [64, 64, 128]
    assert job.run_bounds == [0, 2, 3]


def test_block_job_takes_chunks_in_any_order_as_one_run_per_slice() -> None:
    """A cache hands back evicted chunks newest first: descending ids still merge."""
    page_rows = np.array([[0, 64, 32, 0], [4096, 64, 32, 32]], dtype=np.uint64)
    chunks = np.arange(40, 8, -1)
    job = block_job(np.arange(32), (chunks * 64).astype(np.uint64), page_rows, 64, 64 * 8)
    assert job.slices == 4 and job.run_bounds == [0, 1, 2, 3, 4]
    assert job.run_host.tolist() == [576, 1088, 1600, 2112] and set(job.run_bytes.tolist()) == {512}
    assert job.rows.tolist() == list(range(31, -1, -1))


def test_fits_needs_16_byte_addresses_and_sizes() -> None:
    ok = np.array([0, 16, 4096], dtype=np.uint64)
    assert fits(ok, ok * 2, ok + 32, 512)
    assert not fits(ok, ok + 8, ok)
    assert not fits(ok, ok, np.array([16, 24, 32], dtype=np.uint64))
    assert not fits(ok, 520)
