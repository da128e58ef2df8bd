"""The workers' shared pools on the memory filesystem (``integrations/vllm/shared_pool``):
a pool whose worker died before the scheduler mapped it holds its memory until someone
removes it; the next worker to start removes it, and nothing a live process still owns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aiokv.backends.shared_file import SharedFile
from aiokv.integrations.vllm.shared_pool import attach, claim, pool_file, publish, sweep

POOL = 1 << 16


def die_after(step: str, path: str) -> None:
    """A worker process that makes its pool at ``path`` and dies (no cleanup at all) after
    ``step``: "claimed" (say, while a large pool is being pinned) or "published"."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            claim(path)
            SharedFile(path, POOL)
            if step == "published":
                publish(path, rank=0, num_chunks=4, chunk_bytes=POOL // 4, blocks_per_chunk=1,
                        page_sizes=[[64]], page_offsets=[[0]])
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pools_of_dead_workers_are_removed_and_live_ones_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIOKV_SHM_DIR", str(tmp_path))
    dead_published, dead_claimed = pool_file("crashed", 0), pool_file("crashed", 1)
    die_after("published", dead_published)
    die_after("claimed", dead_claimed)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([Path(dead_published).name, Path(dead_published).name + ".json",
                           Path(dead_claimed).name, Path(dead_claimed).name + ".json"]), left
    live = pool_file("serving", 0)  # this process's pool, not mapped by its scheduler yet
    claim(live)
    pool = SharedFile(live, POOL)
    publish(live, rank=0, num_chunks=4, chunk_bytes=POOL // 4, blocks_per_chunk=1,
            page_sizes=[[64]], page_offsets=[[0]])
    other = tmp_path / "aiokv-elsewhere-rank0.pool"  # another pid namespace's (a container)
    other.write_bytes(b"x")
    (tmp_path / (other.name + ".json")).write_text(json.dumps({"pid": 2**22 - 1, "pidns": "pid:[1]"}))

    removed = sweep(str(tmp_path))
    assert sorted(removed) == sorted([dead_published, dead_published + ".json",
                                      dead_claimed, dead_claimed + ".json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(live).name, Path(live).name + ".json", other.name, other.name + ".json"])
    view = attach("serving", 1, 4)
    assert view is not None and not Path(live).exists()
    pool.close()


def test_a_claimed_pool_is_not_mapped_before_it_is_published(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AIOKV_SHM_DIR", str(tmp_path))
    path = pool_file("starting", 0)
    claim(path)
    assert attach("starting", 1, 4) is None


def test_a_description_that_cannot_be_written_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    import errno

    import aiokv.integrations.vllm.shared_pool as shared_pool

    def full(obj: object, f: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("AIOKV_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shared_pool.json, "dump", full)
    path = pool_file("full", 0)
    with pytest.raises(OSError, match="No space"):
        claim(path)
    assert list(tmp_path.iterdir()) == []
