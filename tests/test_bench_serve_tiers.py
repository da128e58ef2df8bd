"""``aiokv bench serve`` with its tiers: the Redis arm (a server the bench starts and
stops), the event loop's load per arm, and the tier section (host hits against the host
arm, restores against each tier's ceiling, blocks dropped)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import socket
import time
from pathlib import Path

import anyio
import pytest

from aiokv.__main__ import main
from aiokv.bench.redis_tools import local_server, ping
from aiokv.bench.serve.config import ARMS, DEFAULT_ARMS, ServeConfig
from aiokv.bench.serve.loopwatch import LoopWatch
from tests.redis_server import MISSING
from tests.test_bench_serve import conversation_trace

SERVER = shutil.which("redis-server")


def need_server() -> str:
    if MISSING or SERVER is None:
        pytest.skip(MISSING or "redis-server is not installed")
    pytest.importorskip("redis", reason="the redis package is not installed: pip install -e '.[redis]'")
    return SERVER


# -- options ---------------------------------------------------------------------------


def test_the_redis_arm_needs_one_server_and_joins_the_defaults_when_given(tmp_path: Path) -> None:
    assert ServeConfig.defaults(backend="cpu", quick=True).arms == DEFAULT_ARMS
    assert "redis" not in DEFAULT_ARMS
    with pytest.raises(ValueError, match="redis arm needs a server"):
        ServeConfig.defaults(backend="cpu", quick=True, arms=("host", "redis")).check()
    both = ServeConfig.defaults(backend="cpu", quick=True, redis_url="redis://x", redis_server="/bin/true")
    with pytest.raises(ValueError, match="not both"):
        both.check()
    text = tmp_path / "redis-server"
    text.write_text("not a program")
    with pytest.raises(ValueError, match="not an executable file"):
        ServeConfig.defaults(backend="cpu", quick=True, redis_server=str(text)).check()
    given = ServeConfig.defaults(backend="cpu", quick=True, redis_url="redis://127.0.0.1:1")
    assert given.arms == ARMS and given.mirrored_arm() == "disk"
    chosen = ServeConfig.defaults(backend="cpu", quick=True, redis_url="redis://x", arms=("host",))
    assert chosen.arms == ("host",)
    order = given.turns(0)
    assert sorted(order) == sorted(ARMS) and order[order.index("disk") + 1] == "oracle"


def test_misplaced_redis_options_are_refused_before_anything_runs() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["bench", "transfer", "--redis-url", "redis://127.0.0.1:1"]) == 2
        assert main(["bench", "serve", "--quick", "--arms", "host,redis"]) == 2
    assert "redis arm needs a server" in err.getvalue()


# -- the loop watch --------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_loop_watch_sees_a_busy_loop_and_a_late_one() -> None:
    idle, busy = LoopWatch(), LoopWatch()
    async with idle.watching():
        await anyio.sleep(0.3)
    async with busy.watching():
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:  # the loop's own work, in slices
            t = time.perf_counter()
            while time.perf_counter() - t < 0.02:
                pass
            await anyio.lowlevel.checkpoint()
    assert idle.busy < 0.3 < busy.busy  # CPU time of the loop's thread over wall time
    assert 0.25 < idle.wall_s < 1.0 and len(idle.lags) > 10
    assert busy.lag_ms(99) > 5  # a 20 ms slice holds the probe's wake-up back
    assert LoopWatch().lag_ms(50) != LoopWatch().lag_ms(50)  # nan before anything is watched


# -- a server of the bench's own ----------------------------------------------------------


def test_a_server_the_bench_starts_answers_and_is_gone_after(tmp_path: Path) -> None:
    binary = need_server()
    with local_server(binary, maxmemory=64 << 20) as url:
        ping(url)
        port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # stopped
    broken = tmp_path / "redis-server"
    broken.write_text("#!/bin/sh\necho no such server >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ValueError, match="did not answer"), local_server(str(broken), maxmemory=1 << 20):
        pass


# -- the command -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tier_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, str]:
    binary = need_server()
    tmp = tmp_path_factory.mktemp("serve-tiers")
    trace = conversation_trace(tmp / "conversation_trace.jsonl")
    out = tmp / "serve.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "serve", "--quick", "--trace", str(trace), "--requests", "48", "--warmup", "48",
                     "--arms", "host,disk,redis,oracle", "--redis-server", binary, "--tier-dir", str(tmp),
                     "--json", str(out)])
    return code, json.loads(out.read_text()), stdout.getvalue()


def test_the_tier_section_has_every_figure_the_targets_read(tier_run: tuple[int, dict, str]) -> None:
    code, payload, table = tier_run
    assert code == 0
    rows = payload["rows"]
    tiers = {r["name"]: r for r in rows if r["section"].startswith("serve tiers")}
    for arm in ("host", "disk", "redis", "oracle"):
        loop = tiers[f"event loop busy, {arm} arm"]
        assert 0 < loop["value"] < 100 and loop["extra"]["wall_s"] > 0
        assert loop["extra"]["lag_p99_ms"] >= loop["extra"]["lag_p50_ms"] >= 0
    for arm in ("disk", "redis"):
        dropped = tiers[f"blocks dropped on the way down, {arm} arm"]
        assert dropped["value"] == 0 and dropped["extra"]["written"] > 0  # room at this pace
        assert dropped["target"] == ["<=", 0] and dropped["target_met"]
        ttft = tiers[f"host hits, {arm} arm / host arm"]
        assert ttft["target"] == ["<=", 1.1]
        service = tiers[f"host hits' service, {arm} arm / host arm"]
        assert service["value"] > 0 and service["extra"]["n"] == ttft["extra"]["n"]
        restore = tiers[f"restore / tier ceiling, {arm} arm"]
        assert restore["value"] > 0 and restore["extra"]["ceiling_gbps"] > 0
        assert restore["extra"]["tier_bytes"] > 0
        assert restore["value"] == pytest.approx(restore["extra"]["seconds_at_ceilings"]
                                                 / restore["extra"]["seconds"])
        assert restore["target"] == [">=", {"disk": 0.8, "redis": 0.7}[arm]]
        together = tiers[f"restores together / tier ceiling, {arm} arm"]
        assert together["value"] > 0 and together["extra"]["union_s"] > 0
        assert together["extra"]["restores"] >= restore["extra"]["restores"]
    setup = {r["name"]: r for r in rows if r["section"].startswith("serve setup")}
    assert setup["disk tier read ceiling"]["value"] > 0 and setup["Redis GET ceiling"]["value"] > 0
    assert setup["Redis tier"]["value"] > 0
    assert "== serve tiers:" in table and "started" not in table  # progress goes to stderr


def test_the_redis_arm_serves_hits_from_redis(tier_run: tuple[int, dict, str]) -> None:
    _, payload, _ = tier_run
    rows = payload["rows"]
    arm = {r["name"]: r for r in rows if r["section"].startswith("serve arm: redis")}
    assert "TTFT p50 redis hits" in arm and "TTFT p50 disk hits" not in arm
    overall = next(r for r in rows if r["extra"].get("arm") == "redis" and "ttft_ms" in r["extra"])
    assert "disk" in overall["extra"]["hit"]  # its class for any lower tier's hit
    assert any("redis: demoted" in r["note"] for r in rows if r["name"] == "cache hit rate (keys, lookup)")
    assert not any(r["failed"] for r in rows)


# -- the figures, from served requests -------------------------------------------------


def test_the_restore_figure_holds_host_bytes_to_the_load_ceiling_not_the_tiers() -> None:
    """A restore of 8,192 host tokens and 1,024 tier tokens that read its tier at half the
    tier's ceiling is not "4.5x the ceiling": the host's bytes load at the load ceiling
    (50 GB/s here), so at the ceilings the restore would take 1.19 ms, not 2.05."""
    from aiokv.bench.serve.arms import ArmResult
    from aiokv.bench.serve.report import Ceilings
    from aiokv.bench.serve.served import Served
    from aiokv.bench.serve.tier_rows import tier_rows

    ceil = Ceilings(load_gbps=50.0, load_name="copy", peak_flops=1e12, peak_name="peak",
                    block_bytes=16_000)  # 1,000 bytes a token
    served = [Served(0, 10_000, 9_216, 0.0, 0.0, 0.01, 1, host_tokens=8_192, disk_tokens=1_024,
                     load_s=2.048e-3)]
    arm = ArmResult("disk", served, 0, disk_ceiling=1.0, ceiling_name="plain reads")
    row = next(r for r in tier_rows({"disk": arm}, ceil) if r.name.startswith("restore / tier ceiling"))
    at_ceilings = 8.192e6 / 50e9 + 1.024e6 / 1e9
    assert row.value == pytest.approx(at_ceilings / 2.048e-3)  # 0.58
    assert row.target_met is False
    assert row.extra["gbps"] == pytest.approx(1.024e6 / 2.048e-3 / 1e9)  # the tier's bytes: 0.5 GB/s


def test_host_hits_queued_behind_tier_hits_show_in_ttft_not_in_service() -> None:
    """The same two host hits, served in 40 ms in both arms (10 ms restore, 30 ms on the
    model), but the disk arm's waited 200 ms: 50 for admission, 150 for the model once
    restored. The TTFT ratio counts the queue (6x), the service ratio (TTFT less the
    queue waits) reads 1.0, and each arm's waits are in its extra."""
    from aiokv.bench.serve.arms import ArmResult
    from aiokv.bench.serve.report import Ceilings
    from aiokv.bench.serve.served import Served
    from aiokv.bench.serve.tier_rows import tier_rows

    ceil = Ceilings(load_gbps=50.0, load_name="copy", peak_flops=1e12, peak_name="peak", block_bytes=16_000)

    def hits(admit: float, model: float) -> list[Served]:
        return [Served(i, 1_000, 512, arrival=i, start=i + admit, ready=i + admit + 0.01,
                       model_start=i + admit + 0.01 + model, first_token=i + admit + model + 0.04, token=1,
                       host_tokens=512) for i in range(2)]

    host = ArmResult("host", hits(0.0, 0.0), 0)
    disk = ArmResult("disk", hits(0.05, 0.15), 0, disk_ceiling=1.0, ceiling_name="plain reads")
    rows = {r.name: r for r in tier_rows({"host": host, "disk": disk}, ceil)}
    assert rows["host hits, disk arm / host arm"].value == pytest.approx(6.0)
    service = rows["host hits' service, disk arm / host arm"]
    assert service.value == pytest.approx(1.0)
    assert service.extra["n"] == 2 and service.extra["service_p50_ms"] == pytest.approx(40.0)
    assert service.extra["queue_p50_ms"] == pytest.approx(200.0)
    assert service.extra["model_wait_p50_ms"] == pytest.approx(150.0)
    assert service.extra["host_queue_p50_ms"] == pytest.approx(0.0)
    assert disk.served[0].busy == pytest.approx(0.03)  # the model's time: its restore is not in it


