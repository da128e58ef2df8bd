"""``aiokv_tiers``: tier URLs read into tiers, and every bad one refused at start with a
message that names the URL and what to write instead (no vLLM needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiokv.errors import InvalidSpec
from aiokv.integrations.vllm import PluginOptions
from aiokv.integrations.vllm.tier_urls import parse_size, parse_tier_urls


def test_a_disk_url_builds_a_disk_tier_with_its_keywords(tmp_path: Path) -> None:
    [tier] = parse_tier_urls([f"file://{tmp_path}/kv?capacity=2GiB&io_threads=2&fsync=1&direct=auto"])
    assert tier.kind == "disk" and tier.target == str(tmp_path / "kv")
    assert tier.options == {"capacity_bytes": 2 << 30, "io_threads": 2, "fsync": True, "direct": None}
    built = tier.build()
    assert type(built).__name__ == "DiskTier" and built.capacity_bytes == 2 << 30
    assert not tier.write_through


def test_a_redis_url_keeps_redis_py_options_and_takes_ours() -> None:
    pytest.importorskip("redis")
    [tier] = parse_tier_urls(["redis://:s3cret@127.0.0.1:6390/2?namespace=llama&capacity=1e9&ttl=60"
                              "&write_through=1&socket_keepalive=true"])
    assert tier.kind == "redis" and tier.write_through
    assert tier.options == {"capacity_bytes": 10**9, "namespace": "llama", "ttl": 60.0, "write_through": True}
    assert tier.target == "redis://:s3cret@127.0.0.1:6390/2?socket_keepalive=true"
    assert "s3cret" not in tier.shown
    built = tier.build()
    assert built.remote and built.capacity_bytes == 10**9


def test_plugin_options_read_the_tiers(tmp_path: Path) -> None:
    opts = PluginOptions.from_extra_config({"aiokv_tiers": [f"file://{tmp_path}?capacity=64MiB"]})
    assert [t.kind for t in opts.tiers] == ["disk"]
    assert PluginOptions.from_extra_config({}).tiers == ()


@pytest.mark.parametrize(("size", "value"), [("64GiB", 64 << 30), ("500MB", 500 * 10**6), ("1e9", 10**9),
                                             ("4096", 4096), ("1.5KiB", 1536)])
def test_sizes(size: str, value: int) -> None:
    assert parse_size(size, "capacity") == value


@pytest.mark.parametrize("size", ["64G", "-1", "0", "1.3", "lots", ""])
def test_bad_sizes(size: str) -> None:
    with pytest.raises(InvalidSpec, match="capacity"):
        parse_size(size, "capacity")


@pytest.mark.parametrize(("value", "says"), [
    ("file:///tmp/x?capacity=1GiB", "must be a list"),
    ([3], "each aiokv_tiers entry is a URL"),
    (["s3://bucket/kv"], "no tier for the scheme 's3'"),
    (["file://host/kv?capacity=1GiB"], "three slashes"),
    (["file://relative?capacity=1GiB"], "three slashes"),
    (["file:///?capacity=1GiB"], "directory of its own"),
    (["file:///tmp/kv"], "needs capacity="),
    (["file:///tmp/kv?capacity=1GiB&colour=blue"], r"unknown parameter\(s\) \['colour'\]"),
    (["file:///tmp/kv?capacity=1GiB&fsync=maybe"], "fsync='maybe' is not a valid value"),
    (["file:///tmp/kv?capacity=1GiB&io_threads=0"], "io_threads='0'"),
    (["file:///tmp/kv?capacity=1GiB&capacity=2GiB"], "given twice"),
    (["file:///tmp/kv?capacity=1GiB", "file:///tmp/kv/?capacity=2GiB"], "one directory twice"),
    (["file:///tmp/kv?capacity=1GiB&policy=nonsense"], "nonsense"),
])
def test_bad_tier_urls_are_refused_by_name(value: object, says: str) -> None:
    with pytest.raises(InvalidSpec, match=says):
        parse_tier_urls(value)


def test_bad_redis_values_are_refused() -> None:
    pytest.importorskip("redis")
    with pytest.raises(InvalidSpec, match="timeout='0'"):
        parse_tier_urls(["redis://127.0.0.1:6379/0?timeout=0"])
    with pytest.raises(InvalidSpec, match=r"redis://user:\*\*\*@"):
        parse_tier_urls(["redis://user:pw@127.0.0.1:6379/0?ttl=never"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_this_process_cannot_write_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(InvalidSpec, match="cannot be written"):
        parse_tier_urls([f"file://{locked}/kv?capacity=1GiB"])


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InvalidSpec, match="is not a directory"):
        parse_tier_urls([f"file://{tmp_path}/afile/kv?capacity=1GiB"])


def test_the_worker_options_cannot_name_a_pool_file() -> None:
    with pytest.raises(InvalidSpec, match="host_pool_file"):
        PluginOptions.from_extra_config({"aiokv_worker_options": {"host_pool_file": "/dev/shm/x"}})


def test_a_unix_socket_url_reaches_redis_as_written() -> None:
    """docs/vllm.md lists unix:///path: the URL handed to RedisTier keeps its empty host."""
    pytest.importorskip("redis")
    [tier] = parse_tier_urls(["unix:///run/redis/redis.sock?namespace=llama&db=2"])
    assert tier.target == "unix:///run/redis/redis.sock?db=2"
    assert tier.options == {"namespace": "llama"}
    assert tier.build().remote


