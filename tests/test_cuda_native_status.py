"""Which submit path a CUDA worker takes, and why, without a GPU: the native helper by
default where it is built (``AIOKV_NATIVE=0`` or ``WorkerOptions(native=False)`` turn it
off), the Python path where it is missing or refuses the driver (``native=True`` then
raises, on the CPU backend too), a value of ``AIOKV_NATIVE`` nobody understands refused or
warned about, and ``aiokv info`` says which path and why, and that the CPU backend never
uses the helper. A fresh interpreter that cannot import the helper falls back."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from aiokv.backends.cuda import native
from aiokv.backends.cuda.backend import CudaBackend
from aiokv.errors import InvalidSpec
from aiokv.info import collect_info
from aiokv.options import WorkerOptions


def _backend(native_option: bool | None, procs: Any) -> CudaBackend:
    """A CUDA backend's native choice alone, on a stand-in driver."""
    backend = object.__new__(CudaBackend)
    backend.options = WorkerOptions(native=native_option)
    backend.driver = SimpleNamespace(native_procs=procs)  # type: ignore[assignment]
    backend.native_table = None
    backend._open_native()
    return backend


def _fake_procs() -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
    return (0,) * 10, 13000, (0,) * 4, 0


@pytest.mark.parametrize(("env", "option", "used"), [
    (None, None, True), ("", None, True), ("1", None, True), ("on", None, True), ("0", None, False),
    ("off", None, False), (None, False, False), ("0", True, True), (None, True, True),
])
def test_the_option_and_the_environment_pick_the_path(monkeypatch: pytest.MonkeyPatch, env: str | None,
                                                      option: bool | None, used: bool) -> None:
    if native.helper() is None:
        pytest.skip("the native helper is not built here")
    if env is None:
        monkeypatch.delenv(native.ENV, raising=False)
    else:
        monkeypatch.setenv(native.ENV, env)
    usable, why = native.status(option)
    assert usable is used
    backend = _backend(option, _fake_procs)
    assert (backend.native_table is not None) is used
    assert why in backend.native_why
    if not used:
        assert native.ENV in why or "native=False" in why
        assert "disabled" in why


def test_without_the_helper_the_python_path_is_taken_and_native_true_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_WHY", "not built")
    monkeypatch.delenv(native.ENV, raising=False)
    assert native.status() == (False, "native helper not built")
    assert _backend(None, _fake_procs).native_table is None
    with pytest.raises(InvalidSpec, match=r"native=True.*not built"):
        _backend(True, _fake_procs)
    assert collect_info()["CUDA submit path"].startswith("python (native helper not built)")


