"""Trace loading and the offline replay (small hand-made traces; one short real prefix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aiokv.bench.trace import Request, belady_hit_rate, load_trace, replay, simulate


def conversation_trace() -> Path | None:
    """The Mooncake conversation trace where the CLI looks for it ($AIOKV_TRACE_DIR first)."""
    from aiokv.bench.cache import find_traces

    try:
        found = find_traces()
    except FileNotFoundError:
        return None
    return next((p for p in found if p.name == "conversation_trace.jsonl"), None)


def test_load_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 7, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(path)
    assert trace == [Request(0, 1024, 5, (0, 1)), Request(7, 600, 2, (0, 2))]
    assert load_trace(path, limit=1) == trace[:1]


def test_hand_made_trace_known_hit_rate() -> None:
    trace = [[0, 1, 2], [0, 1, 3], [0, 4, 1], [5, 0, 1]]
    # Unbounded: request 2 hits 0,1; request 3 hits 0 (then 4 misses; 1 is not leading);
    # request 4 misses at 5 first. 3 hits / 12 references.
    assert simulate(trace, 100, "lru") == pytest.approx(3 / 12)
    # Capacity 2 LRU: after [0,1,2] holds {1,2}; [0,1,3]: 0 misses -> 0 hits.
    assert simulate(trace, 2, "lru") == 0.0
    res = replay(trace, 100, "lru")
    assert (res.hits, res.references, res.evictions) == (3, 12, 0)


def test_requests_larger_than_cache_store_nothing() -> None:
    res = replay([[1, 2, 3], [1, 2, 3]], 2, "lru")
    assert res.hits == 0 and res.refused_requests == 2


def test_belady_beats_lru_on_a_cyclic_pattern() -> None:
    trace = [[k] for k in [1, 2, 3] * 20]
    assert simulate(trace, 2, "lru") == 0.0
    assert belady_hit_rate(trace, 2) > 0.4
    assert belady_hit_rate(trace, 3) == pytest.approx(57 / 60)


def test_belady_evicts_a_requests_deepest_block_first_on_a_tie() -> None:
    """Blocks of one request share their next use; keeping the leading one is what a prefix
    hit needs (evicting the earliest inserted scored 5/14 here, below online policies)."""
    trace = [[0, 1, 2], [10, 11], [10, 11], [0, 1, 2], [0, 1, 2, 3]]
    assert belady_hit_rate(trace, 4) == pytest.approx(7 / 14)
    for policy in ("lru", "arc", "adaptive", "prefix-lru"):
        assert simulate(trace, 4, policy) <= belady_hit_rate(trace, 4)


@pytest.mark.parametrize("policy", ["lru", "arc", "adaptive"])
def test_policies_replay_hand_made_trace(policy: str) -> None:
    trace = [[0, 1, 2]] * 5
    assert simulate(trace, 8, policy) == pytest.approx(12 / 15)


def test_real_trace_prefix_is_sane() -> None:
    path = conversation_trace()
    if path is None:
        pytest.skip("Mooncake traces not present (set AIOKV_TRACE_DIR)")
    trace = load_trace(path, limit=2000)
    lru = simulate(trace, 2000, "lru")
    best = simulate(trace, 2000, "adaptive")
    assert 0.0 < lru <= belady_hit_rate(trace, 2000)
    assert best >= lru


def test_the_trace_folder_follows_aiokv_trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [i, i + 1]}
            for i in range(3)]
    (tmp_path / "conversation_trace.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setenv("AIOKV_TRACE_DIR", str(tmp_path))
    path = conversation_trace()
    assert path == tmp_path / "conversation_trace.jsonl"
    assert [r.hash_ids for r in load_trace(path)] == [(0, 1), (1, 2), (2, 3)]
