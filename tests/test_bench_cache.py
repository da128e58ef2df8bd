"""``run_cache_bench`` on a tiny hand-made trace: rows, ratios, LRU baseline, clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from aiokv.__main__ import main
from aiokv.bench.cache import find_traces, run_cache_bench


def write_trace(path: Path, requests: int = 80, seed: int = 0) -> Path:
    """Requests that share a few system prompts and repeat some user turns."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for r in range(requests):
            ids = [100 * rng.randrange(4) + i for i in range(3)] + [1000 + (r % 13) * 10 + i
                                                                     for i in range(rng.randint(0, 5))]
            row = {"timestamp": r, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids}
            f.write(json.dumps(row) + "\n")
    return path


def test_rows_on_a_tiny_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "tiny_trace.jsonl")
    said: list[str] = []
    rows = run_cache_bench(traces=[str(trace)], capacities=[8, 40], quick=True, progress=said.append)
    rates = [r for r in rows if r.unit == "%"]
    names = [r.name for r in rates]
    for cap in ("8", "40"):
        assert f"adaptive @ {cap} blocks" in names and f"lru @ {cap} blocks" in names
    for row in rates:
        assert 0.0 <= row.value <= 100.0 and row.ceiling is not None and 0.0 < row.ceiling <= 100.0
        assert row.ratio == pytest.approx(row.value / row.ceiling)
        assert row.section.startswith(("cache hit rate: tiny", "cache face: tiny"))
    face = {r.name: r for r in rows if r.section.startswith("cache face")}
    hit = face["hit rate through the face"]
    assert "bytes verified" in hit.note
    assert hit.value == pytest.approx(hit.extra["simulator"] * 100)  # the face decides like the simulator
    assert face["restore latency p99"].value >= face["restore latency p50"].value > 0
    assert face["restore GB/s (copy time)"].value > 0 and face["restore GB/s (copy time)"].ceiling > 0
    assert any("tiny" in line for line in said)


