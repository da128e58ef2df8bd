"""The command line: info, a quick CPU bench with --json, and clear errors."""

from __future__ import annotations

import json

import pytest

from aiokv.__main__ import main
from aiokv.bench.report import BenchRow, format_table


def test_info_prints_backend_and_versions(capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend (auto)" in out and "torch" in out and "cuda-python" in out


def test_quick_cpu_bench_writes_rows_beside_ceilings(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    assert main(["bench", "--backend", "cpu", "--quick", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "store 32 KiB pages (realistic)" in captured.out and "ratio" in captured.out
    assert "[" in captured.err and "completion wake-up" in captured.err  # progress lines
    payload = json.loads(path.read_text())
    assert payload["meta"]["backend"] == "cpu"
    gbps = [r for r in payload["rows"] if r["unit"] == "GB/s"]
    assert len(gbps) == 8
    for row in gbps:
        assert row["value"] > 0 and row["ceiling"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["ceiling"])
        # The ceiling is the best contiguous copy of the same bytes, of every kind, timed
        # before and after the jobs (a median of one kind let ratios read 1.54).
        ceilings = row["extra"]["ceilings_gbps"]
        d = row["extra"]["direction"]
        assert set(ceilings) == {f"{d}, {kind}, {when}" for kind in ("one copy", "page pieces")
                                 for when in ("start", "end")}
        assert row["ceiling"] == max(ceilings.values())


@pytest.mark.parametrize("page_bytes", [4096, 5000, 1 << 20])
def test_cpu_ceiling_copies_move_every_byte(page_bytes: int) -> None:
    """A ceiling copy that skipped bytes would read fast and make the ratios lie."""
    import torch

    from aiokv.bench.transfer import _contiguous_copies

    gen = torch.Generator().manual_seed(3)
    nbytes = 3 * page_bytes + 17  # a last piece shorter than a page
    kinds = ("store, one copy", "store, page pieces", "load, one copy", "load, page pieces")
    for kind in kinds:
        host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        want = (dev if kind.startswith("store") else host).clone()
        copies = _contiguous_copies(host, dev, "cpu", page_bytes)
        assert set(copies) == set(kinds)
        copies[kind]()
        assert torch.equal(host, want) and torch.equal(dev, want), kind


def test_json_dash_writes_json_to_stdout_and_the_table_to_stderr(tmp_path, capsys, monkeypatch) -> None:
    import aiokv.bench

    rows = [BenchRow("throughput", "store x", 5.0, "GB/s", 10.0, extra={"direction": "store"}),
            BenchRow("completion", "p50", 40.0, "us")]
    monkeypatch.setattr(aiokv.bench, "run_bench", lambda *a, **k: rows)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--backend", "cpu", "--json", "-"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)  # stdout is the JSON alone
    assert [(r["name"], r["value"], r["ratio"]) for r in payload["rows"]] == [
        ("store x", 5.0, 0.5), ("p50", 40.0, None)]
    assert payload["meta"]["backend"] == "cpu"
    assert "== throughput ==" in captured.err and "store x" in captured.err
    assert list(tmp_path.iterdir()) == []  # no file named "-"


@pytest.mark.parametrize("argv", [
    ["bench", "--trace", "t.jsonl"],
    ["bench", "transfer", "--capacity", "100"],
    ["bench", "--backend", "cpu", "--quick", "--policy", "lru"],
    ["bench", "cache", "--loop", "trio"],
])
def test_options_of_the_other_bench_are_refused_before_running(argv, capsys, monkeypatch) -> None:
    import aiokv.bench
    import aiokv.bench.cache

    monkeypatch.setattr(aiokv.bench, "run_bench", lambda *a, **k: pytest.fail("transfer bench ran"))
    monkeypatch.setattr(aiokv.bench.cache, "run_cache_bench", lambda *a, **k: pytest.fail("cache bench ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    flag = next(a for a in argv if a.startswith("--") and a not in ("--backend", "--quick"))
    assert f"{flag} is an option of `aiokv bench " in err


def test_bad_arguments_exit_with_a_message(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", "--backend", "tpu"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_plot_with_the_cache_bench_is_refused_before_running(tmp_path, capsys) -> None:
    missing = tmp_path / "no_such_trace.jsonl"  # would fail later: the refusal must come first
    assert main(["bench", "cache", "--plot", str(tmp_path / "x.png"), "--trace", str(missing)]) == 2
    assert "--plot is an option of `aiokv bench transfer`" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_table_groups_sections_and_shows_ratios() -> None:
    rows = [
        BenchRow("a", "x", 5.0, "GB/s", 10.0),
        BenchRow("b", "y", 1.0, "us"),
        BenchRow("a", "z", 2.0, "GB/s", 4.0, note="n"),
    ]
    text = format_table(rows)
    assert text.index("== a ==") < text.index("== b ==") and text.count("== a ==") == 1
    assert "0.50" in text


def test_plot_draws_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from aiokv.bench.plot import plot_rows

    rows = [
        BenchRow("throughput", f"{d} {p}", 1.0 + i, "GB/s", 4.0, extra={"page_bytes": p, "direction": d})
        for i, (d, p) in enumerate([("store", 16384), ("store", 32768), ("load", 16384), ("load", 32768)])
    ]
    path = tmp_path / "plot.png"
    plot_rows(rows, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_bench_runs_a_worker_on_each_event_loop_it_names(loop: str) -> None:
    """The CUDA bench's wake-up rows run on uvloop and trio through ``run_on_loop``: each
    must really be that loop, and a worker must move bytes on it."""
    import sniffio
    import torch

    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
    from aiokv.bench.cuda import loop_available, run_on_loop

    if not loop_available(loop):
        pytest.skip(f"{loop} is not installed")
    gen = torch.Generator().manual_seed(7)
    kv = torch.randint(-(2**31), 2**31 - 1, (8, 256), dtype=torch.int32, generator=gen)
    before = kv.clone()

    async def round_trip() -> tuple[str, str]:
        async with AsyncOffloadingWorker(CanonicalKVCaches.from_tensors([kv]), num_cpu_chunks=4,
                                         backend="cpu") as worker:
            await worker.submit_store(1, GPULoadStoreSpec([5, 2]), CPULoadStoreSpec([0, 3]))
            kv[5].zero_()
            kv[2].fill_(-1)
            await worker.submit_load(2, CPULoadStoreSpec([0, 3]), GPULoadStoreSpec([5, 2]))
        import asyncio

        name = type(asyncio.get_running_loop()).__module__ if loop != "trio" else "trio"
        return sniffio.current_async_library(), name

    library, module = run_on_loop(loop, round_trip)
    assert library == ("trio" if loop == "trio" else "asyncio")
    assert module.startswith({"asyncio": "asyncio", "uvloop": "uvloop", "trio": "trio"}[loop])
    assert torch.equal(kv, before)


def test_bench_refuses_an_unknown_event_loop() -> None:
    from aiokv.bench.cuda import run_on_loop

    async def nothing() -> None:
        return None

    with pytest.raises(ValueError, match="unknown event loop"):
        run_on_loop("gevent", nothing)


def test_bench_bursts_split_first_submit_from_back_to_back() -> None:
    """The CUDA bench's back-to-back submit row: bursts of jobs 0..size-1 in order, every
    job awaited before the next burst, the first submit of each burst timed apart."""
    import asyncio
    from types import SimpleNamespace

    import numpy as np

    from aiokv.bench import cuda_rows as bench

    clock = iter(range(10**6))
    calls: list[tuple[str, int]] = []
    awaited: list[bool] = []
    cost = {0: 7, 1: 2, 2: 3, 3: 2}  # clock ticks a submit of job k takes (first is "cold")

    class Job:
        def __init__(self) -> None:
            self.i = len(awaited)
            awaited.append(False)

        def __await__(self):
            awaited[self.i] = True
            yield from asyncio.sleep(0).__await__()

    def submit(name: str):
        def call(job_id: int, a, b) -> Job:
            k = len(calls) % 4
            assert k or all(awaited), "a burst began before the last was awaited"
            calls.append((name, k))
            for _ in range(cost[k] - 1):
                next(clock)
            return Job()
        return call

    worker = SimpleNamespace(submit_store=submit("store"), submit_load=submit("load"))
    blocks = [np.arange(3) + k for k in range(4)]
    setup = SimpleNamespace(jobs=[(b, b) for b in blocks], jobs_in_runs=[])
    warm, cold = asyncio.run(bench.bursts(worker, setup, False, bench.JobIds(), bursts=3, size=4,
                                           clock=lambda: next(clock)))
    assert calls == [("load", k) for k in range(4)] * 3
    assert awaited == [True] * 12
    assert (warm, cold) == (2, 7)


def test_unusable_options_exit_2_before_anything_runs(tmp_path, capsys, monkeypatch) -> None:
    import importlib.util

    from aiokv.backends import cuda_usable

    assert main(["bench", "--quick", "--json", str(tmp_path / "no" / "such" / "x.json")]) == 2
    assert "--json" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "trio" else real(name, *a))
    assert main(["bench", "--quick", "--backend", "cpu", "--loop", "trio"]) == 2
    assert "needs trio installed" in capsys.readouterr().err
    if not cuda_usable():
        assert main(["bench", "cache", "--backend", "cuda"]) == 2
        assert "--backend cuda needs" in capsys.readouterr().err


def test_a_failed_figure_makes_the_bench_exit_1_after_the_rest(tmp_path, capsys, monkeypatch) -> None:
    import aiokv.bench

    rows = [BenchRow("s", "store, one job", 5.0, "GB/s", 10.0),
            BenchRow("t", "FAILED", 0.0, "", None, "RuntimeError('no kernel')", failed=True)]
    monkeypatch.setattr(aiokv.bench, "run_bench", lambda *a, **k: rows)
    path = tmp_path / "b.json"
    assert main(["bench", "--backend", "cpu", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    assert "store, one job" in captured.out and "1 figure(s) failed: t / FAILED" in captured.err
    assert [r["failed"] for r in json.loads(path.read_text())["rows"]] == [False, True]
    monkeypatch.setattr(aiokv.bench, "run_bench", lambda *a, **k: rows[:1])
    assert main(["bench", "--backend", "cpu"]) == 0


def test_json_or_plot_naming_a_folder_is_refused_before_running(tmp_path, capsys, monkeypatch) -> None:
    import aiokv.bench

    monkeypatch.setattr(aiokv.bench, "run_bench", lambda *a, **k: pytest.fail("ran"))
    for flag in ("--json", "--plot"):
        assert main(["bench", "--backend", "cpu", flag, str(tmp_path)]) == 2
        assert "is a folder; give a file name" in capsys.readouterr().err
