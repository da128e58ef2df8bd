"""aiokv/bench/tier_sim.py: the offline replay of a host cache with tiers below it."""

from __future__ import annotations

from aiokv.bench.tier_sim import SimTier, replay_tiers
from aiokv.bench.trace import replay


def test_evicted_blocks_hit_in_the_tier_below() -> None:
    # Host of 2 (LRU): [1,2] then [3,4] evicts 1,2 into the tier; [1,2] again hits there.
    trace = [[1, 2], [3, 4], [1, 2], [3, 4]]
    res = replay_tiers(trace, 2, [SimTier("disk", 10)], policy="lru")
    assert res.references == 8
    assert res.hits == {"host": 0, "disk": 4}
    assert res.hit_rate == 0.5 and res.rate("disk") == 0.5
    assert replay(trace, 2, "lru").hits == 0  # the host alone never hits


def test_a_mixed_run_and_a_full_tier() -> None:
    trace = [[1, 2, 3], [4], [1, 2, 3]]
    # Host of 3: [4] evicts 1 (least recent) into a tier of 1 block; the run 1 (disk), 2, 3 (host).
    res = replay_tiers(trace, 3, [SimTier("disk", 1)], policy="lru")
    assert res.hits == {"host": 2, "disk": 1}


def test_write_through_tiers_get_every_stored_block_and_the_next_gets_evictions() -> None:
    trace = [[1, 2], [3, 4], [5, 6], [1, 2]]
    res = replay_tiers(trace, 2, [SimTier("redis", 2, write_through=True), SimTier("disk", 10)],
                       policy="lru")
    # redis holds only the last two stored (5, 6); disk got 1..4 as the host evicted them.
    assert res.hits == {"host": 0, "redis": 0, "disk": 2}


def test_blocks_turned_away_by_admission_go_down() -> None:
    trace = [[7, 8], [7, 8]]
    # Second-offer admission stores nothing on a first offer: the host alone misses both
    # times, while the blocks it turned away went to the tier and hit there.
    assert replay(trace, 4, "lru", admission="second-offer").hits == 0
    res = replay_tiers(trace, 4, [SimTier("disk", 10)], policy="lru", admission="second-offer")
    assert res.hits == {"host": 0, "disk": 2}
