"""The spec as vLLM's factory builds it: config keys, attributes the connector reads, the
manager's semantics, tensor-parallel chunk ids, the worker's errors, the device side of a
job in each release's form, and failed transfers as vLLM's connector worker sees them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import aiokv.integrations.vllm.options as plugin_options  # noqa: E402
from aiokv.backends.cpu import CpuLane  # noqa: E402
from aiokv.errors import HostMemoryError, InvalidSpec, KeyNotLoadable, UsageError  # noqa: E402

from .harness import (  # noqa: E402
    DEVICE_POINTERS,
    Group,
    build_configs,
    connectors,
    device_side,
    documented_kv_transfer_config,
    layer_caches,
    write_tiny_model,
)

GROUPS = [Group(("l0", "l1"), pad_bytes=128), Group(("l2",))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def make_spec(model_dir, extra=None, **kw):
    vc, kc = build_configs(model_dir, extra=extra or {}, groups=GROUPS, **kw)
    return OffloadingSpecFactory.create_spec(build_offloading_config(vc, kc)), vc, kc


def test_documented_config_builds_the_spec_through_vllms_factory(model_dir) -> None:
    doc = documented_kv_transfer_config()
    assert KVTransferConfig(**doc).kv_connector == "OffloadingConnector"
    spec, _, kc = make_spec(model_dir)
    assert type(spec).__name__ == "AiokvOffloadingSpec"
    assert spec.options.policy == "adaptive"
    per_chunk = -(-(kc.kv_cache_tensors[0].size // kc.num_blocks) // 512) * 512
    assert spec.num_chunks == doc["kv_connector_extra_config"]["cpu_bytes_to_use"] // per_chunk
    # What the connector reads, as vLLM's CPU spec sets it on a host without a shared region.
    assert spec.blocks_per_chunk == 1
    assert spec.replicated_layout is False
    assert spec.offload_prompt_only is True
    assert spec.kv_events_config.enable_kv_cache_events is True
    assert spec.get_manager() is spec.get_manager()
    assert spec.get_manager().num_chunks == spec.num_chunks


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"aiokv_polcy": "lru"}, "aiokv_policy"),
        ({"aiokv-policy": "lru"}, "'aiokv-policy': did you mean 'aiokv_policy'"),
        ({"AIOKV_POLICY": "lru"}, "'AIOKV_POLICY': did you mean 'aiokv_policy'"),
        ({"cpu_bytes_to_use": 1e30}, "int32 chunk ids"),
        ({"aiokv_policy": "fifo"}, "'arc'"),
        ({"aiokv_backend": "tpu"}, "'cpu'"),
        ({"cpu_bytes_to_use": "much"}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 100}, "holds no chunk"),
        ({"canonical_layout": True}, "canonical_layout"),
        ({"aiokv_tiers": "file:///tmp/kv?capacity=1GiB"}, "a list of tier URLs"),
        ({"aiokv_tiers": ["file:///tmp/kv"]}, "needs capacity="),
        ({"aiokv_tiers": ["s3://bucket"]}, "no tier for the scheme"),
    ],
)
def test_bad_config_is_refused_at_construction(model_dir, extra, match) -> None:
    with pytest.raises(InvalidSpec, match=match):
        make_spec(model_dir, extra)


def test_a_pool_larger_than_the_host_is_refused_typed(model_dir, monkeypatch) -> None:
    monkeypatch.setattr(plugin_options, "available_host_memory", lambda: 1 << 30)
    with pytest.raises(HostMemoryError, match="lower cpu_bytes_to_use"):
        make_spec(model_dir, {"cpu_bytes_to_use": 2 << 30})


def test_vllm_outside_the_tested_range_is_refused(model_dir, monkeypatch) -> None:
    make_spec(model_dir)  # the installed release is in the range
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(UsageError, match=r"vllm>=0\.33,<0\.35"):
        make_spec(model_dir)


def _keys(n: int, tag: str, group: int = 0) -> list[bytes]:
    return [make_offload_key(f"{tag}{i}".encode().ljust(32, b"."), group) for i in range(n)]


def test_manager_follows_vllms_cpu_manager(model_dir) -> None:
    spec, _, _ = make_spec(model_dir, {"cpu_bytes_to_use": 4 * 2560, "aiokv_policy": "lru"})
    m = spec.get_manager()
    assert m.num_chunks == 4
    ctx = ReqContext(req_id="a")
    m.on_new_request(ctx)
    a = _keys(3, "a")
    with m.lock:
        out = m.prepare_store(a, ctx)
    assert out.keys_to_store == a and list(out.store_spec.block_ids) == [0, 1, 2] and out.evicted_keys == []
    assert out.store_spec.block_ids.dtype == np.int32
    assert m.lookup(a[0], ctx) is LookupResult.HIT_PENDING
    with pytest.raises(KeyNotLoadable):
        m.prepare_load(a[:1], ctx)
    m.complete_store(a, ctx)
    assert [m.lookup(k, ctx) for k in a] == [LookupResult.HIT] * 3
    # Already held: nothing to store, an empty spec.
    again = m.prepare_store(a, ctx)
    assert again.keys_to_store == [] and len(again.store_spec.block_ids) == 0
    # Pinned keys are never evicted; a store that cannot fit changes nothing.
    spec_a = m.prepare_load(a, ctx)
    assert list(spec_a.block_ids) == [0, 1, 2]
    b = _keys(2, "b")
    assert m.prepare_store(b, ctx) is None
    m.complete_load(a, ctx)
    m.touch(a[1:], ctx)  # a[0] is now the least recently used
    out_b = m.prepare_store(b, ctx)
    assert out_b.evicted_keys == [a[0]] and m.lookup(a[0], ctx) is LookupResult.MISS
    # A failed store frees its chunks and is announced as metadata only.
    m.complete_store(b, ctx, success=False)
    assert [m.lookup(k, ctx) for k in b] == [LookupResult.MISS] * 2
    events = list(m.take_events())
    assert [(e.removed, e.metadata_only, e.keys) for e in events] == [
        (False, False, a),
        (True, False, [a[0]]),
        (True, True, b),
    ]
    assert list(m.take_events()) == []
    m.on_request_finished(ctx)
    m.reset_cache()
    assert m.lookup(a[1], ctx) is LookupResult.MISS
    m.chunks.check_invariants()


@pytest.mark.parametrize("policy", ["adaptive", "prefix-lru"])
def test_eviction_keeps_a_prefix_of_every_group(model_dir, policy: str) -> None:
    # vLLM offers a request's keys group by group, each with its end-token position; a
    # block only hits while every group holds it, so eviction must take the deepest
    # block of every group before any group's shallower one.
    spec, _, _ = make_spec(
        model_dir, {"cpu_bytes_to_use": 6 * 2560, "aiokv_policy": policy, "aiokv_admission": "all"}
    )
    m = spec.get_manager()
    assert m.num_chunks == 6
    ctx = ReqContext(req_id="a")
    m.on_new_request(ctx)
    g0, g1 = _keys(3, "p", group=0), _keys(3, "p", group=1)
    for keys in (g0, g1):
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * 32)
    out = m.prepare_store(g0 + g1, ctx)
    assert out.keys_to_store == g0 + g1
    m.complete_store(g0 + g1, ctx)
    other = ReqContext(req_id="b")
    m.on_new_request(other)
    b = [_keys(1, "q", group=0)[0], _keys(1, "q", group=1)[0]]
    for key in b:
        other.set_offload_key_position(key, 32)
    out_b = m.prepare_store(b, other)
    assert sorted(out_b.evicted_keys) == sorted([g0[2], g1[2]])
    assert [m.lookup(k, ctx) for k in g0[:2] + g1[:2]] == [LookupResult.HIT] * 4
    # The store spec still lists chunk ids in vLLM's offer order.
    spec_a = m.prepare_load(g0[:2] + g1[:2], ctx)
    assert list(spec_a.block_ids) == [out.store_spec.block_ids[i] for i in (0, 1, 3, 4)]
    m.complete_load(g0[:2] + g1[:2], ctx)
    m.chunks.check_invariants()


@pytest.mark.parametrize("policy", ["adaptive", "lru", "arc"])
def test_a_held_block_offered_again_counts_as_used(model_dir, policy: str) -> None:
    # vLLM 0.33 never calls touch(): a prefix its GPU cache serves is offered to
    # prepare_store again, which vLLM's CPU manager counts as a reuse. It must outlive a
    # prefix nobody came back to.
    spec, _, _ = make_spec(
        model_dir, {"cpu_bytes_to_use": 6 * 2560, "aiokv_policy": policy, "aiokv_admission": "all"}
    )
    m = spec.get_manager()
    reused, idle, new = _keys(3, "r"), _keys(3, "i"), _keys(3, "n")
    for i, keys in enumerate((reused, idle, reused, new)):
        ctx = ReqContext(req_id=f"req{i}")
        m.on_new_request(ctx)
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * 32)
        out = m.prepare_store(keys, ctx)
        m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
    assert sorted(out.evicted_keys) == sorted(idle)
    assert [m.lookup(k, ctx) for k in reused + new] == [LookupResult.HIT] * 6
    m.chunks.check_invariants()


def test_events_off_keeps_none(model_dir) -> None:
    spec, _, _ = make_spec(model_dir, {"cpu_bytes_to_use": 4 * 2560}, events=False)
    m = spec.get_manager()
    ctx = ReqContext(req_id="a")
    m.complete_store(m.prepare_store(_keys(2, "x"), ctx).keys_to_store, ctx)
    assert list(m.take_events()) == []


def test_tensor_parallel_ranks_share_chunk_ids_with_their_own_bytes(model_dir) -> None:
    """The scheduler's manager hands out ids; each rank's pool of the same count holds that
    rank's own bytes under them."""
    extra = {"cpu_bytes_to_use": 2 * 16 * 2560, "aiokv_backend": "cpu"}
    ranks = []
    for rank in range(2):
        vc, kc = build_configs(model_dir, extra=extra, groups=GROUPS, world_size=2)
        vc.parallel_config.rank = rank
        caches, rows = layer_caches(kc, seed=100 + rank)
        scheduler, worker = connectors(vc, kc, caches)
        ranks.append((scheduler.connector_scheduler.manager, worker.connector_worker, rows))
    manager = ranks[0][0]
    assert manager.num_chunks == 16
    ctx = ReqContext(req_id="tp")
    keys = _keys(3, "t", 0) + _keys(3, "t", 1)
    out = manager.prepare_store(keys, ctx)
    src = GPULoadStoreSpec([5, 6, 7, 5, 6, 7], group_sizes=[3, 3], block_indices=[0, 0])
    dst = GPULoadStoreSpec([20, 21, 22, 30, 31, 32], group_sizes=[3, 3], block_indices=[0, 0])
    for _, cw, _ in ranks:  # each rank resolves the spec against its own tensors
        assert cw.worker.submit_store(1, device_side(cw, src), out.store_spec)
        cw.worker.wait({1})
    manager.complete_store(keys, ctx)
    load = manager.prepare_load(keys, ctx)
    for _, cw, _ in ranks:
        assert cw.worker.submit_load(2, load, device_side(cw, dst), expedited=True)
        cw.worker.wait({2})
        assert sorted(r.job_id for r in cw.worker.get_finished()) == [1, 2]
    for _, _, rows in ranks:
        for layer, (a, b) in {"l0": (20, 5), "l1": (20, 5), "l2": (30, 5)}.items():
            for i in range(3):
                page = GROUPS[0].spec(16).unpadded_page_size_bytes if layer != "l2" else None
                n = page or GROUPS[1].spec(16).unpadded_page_size_bytes
                assert torch.equal(rows[layer][a + i, :n], rows[layer][b + i, :n]), (layer, i)
    assert not torch.equal(ranks[0][2]["l0"][20], ranks[1][2]["l0"][20])
    for _, cw, _ in ranks:
        cw.worker.shutdown()


