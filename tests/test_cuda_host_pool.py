"""The exact-size pinned host pool without a GPU (a fake driver that registers ranges as
the real one does): memory the device may still write is never unmapped, a closed pool
is unregistered and unmapped, and a pool that cannot be mapped for lack of memory raises
``HostMemoryError``."""

from __future__ import annotations

import errno
import gc
import mmap
from typing import Any

import pytest
import torch

from aiokv.backends.cuda import host_pool
from aiokv.backends.cuda.host_pool import PinnedHostPool
from aiokv.errors import HostMemoryError, InvalidSpec, WorkerBroken
from tests.conftest import mapped


class _Registrations:
    """Registers ranges as the driver does: an overlapping one is refused."""

    def __init__(self) -> None:
        self.broken: Any = None
        self.ranges: dict[int, int] = {}

    def ensure_context(self) -> None:
        pass

    def host_register(self, address: int, nbytes: int) -> int:
        if any(a < address + nbytes and address < a + n for a, n in self.ranges.items()):
            raise RuntimeError("CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
        self.ranges[address] = nbytes
        return address

    def host_unregister(self, address: int) -> None:
        del self.ranges[address]


@pytest.mark.parametrize("how", ["abandoned", "closed after the context died"])
def test_pinned_memory_the_device_may_write_staysmapped(how: str) -> None:
    """Unmapped while registered, the range could be mapped again for something else, which
    the device would then write (seen on the H200: a dropped pool's bytes arrived in a new
    mapping at its address), and the new range would fail to register."""
    drv = _Registrations()
    pool = PinnedHostPool(8 << 20, drv)  # type: ignore[arg-type]
    address = pool.address
    pool.tensor.fill_(0x22)
    if how == "abandoned":
        pool.abandon()
    else:
        drv.broken = WorkerBroken("context lost")
        pool.close()
    del pool
    gc.collect()
    assert mapped(address) and address in drv.ranges
    drv.broken = None
    again = PinnedHostPool(8 << 20, drv)  # type: ignore[arg-type]
    assert again.address != address
    again.close()
    assert again.address not in drv.ranges


def test_a_closed_pool_is_unregistered_and_unmapped() -> None:
    drv = _Registrations()
    pool = PinnedHostPool(8 << 20, drv)  # type: ignore[arg-type]
    address = pool.address
    pool.close()
    del pool
    gc.collect()
    assert not drv.ranges and not mapped(address)


@pytest.mark.parametrize("failure", [OSError(errno.ENOMEM, "Cannot allocate memory"),
                                     OverflowError("cannot fit 'int' into an index-sized integer")])
def test_a_mapping_that_fails_raises_host_memory_error_and_registers_nothing(monkeypatch, failure) -> None:
    def refuse(*_: Any, **__: Any) -> mmap.mmap:
        raise failure

    monkeypatch.setattr(host_pool.mmap, "mmap", refuse)
    drv = _Registrations()
    with pytest.raises(HostMemoryError, match="fewer chunks") as info:
        PinnedHostPool(5 << 40, drv)  # type: ignore[arg-type]
    assert str(5 << 40) in str(info.value) and info.value.__cause__ is failure
    assert not drv.ranges


def test_a_registration_refused_for_lack_of_memory_unmaps_and_propagates() -> None:
    class Refusing(_Registrations):
        def host_register(self, address: int, nbytes: int) -> int:
            self.seen = address
            raise HostMemoryError(f"could not pin {nbytes} bytes of host memory: ask for fewer chunks")

    drv = Refusing()
    with pytest.raises(HostMemoryError, match="fewer chunks"):
        PinnedHostPool(8 << 20, drv)  # type: ignore[arg-type]
    gc.collect()
    assert not mapped(drv.seen) and not drv.ranges


def test_a_pool_of_no_bytes_is_bad_input() -> None:
    with pytest.raises(InvalidSpec, match="positive size"):
        PinnedHostPool(0, _Registrations())  # type: ignore[arg-type]


def test_a_pool_in_a_shared_file_is_pinned_seen_by_another_mapping_and_unnamed_at_close(tmp_path) -> None:
    """vLLM's scheduler maps the workers' pools to move blocks to lower tiers: the file's
    bytes are the registered memory's, and closing removes the name."""
    drv = _Registrations()
    path = tmp_path / "pool"
    pool = PinnedHostPool(3 * mmap.PAGESIZE + 5, drv, str(path))  # type: ignore[arg-type]
    assert pool.address in drv.ranges and drv.ranges[pool.address] == 4 * mmap.PAGESIZE
    pool.tensor[:] = torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as other:
        assert bytes(other[: pool.nbytes]) == pool.tensor.numpy().tobytes()
        other[7] = (int(pool.tensor[7]) + 1) % 256
        assert int(pool.tensor[7]) == other[7]
    address = pool.address
    pool.close()
    gc.collect()
    assert not path.exists() and not drv.ranges and not mapped(address)


def test_a_shared_pool_whose_registration_fails_leaves_no_file(tmp_path) -> None:
    class Refusing(_Registrations):
        def host_register(self, address: int, nbytes: int) -> int:
            raise HostMemoryError("could not pin: ask for fewer chunks")

    with pytest.raises(HostMemoryError):
        PinnedHostPool(8 << 20, Refusing(), str(tmp_path / "pool"))  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