def test_restores_together_count_the_tier_bytes_over_the_union_of_their_intervals() -> None:
    """Two restores of 1,024 tier tokens each (1.024 MB at 1,000 bytes a token) that ran
    at once for 1 ms of their 2 ms each: each took 2 ms (0.51 GB/s per restore, 0.51 of a
    1 GB/s ceiling), but the tier moved 2.048 MB in the 3 ms they spanned (0.68)."""
    from aiokv.bench.serve.arms import ArmResult
    from aiokv.bench.serve.report import Ceilings
    from aiokv.bench.serve.served import Served
    from aiokv.bench.serve.tier_rows import tier_rows, union_seconds

    assert union_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == pytest.approx(4.0)
    assert union_seconds([]) == 0.0
    ceil = Ceilings(load_gbps=50.0, load_name="copy", peak_flops=1e12, peak_name="peak", block_bytes=16_000)
    served = [Served(i, 2_000, 1_024, 0.0, 0.0, 0.01, 1, disk_tokens=1_024, load_s=2e-3, load_at=i * 1e-3)
              for i in range(2)]
    arm = ArmResult("disk", served, 0, disk_ceiling=1.0, ceiling_name="plain reads")
    rows = {r.name: r for r in tier_rows({"disk": arm}, ceil)}
    per = rows["restore / tier ceiling, disk arm"]
    together = rows["restores together / tier ceiling, disk arm"]
    assert per.value == pytest.approx(1.024e6 / 1e9 / 2e-3)  # each restore's own time
    assert together.value == pytest.approx(2.048e6 / 3e-3 / 1e9)
    assert together.extra["union_s"] == pytest.approx(3e-3)
    assert together.extra["overlap"] == pytest.approx(4 / 3)
    assert "per restore" in per.note and "union" in together.note


