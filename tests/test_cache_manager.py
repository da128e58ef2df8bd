"""ChunkManager: states, atomic stores, pinning, failure cleanup, events, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokv.cache import (
    ChunkManager,
    KeyNotLoadable,
    KeysRemoved,
    KeysStored,
    LookupResult,
    StorePlan,
)


def store(mgr: ChunkManager, keys: list[object]) -> StorePlan:
    plan = mgr.prepare_store(keys)
    assert plan is not None
    mgr.complete_store(plan.keys_to_store, success=True)
    return plan


def test_store_lifecycle_and_lookup() -> None:
    mgr = ChunkManager(4)
    plan = mgr.prepare_store([b"a", b"b"])
    assert plan is not None
    assert plan.keys_to_store == [b"a", b"b"]
    assert len(set(plan.chunk_ids)) == 2 and all(0 <= c < 4 for c in plan.chunk_ids)
    assert plan.evicted == []
    assert mgr.lookup(b"a") is LookupResult.HIT_PENDING
    with pytest.raises(KeyNotLoadable):
        mgr.prepare_load([b"a"])
    mgr.complete_store([b"a", b"b"], success=True)
    assert mgr.lookup(b"a") is LookupResult.HIT
    assert mgr.lookup(b"zz") is LookupResult.MISS
    assert mgr.prepare_load([b"b", b"a"]) == [plan.chunk_ids[1], plan.chunk_ids[0]]
    mgr.complete_load([b"b", b"a"])
    again = mgr.prepare_store([b"a", b"b"])
    assert again is not None and again.keys_to_store == [] and again.chunk_ids == []
    assert mgr.num_free_chunks == 2
    mgr.check_invariants()


def test_chunks_are_handed_out_lowest_id_first_so_stores_stay_contiguous() -> None:
    """Freed chunks come back lowest first, whatever order they were freed in, so a store
    after evictions fills the lowest holes and its copies merge into few DMA runs."""
    mgr = ChunkManager(8)
    assert store(mgr, list("abcdef")).chunk_ids == [0, 1, 2, 3, 4, 5]
    failed = mgr.prepare_store(["x", "y"])
    assert failed is not None and failed.chunk_ids == [6, 7]
    mgr.complete_store(["y", "x"], success=False)  # frees 7, then 6
    plan = mgr.prepare_store(list("ghijk"))  # 3 to evict: LRU takes a, b, c
    assert plan is not None and plan.evicted == ["a", "b", "c"]
    assert plan.chunk_ids == [0, 1, 2, 6, 7]
    mgr.check_invariants()


def test_key_not_loadable_is_value_error_and_pins_nothing() -> None:
    mgr = ChunkManager(4)
    store(mgr, [1])
    with pytest.raises(ValueError):
        mgr.prepare_load([1, 2])
    assert mgr.stats().pinned_keys == 0


def test_failed_store_leaves_no_loadable_key_and_frees_chunks() -> None:
    mgr = ChunkManager(3)
    plan = mgr.prepare_store(["x", "y", "z"])
    assert plan is not None and mgr.num_free_chunks == 0
    mgr.complete_store(plan.keys_to_store, success=False)
    for key in "xyz":
        assert mgr.lookup(key) is LookupResult.MISS
    assert mgr.num_free_chunks == 3
    assert mgr.stats().failed_stores == 3
    assert not any(isinstance(e, KeysStored) for e in mgr.take_events())
    mgr.check_invariants()


def test_atomic_eviction_refusal_changes_nothing() -> None:
    mgr = ChunkManager(3)
    store(mgr, ["a", "b"])
    mgr.prepare_load(["a"])  # pinned: only "b" and one free chunk are available
    before = (mgr.num_free_chunks, sorted(mgr._entries), mgr.policy.order())  # type: ignore[attr-defined]
    mgr.take_events()
    assert mgr.prepare_store(["c", "d", "e"]) is None
    after = (mgr.num_free_chunks, sorted(mgr._entries), mgr.policy.order())  # type: ignore[attr-defined]
    assert before == after
    assert mgr.take_events() == []
    assert mgr.stats().store_plans_refused == 1
    mgr.check_invariants()


def test_pinned_and_pending_keys_are_never_evicted() -> None:
    mgr = ChunkManager(3)
    store(mgr, ["old"])
    mgr.prepare_load(["old"])
    pending = mgr.prepare_store(["w"])
    assert pending is not None
    plan = mgr.prepare_store(["n1"])
    assert plan is not None and plan.evicted == []
    assert mgr.prepare_store(["n2"]) is None  # only pinned / pending / just-written... none evictable
    mgr.complete_store(["n1"])
    plan = mgr.prepare_store(["n2"])
    assert plan is not None and plan.evicted == ["n1"]
    assert mgr.lookup("old") is LookupResult.HIT
    mgr.complete_load(["old"])
    mgr.complete_store(["n2", "w"])
    plan = mgr.prepare_store(["n3"])
    assert plan is not None and plan.evicted == ["old"]
    mgr.check_invariants()


def test_same_offer_keys_are_never_evicted_by_their_offer() -> None:
    mgr = ChunkManager(3)
    store(mgr, ["a", "b", "c"])  # "a" is least recent
    plan = mgr.prepare_store(["a", "b", "d"])
    assert plan is not None
    assert plan.evicted == ["c"]
    assert plan.keys_to_store == ["d"]
    # Offer holds every chunk: nothing else to evict, so a fourth key cannot fit.
    mgr.complete_store(["d"])
    assert mgr.prepare_store(["a", "b", "d", "e"]) is None
    mgr.check_invariants()


def test_events_and_stats() -> None:
    mgr = ChunkManager(2)
    store(mgr, ["a", "b"])
    plan = store(mgr, ["c"])
    assert plan.evicted == ["a"]
    events = mgr.take_events()
    assert events == [KeysStored(("a", "b")), KeysRemoved(("a",)), KeysStored(("c",))]
    assert mgr.take_events() == []
    st_ = mgr.stats()
    assert (st_.chunks_used, st_.chunks_free, st_.keys, st_.evictions) == (2, 0, 2, 1)
    with pytest.raises(AttributeError):
        st_.keys = 5  # type: ignore[misc]


def test_admission_rejections_are_counted() -> None:
    mgr = ChunkManager(4, admission="second-offer")
    plan = mgr.prepare_store(["a", "b"])
    assert plan is not None and plan.keys_to_store == []
    plan = mgr.prepare_store(["a", "b"])
    assert plan is not None and plan.keys_to_store == ["a", "b"]
    assert mgr.stats().rejected_by_admission == 2


def test_a_store_taken_without_admission_neither_asks_nor_teaches_it() -> None:
    """A block read back from a lower tier is stored whatever admission would say (it was
    admitted once), and admission never hears of it: another key's first offer is still
    refused and its second admitted, as without the read-backs between them."""
    mgr = ChunkManager(4, admission="second-offer")
    plan = mgr.prepare_store(["a"], admit=False)
    assert plan is not None and plan.keys_to_store == ["a"]
    mgr.complete_store(["a"])
    assert mgr.lookup("a") is LookupResult.HIT
    assert mgr.stats().rejected_by_admission == 0
    plan = mgr.prepare_store(["b"])
    assert plan is not None and plan.keys_to_store == []  # b's first offer: refused
    plan = mgr.prepare_store(["c"], admit=False)
    assert plan is not None and plan.keys_to_store == ["c"]
    mgr.complete_store(["c"])
    plan = mgr.prepare_store(["b"])
    assert plan is not None and plan.keys_to_store == ["b"]  # the second offer of b
    mgr.check_invariants()


def test_keys_to_keep_are_not_evicted_without_being_offered() -> None:
    """``keep`` protects keys from this plan's evictions as the offer does, without being
    offered (nothing is touched or observed): the next victim is taken instead, and no
    plan is made when only kept keys could be evicted."""
    mgr = ChunkManager(3, policy="lru")
    for key in "abc":
        mgr.prepare_store([key])
        mgr.complete_store([key])
    plan = mgr.prepare_store(["d"], keep={"a"})
    assert plan is not None and plan.evicted == ["b"]
    mgr.complete_store(["d"])
    assert mgr.prepare_store(["e"], keep={"a", "c", "d"}) is None
    mgr.check_invariants()


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError):
        ChunkManager(4, policy="nope")
    with pytest.raises(ValueError):
        ChunkManager(4, admission="nope")
    with pytest.raises(ValueError):
        ChunkManager(0)


def test_a_refused_manager_leaves_the_callers_policy_object_usable() -> None:
    from aiokv.cache import make_admission, make_policy

    policy = make_policy("lru", 4)
    with pytest.raises(ValueError, match="unknown admission"):
        ChunkManager(4, policy=policy, admission="nope")
    taken = make_admission("adaptive", 4)
    ChunkManager(4, admission=taken)
    with pytest.raises(ValueError, match="already serves"):
        ChunkManager(4, policy=policy, admission=taken)
    assert ChunkManager(4, policy=policy).policy is policy  # still the caller's to give
    with pytest.raises(ValueError, match="already serves"):
        ChunkManager(4, policy=policy)  # now it serves one


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete_ok", "complete_fail", "load", "unload", "touch"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=5),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, policy=st.sampled_from(["lru", "arc", "prefix-lru", "adaptive"]))
def test_invariants_under_random_operations(ops: list[tuple[str, list[int]]], policy: str) -> None:
    mgr = ChunkManager(5, policy=policy)
    pending: list[int] = []
    pins: list[int] = []
    for op, keys in ops:
        if op == "store":
            plan = mgr.prepare_store(keys)
            if plan is not None:
                assert not set(plan.evicted) & set(keys)
                pending.extend(plan.keys_to_store)
        elif op in ("complete_ok", "complete_fail") and pending:
            batch, pending = pending[: len(keys)], pending[len(keys) :]
            mgr.complete_store(batch, success=op == "complete_ok")
            if op == "complete_fail":
                assert all(mgr.lookup(k) is LookupResult.MISS for k in batch)
        elif op == "load":
            loadable = [k for k in keys if mgr.lookup(k) is LookupResult.HIT]
            if loadable:
                mgr.prepare_load(loadable)
                pins.extend(loadable)
        elif op == "unload" and pins:
            mgr.complete_load([pins.pop()])
        elif op == "touch":
            mgr.touch(keys)
        mgr.check_invariants()
        for key in pins:
            assert mgr.lookup(key) is LookupResult.HIT
    mgr.complete_store(pending, success=False)
    mgr.complete_load(pins)
    mgr.check_invariants()
    assert mgr.stats().pending_keys == 0 and mgr.stats().pinned_keys == 0