@pytest.mark.parametrize("name", ["lru", "LRU"])
def test_lru_policy_gives_one_row_per_capacity(tmp_path: Path, name: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl", requests=30)
    rows = run_cache_bench(traces=[trace], capacities=[16], policy=name, quick=True)
    hit_rows = [r.name for r in rows if r.unit == "%" and r.section.startswith("cache hit")]
    assert hit_rows == ["lru @ 16 blocks"]


def test_missing_traces_raise_file_not_found_naming_the_flag(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(FileNotFoundError, match="--trace"):
        run_cache_bench(traces=[str(tmp_path / "nope.jsonl")])
    monkeypatch.setattr("aiokv.bench.cache._search_dirs", lambda: [tmp_path / "empty"])
    with pytest.raises(FileNotFoundError, match="--trace PATH"):
        find_traces()


def test_the_trace_dir_may_come_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    write_trace(tmp_path / "b_trace.jsonl")
    write_trace(tmp_path / "a_trace.jsonl")
    monkeypatch.setenv("AIOKV_TRACE_DIR", str(tmp_path))
    assert [p.name for p in find_traces()] == ["a_trace.jsonl", "b_trace.jsonl"]


def test_bad_arguments_are_value_errors_and_the_cli_prints_them(tmp_path: Path, capsys) -> None:
    trace = write_trace(tmp_path / "t.jsonl", requests=5)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        run_cache_bench(traces=[trace], policy="nope")
    with pytest.raises(ValueError, match="positive"):
        run_cache_bench(traces=[trace], capacities=[0])
    assert main(["bench", "cache", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "aiokv bench cache: trace not found" in capsys.readouterr().err


def test_a_trace_line_without_hash_ids_names_the_file_and_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    assert main(["bench", "cache", "--trace", str(path)]) == 2
    assert "bad.jsonl, line 2: not a Mooncake request (no hash_ids)" in capsys.readouterr().err


def test_edge_traces_give_honest_rows(tmp_path: Path) -> None:
    """No hit at all: no "inf" ratio and no made-up latencies; a capacity far beyond the
    trace needs no pool of that size; two traces of one name keep their own sections."""
    once = tmp_path / "once.jsonl"
    once.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [i]}) + "\n" for i in range(20)))
    rows = run_cache_bench(traces=[once], capacities=[1_000_000], quick=True)
    assert not any("inf" in r.note for r in rows)
    face = [r.name for r in rows if r.section.startswith("cache face")]
    assert "restore latency p50" not in face and "offload GB/s (copy time)" in face
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        write_trace(tmp_path / sub / "x.jsonl", requests=20, seed=ord(sub))
    rows = run_cache_bench(traces=[tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"],
                           capacities=[8], quick=True)
    sections = {r.section for r in rows if r.section.startswith("cache hit rate")}
    assert sections == {"cache hit rate: a/x, real cache (reference: offline optimum, Belady's rule)",
                        "cache hit rate: b/x, real cache (reference: offline optimum, Belady's rule)"}


def test_wrong_bytes_through_the_face_fail_the_row_and_the_command(tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    """A restore that leaves wrong bytes in the blocks marks the face's row failed, and the
    command exits 1 (a script must not read corruption as a pass)."""
    from aiokv.cache.offload import OffloadCache

    real = OffloadCache.restore

    async def corrupting(self, keys, blocks, *args, **kwargs):  # type: ignore[no-untyped-def]
        ok = await real(self, keys, blocks, *args, **kwargs)
        for t in self._worker.kv_caches.tensors:
            t.tensor.view(-1)[::7] += 1  # after the copy: the blocks no longer hold the keys
        return ok

    monkeypatch.setattr(OffloadCache, "restore", corrupting)
    trace = write_trace(tmp_path / "tiny_trace.jsonl")
    rows = run_cache_bench(traces=[str(trace)], capacities=[40], quick=True, progress=lambda _: None)
    hit = next(r for r in rows if r.name == "hit rate through the face")
    assert hit.failed and "WRONG BYTES" in hit.note
    assert main(["bench", "cache", "--quick", "--capacity", "40", "--trace", str(trace)]) == 1
    assert "failed" in capsys.readouterr().err


def tiny_tier_trace(path: Path, requests: int = 300) -> Path:
    rng = random.Random(5)
    rows_in = [{"timestamp": i, "input_length": 512, "output_length": 1,
                "hash_ids": [rng.randrange(30) for _ in range(4)]} for i in range(requests)]
    path.write_text("\n".join(json.dumps(r) for r in rows_in))
    return path


def test_tier_bench_replays_through_the_real_cache(tmp_path: Path) -> None:
    from aiokv.bench.tiers import run_tier_bench

    trace = tiny_tier_trace(tmp_path / "tiny_trace.jsonl")
    said: list[str] = []
    rows = run_tier_bench([trace], [("host", 4), ("disk", 40)], policy="lru", quick=True,
                          tier_dir=str(tmp_path), restore_blocks=8, progress=said.append)
    by_name = {r.name: r for r in rows}
    total, host = by_name["all tiers"], by_name["host tier, with tiers below"]
    assert "bytes verified" in total.note and not total.failed
    assert total.ceiling == pytest.approx(by_name["lru @ 44"].value)  # LRU over host + disk
    # Tier hits let a run reach host blocks behind them: the host never serves less.
    assert host.ratio is not None and host.ratio >= 1.0
    assert host.ceiling == pytest.approx(by_name["host only (lru) @ 4"].value)
    assert total.value == pytest.approx(host.value + by_name["disk tier"].value)
    assert by_name["blocks dropped on their way down"].value == 0
    restore = by_name["restore from disk"]
    assert restore.value > 0 and restore.ceiling and restore.ceiling > 0 and not restore.failed
    assert "bytes verified" in restore.note
    assert by_name["p50 with a disk tier configured"].ceiling
    persist = by_name["host written out as the cache closes"]
    assert persist.extra["persisted"] == persist.extra["found"] == 8 and "bytes verified" in persist.note
    assert not any(r.failed for r in rows) and said
    assert not list(tmp_path.glob("aiokv-*"))  # the tiers' folders are removed


def test_a_replay_through_the_real_cache_repeats(tmp_path: Path) -> None:
    """The writes' progress never decides a hit: replays of one trace over a real disk tier
    agree (the tier's own LRU order of blocks written at the same moment is all that may
    differ), nothing is dropped, and every restored block holds its key's bytes."""
    import anyio

    from aiokv.bench.replay import replay_cache
    from aiokv.bench.trace import load_trace

    rng = random.Random(5)
    rows = [{"timestamp": i, "hash_ids": [root * 8 + j for j in range(rng.randint(1, 8))]}
            for i in range(300) if (root := rng.randrange(60)) >= 0]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_trace(tmp_path / "t.jsonl")
    runs = [anyio.run(lambda: replay_cache(trace, 8, [("disk", 160)], tier_dir=str(tmp_path)))
            for _ in range(2)]
    for run in runs:
        assert run.host_hits > 0 and run.tier_hits["disk"] > run.host_hits
        assert run.wrong_blocks == 0 and run.dropped == {"disk": 0}
        assert run.hits == run.host_hits + run.tier_hits["disk"]
    assert abs(runs[0].hit_rate - runs[1].hit_rate) <= 0.01


@pytest.mark.parametrize("spec", ["disk=100", "host=10", "host=10,tape=5", "host=10,disk=0",
                                  "host=10,disk=x", "host=1,disk=2,disk=3"])
def test_bad_tier_specs_are_refused_by_the_cli(spec: str, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2]}) + "\n")
    assert main(["bench", "cache", "--trace", str(trace), "--tiers", spec]) == 2
    assert "--tiers" in capsys.readouterr().err


