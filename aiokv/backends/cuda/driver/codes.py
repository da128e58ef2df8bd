"""Driver return codes and what they become: the one place a code turns into an aiokv error.

A sticky code (the context is unusable for the rest of the process) becomes ``WorkerBroken``,
a code that means the caller handed over something unusable becomes ``InvalidSpec``, and any
other failure ``CudaCallFailed``; the raw code stays as the error's ``__cause__`` (a
``DriverError``, which lives in ``aiokv.errors`` with every other error class).
"""

from __future__ import annotations

from cuda.bindings import driver as cu

from ....errors import CudaCallFailed, DriverError, InvalidSpec, WorkerBroken

__all__ = ["BAD_INPUT", "NOT_READY", "OK", "OUT_OF_MEMORY", "STICKY", "driver_error", "translate"]

OK = cu.CUresult.CUDA_SUCCESS
NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
OUT_OF_MEMORY = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

# Errors after which the context is unusable for the rest of the process.
STICKY = frozenset(
    int(getattr(cu.CUresult, name))
    for name in (
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_ASSERT",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "CUDA_ERROR_EXTERNAL_DEVICE",
        # cuda.h says these too leave the process unusable (226: Hopper's error containment).
        "CUDA_ERROR_CONTAINED",
        "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    )
    if hasattr(cu.CUresult, name)
)
# Errors that mean the caller handed us something unusable.
BAD_INPUT = frozenset(
    int(getattr(cu.CUresult, name))
    for name in (
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_INVALID_CONTEXT",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    )
    if hasattr(cu.CUresult, name)
)


def driver_error(code: int, what: str) -> DriverError:
    """The raw failure of call ``what``, named as the driver names its code."""
    return DriverError(code, what, error_name(code))


def error_name(code: int) -> str:
    try:
        return cu.CUresult(code).name
    except ValueError:
        return "CUDA_ERROR_UNKNOWN_CODE"


def translate(code: int, what: str) -> Exception:
    """The one place a driver code becomes an aiokv error (raised ``from`` the raw one)."""
    raw = driver_error(code, what)
    if code in STICKY:
        err: Exception = WorkerBroken(
            f"the CUDA context is broken ({raw}); every pending transfer failed. Restart the "
            "process: a sticky CUDA error cannot be cleared"
        )
    elif code in BAD_INPUT:
        err = InvalidSpec(f"CUDA rejected the request: {raw}")
    else:
        err = CudaCallFailed(f"CUDA call failed: {raw}", code)
    err.__cause__ = raw
    return err
