"""``aiokv bench serve`` as a new user meets it: ``--quick`` runs with no trace beside the
checkout (a slice of the Mooncake conversation trace ships in the package, with its
licence and source), bad options exit 2 before the model is built, and ``--help`` of each
kind of bench lists that kind's own options and defaults."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
from pathlib import Path

import pytest

import aiokv
from aiokv.__main__ import main
from aiokv.bench import cache as cache_bench
from aiokv.bench.serve import run as serve_run
from aiokv.bench.trace import FULL_TRACES, PACKAGED_TRACE, load_trace

REPO = Path(aiokv.__file__).resolve().parents[1]
DATA = PACKAGED_TRACE.parent


@pytest.fixture
def no_traces(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A machine with no Mooncake trace anywhere the bench looks (a fresh clone)."""
    empty = tmp_path / "nowhere"
    empty.mkdir()
    monkeypatch.delenv("AIOKV_TRACE_DIR", raising=False)
    monkeypatch.setattr(cache_bench, "_search_dirs", lambda: [empty])
    return tmp_path


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the model fails the test: bad options must be refused before it."""

    def built(*_a: object, **_k: object) -> None:
        raise AssertionError("the model was built before the options were checked")

    monkeypatch.setattr(serve_run, "LlamaModel", built)


# -- the trace slice in the package ------------------------------------------------------------


def test_the_trace_slice_ships_small_with_its_licence_and_source() -> None:
    assert PACKAGED_TRACE.is_file() and PACKAGED_TRACE.stat().st_size < 200_000
    requests = load_trace(PACKAGED_TRACE)
    assert len(requests) == 400 and all(r.hash_ids for r in requests)
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)
    licence = (DATA / "LICENSE-APACHE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    readme = (DATA / "README.md").read_text()
    assert "kvcache-ai/Mooncake" in readme and FULL_TRACES in readme and "first 400 lines" in readme


def test_the_slice_is_package_data_so_a_plain_install_has_it() -> None:
    """Every file of ``aiokv/bench/data`` is named by the package-data globs, so a wheel
    (not only an editable install) carries them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["aiokv.bench"]
    files = sorted(p.name for p in DATA.iterdir() if p.is_file())
    assert {"conversation_first400.jsonl", "LICENSE-APACHE", "README.md"} <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(f"data/{name}", g) for g in globs), name


def test_quick_serve_runs_on_the_slice_when_no_trace_is_found(no_traces: Path, capsys) -> None:
    out = no_traces / "serve.json"
    code = main(["bench", "serve", "--quick", "--requests", "4", "--warmup", "4", "--arms", "gpu",
                 "--decode-tokens", "2", "--tier-dir", str(no_traces), "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "shipped with aiokv" in err and FULL_TRACES in err
    meta = json.loads(out.read_text())["meta"]
    assert meta["workload"].startswith("conversation_first400")


def test_a_missing_trace_says_where_to_get_the_full_ones(no_traces: Path, capsys) -> None:
    assert main(["bench", "cache", "--quick"]) == 2
    assert FULL_TRACES in capsys.readouterr().err


# -- bad options exit 2 before the model is built ------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--trace", "/no/such/trace.jsonl"], "trace not found"),
    (["--requests", "300"], "holds 400 requests"),  # the slice is all there is here
    (["--gpu-blocks", "1"], "cannot hold the largest request"),
    (["--arms", "recompute,warp"], "--arms takes names"),
])
def test_bad_options_exit_2_before_the_model_is_built(argv, message, no_traces: Path, no_model: None,
                                                     capsys) -> None:
    assert main(["bench", "serve", "--quick", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_trace_line_that_is_no_request_exits_2_before_the_model(tmp_path: Path, no_model: None,
                                                                 capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    assert main(["bench", "serve", "--quick", "--trace", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


# -- help per kind ------------------------------------------------------------------------------


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    return " ".join(out.getvalue().split())  # argparse wraps lines: compare words


def test_serve_help_lists_its_own_options_and_their_defaults() -> None:
    text = _help(["bench", "serve", "--help"])
    assert text.startswith("usage: aiokv bench serve")
    for flag in ("--requests", "--warmup", "--segments", "--arms", "--mode", "--load", "--trace",
                 "--tier-dir", "--loop", "--plot", "--json", "--quick", "--redis-url", "--redis-server",
                 "--redis-blocks"):
        assert flag in text, flag
    assert "measured requests (default 400 on CUDA, 200 on the CPU and with --quick; prefix mode 100)" in text
    assert "(default: one per 25 measured requests)" in text
    assert "(default 0.5 on CUDA, 0.3 on the CPU and with --quick)" in text
    assert FULL_TRACES in text
    for other in ("--capacity", "--tiers"):  # bench cache's
        assert other not in text


def test_each_kind_has_its_own_help_and_bench_alone_lists_the_kinds() -> None:
    cache = _help(["bench", "cache", "--help"])
    assert "--capacity" in cache and "--tiers" in cache
    assert "--requests" not in cache and "--loop" not in cache
    transfer = _help(["bench", "transfer", "--help"])
    assert "--loop" in transfer and "--trace" not in transfer and "--requests" not in transfer
    assert "(default: auto)" in transfer
    bench = _help(["bench", "--help"])
    assert all(kind in bench for kind in ("transfer", "cache", "serve"))
    assert "`aiokv bench` alone runs `aiokv bench transfer`" in bench


def test_an_option_of_another_kind_is_named_as_such(capsys) -> None:
    assert main(["bench", "--quick", "--requests", "3"]) == 2  # transfer, the default kind
    assert "--requests is an option of `aiokv bench serve`" in capsys.readouterr().err
    assert main(["bench", "serve", "--capacity=5"]) == 2
    assert "--capacity is an option of `aiokv bench cache`" in capsys.readouterr().err
    assert main(["bench", "transfer", "--trace", "x"]) == 2
    assert "`aiokv bench cache` and `aiokv bench serve`" in capsys.readouterr().err
