"""The host side of a CUDA submit, measured without a GPU: a CUDA worker whose every
driver entry point is a C function that does nothing and succeeds (the native helper's
``FAKES``), so what a submit costs is aiokv's own work alone, on either submit path.

``noop_cuda()`` makes ``backend="cuda"`` build such a worker from CPU tensors: the Python
path calls the no-ops through the driver facade's ctypes bindings, the native path through
the helper's table (its issuer and waiter threads included), and copies move no bytes.
Events read as complete at once, so a job ends as soon as its program has been issued. The
staged strategy gets a CPU staging ring and a page table that is never uploaded.

``host_figures`` times the host side of a submit (docs/performance.md, "Host side"): a
per-layer job (128 blocks of 64 pages of 32 KiB, staged) and a 1-block job on each path,
and, where a C compiler is at hand, how many times a submit lets the GIL go: a child
process runs the submits with a shim in ``LD_PRELOAD`` that counts the submitting
thread's calls of ``PyEval_SaveThread`` (every GIL release: ctypes, numpy, blocking calls
alike). Needs the native helper built for the native rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec, SyncOffloadingWorker
from ..backends.cuda import native
from ..backends.cuda.backend import CudaBackend
from ..backends.cuda.driver import Driver
from ..backends.cuda.driver.batch import holding_gil
from ..backends.cuda.lane import CudaLane
from ..backends.cuda.staged import SLOTS, StagedCopy
from ..options import WorkerOptions

__all__ = ["CALLER_STREAM", "NoopCudaBackend", "NoopDriver", "host_figures", "noop_cuda"]

CALLER_STREAM = 0x7
_VP, _SZ, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


def _fakes() -> dict[str, int]:
    ext = native.helper()
    if ext is None:
        raise RuntimeError("the no-op driver needs the native helper built (python setup.py build_ext)")
    return dict(ext.FAKES)


class NoopDriver(Driver):
    """``Driver`` with every entry point a C no-op (bound the way the real ones are).
    ``pitched``: it has 2-D batches (``cuMemcpy3DBatchAsync``), as CUDA 12.8+ drivers do."""

    def __init__(self, device_index: int = 0, pitched: bool = False) -> None:  # no cuInit: nothing is real
        fakes = _fakes()
        noop = fakes["noop"]
        self.device_index = device_index
        self._local = threading.local()
        self.broken = None
        self.driver_version = 13000
        self.priority_low, self.priority_high = 0, -1
        self._pool_lock = threading.Lock()
        self._event_pool, self._sync_pool, self._timing_pool, self._all_events = [], [], [], []
        self.batch_kind = "batch13"
        self._batch_fn = ctypes.CFUNCTYPE(_INT, _VP, _VP, _VP, _SZ, _VP, _VP, _SZ, _VP)(noop)
        pitched_proto = ctypes.CFUNCTYPE(_INT, _SZ, _VP, ctypes.c_ulonglong, _VP)
        self._batch3d_fn = pitched_proto(noop) if pitched else None
        self._batch_fn_gil = holding_gil(self._batch_fn)
        self._batch3d_fn_gil = holding_gil(self._batch3d_fn)
        self._event_sync = ctypes.CFUNCTYPE(_INT, _VP)(noop)
        self._host_func = ctypes.PYFUNCTYPE(_INT, _VP, _VP, _VP)(fakes["host_func_now"])
        self._record_fn = ctypes.PYFUNCTYPE(_INT, _VP, _VP)(noop)
        self._wait_fn = ctypes.PYFUNCTYPE(_INT, _VP, _VP, ctypes.c_uint)(noop)
        self._query_fn = ctypes.PYFUNCTYPE(_INT, _VP)(noop)
        ui = ctypes.c_uint
        self._launch_fn = ctypes.PYFUNCTYPE(_INT, _VP, ui, ui, ui, ui, ui, ui, ui, _VP, _VP, _VP)(noop)
        self._memcpy_fn = ctypes.PYFUNCTYPE(_INT, ctypes.c_uint64, ctypes.c_uint64, _SZ, _VP)(noop)
        self._modules = []
        self.max_pitch = 1 << 21
        self._attrs, self._attr_ptrs = {}, {}
        self._first_attr, self._fail_idx = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._first_attr_at = ctypes.addressof(self._first_attr)
        self._fail_idx_at = ctypes.addressof(self._fail_idx)
        self.context = 0
        self._handles = 0x1000
        self._fakes = fakes

    def _handle(self) -> int:
        self._handles += 16
        return self._handles

    def ensure_context(self) -> None:
        pass

    def create_stream(self, high_priority: bool = False) -> int:
        return self._handle()

    def destroy_stream(self, stream: Any) -> None:
        pass

    def create_event(self, timing: bool = False, blocking: bool = False) -> int:
        event = self._handle()
        with self._pool_lock:
            self._all_events.append(event)
        return event

    def wrap_event(self, handle: int) -> int:
        return int(handle)

    def elapsed(self, start: Any, stop: Any) -> float | None:
        return 1e-6

    def stream_synchronize(self, stream: Any) -> None:
        pass

    def host_register(self, address: int, nbytes: int) -> int:
        return address

    def host_unregister(self, address: int) -> None:
        pass

    def allocation_base(self, address: int) -> int:
        return address

    def load_function(self, image: bytes, name: bytes) -> int:
        return 0xF00D

    def _attr_at(self, stream_ordered: bool, to_host: bool | None) -> int:
        return 0xA0 + int(stream_ordered) + 2 * bool(to_host)

    def native_procs(self) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
        noop = self._fakes["noop"]
        procs = [noop] * 10
        procs[7] = self._fakes["event_create"]  # cuEventCreate: a handle the waiter can use
        return tuple(procs), 13000, tuple(self._attr_at(bool(f & 1), bool(f & 2)) for f in range(4)), 0

    def close(self) -> None:
        with self._pool_lock:
            self._all_events, self._event_pool, self._sync_pool, self._timing_pool = [], [], [], []


class NoopCudaBackend(CudaBackend):
    """``CudaBackend`` over a ``NoopDriver``, for CPU tensors (see the module doc)."""

    pitched = False  # what ``noop_cuda(pitched=...)`` asks of its driver

    def __init__(self, kv: CanonicalKVCaches, options: Any = None) -> None:  # no device to find
        self.options = WorkerOptions.coerce(options)
        self.torch_device = torch.device("cpu")
        self.driver = NoopDriver(pitched=self.pitched)
        self._lanes: list[CudaLane] = []
        self._capture_stream = None
        self.native_table = None
        self.native_why = ""
        self.plans_ids = False
        self._open_native()

    def check_caches(self, kv: CanonicalKVCaches) -> None:
        pass

    def _waitable(self, after: Any) -> tuple[str, int] | None:
        if after is None:
            return "stream", CALLER_STREAM  # the caller's "current stream"
        return super()._waitable(after)

    def open_lane(self, *args: Any, **kwargs: Any) -> Any:
        lane: Any = super().open_lane(*args, **kwargs)
        strategy = lane._strategy
        if isinstance(strategy, StagedCopy):  # a CPU ring; the page table is never uploaded
            strategy.staging = torch.empty(SLOTS * strategy.slot_bytes, dtype=torch.uint8)
            strategy.kernel.upload = _fake_upload(strategy)  # type: ignore[method-assign]
        return lane


def _fake_upload(strategy: StagedCopy) -> Any:
    def upload(pages: np.ndarray, stream: Any, keep: bool = False) -> int:
        drv = strategy.kernel.driver  # what the real upload calls: a copy, then a record
        drv.memcpy(0xDE00, 0xDF00, pages.size * 8, stream)  # no bytes move: made-up addresses
        drv.record(strategy.joined, stream)
        return 0xDE00

    return upload


@contextlib.contextmanager
def noop_cuda(pitched: bool = False) -> Iterator[None]:
    """While inside, ``backend="cuda"`` builds a ``NoopCudaBackend`` (whose driver has 2-D
    batches with ``pitched``)."""
    from .. import core

    real = core.resolve_backend
    backend = type("NoopCudaBackend", (NoopCudaBackend,), {"pitched": pitched})

    def resolve(name: str, kv: CanonicalKVCaches, options: Any = None) -> Any:
        if name == "cuda":
            return backend(kv, options)
        return real(name, kv, options)

    core.resolve_backend = resolve
    try:
        yield
    finally:
        core.resolve_backend = real


# -- figures -------------------------------------------------------------------------------

LAYERS, BLOCKS, JOB_BLOCKS, CHUNKS = 32, 1024, 128, 512


def per_layer_kv() -> CanonicalKVCaches:
    """Llama-8B-shaped per-layer caches: 32 layers of K and V pages of 32 KiB (not touched:
    the memory is only reserved)."""
    tensors = [torch.empty(2, BLOCKS, 16, 8, 128, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return CanonicalKVCaches.from_tensors(tensors, block_dim=1)


def tiny_kv() -> CanonicalKVCaches:
    return CanonicalKVCaches.from_tensors([torch.empty(64, 4096, dtype=torch.uint8)])


def _submit_times(worker: SyncOffloadingWorker, jobs: list[tuple[Any, Any]], reps: int) -> list[float]:
    out = []
    for i in range(reps):
        blocks, chunks = jobs[i % len(jobs)]
        t0 = time.perf_counter()
        worker.submit_store(i, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
        out.append(time.perf_counter() - t0)
        worker.wait([i])
        worker.get_finished()
    return out


_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
static __thread long releases;
void *PyEval_SaveThread(void)
{
    static void *(*real)(void);
    if (real == 0)
        real = (void *(*)(void))dlsym(RTLD_NEXT, "PyEval_SaveThread");
    releases++;
    return real();
}
long aiokv_gil_releases(void) { return releases; }
"""


