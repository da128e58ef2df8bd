"""Eviction and admission policies in isolation and through ChunkManager."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import pytest

from aiokv.cache import (
    AdaptiveAdmission,
    ARCPolicy,
    ChunkManager,
    EvictionPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    available_policies,
    register_policy,
)


def always(_: Hashable) -> bool:
    return True


def test_lru_order() -> None:
    pol = LRUPolicy()
    pol.on_insert(["a", "b", "c"])
    pol.on_access(["a"])
    assert pol.order() == ["b", "c", "a"]
    assert pol.victims(2, always) == ["b", "c"]
    assert pol.victims(2, lambda k: k != "b") == ["c", "a"]
    assert pol.victims(4, always) is None
    pol.on_remove("c", evicted=True)
    assert pol.order() == ["b", "a"]


def test_prefix_lru_evicts_tail_first() -> None:
    pol = PrefixLRUPolicy()
    pol.on_insert([1, 2, 3])
    assert pol.victims(1, always) == [3]


def test_lru_through_manager() -> None:
    mgr = ChunkManager(3, policy="lru")
    for key in "abc":
        plan = mgr.prepare_store([key])
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    mgr.touch(["a"])
    plan = mgr.prepare_store(["d"])
    assert plan is not None and plan.evicted == ["b"]


def test_arc_scan_does_not_flush_frequent_set() -> None:
    arc = ARCPolicy(4)
    mgr = ChunkManager(4, policy=arc)
    hot = ["h1", "h2"]
    plan = mgr.prepare_store(hot)
    assert plan is not None
    mgr.complete_store(hot)
    mgr.touch(hot)  # second use: frequency list T2
    for i in range(20):  # a one-pass scan
        plan = mgr.prepare_store([f"s{i}"])
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    assert "h1" in mgr and "h2" in mgr
    assert set(arc.t2) == set(hot)


def test_arc_target_moves_on_ghost_hits() -> None:
    arc = ARCPolicy(2)
    arc.on_insert(["a", "b"])
    assert arc.victims(1, always) == ["a"]
    arc.on_remove("a", evicted=True)
    assert "a" in arc.b1
    p0 = arc.p
    arc.on_insert(["a"])  # ghost hit in B1: recency deserved more room
    assert arc.p > p0 and "a" in arc.t2
    arc.on_access(["b"])  # b to T2 as well
    assert arc.victims(1, always) is not None
    arc.on_remove("a", evicted=True)
    assert "a" in arc.b2
    p1 = arc.p
    arc.on_insert(["a"])  # ghost hit in B2: frequency deserved more room
    assert arc.p < p1


def test_arc_failed_store_leaves_no_ghost() -> None:
    arc = ARCPolicy(2)
    arc.on_insert(["a"])
    arc.on_remove("a", evicted=False)
    assert "a" not in arc.b1 and len(arc) == 0


def test_register_custom_policy() -> None:
    class MRU(LRUPolicy):
        def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
            out = [k for k in reversed(self.order()) if evictable(k)][:n]
            return out if len(out) == n else None

    register_policy("test-mru", MRU)
    assert "test-mru" in available_policies()
    with pytest.raises(ValueError):
        register_policy("test-mru", MRU)
    mgr = ChunkManager(2, policy="test-mru")
    for key in "ab":
        plan = mgr.prepare_store([key])
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    plan = mgr.prepare_store(["c"])
    assert plan is not None and plan.evicted == ["b"]
    assert isinstance(mgr.policy, EvictionPolicy)


def test_adaptive_admits_everything_while_free() -> None:
    adm = AdaptiveAdmission(8)
    adm.filtering = True
    assert adm.admit(["a", "b"], free_chunks=5) == [True, True]
    assert adm.admit(["a", "b"], free_chunks=1) == [False, False]


def _hot_set_under_scans(rounds: int) -> list[list[int]]:
    # 60 hot keys used round-robin, each followed by 3 one-off keys: a hot key comes back
    # after 240 references, too late for a 100-chunk LRU that stores everything.
    out: list[list[int]] = []
    fresh = 1000
    for _ in range(rounds):
        for hot in range(60):
            out.append([hot])
            for _ in range(3):
                out.append([fresh])
                fresh += 1
    return out


def test_adaptive_filters_when_one_offs_flush_a_small_cache() -> None:
    from aiokv.bench.trace import simulate

    trace = _hot_set_under_scans(8)
    assert simulate(trace, 100, "lru") == 0.0
    assert simulate(trace, 100, "adaptive") > 0.15
    mgr = ChunkManager(100, policy="adaptive")
    for keys in trace:
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    adm = mgr.admission
    assert isinstance(adm, AdaptiveAdmission) and adm.filtering
    mgr.check_invariants()


def test_adaptive_keeps_admitting_when_everything_fits() -> None:
    mgr = ChunkManager(4096, policy="adaptive")
    adm = mgr.admission
    assert isinstance(adm, AdaptiveAdmission)
    convo = [[0, *range(1, 2 + i)] for i in range(40)]  # a growing conversation
    for keys in convo:
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    assert not adm.filtering
    assert mgr.count_leading_hits(convo[-1]) == len(convo[-1])


def _chat(turns: int, convs: int, partial_tail: bool) -> list[list[int]]:
    # Interleaved conversations; each turn re-sends the previous turn and adds two blocks. With
    # ``partial_tail`` the last block of a turn is partial: the next turn sends a new id for it.
    out: list[list[int]] = []
    fresh = 1_000_000
    history: list[list[int]] = [[] for _ in range(convs)]
    for _ in range(turns):
        for c in range(convs):
            prev = history[c]
            keep = prev[:-1] if partial_tail and prev else prev
            cur = [*keep, fresh, fresh + 1]
            fresh += 2
            history[c] = cur
            out.append([0, *cur])
    return out


def test_adaptive_skips_last_keys_that_never_come_back() -> None:
    trace = _chat(turns=12, convs=40, partial_tail=True)  # 961 distinct keys
    mgr = ChunkManager(800, policy="adaptive")
    for keys in trace:
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    adm = mgr.admission
    assert isinstance(adm, AdaptiveAdmission) and adm.tail.skip
    assert len(mgr) == 800  # full: last keys are skipped only when room is short
    last = trace[-1]
    assert last[-1] not in mgr and last[-2] in mgr
    # Every key the next turn re-sends is still a hit.
    assert mgr.count_leading_hits(last[:-1]) == len(last) - 1
    mgr.check_invariants()


def test_adaptive_keeps_last_keys_that_are_sent_again() -> None:
    trace = _chat(turns=12, convs=40, partial_tail=False)
    mgr = ChunkManager(10_000, policy="adaptive")
    for keys in trace:
        plan = mgr.prepare_store(keys)
        assert plan is not None
        mgr.complete_store(plan.keys_to_store)
    adm = mgr.admission
    assert isinstance(adm, AdaptiveAdmission) and not adm.tail.skip
    assert mgr.count_leading_hits(trace[-1]) == len(trace[-1])


def test_tail_skip_raises_hit_rate_on_a_small_cache() -> None:
    from aiokv.bench.trace import simulate

    trace = _chat(turns=10, convs=60, partial_tail=True)
    never_skip = AdaptiveAdmission(600)
    never_skip.tail.ratio = 0.0
    without = simulate(trace, 600, "adaptive", never_skip)
    assert simulate(trace, 600, "adaptive") > without + 0.02


def test_admit_offer_defaults_to_admit() -> None:
    from aiokv.cache import AdmitAll

    class EvenOnly(AdmitAll):
        def admit(self, keys: Sequence[Hashable], free_chunks: int) -> list[bool]:
            return [int(str(k)) % 2 == 0 for k in keys]

    adm = EvenOnly()
    assert adm.admit_offer([1, 2, 3, 4], [3, 4], 10) == [False, True]
    mgr = ChunkManager(8, policy="lru", admission=adm)
    plan = mgr.prepare_store([1, 2, 3, 4])
    assert plan is not None and plan.keys_to_store == [2, 4]
