"""How bench figures print: counts as whole numbers, a skipped figure as "skipped" (JSON
null, never a 0 that reads as measured), lower bounds never under a column headed
"ceiling", targets marked met or MISSED, and a ``meta`` block naming the code (aiokv's
version and git commit) that produced the figures."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

import aiokv
from aiokv.bench import bench_meta, source_commit
from aiokv.bench.report import BenchRow, format_table, write_json
from aiokv.bench.serve.run import _count


def _json(rows: list[BenchRow], meta: dict | None = None) -> dict:
    out = io.StringIO()
    write_json(out, rows, meta or {})
    return json.loads(out.getvalue())


def test_counts_print_as_whole_numbers_and_rates_keep_their_decimals() -> None:
    rows = [BenchRow("setup", "GPU pool", 83.0, "blocks", note="1.3 MiB"),
            BenchRow("setup", "tokens equal", 16.0, "tokens", 16.0),
            BenchRow("setup", "mean prompt", 482.5, "tokens"),
            BenchRow("setup", "load", 2.0, "GB/s", 4.0)]
    table = format_table(rows)
    assert "83 blocks" in table and "83.00" not in table
    equal = next(line for line in table.splitlines() if line.startswith("tokens equal"))
    assert equal.split()[2:5] == ["16", "tokens", "16"]  # the ceiling too
    assert "482.50 tokens" in table  # not a whole number: as measured
    assert "2.00 GB/s" in table and "0.50" in table


def test_a_skipped_figure_reads_skipped_and_is_null_in_json() -> None:
    rows = [BenchRow.skipped("wake-up", "trio: skipped", "trio is not installed"),
            BenchRow("wake-up", "FAILED", None, "", note="RuntimeError()", failed=True),
            BenchRow("wake-up", "asyncio", 12.5, "us")]
    table = format_table(rows)
    skipped = next(line for line in table.splitlines() if line.startswith("trio"))
    assert "skipped" in skipped.split("trio: skipped", 1)[1] and "0.00" not in skipped
    assert "FAILED" in next(line for line in table.splitlines() if line.startswith("FAILED"))
    payload = _json(rows)
    assert [r["value"] for r in payload["rows"]] == [None, None, 12.5]
    assert payload["rows"][0]["ratio"] is None


def test_the_cpu_transfer_bench_reports_its_cuda_only_row_as_skipped(monkeypatch) -> None:
    """The host side of a CUDA submit runs on no-op driver entry points from the native
    helper: where it is not built, the CPU bench says the rows are skipped (no 0 that reads
    as a measurement)."""
    import aiokv.bench
    import aiokv.bench.transfer
    from aiokv.backends.cuda import native

    monkeypatch.setattr(aiokv.bench.transfer, "run_transfer_bench", lambda *a, **k: [])
    monkeypatch.setattr(native, "_ext", None)
    (row,) = aiokv.bench.run_bench("cpu", quick=True, loop="asyncio", progress=lambda _m: None)
    assert row.value is None and "skipped" in format_table([row])


def test_lower_bounds_are_never_headed_ceiling() -> None:
    rows = [BenchRow("serve arm: host", "TTFT p50", 36.4, "ms", 19.9, bound=True),
            BenchRow("serve arm: host", "restore GB/s", 8.0, "GB/s", 30.0),
            BenchRow("transfer", "store", 20.0, "GB/s", 40.0)]
    lines = format_table(rows).splitlines()
    serve = lines[:lines.index("== transfer ==")]
    header = serve[1]
    assert "ceiling/bound" in header
    assert ">= 19.90" in next(line for line in serve if line.startswith("TTFT p50"))
    assert "<= 30.00" in next(line for line in serve if line.startswith("restore GB/s"))
    transfer = lines[lines.index("== transfer =="):]
    assert "ceiling" in transfer[1] and "bound" not in transfer[1] and "<=" not in transfer[3]
    assert _json(rows)["rows"][0]["bound"] is True


def test_targets_are_marked_met_or_missed() -> None:
    rows = [BenchRow("serve targets", "host arm / recompute", 0.4, "x", target=("<=", 0.5)),
            BenchRow("serve targets", "layerwise arm / host arm", 0.9, "x", target=("<=", 0.85)),
            BenchRow("serve targets", "no requests", float("nan"), "x", target=("<=", 1.2)),
            BenchRow("serve targets", "plain", 3.0, "x")]
    lines = format_table(rows).splitlines()
    assert "target" in lines[1]
    mark = {line.split()[0] + line.split()[1]: line for line in lines[3:]}
    assert "<= 0.5 met" in mark["hostarm"]
    assert "<= 0.85 MISSED" in mark["layerwisearm"]
    assert "<= 1.2 n/a" in mark["norequests"]
    payload = _json(rows)
    assert [r["target_met"] for r in payload["rows"]] == [True, False, None, None]
    assert payload["rows"][0]["target"] == ["<=", 0.5]


def test_serve_target_rows_carry_their_targets() -> None:
    from aiokv.bench.serve.compare import _goal

    assert _goal("<= 0.5") == ("<=", 0.5) and _goal(">= 2") == (">=", 2.0)
    with pytest.raises(ValueError):
        _goal("< 1")


def test_parameter_counts_read_as_counts() -> None:
    assert _count(111_000) == "111k" and _count(6.98e9) == "6.98B" and _count(7.5e6) == "7.5M"
    assert _count(640) == "640"


def test_meta_names_the_version_and_the_commit_of_this_checkout() -> None:
    meta = bench_meta("cpu")
    assert meta["aiokv"] == aiokv.__version__
    root = Path(aiokv.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("aiokv does not run from a git checkout here")
    assert meta["commit"] == head.stdout.strip() and isinstance(meta["dirty"], bool)


def test_meta_commit_is_null_outside_a_checkout(monkeypatch, tmp_path: Path) -> None:
    """An installed wheel (no .git beside the package) says null, not a guess."""
    import aiokv.bench

    fake = tmp_path / "site-packages" / "aiokv" / "bench" / "__init__.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    monkeypatch.setattr(aiokv.bench, "__file__", str(fake))
    assert source_commit() == (None, None)
    meta = bench_meta("cpu")
    assert meta["commit"] is None and meta["dirty"] is None and meta["aiokv"] == aiokv.__version__
