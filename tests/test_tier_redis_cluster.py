"""RedisTier on a real three-node Redis Cluster on loopback: keys spread over every node's
slots, batches split per node, byte-exact under asyncio, uvloop and trio."""

from __future__ import annotations

from collections.abc import Iterator

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
