"""RedisTier on a real three-node Redis Cluster on loopback: keys spread over every node's
slots, batches split per node, byte-exact under asyncio, uvloop and trio."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisCluster, need_redis, running
from tests.test_tier_redis import buffers, keys_of, opened, payloads

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    need_redis()
    with running(RedisCluster(tmp_path_factory.mktemp("cluster"))) as started:
        assert isinstance(started, RedisCluster)
        yield started


@pytest.fixture(params=["thread", "asyncio"])
def client(request: pytest.FixtureRequest, anyio_backend: tuple[str, dict]) -> str:
    if request.param == "asyncio" and anyio_backend[0] != "asyncio":
        pytest.skip("redis-py's asyncio client runs on asyncio loops only")
    return str(request.param)


@pytest.mark.anyio
async def test_cluster_round_trip_touches_every_node(cluster: RedisCluster, client: str) -> None:
    namespace = f"cluster-{client}"
    tier = await opened(cluster.url, namespace=namespace, client=client, group_bytes=1 << 20)
    try:
        assert tier.cluster
        keys, data = keys_of(40, namespace), payloads(40)
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 40
        names = {tier.redis_key(k).decode() for k in keys}
        for node in cluster.nodes:  # every node holds some of this batch's keys
            held = set(node.cli("--scan", "--pattern", f"{next(iter(names))[:39]}*").split())
            assert held & names, f"node {node.port} holds none of the batch"
        absent = keys_of(2, "nowhere")
        asked = [*keys, *absent]
        out = buffers(42)
        assert await tier.read(asked, out) == [True] * 40 + [False] * 2
        assert [bytes(o) for o in out[:40]] == data
        assert await tier.exists(asked) == [True] * 40 + [False] * 2
        stats = tier.statistics()
        assert (stats.errors, stats.corrupt, stats.read_hits) == (0, 0, 40)
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_cluster_keyword_matches_the_scheme(cluster: RedisCluster) -> None:
    url = cluster.url.replace("redis+cluster://", "redis://")
    tier = await opened(url, namespace="kw", cluster=True)
    try:
        keys, data = keys_of(6, "kw"), payloads(6)
        assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 6
        out = buffers(6)
        assert await tier.read(keys, out) == [True] * 6
        assert [bytes(o) for o in out] == data
    finally:
        await tier.aclose()


@pytest.mark.anyio
async def test_a_dead_node_costs_only_its_own_keys(tmp_path: Path, anyio_backend: tuple[str, dict]) -> None:
    """One master killed: its keys miss (counted as errors) while the other nodes' keys
    still restore byte-exact, without waiting; restarted (empty), the same tier writes and
    reads on it again."""
    import time

    import anyio

    if anyio_backend[1]:
        pytest.skip("uvloop drives the same thread client as asyncio; a cluster restart is slow")
    need_redis()
    with running(RedisCluster(tmp_path / "cluster")) as started:
        assert isinstance(started, RedisCluster)
        tier = await opened(started.url, namespace="dead-node", timeout=1.0)
        try:
            keys, data = keys_of(30, "dead"), payloads(30)
            assert all(await tier.write(keys, [memoryview(d) for d in data]))
            victim = started.nodes[2]
            on_victim = set(victim.cli("--scan", "--pattern", "aiokv:*").split())
            assert on_victim
            lost = [tier.redis_key(k).decode() in on_victim for k in keys]
            victim.kill()
            out = buffers(30)
            begin = time.monotonic()
            with anyio.fail_after(10):
                hits = await tier.read(keys, out)
            assert time.monotonic() - begin < 5
            assert hits == [not gone for gone in lost]
            assert await tier.exists(keys) == hits  # the live nodes still answer
            assert all(bytes(o) == d for o, d, hit in zip(out, data, hits) if hit)
            assert tier.statistics().errors >= sum(lost)
            victim.start()
            deadline = time.monotonic() + 20
            while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in started.nodes):
                assert time.monotonic() < deadline, "the cluster did not recover"
                await anyio.sleep(0.05)
            assert await tier.write(keys, [memoryview(d) for d in data]) == [True] * 30
            out = buffers(30)
            assert await tier.read(keys, out) == [True] * 30
            assert [bytes(o) for o in out] == data
        finally:
            await tier.aclose()
