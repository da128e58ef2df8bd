"""Pitched (2D) planning of the CUDA wing (``aiokv.backends.cuda.pitched``): runs of pages
at a uniform device pitch, and pitched plans that move exactly the bytes a naive loop moves.
Pure numpy: no device needed."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.backends.cuda.pitched import pitched_runs, plan_pitched
from aiokv.plan import HostLayout, map_blocks, plan_copies
from tests.test_plan import carved, naive_copy


def test_pitched_runs_find_uniform_pitch_and_break_on_gaps() -> None:
    _, kv, base = carved([3 * 768, 2 * 768, 768, 0])
    layout = HostLayout.build(kv, 2)
    (run,) = pitched_runs(layout, base, max_pitch=1 << 20)
    assert run.refs == (3, 2, 1, 0) and run.device_pitch == 768
    # A gap after the second page splits the run; a pitch over the limit splits every page.
    _, kv, base = carved([0, 768, 2 * 768 + 96, 3 * 768 + 96])
    layout = HostLayout.build(kv, 1)
    assert [r.refs for r in pitched_runs(layout, base, max_pitch=1 << 20)] == [(0, 1), (2, 3)]
    singles = pitched_runs(layout, base, max_pitch=512)
    assert [r.refs for r in singles] == [(0,), (1,), (2,), (3,)]
    assert all(r.device_pitch == 64 for r in singles)
    # Pages in two allocations never share a copy, even at a uniform pitch.
    _, kv, base = carved([0, 768, 1536, 2304])
    split = pitched_runs(HostLayout.build(kv, 1), base, 1 << 20, allocation=np.array([0, 0, 1, 1]))
    assert [r.refs for r in split] == [(0, 1), (2, 3)]
    # Overlapping rows (pitch below the page size) never form a run.
    _, kv, base = carved([0, 32], stride=200)
    assert len(pitched_runs(HostLayout.build(kv, 1), base, max_pitch=1 << 20)) == 2


@settings(max_examples=40, deadline=None)
@given(
    starts=st.sampled_from([[0, 768, 1536, 2304], [2304, 1536, 768, 0], [0, 800, 1536, 2304, 4000]]),
    bpc=st.integers(1, 3),
    data=st.data(),
)
def test_pitched_plan_moves_exactly_the_bytes_a_naive_loop_moves(starts, bpc: int, data) -> None:
    arena, kv, base = carved(starts)
    layout = HostLayout.build(kv, bpc)
    num_chunks = 12
    n = data.draw(st.integers(1, 8))
    skip = data.draw(st.integers(0, bpc - 1))
    need = -(-(n + skip) // bpc)
    gpu = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
    chunks = data.draw(st.permutations(range(num_chunks)))[:need]
    m = map_blocks(gpu, chunks, layout=layout, num_chunks=num_chunks, block_indices=[skip], unique_host=True)
    rng = np.random.default_rng(n)
    expect = rng.integers(0, 256, num_chunks * layout.chunk_bytes, dtype=np.uint8)
    got = expect.copy()
    naive_copy(layout, m, [arena[b:] for b in base], expect)
    runs = pitched_runs(layout, base, max_pitch=1 << 20)
    plan = plan_pitched(m, layout, runs, base)
    for da, dp, ho, hp, w, h in zip(plan.device_addr, plan.device_pitch, plan.host_offset,
                                    plan.host_pitch, plan.width, plan.height):
        assert dp >= w and hp >= w
        for r in range(h):
            got[ho + r * hp : ho + r * hp + w] = arena[da + r * dp : da + r * dp + w]
    assert np.array_equal(got, expect)
    assert plan.total_bytes == plan_copies(m, layout).total_bytes
    assert len(plan) == n * len(runs)
