"""Every script in benchmarks/ runs in its quick mode on the CPU backend and prints its
rows, so the scripts cannot rot while the library moves under them."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"aiokv_benchmark_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_every_script_is_covered_here() -> None:
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert scripts == {"disk_restores", "gemm_overlap", "wakeup_loops"}, \
        "add a quick-mode test for each new script"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.stem)
def test_scripts_use_only_public_names(path: Path) -> None:
    """``from aiokv import X`` and ``from aiokv.bench import X`` with X in that module's
    ``__all__``; nothing else of aiokv (its internals may move under the scripts)."""
    public = {"aiokv", "aiokv.bench"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            assert not [a.name for a in node.names if a.name.split(".")[0] == "aiokv"], ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aiokv":
            assert node.module in public, f"{path.name}: {ast.unparse(node)} is not a public module"
            exported = set(importlib.import_module(node.module).__all__)
            names = {a.name for a in node.names}
            assert names <= exported, f"{path.name}: {sorted(names - exported)} not in {node.module}.__all__"


def test_wakeup_loops_prints_a_row_per_loop_job_and_doorbell(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("wakeup_loops")
    assert script.main(["--quick", "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"(asyncio|uvloop|trio) +(on|off) ", line)]
    skipped = [line for line in out.splitlines() if "skipped" in line]
    assert len(rows) + 4 * len(skipped) == 12  # 3 loops x 2 jobs x doorbell on/off
    for line in rows:
        wake_p50, wake_p99, trip_p50 = (float(x) for x in re.findall(r"([\d.]+) us", line))
        assert 0 <= wake_p50 <= wake_p99 and trip_p50 > 0


def test_wakeup_loops_refuses_an_unknown_loop() -> None:
    script = load_script("wakeup_loops")
    with pytest.raises(SystemExit) as info:
        script.main(["--quick", "--loops", "gevent"])
    assert info.value.code == 2


def test_gemm_overlap_prints_rates_beside_the_ceiling(capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("gemm_overlap")
    assert script.main(["--quick"]) == 0
    out = capsys.readouterr().out
    values = {m[0].strip(): float(m[1]) for m in re.findall(r"^(.+?)\s+(-?[\d.]+) \S+$", out, re.M)}
    assert values["contiguous copy of the same bytes (ceiling)"] > 0 and values["GEMM alone"] > 0
    for name in ("store, one job at a time, idle (device time)",
                 "store under the GEMM, one job at a time (device time)",
                 "store under the GEMM, two jobs in flight (wall)"):
        assert values[name] > 0
    assert sum(1 for line in out.splitlines() if "GEMM slowdown beside it" in line) == 2


@pytest.mark.usefixtures("disk_reader")
@pytest.mark.parametrize("flags", [[], ["--unordered", "--writes", "2"]], ids=["ordered", "unordered-writes"])
def test_disk_restores_prints_each_restore_and_the_rates(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         flags: list[str]) -> None:
    script = load_script("disk_restores")
    assert script.main(["--quick", "--dir", str(tmp_path), *flags]) == 0
    out = capsys.readouterr().out
    assert re.search(r"read ceiling [\d.]+ GB/s", out)
    (line,) = [x for x in out.splitlines() if x.startswith("round 0:")]
    ends = [float(x) for x in re.search(r"ends ([\d. ]+) ms", line).group(1).split()]  # type: ignore[union-attr]
    assert len(ends) == 4 and all(e > 0 for e in ends)
    assert "per restore" in line and "together" in line
    assert not list(tmp_path.iterdir())  # its tier's folder is gone
