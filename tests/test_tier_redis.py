"""RedisTier against real redis-server processes: byte-exact round trips, a store shared by
two processes, namespaces and layouts kept apart, corrupt values, a killed and restarted
server, AUTH, TLS and the per-process capacity. Every async test runs on asyncio, uvloop and
trio."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.redis_server import RedisServer, make_tls_files, need_redis, running

pytestmark = pytest.mark.timeout(60)

BLOCK = 3 * 4096 + 17  # odd on purpose: no alignment is assumed anywhere


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    need_redis()
    with running(RedisServer(tmp_path_factory.mktemp("redis"))) as started:
        assert isinstance(started, RedisServer)
        yield started


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server this test may kill, freeze and restart."""
    need_redis()
    with running(RedisServer(tmp_path / "redis")) as started:
        assert isinstance(started, RedisServer)
        yield started


@pytest.fixture(params=["thread", "asyncio"])
def client(request: pytest.FixtureRequest, anyio_backend: tuple[str, dict]) -> str:
    if request.param == "asyncio" and anyio_backend[0] != "asyncio":
        pytest.skip("redis-py's asyncio client runs on asyncio loops only")
    return str(request.param)


def fingerprint(block: int = BLOCK, extra: bytes = b"") -> bytes:
    from aiokv.cache.tiers import codec

    return codec.layout_fingerprint(block_bytes=block, page_sizes=[block], num_layers=1, extra=extra)


def keys_of(n: int, tag: str = "k") -> list[bytes]:
    from aiokv.cache.tiers import codec

    run = os.urandom(8)  # fresh keys per call: module-scoped servers outlive one test
    return [codec.key_bytes((tag, i, run)) for i in range(n)]


def payloads(n: int, block: int = BLOCK) -> list[bytes]:
    return [os.urandom(block) for _ in range(n)]


def buffers(n: int, block: int = BLOCK) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(block))) for _ in range(n)]