def test_a_redis_tier_needs_a_url(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2]}) + "\n")
    assert main(["bench", "cache", "--trace", str(trace), "--tiers", "host=4,redis=8"]) == 2
    assert "--redis-url" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--tiers", "host=4,disk=8", "--redis-url", "redis://127.0.0.1:1"], "add redis=BLOCKS"),
    (["--redis-url", "redis://127.0.0.1:1"], "--redis-url is an option of --tiers"),
    (["--tier-dir", "/"], "--tier-dir is an option of --tiers"),
    (["--tiers", "host=4,disk=8", "--tier-dir", "/nonexistent/aiokv"], "not a folder this user can write"),
    (["--tiers", "host=4,disk=8", "--capacity", "8"], "--capacity is not read with --tiers"),
    (["--tiers", "host=4,disk=8,redis=8", "--redis-url", "redis://127.0.0.1:1"], "does not answer"),
])
def test_tier_bench_options_that_cannot_work_are_refused_before_any_replay(
        tmp_path: Path, capsys, monkeypatch, argv: list[str], says: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"hash_ids": [1, 2]}) + "\n")
    monkeypatch.setattr("aiokv.bench.tiers.replay_cache", None)  # a replay would raise TypeError
    assert main(["bench", "cache", "--trace", str(trace), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_cache_bench_help_names_its_options_and_the_traces(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "cache", "--help"])
    out = capsys.readouterr().out
    for flag in ("--trace", "--capacity", "--policy", "--tiers", "--redis-url", "--tier-dir"):
        assert flag in out
    assert "Mooncake" in out and "AIOKV_TRACE_DIR" in out


def test_the_tier_bench_leaves_nothing_in_redis(tmp_path: Path) -> None:
    from aiokv.bench.tiers import run_tier_bench
    from tests.redis_server import RedisServer, need_redis, running

    need_redis()
    trace = tiny_tier_trace(tmp_path / "tiny_trace.jsonl", requests=120)
    with running(RedisServer(tmp_path / "redis")) as server:
        assert isinstance(server, RedisServer)
        import redis

        client = redis.Redis.from_url(server.url)
        client.set(b"user-key", b"kept")
        rows = run_tier_bench([trace], [("host", 4), ("disk", 16), ("redis", 16)], policy="lru",
                              quick=True, tier_dir=str(tmp_path), redis_url=server.url,
                              restore_blocks=4)
        by_name = {r.name: r for r in rows}
        assert by_name["redis tier"].note.startswith(tuple("123456789"))  # it wrote blocks
        assert not any(r.failed for r in rows)
        assert client.keys(b"*") == [b"user-key"]
        client.close()