def test_worker_refuses_bad_specs_and_stays_usable(model_dir) -> None:
    vc, kc = build_configs(model_dir, extra={"cpu_bytes_to_use": 8 * 2560}, groups=GROUPS, num_gpu_blocks=16)
    caches, _ = layer_caches(kc, seed=3)
    _, worker_conn = connectors(vc, kc, caches)
    worker = worker_conn.connector_worker.worker
    cpu = worker_conn.connector_worker.spec  # the worker process's spec
    assert cpu.num_chunks == 8
    bad_block = GPULoadStoreSpec([99, 1], group_sizes=[1, 1], block_indices=[0, 0])
    with pytest.raises(InvalidSpec):
        worker.submit_store(1, bad_block, CPULoadStoreSpec([0, 1]))
    bad_chunk = GPULoadStoreSpec([1, 1], group_sizes=[1, 1], block_indices=[0, 0])
    with pytest.raises(InvalidSpec):
        worker.submit_store(1, bad_chunk, CPULoadStoreSpec([0, 8]))
    assert worker.submit_store(1, bad_chunk, CPULoadStoreSpec([0, 1]))
    worker.wait({1})
    [result] = worker.get_finished()
    assert result.job_id == 1 and result.success and result.transfer_size > 0
    assert type(result).__module__ == "vllm.v1.kv_offload.base"
    worker.shutdown()