async def opened(url: str, fp: bytes | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    from aiokv.cache.tiers.redis import RedisTier

    tier = RedisTier(url, timeout=kwargs.pop("timeout", 2.0), **kwargs)  # type: ignore[arg-type]
    await tier.open(fp or fingerprint())
    return tier


@pytest.mark.anyio
async def test_round_trip_is_byte_exact(server: RedisServer, client: str) -> None:
    tier = await opened(server.url, namespace="rt", client=client, group_bytes=3 * BLOCK)
    try:
        keys, data = keys_of(10), payloads(10)
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 10
        absent = keys_of(1, "absent")[0]
        asked = [*keys[:4], absent, *keys[4:]]
        out = buffers(11)
        hits = await tier.read(asked, out)
        assert hits == [True] * 4 + [False] + [True] * 6
        for i, d in enumerate(data):
            assert bytes(out[i if i < 4 else i + 1]) == d
        assert await tier.exists(asked) == hits
        stats = tier.statistics()
        assert (stats.reads, stats.read_hits, stats.read_bytes) == (11, 10, 10 * BLOCK)
        assert (stats.writes, stats.write_bytes, stats.errors, stats.corrupt) == (10, 10 * BLOCK, 0, 0)
        assert (stats.blocks, stats.bytes_held) == (-1, -1)
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_large_blocks_and_typed_buffers(server: RedisServer) -> None:
    """2 MiB blocks (one round trip each) land in int16 views of the caller's memory."""
    block = 2 << 20
    tier = await opened(server.url, fingerprint(block), namespace="big")
    try:
        keys, data = keys_of(3, "big"), payloads(3, block)
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 3
        out = [memoryview(bytearray(block)).cast("h") for _ in range(3)]
        assert await tier.read(keys, out) == [True] * 3
        assert [o.tobytes() for o in out] == data
    finally:
        await tier.aclose()


def test_a_second_process_reads_what_the_first_stored(server: RedisServer) -> None:
    """Another interpreter writes through its own tier; this one restores the same bytes."""
    seed = int.from_bytes(os.urandom(4), "little")
    script = f"""
import random, anyio
from aiokv.cache.tiers import codec
from aiokv.cache.tiers.redis import RedisTier
async def main():
    fp = codec.layout_fingerprint(block_bytes={BLOCK}, page_sizes=[{BLOCK}], num_layers=1)
    tier = RedisTier({server.url!r}, namespace="shared")
    await tier.open(fp)
    rng = random.Random({seed})
    keys = [codec.key_bytes(("prefix", i)) for i in range(6)]
    ok = await tier.write(keys, [memoryview(rng.randbytes({BLOCK})) for _ in keys])
    await tier.aclose()
    assert all(ok), ok
anyio.run(main, backend="trio")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    import random

    from aiokv.cache.tiers import codec

    rng = random.Random(seed)
    expected = [rng.randbytes(BLOCK) for _ in range(6)]

    async def restore() -> list[bytes]:
        tier = await opened(server.url, namespace="shared")
        out = buffers(6)
        try:
            hits = await tier.read([codec.key_bytes(("prefix", i)) for i in range(6)], out)
        finally:
            await tier.aclose()
        assert hits == [True] * 6
        return [bytes(o) for o in out]

    assert anyio.run(restore) == expected


@pytest.mark.anyio
async def test_namespaces_and_layouts_never_exchange_bytes(server: RedisServer) -> None:
    a = await opened(server.url, namespace="tenant-a")
    b = await opened(server.url, namespace="tenant-b")
    other_layout = await opened(server.url, fingerprint(extra=b"another model"), namespace="tenant-a")
    try:
        keys = keys_of(4, "iso")
        assert all(await a.write(keys, [memoryview(d) for d in payloads(4)]))
        for tier in (b, other_layout):
            assert await tier.exists(keys) == [False] * 4
            assert await tier.read(keys, buffers(4)) == [False] * 4
        # Even a value copied under b's own key name (a collision, a misconfigured proxy)
        # fails b's header check: a miss counted as corrupt, never a's bytes.
        import redis

        raw = redis.Redis.from_url(server.url)
        try:
            raw.set(b.redis_key(keys[0]), raw.get(a.redis_key(keys[0])))
        finally:
            raw.close()
        assert await b.read(keys[:1], buffers(1)) == [False]
        assert b.statistics().corrupt == 1
    finally:
        for tier in (a, b, other_layout):
            await tier.aclose()


@pytest.mark.anyio
async def test_corrupt_values_are_misses(server: RedisServer) -> None:
    import redis

    tier = await opened(server.url, namespace="corrupt")
    raw = redis.Redis.from_url(server.url)
    try:
        keys = keys_of(6, "bad")
        assert all(await tier.write(keys, [memoryview(d) for d in payloads(6)]))
        names = [tier.redis_key(k) for k in keys]
        raw.setrange(names[0], len(raw.get(names[0])) - 5, b"\x00flip")  # payload bytes
        raw.setrange(names[1], 10, b"\xff")  # header bytes
        raw.set(names[2], raw.get(names[2])[:-1])  # truncated
        raw.append(names[3], b"tail")  # too long
        raw.delete(names[4])
        raw.lpush(names[4], b"not a string")  # WRONGTYPE: an error, not a hit
        hits = await tier.read(keys, buffers(6))
        assert hits == [False] * 5 + [True]
        stats = tier.statistics()
        assert (stats.corrupt, stats.errors, stats.read_hits) == (4, 1, 1)
    finally:
        raw.close()
        await tier.aclose()


@pytest.mark.anyio
async def test_killed_server_is_a_miss_and_the_tier_recovers(own_server: RedisServer, client: str) -> None:
    """The server is frozen while a batch is in flight, then killed: the batch misses within
    the timeout; once a server returns on the port the same tier object stores and reads."""
    import signal

    tier = await opened(own_server.url, namespace="faults", client=client, timeout=1.0, group_bytes=BLOCK)
    try:
        keys, data = keys_of(8, "fault"), payloads(8)
        assert all(await tier.write(keys, [memoryview(d) for d in data]))
        assert own_server.process is not None
        own_server.process.send_signal(signal.SIGSTOP)
        results: list[list[bool]] = []

        async def reader() -> None:
            results.append(await tier.read(keys, buffers(8)))

        start = time.monotonic()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                await anyio.sleep(0.2)
                own_server.kill()  # mid-batch: the request is sent, no reply will come
        assert results == [[False] * 8]
        assert time.monotonic() - start < 5
        errors = tier.statistics().errors
        assert errors >= 1
        with anyio.fail_after(10):
            assert await tier.read(keys, buffers(8)) == [False] * 8  # refused: still a miss
            assert await tier.exists(keys) == [False] * 8
            assert await tier.write(keys[:1], [memoryview(data[0])]) == [False]
        assert tier.statistics().errors > errors
        own_server.start()  # same port, empty store
        out = buffers(8)
        assert await tier.read(keys, out) == [False] * 8
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 8
        assert await tier.read(keys, out) == [True] * 8
        assert [bytes(o) for o in out] == data
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_a_stalled_server_times_out_as_misses(own_server: RedisServer) -> None:
    import signal

    tier = await opened(own_server.url, namespace="stall", timeout=0.3)
    try:
        keys, data = keys_of(3, "stall"), payloads(3)
        assert all(await tier.write(keys, [memoryview(d) for d in data]))
        assert own_server.process is not None
        own_server.process.send_signal(signal.SIGSTOP)
        try:
            with anyio.fail_after(5):
                assert await tier.read(keys, buffers(3)) == [False] * 3
        finally:
            own_server.process.send_signal(signal.SIGCONT)
        out = buffers(3)
        assert await tier.read(keys, out) == [True] * 3
        assert [bytes(o) for o in out] == data
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_a_cancelled_read_leaves_the_tier_usable(own_server: RedisServer, client: str) -> None:
    """Cancelled while the server is frozen mid-batch: the caller gets its cancellation back
    within the timeout (a worker thread is never abandoned while it may still write into the
    caller's buffers) and the next read, once the server runs again, hits byte-exact."""
    import signal

    tier = await opened(own_server.url, namespace="cancel", client=client, timeout=1.0, group_bytes=BLOCK)
    try:
        keys, data = keys_of(6, "cancel"), payloads(6)
        assert all(await tier.write(keys, [memoryview(d) for d in data]))
        assert own_server.process is not None
        own_server.process.send_signal(signal.SIGSTOP)
        try:
            got: list[list[bool]] = []
            with anyio.fail_after(10):
                with anyio.move_on_after(0.2) as scope:
                    got.append(await tier.read(keys, buffers(6)))
            # asyncio raises the cancellation at once; trio lets the shielded thread finish
            # (its socket timed out, so: all misses) and cancels at the next checkpoint.
            assert scope.cancelled_caught or got == [[False] * 6]
        finally:
            own_server.process.send_signal(signal.SIGCONT)
        out = buffers(6)
        with anyio.fail_after(10):
            assert await tier.read(keys, out) == [True] * 6
        assert [bytes(o) for o in out] == data
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_auth_through_the_url(tmp_path: Path) -> None:
    need_redis()
    with running(RedisServer(tmp_path / "auth", password="s3cret-pass")) as srv:
        assert isinstance(srv, RedisServer)
        good = await opened(srv.url, namespace="auth")
        wrong = await opened(srv.url.replace("s3cret-pass", "wrong"), namespace="auth")
        anonymous = await opened(f"redis://127.0.0.1:{srv.port}/0", namespace="auth")
        try:
            keys, data = keys_of(2, "auth"), payloads(2)
            assert await good.write(keys, [memoryview(d) for d in data]) == [True, True]
            for tier in (wrong, anonymous):
                assert await tier.read(keys, buffers(2)) == [False, False]
                assert await tier.write(keys, [memoryview(d) for d in data]) == [False, False]
                assert tier.statistics().errors >= 2
            out = buffers(2)
            assert await good.read(keys, out) == [True, True]
            assert [bytes(o) for o in out] == data
        finally:
            for tier in (good, wrong, anonymous):
                await tier.aclose()


@pytest.mark.anyio
async def test_a_wrong_password_is_logged_once_and_check_raises_the_reason(
        tmp_path: Path, client: str, caplog: pytest.LogCaptureFixture) -> None:
    """Counters alone left a wrong password silent: the first failure is logged with the
    server's reason (the password never), later ones are not repeated within the interval,
    and check=True makes open() raise TierError with that reason instead."""
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import TierError

    need_redis()
    with running(RedisServer(tmp_path / "auth", password="s3cret-pass")) as srv:
        assert isinstance(srv, RedisServer)
        wrong_url = srv.url.replace("s3cret-pass", "wrong-pass")
        anonymous_url = f"redis://127.0.0.1:{srv.port}/0"
        for url, reason in ((wrong_url, "WRONGPASS|invalid username-password"),
                            (anonymous_url, "NOAUTH|Authentication required")):
            with pytest.raises(TierError, match=reason) as caught:
                await RedisTier(url, check=True, client=client, timeout=2.0).open(fingerprint())
            assert "wrong-pass" not in str(caught.value)
            caplog.clear()
            with caplog.at_level("WARNING", logger="aiokv"):
                tier = await opened(url, namespace="auth", client=client)
                try:
                    keys = keys_of(2, "auth")
                    for _ in range(3):
                        assert await tier.read(keys, buffers(2)) == [False, False]
                        assert await tier.write(keys, buffers(2)) == [False, False]
                finally:
                    await tier.aclose()
            failing = [r for r in caplog.records if "failing" in r.getMessage()]
            assert len(failing) == 1, caplog.text
            assert re.search(reason, failing[0].getMessage())
            assert "wrong-pass" not in caplog.text
        good = RedisTier(srv.url, check=True, client=client, timeout=2.0)
        await good.open(fingerprint())  # the right password passes the check
        await good.aclose()


@pytest.mark.anyio
async def test_a_server_down_at_open_fails_the_check_and_recovery_is_logged(
        own_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import TierError

    own_server.kill()
    with pytest.raises(TierError, match=r"127\.0\.0\.1"):
        await RedisTier(own_server.url, check=True, timeout=1.0).open(fingerprint())
    with caplog.at_level("INFO", logger="aiokv"):
        tier = await opened(own_server.url, namespace="down", timeout=1.0)  # no check: opens
        try:
            keys, data = keys_of(2, "down"), payloads(2)
            assert await tier.write(keys, [memoryview(d) for d in data]) == [False, False]
            own_server.start()
            assert await tier.write(keys, [memoryview(d) for d in data]) == [True, True]
        finally:
            await tier.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failing" in m for m in messages) == 1
    assert sum("works again" in m for m in messages) == 1


@pytest.mark.anyio
@pytest.mark.parametrize(("other_dtype", "other_page", "shared"), [
    ("bfloat16", (4, 2, 16), True),  # the same layout: a prefix written once is found
    ("float16", (4, 2, 16), False),  # same bytes per block, another dtype
    ("bfloat16", (8, 1, 16), False),  # same bytes per block, twice the tokens per block
])
async def test_caches_share_redis_only_with_the_same_dtype_and_page_shape(
        server: RedisServer, other_dtype: str, other_page: tuple[int, ...], shared: bool) -> None:
    """The default fingerprint sees what the tensors are (dtype, page shape: tokens per
    block), not only their bytes: an fp16 and a bf16 model on one Redis never read each
    other's blocks as hits."""
    import torch

    from aiokv import AsyncOffloadingWorker, OffloadCache
    from aiokv.cache.tiers.redis import RedisTier
    from tests.conftest import make_layers

    tag = os.urandom(4).hex()
    keys = [f"{tag}-{i}" for i in range(4)]
    kv_a = make_layers(num_layers=2, num_blocks=8, page_shape=(4, 2, 16), dtype=torch.bfloat16)
    kv_b = make_layers(num_layers=2, num_blocks=8, page_shape=other_page,
                       dtype=getattr(torch, other_dtype), seed=1)
    async with AsyncOffloadingWorker(kv_a.kv, num_cpu_chunks=6, backend="cpu") as wa, \
            AsyncOffloadingWorker(kv_b.kv, num_cpu_chunks=6, backend="cpu") as wb:
        tier_a = RedisTier(server.url, write_through=True, timeout=2.0)
        tier_b = RedisTier(server.url, write_through=True, timeout=2.0)
        async with OffloadCache(wa, tiers=[tier_a], staging_chunks=2) as a, \
                OffloadCache(wb, tiers=[tier_b], staging_chunks=2) as b:
            assert (await a.offload(keys, [0, 1, 2, 3])).stored == 4
            await a.drain()
            assert await tier_a.exists([tier_a_key(k) for k in keys]) == [True] * 4
            found = await b.alookup(keys)
            assert int(found) == (4 if shared else 0)
            restored = await b.restore(keys, [4, 5, 6, 7])
            assert bool(restored) == shared
            if shared:
                for i in range(4):
                    assert torch.equal(kv_b.layers[0][:, 4 + i].view(torch.uint8),
                                       kv_a.layers[0][:, i].view(torch.uint8))


def tier_a_key(key: str) -> bytes:
    from aiokv.cache.tiers import codec

    return codec.key_bytes(key)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need_redis()
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    if files is None:
        pytest.skip("openssl could not make a test certificate")
    return files


@pytest.mark.anyio
async def test_tls_through_a_rediss_url(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    srv = RedisServer(tmp_path / "tls", password="tls-pass", tls=tls_files)
    try:
        srv.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS support: {exc}")
        raise
    try:
        assert srv.url.startswith("rediss://")
        tier = await opened(srv.url, namespace="tls")
        plain = await opened(srv.url.replace("rediss://", "redis://").split("?")[0], namespace="tls")
        try:
            keys, data = keys_of(3, "tls"), payloads(3)
            assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 3
            out = buffers(3)
            assert await tier.read(keys, out) == [True] * 3
            assert [bytes(o) for o in out] == data
            assert await plain.read(keys, buffers(3)) == [False] * 3  # no TLS: refused
        finally:
            await tier.aclose()
            await plain.aclose()
    finally:
        srv.stop()


@pytest.mark.anyio
async def test_capacity_bounds_what_this_process_keeps(server: RedisServer) -> None:
    tier = await opened(server.url, namespace="cap", capacity_bytes=3 * BLOCK, ttl=600)
    try:
        keys, data = keys_of(6, "cap"), payloads(6)
        assert await tier.write(keys[:3], [memoryview(d) for d in data[:3]]) == [True] * 3
        assert await tier.read(keys[:1], buffers(1)) == [True]  # key 0 is now the newest used
        assert await tier.write(keys[3:5], [memoryview(d) for d in data[3:5]]) == [True] * 2
        assert await tier.exists(keys[:5]) == [True, False, False, True, True]
        stats = tier.statistics()
        assert (stats.blocks, stats.bytes_held, stats.evictions) == (3, 3 * BLOCK, 2)
        # A batch larger than the whole capacity stores what fits, in order.
        assert await tier.write(keys[:4], [memoryview(d) for d in data[:4]]) == [True] * 3 + [False]
        assert tier.statistics().bytes_held == 3 * BLOCK
        ttl = int(server.cli("TTL", tier.redis_key(keys[0]).decode()))
        assert 0 < ttl <= 600
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_a_full_server_drops_writes_and_an_lru_server_evicts(tmp_path: Path) -> None:
    """maxmemory with noeviction: writes past it are refused (False, counted) and what was
    stored still reads; with allkeys-lru the server evicts old blocks, which read as plain
    misses, never as corrupt."""
    need_redis()
    args = ("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")  # ~1 MB is the base
    with running(RedisServer(tmp_path / "full", args=args)) as srv:
        assert isinstance(srv, RedisServer)
        tier = await opened(srv.url, namespace="full")
        try:
            keys, data = keys_of(400, "full"), payloads(400)
            stored = await tier.write(keys, [memoryview(d) for d in data])
            assert 0 < sum(stored) < 400
            assert tier.statistics().errors >= 400 - sum(stored)
            kept = [i for i, ok in enumerate(stored) if ok]
            out = buffers(len(kept))
            assert await tier.read([keys[i] for i in kept], out) == [True] * len(kept)
            assert [bytes(o) for o in out] == [data[i] for i in kept]
            srv.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
            assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 400
            hits = await tier.read(keys, buffers(400))
            assert 0 < sum(hits) < 400
            assert tier.statistics().corrupt == 0
        finally:
            await tier.aclose()


@pytest.mark.anyio
async def test_misuse_raises_and_io_trouble_does_not(server: RedisServer, anyio_backend: tuple) -> None:
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import InvalidSpec, UsageError

    for bad in ("localhost:6379", "http://127.0.0.1:1/", "unix+cluster:///tmp/x.sock"):
        with pytest.raises(InvalidSpec):
            RedisTier(bad)
    with pytest.raises(InvalidSpec):
        RedisTier("redis+cluster://127.0.0.1:1", cluster=False)
    with pytest.raises(InvalidSpec):
        RedisTier(server.url, capacity_bytes=0)
    tier = RedisTier(server.url)
    with pytest.raises(UsageError):
        await tier.read(keys_of(1), buffers(1))
    with pytest.raises(InvalidSpec):
        await tier.open(b"short")
    await tier.open(fingerprint())
    with pytest.raises(UsageError):
        await tier.open(fingerprint())
    assert (await tier.read([], []), await tier.write([], []), await tier.exists([])) == ([], [], [])
    with pytest.raises(InvalidSpec):
        await tier.read(keys_of(2), buffers(1))
    with pytest.raises(InvalidSpec):
        await tier.read(keys_of(1), [memoryview(bytes(BLOCK))])  # read-only
    with pytest.raises(InvalidSpec):
        await tier.write(keys_of(1), [memoryview(bytearray(2 * BLOCK))[::2]])  # strided
    await tier.aclose()
    with pytest.raises(UsageError):
        await tier.write(keys_of(1), buffers(1))
    if anyio_backend[0] == "trio":
        with pytest.raises(UsageError):
            await RedisTier(server.url, client="asyncio").open(fingerprint())
    # Nothing listens on this port: every call is a miss, fast, and counted.
    from tests.redis_server import free_port

    dead = await opened(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    try:
        with anyio.fail_after(10):
            assert await dead.read(keys_of(2), buffers(2)) == [False, False]
            assert await dead.write(keys_of(1), buffers(1)) == [False]
            assert await dead.exists(keys_of(3)) == [False] * 3
        assert dead.statistics().errors == 3
    finally:
        await dead.aclose()


@pytest.mark.parametrize("bad", [True, False, 1.5, "4096", 0, -1])
def test_counts_take_the_shared_integer_check(bad: object) -> None:
    """The disk tier's rule: an int, never a bool; capacity_bytes may also be None."""
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import InvalidSpec

    for name in ("capacity_bytes", "threads", "group_bytes"):
        with pytest.raises(InvalidSpec, match=name):
            RedisTier("redis://127.0.0.1:6379/0", **{name: bad})


@pytest.mark.parametrize("bad", [True, "5", 0, -1.0, float("nan"), float("inf")])
def test_seconds_are_positive_finite_numbers(bad: object) -> None:
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import InvalidSpec

    for name in ("timeout", "ttl"):
        with pytest.raises(InvalidSpec, match=name):
            RedisTier("redis://127.0.0.1:6379/0", **{name: bad})


def test_numpy_counts_are_accepted() -> None:
    import numpy as np

    from aiokv.cache.tiers.redis import RedisTier

    tier = RedisTier("redis://127.0.0.1:6379/0", capacity_bytes=np.int64(1 << 20), threads=np.int8(2))
    assert type(tier.capacity_bytes) is int and tier.capacity_bytes == 1 << 20


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:99999/0", "redis://127.0.0.1:abc/0", "redis://127.0.0.1:-1/0",
    "redis+cluster://127.0.0.1:70000", "rediss://h:6379/not-a-db", "redis://h:6379/0/1",
    "redis://h:6379/0?db=x", "redis://h:0/0", "redis://h/0?socket_timeout=soon",
])
def test_a_url_that_cannot_connect_is_refused_at_construction(url: str) -> None:
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import InvalidSpec

    with pytest.raises(InvalidSpec, match="Redis URL") as caught:
        RedisTier(url)
    assert "secret" not in str(caught.value)
    with pytest.raises(InvalidSpec, match="Redis URL") as caught:
        RedisTier(url.replace("://", "://user:secret@", 1))
    assert "secret" not in str(caught.value)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://127.0.0.1", "redis://u:p@h:1/15", "rediss://h:6380",
    "redis+cluster://h:7000", "unix:///tmp/redis.sock?db=2", "redis://[::1]:6379/0",
])
def test_good_urls_are_accepted(url: str) -> None:
    from aiokv.cache.tiers.redis import RedisTier

    RedisTier(url)


@pytest.mark.anyio
async def test_a_unix_socket_url_round_trips(tmp_path: Path) -> None:
    need_redis()
    sock = tmp_path / "redis.sock"
    with running(RedisServer(tmp_path / "unix", args=("--unixsocket", str(sock)))) as srv:
        assert isinstance(srv, RedisServer)
        tier = await opened(f"unix://{sock}?db=3", namespace="unix")
        try:
            keys, data = keys_of(3, "unix"), payloads(3)
            assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 3
            out = buffers(3)
            assert await tier.read(keys, out) == [True] * 3
            assert [bytes(o) for o in out] == data
            assert srv.cli("-n", "3", "DBSIZE") == "3"
        finally:
            await tier.aclose()


@pytest.mark.anyio
async def test_long_keys_share_a_batch_with_short_ones(server: RedisServer, client: str) -> None:
    from aiokv.cache.tiers import codec

    tier = await opened(server.url, namespace="long", client=client)
    try:
        run = os.urandom(8)
        keys = [b"s" + run, os.urandom((1 << 16) + 1), run * (1 << 17), b"x" * 1025 + run]
        data = payloads(len(keys))
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * len(keys)
        out = buffers(len(keys))
        assert await tier.read(keys, out) == [True] * len(keys)
        assert [bytes(o) for o in out] == data
        assert await tier.exists(keys) == [True] * len(keys)
        forged = codec.stored_key(keys[1])
        assert await tier.read([forged], buffers(1)) == [False]
        assert tier.statistics().errors == 0
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_a_capacity_below_one_block_is_refused(server: RedisServer) -> None:
    from aiokv.cache.tiers.redis import RedisTier
    from aiokv.errors import InvalidSpec

    with pytest.raises(InvalidSpec, match=rf"capacity_bytes={BLOCK - 1}.*{BLOCK}-byte block"):
        RedisTier(server.url, capacity_bytes=BLOCK - 1).check_block_bytes(BLOCK)
    RedisTier(server.url, capacity_bytes=BLOCK).check_block_bytes(BLOCK)
    RedisTier(server.url).check_block_bytes(BLOCK)  # no bound of its own: any block
    tier = await opened(server.url, namespace="tiny", capacity_bytes=BLOCK - 1)
    try:
        with pytest.raises(InvalidSpec, match="capacity_bytes"):
            await tier.write(keys_of(1), [memoryview(d) for d in payloads(1)])
        assert tier.statistics().writes == 0
    finally:
        await tier.aclose()


def test_without_the_package_construction_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokv.cache.tiers as tiers
    from aiokv.errors import MissingExtra

    monkeypatch.setitem(sys.modules, "redis", None)
    for name in ("redis", "redis_client", "redis_wire"):  # as if never imported
        monkeypatch.delitem(sys.modules, f"aiokv.cache.tiers.{name}", raising=False)
        monkeypatch.delattr(tiers, name, raising=False)
    with pytest.raises(MissingExtra, match=r"the 'redis' extra with python3 -m pip install -e '\.\[redis\]'"):
        tiers.RedisTier("redis://127.0.0.1:6379/0")


@pytest.mark.anyio
async def test_concurrent_batches_share_the_connections(server: RedisServer, client: str) -> None:
    """Many tasks reading and writing at once through one tier (more round trips than
    threads): every block lands byte-exact in its own task's buffers."""
    tier = await opened(server.url, namespace="many", client=client, threads=2, group_bytes=BLOCK)
    try:
        batches = [(keys_of(4, f"many{t}"), payloads(4)) for t in range(8)]
        failures: list[str] = []

        async def one(keys: list[bytes], data: list[bytes]) -> None:
            if not all(await tier.write(keys, [memoryview(d) for d in data])):
                failures.append("write")
            out = buffers(4)
            if await tier.read(keys, out) != [True] * 4 or [bytes(o) for o in out] != data:
                failures.append("read")

        async with anyio.create_task_group() as tg:
            for keys, data in batches:
                tg.start_soon(one, keys, data)
        assert failures == []
        assert tier.statistics().errors == 0
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_values_written_with_either_checksum_read_with_the_other(
        server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokv.cache.tiers import codec

    keys, data = keys_of(4, "crc"), payloads(4)
    first = await opened(server.url, namespace="crc")
    try:
        assert all(await first.write(keys[:2], [memoryview(d) for d in data[:2]]))
        monkeypatch.setattr(codec, "_crc32", codec._zlib_crc32)  # as without isal
        assert all(await first.write(keys[2:], [memoryview(d) for d in data[2:]]))
        out = buffers(4)
        assert await first.read(keys, out) == [True] * 4
        monkeypatch.undo()
        out2 = buffers(4)
        assert await first.read(keys, out2) == [True] * 4
        assert [bytes(o) for o in out] == [bytes(o) for o in out2] == data
    finally:
        await first.aclose()
