"""Host pools under a file name (``WorkerOptions.host_pool_file``): the same chunks seen by a
second mapping, a file made anew, a name removed only while it is still this pool's, a
filesystem too small refused at once, and bad names refused before anything is made."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
import torch

from aiokv import CanonicalKVCaches, SyncOffloadingWorker, WorkerOptions
from aiokv.backends.cpu import CpuHostPool
from aiokv.backends.shared_file import SharedFile
from aiokv.errors import HostMemoryError, InvalidSpec
from aiokv.specs import CPULoadStoreSpec, GPULoadStoreSpec


def test_a_worker_pool_in_a_file_is_what_another_mapping_reads(tmp_path) -> None:
    """A block stored by a worker whose pool is a shared file reads back byte for byte
    through a second mapping, and a block written through that mapping loads to the GPU
    side as written (the two directions vLLM's scheduler uses for lower tiers)."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randint(0, 256, (8, 2, 4096), dtype=torch.uint8, generator=gen)
    path = tmp_path / "pool"
    worker = SyncOffloadingWorker(CanonicalKVCaches.from_tensors([kv], block_dim=0), num_cpu_chunks=4,
                                  backend="cpu", options=WorkerOptions(host_pool_file=str(path)))
    chunk = worker.chunk_bytes
    assert worker.submit_store(1, GPULoadStoreSpec([5]), CPULoadStoreSpec([2]))
    worker.wait({1})
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as other:
        seen = np.frombuffer(other, dtype=np.uint8, count=4 * chunk).reshape(4, chunk)
        assert bytes(seen[2, : kv[5].numel()]) == kv[5].numpy().tobytes()
        fresh = np.random.default_rng(2).integers(0, 256, kv[0].numel(), dtype=np.uint8)
        seen[3, : fresh.size] = fresh
        del seen
    assert worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([0]))
    worker.wait({2})
    assert kv[0].numpy().tobytes() == fresh.tobytes()
    worker.shutdown()
    assert not path.exists()


def test_the_file_is_made_anew_and_a_new_file_of_that_name_is_left_alone(tmp_path) -> None:
    path = tmp_path / "pool"
    path.write_bytes(b"stale bytes of an earlier run")
    shared = SharedFile(str(path), 10)
    assert os.path.getsize(path) == mmap.PAGESIZE and shared.map[:5] == b"\0" * 5
    os.unlink(path)
    path.write_bytes(b"someone else's")
    shared.close()
    assert path.read_bytes() == b"someone else's"


def test_a_filesystem_too_small_is_refused_at_once(tmp_path, monkeypatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(HostMemoryError, match="shm-size"):
        CpuHostPool(1 << 20, str(tmp_path / "pool"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["relative/pool", "", 3])
def test_a_bad_file_name_is_refused_by_the_options(name) -> None:
    with pytest.raises(InvalidSpec, match="host_pool_file"):
        WorkerOptions(host_pool_file=name)


def test_a_missing_directory_is_refused_before_anything_is_made(tmp_path) -> None:
    with pytest.raises(InvalidSpec, match="directory does not exist"):
        CpuHostPool(4096, str(tmp_path / "nowhere" / "pool"))
