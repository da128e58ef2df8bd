"""The tier ceilings of the bench: plain reads of files and plain redis-py GETs, measured
and cleaned up after, on a real directory and a real redis-server."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import anyio
import pytest

from aiokv.bench.ceilings import (
    disk_io_size,
    disk_read_ceiling,
    raw_read_ceiling,
    read_files_ceiling,
    redis_get_ceiling,
)
from aiokv.cache.tiers.codec import layout_fingerprint
from aiokv.cache.tiers.disk import DiskTier
from aiokv.cache.tiers.disk_io import ALIGN
from aiokv.errors import InvalidSpec, UsageError
from tests.redis_server import RedisServer, need_redis, running

BLOCK = 3 * ALIGN + 123


@pytest.mark.anyio
async def test_raw_read_ceiling_measures_and_cleans_up(tmp_path: Path) -> None:
    for direct in (None, False):
        gbps = await anyio.to_thread.run_sync(partial(
            raw_read_ceiling, str(tmp_path), 3 * ALIGN + 5, 4, 2 * ALIGN, direct=direct,
            threads=2, rounds=1))
        assert gbps > 0
    assert os.listdir(tmp_path) == []
    with pytest.raises(InvalidSpec):
        raw_read_ceiling(str(tmp_path), 0, 4)
    with pytest.raises(InvalidSpec):
        read_files_ceiling([], BLOCK, direct=False)


@pytest.mark.anyio
async def test_a_tiers_own_files_measure_its_ceiling(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=8 * BLOCK)
    await tier.open(layout_fingerprint(block_bytes=BLOCK))
    with pytest.raises(UsageError):
        await disk_read_ceiling(tier, 4)
    await tier.write([b"k1", b"k2"], [memoryview(os.urandom(BLOCK)) for _ in range(2)])
    before = sorted(os.listdir(tier.directory))
    assert await disk_read_ceiling(tier, 4, rounds=1) > 0
    assert sorted(os.listdir(tier.directory)) == before
    with pytest.raises(InvalidSpec):
        await disk_read_ceiling(tier, 0)
    size = disk_io_size(BLOCK)
    assert size % ALIGN == 0 and size > BLOCK
    assert os.path.getsize(os.path.join(tier.directory, next(n for n in before if n.endswith(".kv")))) == size
    await tier.aclose()


def test_redis_get_ceiling_measures_and_cleans_up(tmp_path: Path) -> None:
    need_redis()
    with running(RedisServer(tmp_path / "redis")) as server:
        assert isinstance(server, RedisServer)
        before = server.cli("DBSIZE")
        rate = anyio.run(redis_get_ceiling, server.url, 1 << 16, 8)
        assert rate > 0
        assert server.cli("DBSIZE") == before
        with pytest.raises(InvalidSpec):
            anyio.run(redis_get_ceiling, server.url, 0, 8)
