"""The error tree's own contract: every class lives in ``aiokv.errors`` and is exported, each
derives from the builtin a caller would already catch, and the messages say what failed.
(Which call raises which error is tested beside that call's module.)"""

from __future__ import annotations

import ast
import builtins
import inspect
import pickle
from pathlib import Path

import pytest

import aiokv
import aiokv.errors
from aiokv import TransferResult
from aiokv.errors import (
    AiokvError,
    CudaCallFailed,
    DriverError,
    DuplicateJob,
    HostMemoryError,
    InvalidSpec,
    KeyNotLoadable,
    MissingExtra,
    QueueFull,
    TierError,
    TransferFailed,
    UsageError,
    WorkerBroken,
    WorkerClosed,
)

ROOT = Path(__file__).resolve().parent.parent / "aiokv"

ERRORS = [obj for _, obj in inspect.getmembers(aiokv.errors, inspect.isclass)
          if issubclass(obj, BaseException) and obj.__module__ == "aiokv.errors"]


def test_errors_derive_from_the_builtins_callers_catch() -> None:
    assert issubclass(InvalidSpec, ValueError)
    assert issubclass(DuplicateJob, InvalidSpec)
    assert issubclass(KeyNotLoadable, InvalidSpec)
    assert issubclass(UsageError, RuntimeError)
    assert issubclass(WorkerClosed, UsageError)
    assert issubclass(QueueFull, UsageError)
    assert issubclass(WorkerBroken, RuntimeError)
    assert issubclass(HostMemoryError, MemoryError)
    assert issubclass(CudaCallFailed, RuntimeError)
    assert issubclass(TierError, OSError)
    assert issubclass(MissingExtra, UsageError) and issubclass(MissingExtra, ImportError)
    assert not issubclass(WorkerBroken, UsageError)  # the device failed, not the caller
    for cls in ERRORS:
        assert issubclass(cls, AiokvError), f"{cls.__name__} is outside the tree"


def test_every_error_class_is_listed_and_exported() -> None:
    names = {cls.__name__ for cls in ERRORS}
    assert names == set(aiokv.errors.__all__)
    for name in names:
        assert getattr(aiokv, name) is getattr(aiokv.errors, name), f"aiokv.{name} is not the tree's"
        assert name in aiokv.__all__


def test_every_public_error_is_defined_in_the_errors_module() -> None:
    for name in aiokv.__all__:
        obj = getattr(aiokv, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            assert obj.__module__ == "aiokv.errors", f"{name} is defined in {obj.__module__}"


def _exception_bases() -> set[str]:
    builtin = {name for name, obj in vars(builtins).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException)}
    return builtin | set(aiokv.errors.__all__)


def test_no_module_outside_errors_defines_an_exception_class() -> None:
    """Read from the source, so a class defined in a module nothing imports is caught too."""
    bases = _exception_bases()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            named = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases}
            if named & bases or any(n.endswith(("Error", "Exception")) for n in named):
                found.append(f"{path.relative_to(ROOT.parent)}: class {node.name}")
    assert found == [], "error classes belong in aiokv/errors.py"


def test_transfer_failed_carries_its_result_and_says_which_job() -> None:
    result = TransferResult(12, False, transfer_type=("GPU", "CPU"))
    err = TransferFailed(result, "OSError('simulated device fault')")
    assert err.result is result and err.result.job_id == 12 and not err.result.success
    assert err.reason == "OSError('simulated device fault')"
    assert str(err) == "job 12 failed: OSError('simulated device fault')"
    assert str(TransferFailed(result)) == "job 12 failed" and TransferFailed(result).reason == ""


def test_driver_error_names_the_call_and_its_code() -> None:
    raw = DriverError(2, "cuMemHostRegister", "CUDA_ERROR_OUT_OF_MEMORY")
    assert str(raw) == "cuMemHostRegister returned CUDA_ERROR_OUT_OF_MEMORY (2)"
    assert (raw.code, raw.what, raw.name) == (2, "cuMemHostRegister", "CUDA_ERROR_OUT_OF_MEMORY")
    err = HostMemoryError(f"could not pin 4096 bytes of host memory ({raw})")
    err.__cause__ = raw
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in str(err) and isinstance(err.__cause__, AiokvError)


def test_cuda_call_failed_keeps_the_driver_code() -> None:
    err = CudaCallFailed("CUDA call failed: cuStreamCreate returned CUDA_ERROR_NOT_PERMITTED (800)", 800)
    assert err.code == 800 and "CUDA_ERROR_NOT_PERMITTED" in str(err)


@pytest.mark.parametrize("cls", [InvalidSpec, DuplicateJob, KeyNotLoadable, UsageError, WorkerClosed,
                                 QueueFull, WorkerBroken, HostMemoryError, TierError])
def test_plain_errors_keep_their_message_and_pickle(cls: type[AiokvError]) -> None:
    err = cls("what was wrong, and what to do")
    assert str(err) == "what was wrong, and what to do"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and str(again) == str(err)