def test_a_driver_the_helper_refuses_falls_back_unless_native_is_required(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if native.helper() is None:
        pytest.skip("the native helper is not built here")
    monkeypatch.setenv(native.ENV, "1")

    def bad() -> Any:
        return (0,) * 3, 13000, (0,) * 4, 0  # the wrong number of entry points

    backend = _backend(None, bad)
    assert backend.native_table is None and "refused" in backend.native_why
    with pytest.raises(InvalidSpec, match="refused"):
        _backend(True, bad)


def test_info_says_which_path_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.info import _submit_path

    gpu = True  # as on a GPU machine: what ``aiokv info`` prints there
    monkeypatch.setenv(native.ENV, "0")
    assert _submit_path(gpu) == "python (disabled by AIOKV_NATIVE=0)"
    monkeypatch.delenv(native.ENV)
    want = ("native issuer thread, jobs planned in C (native helper built; the default where it is)"
            if native.helper() else "python (native helper not built)")
    assert _submit_path(gpu) == want
    monkeypatch.setenv(native.ENV, "1")
    want = ("native issuer thread, jobs planned in C (native helper built; AIOKV_NATIVE=1)"
            if native.helper() else "python (native helper not built)")
    assert _submit_path(gpu) == want


@pytest.mark.parametrize("built", [True, False])
def test_info_on_a_machine_without_a_gpu_says_the_cpu_backend_never_uses_the_helper(
        monkeypatch: pytest.MonkeyPatch, built: bool) -> None:
    import aiokv.info

    monkeypatch.setattr(aiokv.info, "cuda_usable", lambda: False)
    if not built:
        monkeypatch.setattr(native, "_ext", None)
        monkeypatch.setattr(native, "_WHY", "not built")
    elif native.helper() is None:
        pytest.skip("the native helper is not built here")
    monkeypatch.setenv(native.ENV, "1")
    info = collect_info()
    assert info["backend (auto)"] == "cpu"
    assert info["CUDA submit path"].endswith(
        "; not used here: the CPU backend this machine runs makes no driver calls")
    monkeypatch.setenv(native.ENV, "0")
    assert "not used here" not in collect_info()["CUDA submit path"]


@pytest.mark.parametrize("value", ["2", "garbage", "yes please"])
def test_a_value_of_the_variable_nobody_understands_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                              value: str) -> None:
    """A CUDA worker refuses to start (the variable picks its path); ``aiokv info`` says
    why; a CPU worker, which the variable does not concern, starts with a warning."""
    import torch

    from aiokv import CanonicalKVCaches, SyncOffloadingWorker

    monkeypatch.setenv(native.ENV, value)
    with pytest.raises(InvalidSpec, match=f"AIOKV_NATIVE={value!r} is not understood"):
        native.status()
    with pytest.raises(InvalidSpec, match="not understood"):
        _backend(None, _fake_procs)
    assert native.status(False)[0] is False  # an explicit choice does not read it
    assert collect_info()["CUDA submit path"].startswith("refused: AIOKV_NATIVE=")
    kv = CanonicalKVCaches.from_tensors([torch.zeros(4, 64, dtype=torch.uint8)])
    with pytest.warns(RuntimeWarning, match="not understood.*CPU backend never uses"):
        SyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu").shutdown()


def test_native_true_on_the_cpu_backend_needs_the_helper_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/native.md: ``native=True`` raises ``InvalidSpec`` where the helper is missing,
    whatever the backend; where it is built the CPU backend takes the option (and makes no
    driver calls)."""
    import torch

    from aiokv import CanonicalKVCaches, SyncOffloadingWorker

    monkeypatch.delenv(native.ENV, raising=False)
    kv = CanonicalKVCaches.from_tensors([torch.zeros(4, 64, dtype=torch.uint8)])
    if native.helper() is not None:
        SyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu", options={"native": True}).shutdown()
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_WHY", "not built")
    with pytest.raises(InvalidSpec, match=r"native=True.*not built.*CPU backend never uses it"):
        SyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu", options={"native": True})
    SyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu").shutdown()  # the default: fine


def test_native_must_be_none_or_a_bool() -> None:
    with pytest.raises(InvalidSpec, match="native"):
        WorkerOptions(native=1)  # type: ignore[arg-type]
    assert WorkerOptions.coerce({"native": False}).native is False


def test_an_interpreter_that_cannot_import_the_helper_falls_back() -> None:
    """As on a machine installed without a compiler: the import fails, the path is Python."""
    code = ("import sys; sys.modules['aiokv.backends.cuda._native'] = None\n"
            "from aiokv.backends.cuda import native\n"
            "from aiokv.info import collect_info\n"
            "print(native.status(), collect_info()['CUDA submit path'])\n")
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout
    assert "(False, 'native helper not built')" in out and "python (native helper not built)" in out


def test_a_helper_built_from_other_sources_is_not_used() -> None:
    """An in-place build left from older sources (an editable install after a pull): its
    ``ABI`` differs from what this Python side speaks, so its rows could mean other calls.
    The path is Python, and ``aiokv info`` says the helper must be rebuilt."""
    code = ("import sys, types\n"
            "stale = types.ModuleType('aiokv.backends.cuda._native')\n"
            "stale.ABI, stale.WORDS = 0, 8\n"
            "stale.set_error_class = lambda cls: None\n"
            "sys.modules[stale.__name__] = stale\n"
            "from aiokv.backends.cuda import native\n"
            "from aiokv.info import collect_info\n"
            "print(native.status(), native.helper(), '|', collect_info()['CUDA submit path'])\n")
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout
    status, info = out.split("|")
    assert status.startswith("(False,") and "None" in status and "rebuild" in status
    assert info.strip().startswith("python (") and "rebuild" in info