def _worker_rig(model_dir, seed: int, **extra):
    vc, kc = build_configs(
        model_dir, extra={"cpu_bytes_to_use": 8 * 2560, **extra}, groups=GROUPS, num_gpu_blocks=16
    )
    caches, rows = layer_caches(kc, seed=seed)
    _, worker_conn = connectors(vc, kc, caches)
    return worker_conn.connector_worker, rows


@pytest.mark.skipif(not DEVICE_POINTERS, reason="vLLM before 0.34 hands workers block ids")
def test_worker_refuses_pointers_that_are_not_its_blocks_and_enqueues_nothing(model_dir) -> None:
    cw, _ = _worker_rig(model_dir, seed=4)
    worker = cw.worker
    good = device_side(cw, GPULoadStoreSpec([3, 4, 5], group_sizes=[2, 1], block_indices=[0, 0]))
    off_by_one = type(good)(**{**vars(good), "ptrs": good.ptrs + np.uint64(1)})
    other = torch.empty(16, 2560, dtype=torch.int8)  # a tensor vLLM never registered
    foreign = type(good)(**{**vars(good), "ptrs": good.ptrs - good.ptrs[0] + np.uint64(other.data_ptr())})
    for bad in (off_by_one, foreign):
        with pytest.raises(InvalidSpec, match="does not start a block of the registered tensor"):
            worker.submit_store(1, bad, CPULoadStoreSpec([0, 1, 2]))
        with pytest.raises(InvalidSpec, match="does not start a block"):
            worker.submit_load(2, CPULoadStoreSpec([0, 1, 2]), bad, expedited=True)
    stats = worker.aiokv_worker.statistics()
    assert sum(stats.completed.values()) == sum(stats.in_flight.values()) == 0
    assert worker.get_finished() == []
    assert worker.submit_store(1, good, CPULoadStoreSpec([0, 1, 2]))  # the same ids, now enqueued
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    worker.shutdown()