def _releases_here(worker: SyncOffloadingWorker, jobs: list[tuple[Any, Any]], reps: int) -> float:
    """Mean GIL releases per submit on this thread (inside the ``LD_PRELOAD`` shim)."""
    count = ctypes.PyDLL(None).aiokv_gil_releases  # its calls keep the GIL
    count.restype = ctypes.c_long
    total = 0
    for i in range(reps):
        blocks, chunks = jobs[i % len(jobs)]
        spec_g, spec_c = GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks)
        before = count()
        worker.submit_store(10_000 + i, spec_g, spec_c)
        total += count() - before
        worker.wait([10_000 + i])
        worker.get_finished()
    return total / reps


def gil_releases(reps: int = 50) -> dict[str, dict[str, float]] | None:
    """Per path, GIL releases per submit of the per-layer and the 1-block job, counted in a
    child process (see the module doc); None without a C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, shim = os.path.join(tmp, "shim.c"), os.path.join(tmp, "shim.so")
        with open(source, "w") as fh:
            fh.write(_SHIM)
        if subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", shim, source, "-ldl"],
                          capture_output=True).returncode != 0:
            return None
        # After whatever is preloaded already (a sanitizer's runtime must come first).
        env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, (os.environ.get("LD_PRELOAD"), shim)))}
        child = f"from aiokv.bench.hostside import _gil_child; _gil_child({reps})"
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env,
                             check=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def _gil_child(reps: int) -> None:
    def count(w: SyncOffloadingWorker, jobs: list[tuple[Any, Any]]) -> dict[str, float]:
        return {"GIL releases per submit": _releases_here(w, jobs, reps)}

    print(json.dumps(_measure(reps, count)))


def _jobs() -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
    rng = np.random.default_rng(0)
    layer_jobs = [(rng.choice(BLOCKS, JOB_BLOCKS, replace=False),
                   rng.choice(CHUNKS, JOB_BLOCKS, replace=False)) for _ in range(4)]
    tiny_jobs: list[tuple[Any, Any]] = [([i % 64], [(i * 7) % 64]) for i in range(16)]
    return layer_jobs, tiny_jobs


def _measure(reps: int, figures_of: Any) -> dict[str, dict[str, float]]:
    """``figures_of(worker, jobs)`` per path and job kind, after a warm-up."""
    layer_jobs, tiny_jobs = _jobs()
    kv, small = per_layer_kv(), tiny_kv()
    out: dict[str, dict[str, float]] = {}
    paths = [("python", False)] + ([("native", True)] if native.helper() is not None else [])
    with noop_cuda():
        for name, flag in paths:
            figures: dict[str, float] = {}
            for label, caches, chunks, jobs in (("per-layer", kv, CHUNKS, layer_jobs),
                                                 ("1-block", small, 64, tiny_jobs)):
                w = SyncOffloadingWorker(caches, num_cpu_chunks=chunks, backend="cuda",
                                         options={"native": flag})
                try:
                    _submit_times(w, jobs, 20)  # warm-up
                    figures.update({f"{label} {key}": value for key, value in figures_of(w, jobs).items()})
                finally:
                    w.shutdown()
            out[name] = figures
    return out


def host_figures(reps: int = 400) -> dict[str, dict[str, float]]:
    """Per path ("python", "native"): submit p50 / p10 in microseconds of the per-layer
    staged job and of the 1-block job, and (with a C compiler) GIL releases per submit."""

    def timed(w: SyncOffloadingWorker, jobs: list[tuple[Any, Any]]) -> dict[str, float]:
        times = _submit_times(w, jobs, reps)
        return {"submit p50 us": statistics.median(times) * 1e6,
                "submit p10 us": float(np.percentile(times, 10)) * 1e6}

    out = _measure(reps, timed)
    releases = gil_releases()
    for path, figures in (releases or {}).items():
        out[path].update(figures)
    return out


if __name__ == "__main__":
    for path, figures in host_figures().items():
        for key, value in figures.items():
            print(f"{path:<7} {key:<36} {value:10.2f}")