def test_restores_together_take_the_union_segment_by_segment() -> None:
    """Segments run one after another, each on the trace clock from its own first arrival,
    so a segment's last restore (1 to 3 ms on its clock) may seem to overlap the next
    segment's first (2 to 4 ms on the next one's), though they never ran at once: the tier
    moved 2.048 MB in 4 ms of restoring, 0.51 of a 1 GB/s ceiling, one at a time, not
    2.048 MB in the 3 ms of one union over both segments (0.68, 1.33 at once)."""
    from aiokv.bench.serve.arms import ArmResult
    from aiokv.bench.serve.report import Ceilings
    from aiokv.bench.serve.served import Served
    from aiokv.bench.serve.tier_rows import tier_rows

    ceil = Ceilings(load_gbps=50.0, load_name="copy", peak_flops=1e12, peak_name="peak", block_bytes=16_000)
    served = [Served(i, 2_000, 1_024, 0.0, 0.0, 0.01, 1, disk_tokens=1_024, load_s=2e-3,
                     load_at=(1 + i) * 1e-3, segment=i) for i in range(2)]
    arm = ArmResult("disk", served, 0, disk_ceiling=1.0, ceiling_name="plain reads")
    rows = {r.name: r for r in tier_rows({"disk": arm}, ceil)}
    together = rows["restores together / tier ceiling, disk arm"]
    assert together.extra["union_s"] == pytest.approx(4e-3)
    assert together.extra["overlap"] == pytest.approx(1.0)
    assert together.value == pytest.approx(2.048e6 / 4e-3 / 1e9)
