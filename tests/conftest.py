"""Shared fixtures: KV caches filled with random bytes, and the event-loop matrix."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from aiokv import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from aiokv.backends.cpu import CpuCompletion
from aiokv.errors import WorkerClosed

LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(sys.platform == "win32", reason="uvloop has no Windows build"),
    ),
    pytest.param(("trio", {}), id="trio"),
]


# Native lanes a test made (``test_cuda_layers.make_lane``): their issuer threads are
# drained once it ended, so a load's later layers never run into the next test.
NATIVE_LANES: list[Any] = []


@pytest.fixture(autouse=True)
def _drain_native_lanes() -> Iterator[None]:
    yield
    lanes, NATIVE_LANES[:] = list(NATIVE_LANES), []
    for lane in lanes:
        if getattr(lane, "native", None) is not None:
            with contextlib.suppress(WorkerClosed):  # closed by the test: drained already
                lane.native.drain(10)


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict]:
    """Every ``@pytest.mark.anyio`` test runs on asyncio, uvloop and trio."""
    return request.param


def random_bytes_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill a tensor with random bytes (every dtype, no NaN special-casing needed)."""
    view = t.view(torch.uint8) if t.element_size() != 1 else t
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))
    return t


@dataclass
class KV:
    layers: list[torch.Tensor]
    kv: CanonicalKVCaches

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.layers]


def make_layers(
    num_layers: int = 4, num_blocks: int = 32, page_shape: tuple[int, ...] = (4, 2, 16),
    dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu",
) -> KV:
    """Per-layer ``(2, num_blocks, *page_shape)`` tensors (K and V pages), random bytes."""
    gen = torch.Generator().manual_seed(seed)
    layers = [
        random_bytes_(torch.empty(2, num_blocks, *page_shape, dtype=dtype), gen).to(device)
        for _ in range(num_layers)
    ]
    return KV(layers, CanonicalKVCaches.from_tensors(layers, block_dim=1))


def make_two_groups(seed: int = 1, device: str = "cpu") -> KV:
    """Two KV-cache groups with different page sizes and block counts (a hybrid model)."""
    gen = torch.Generator().manual_seed(seed)
    a = [random_bytes_(torch.empty(40, 256, dtype=torch.uint8), gen).to(device) for _ in range(3)]
    b = [random_bytes_(torch.empty(24, 96, dtype=torch.uint8), gen).to(device) for _ in range(2)]
    tensors = [CanonicalKVCacheTensor(t, 256) for t in a] + [CanonicalKVCacheTensor(t, 96) for t in b]
    groups = [
        [CanonicalKVCacheRef(i, 256) for i in range(3)],
        [CanonicalKVCacheRef(3, 96), CanonicalKVCacheRef(4, 64)],  # only 64 of 96 bytes move
    ]
    return KV(a + b, CanonicalKVCaches(tensors, groups))


@pytest.fixture
def kv4() -> KV:
    return make_layers()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes make NaNs, which ``torch.equal`` calls unequal)."""
    as_bytes = [t.contiguous().view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and torch.equal(*as_bytes)


def mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@pytest.fixture(params=["native", "python"])
def disk_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a disk tier opened in the test reads: its native reader (skipped where it
    is not built) and Python (``AIOKV_DISK_NATIVE=0``, as where it is not built)."""
    from aiokv.cache.tiers import disk_native

    native = request.param == "native"
    monkeypatch.setenv(disk_native.ENV, "1" if native else "0")
    if native and disk_native.reader() is None:
        pytest.skip(f"the native disk reader: {disk_native.status()}")
    return str(request.param)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB filesystem (tmpfs), so disk-tier writes hit a real ENOSPC (root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                              capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs to fill: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=10)


def copies_ending(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """A way to block the calling thread (a loop's included, which then does not poll)
    until ``n`` more copies have ended on the CPU backend."""
    ended = threading.Semaphore(0)
    finish = CpuCompletion._finish

    def counted(self: CpuCompletion, error: BaseException | None, elapsed: float | None) -> None:
        finish(self, error, elapsed)
        ended.release()

    monkeypatch.setattr(CpuCompletion, "_finish", counted)

    def wait(n: int) -> None:
        for _ in range(n):
            assert ended.acquire(timeout=10), "a copy did not end"

    return wait