SECRET = "s3cr3t-value"


@pytest.mark.parametrize("value", [
    [f"redis://127.0.0.1:6379/0?password={SECRET}&ttl=never"],  # a bad value of ours
    [f"redis://127.0.0.1:99999/0?password={SECRET}"],  # refused by RedisTier
    [f"rediss://127.0.0.1:6379/0?ssl_password={SECRET}&colour=blue&ttl=0"],
    f"redis://:{SECRET}@127.0.0.1:6379/0",  # a URL where a list was meant
    [f"unix://:{SECRET}@/run/redis.sock?timeout=-1"],
])
def test_no_password_reaches_a_message(value: object) -> None:
    """redis-py takes a password from the URL's user part or from its password= (and
    ssl_password=) parameter; neither may appear in an error, a log label or a repr."""
    pytest.importorskip("redis")
    with pytest.raises(InvalidSpec) as caught:
        parse_tier_urls(value)
    assert SECRET not in str(caught.value), caught.value
    assert "***" in str(caught.value)


def test_a_parsed_redis_tier_keeps_its_password_out_of_sight() -> None:
    pytest.importorskip("redis")
    from aiokv.cache.tiers.redis_client import redacted

    url = f"redis://user:{SECRET}@127.0.0.1:6379/0?password={SECRET}&namespace=a&ssl_password={SECRET}"
    [tier] = parse_tier_urls([url])
    assert SECRET in tier.target  # what redis-py is given
    assert SECRET not in tier.shown and SECRET not in repr(tier)
    assert SECRET not in repr(PluginOptions.from_extra_config({"aiokv_tiers": [url]}))
    assert SECRET not in redacted(url)  # RedisTier's label in its failure log
    assert redacted("unix:///run/redis.sock?password=x&db=1") == "unix:///run/redis.sock?password=***&db=1"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0?namspace=llama",
                                 "rediss://127.0.0.1:6379/0?ssl_ca_cert=/etc/ca.pem",
                                 "unix:///run/redis.sock?socket_timout=3"])
def test_a_misspelt_redis_parameter_is_refused_at_start(url: str) -> None:
    """A parameter neither aiokv nor redis-py takes used to pass the start's check and then
    fail every connection (redis-py's TypeError), leaving the tier dead: refused instead."""
    pytest.importorskip("redis")
    name = url.rpartition("?")[2].partition("=")[0]
    with pytest.raises(InvalidSpec, match=f"unknown parameter.*{name}"):
        parse_tier_urls([url])


def test_redis_pys_own_parameters_still_pass() -> None:
    pytest.importorskip("redis")
    [tier] = parse_tier_urls(["rediss://127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required"
                              "&socket_keepalive=1&health_check_interval=5&client_name=kv&namespace=a"])
    assert "ssl_ca_certs=%2Fetc%2Fca.pem" in tier.target


def test_data_parallel_engines_each_get_a_directory_of_their_own(tmp_path: Path) -> None:
    """vLLM gives every data-parallel engine the same aiokv_tiers; a directory takes one
    DiskTier at a time, so all but the first engine's disk tier were refused when they
    opened (a log line) and served without it. Each engine now has its own subdirectory
    and its share of the capacity; a Redis tier is shared as written."""
    import anyio

    pytest.importorskip("redis")
    tiers = parse_tier_urls([f"file://{tmp_path}/kv?capacity=4MiB", "redis://127.0.0.1:6379/0?namespace=a"])
    engines = [[t.for_data_parallel(index, 2) for t in tiers] for index in range(2)]
    disks = [e[0] for e in engines]
    assert [d.target for d in disks] == [str(tmp_path / "kv" / "dp0"), str(tmp_path / "kv" / "dp1")]
    assert [d.options["capacity_bytes"] for d in disks] == [2 << 20, 2 << 20]
    assert engines[0][1] == engines[1][1] == tiers[1]
    assert [t.for_data_parallel(0, 1) for t in tiers] == list(tiers)

    async def open_both() -> None:
        built = [d.build() for d in disks]
        for tier in built:
            await tier.open(b"f" * 16)  # the second one was refused: the directory in use
        for tier in built:
            await tier.aclose()

    anyio.run(open_both)