def test_the_null_block_placeholder_keeps_later_blocks_at_their_chunk_offsets(model_dir) -> None:
    # vLLM 0.34 keeps null pages (block 0) inside a stored chunk so the blocks after them
    # keep their logical offsets; the null block is copied like any other.
    cw, rows = _worker_rig(model_dir, seed=6, blocks_per_chunk=2)
    worker = cw.worker
    before = {name: r.clone() for name, r in rows.items()}
    src = GPULoadStoreSpec([0, 5, 6, 0], group_sizes=[2, 2], block_indices=[0, 0])
    assert worker.submit_store(1, device_side(cw, src), CPULoadStoreSpec([2, 3]))
    worker.wait({1})
    dst = GPULoadStoreSpec([10, 11, 12, 13], group_sizes=[2, 2], block_indices=[0, 0])
    assert worker.submit_load(2, CPULoadStoreSpec([2, 3]), device_side(cw, dst), expedited=True)
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
    moved = {"l0": {10: 0, 11: 5}, "l1": {10: 0, 11: 5}, "l2": {12: 6, 13: 0}}
    for layer, pairs in moved.items():
        group = GROUPS[0] if layer != "l2" else GROUPS[1]
        n = group.spec(16).unpadded_page_size_bytes
        for dst_block, src_block in pairs.items():
            assert torch.equal(rows[layer][dst_block, :n], before[layer][src_block, :n]), (layer, dst_block)
    worker.shutdown()


def test_failed_transfers_reach_vllms_connector_worker(model_dir, monkeypatch) -> None:
    """A copy that fails is reported with success=False, never as a hit. vLLM 0.34 turns a
    failed load into a failed receive of its request, a failed expedited load into an error
    in the step, a failed store into a failed job; vLLM 0.33 asserts on every failure."""
    cw, _ = _worker_rig(model_dir, seed=8)

    def fail(self, plan):
        raise OSError("simulated device fault")

    monkeypatch.setattr(CpuLane, "_copy", fail)
    gpu = GPULoadStoreSpec([3], group_sizes=[1, 0], block_indices=[0, 0])

    def step(load_jobs: dict | None = None, store_jobs: dict | None = None) -> None:
        """One step's transfers in the model runner's order: stores queued by the last
        step are submitted with this step's loads (sync ones waited on)."""
        cw.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=store_jobs or {}))
        cw.start_kv_transfers(OffloadingConnectorMetadata(load_jobs=load_jobs or {}, store_jobs={}))
        cw.worker.wait({*(load_jobs or {}), *(store_jobs or {})})

    step(store_jobs={1: TransferJob(req_id="s", src_spec=gpu, dst_spec=CPULoadStoreSpec([0]))})
    step(load_jobs={2: TransferJob(req_id="a", src_spec=CPULoadStoreSpec([1]), dst_spec=gpu)})
    try:
        if not DEVICE_POINTERS:
            with pytest.raises(AssertionError):
                cw.get_finished(set())
            return
        _, recving = cw.get_finished(set())
        assert recving == {"a"} and cw.take_failed_recving() == {"a"}
        meta = cw.build_connector_worker_meta()
        assert set(meta.completed_jobs) == {1, 2} and meta.failed_jobs == {1, 2}
        step(load_jobs={3: TransferJob(req_id="b", src_spec=CPULoadStoreSpec([1]), dst_spec=gpu, sync=True)})
        with pytest.raises(RuntimeError, match="sync load job 3 failed"):
            cw.get_finished(set())
        failed = cw.worker.aiokv_worker.statistics().failed
        assert failed["store"] == 1 and sum(failed.values()) == 3, failed
    finally:
        cw.worker.shutdown()


def test_import_aiokv_does_not_import_an_installed_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, aiokv, aiokv.integrations.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
