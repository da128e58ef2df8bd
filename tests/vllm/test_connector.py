"""AiokvConnector as vLLM loads it (``kv_connector_module_path``), and its worker half
driven step by step with hand-built metadata: two KV-cache groups whose layers interleave
in the forward, two blocks per chunk, loads that start mid-chunk, flushes and failures."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from aiokv.backends.cpu import CpuLane
from aiokv.errors import InvalidSpec, UsageError
from aiokv.specs import Direction

from .harness import Group, build_configs, documented_kv_transfer_config, layer_caches, write_tiny_model

# Group 0 holds layers 0 and 2, group 1 layer 1: the forward alternates between groups.
L0, L1, L2 = (f"model.layers.{i}.self_attn.attn" for i in range(3))
GROUPS = [Group((L0, L2), pad_bytes=64), Group((L1,), head_size=16)]
FORWARD = (L0, L1, L2)
BPC = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _connector(model_dir, role: KVConnectorRole, **extra):
    vc, kc = build_configs(model_dir, extra={"aiokv_backend": "cpu", "blocks_per_chunk": BPC,
                                             "cpu_bytes_to_use": 1 << 22, **extra},
                           groups=GROUPS, connector="AiokvConnector")
    connector = KVConnectorFactory.create_connector(vc, role, kc)
    return connector, vc, kc


def test_the_documented_line_loads_the_connector_through_vllms_factory(model_dir) -> None:
    doc = documented_kv_transfer_config("AiokvConnector")
    assert doc["kv_connector_module_path"] == "aiokv.integrations.vllm"
    assert "spec_name" not in doc["kv_connector_extra_config"]
    scheduler, vc, kc = _connector(model_dir, KVConnectorRole.SCHEDULER)
    worker, _, _ = _connector(model_dir, KVConnectorRole.WORKER)
    assert type(scheduler).__name__ == type(worker).__name__ == "AiokvConnector"
    assert type(scheduler.connector_scheduler.manager).__name__ == "AiokvOffloadingManager"
    assert scheduler.connector_scheduler.config.sync_load_budget_bytes == 1 << 62
    caches, _ = layer_caches(kc, seed=1)
    with set_current_vllm_config(vc):
        worker.register_kv_caches(caches)
    cw = worker.connector_worker
    assert type(cw.worker).__name__ == "AiokvOffloadingWorker"
    assert cw.order.layer_of == {L0: 0, L1: 1, L2: 2} and cw.order.ref_layers == [[0, 2], [1]]
    worker.shutdown()


def test_vllm_switches_full_cuda_graphs_to_piecewise_for_the_connector(model_dir, monkeypatch) -> None:
    """The hooks run host code between layers, which a full CUDA graph would skip on replay."""
    monkeypatch.setattr(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True))
    vc, _ = build_configs(model_dir, extra={}, groups=GROUPS, connector="AiokvConnector")
    for connector, mode in (("AiokvConnector", "PIECEWISE"), ("OffloadingConnector", "FULL_AND_PIECEWISE")):
        config = VllmConfig(
            model_config=vc.model_config,
            device_config=vc.device_config,
            kv_transfer_config=KVTransferConfig(**documented_kv_transfer_config(connector)),
            compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"),
        )
        assert config.compilation_config.cudagraph_mode.name == mode, connector


@pytest.mark.parametrize(("extra", "error", "match"), [
    ({"spec_name": "CPUOffloadingSpec"}, InvalidSpec, "runs aiokv's own offloading spec"),
    ({"aiokv_polcy": "lru"}, InvalidSpec, "did you mean 'aiokv_policy'"),
    ({"sync_load_budget_bytes": -5}, InvalidSpec, "sync_load_budget_bytes"),
])
def test_bad_config_is_refused_at_construction(model_dir, extra, error, match) -> None:
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(error, match=match):
            _connector(model_dir, role, **extra)


def test_vllm_outside_the_tested_range_is_refused(model_dir, monkeypatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(UsageError, match=r"0\.35\.0"):
        _connector(model_dir, KVConnectorRole.SCHEDULER)


class Rig:
    """The worker-role connector over random CPU caches, stepped with hand-built metadata."""

    def __init__(self, model_dir) -> None:
        self.connector, vc, kc = _connector(model_dir, KVConnectorRole.WORKER)
        self.caches, self.rows = layer_caches(kc, seed=4)
        with set_current_vllm_config(vc):
            self.connector.register_kv_caches(self.caches)
        self.page = {n: g.kv_cache_spec.unpadded_page_size_bytes
                     for g in kc.kv_cache_groups for n in g.layer_names}
        self.layers_of = [list(g.layer_names) for g in kc.kv_cache_groups]
        self.completed: dict[int, bool] = {}
        self.recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid: set[int] = set()

    def step(self, *, loads=None, stores=None, flush=None, on_layer=None) -> None:
        c = self.connector
        meta = OffloadingConnectorMetadata(load_jobs=loads or {}, store_jobs=stores or {},
                                           jobs_to_flush=set(flush) if flush else None)
        c.handle_preemptions(meta)
        c.bind_connector_metadata(meta)
        sync = any(job.sync for job in meta.load_jobs.values())
        if sync:
            c.start_load_kv(None)
        for layer in FORWARD:
            c.wait_for_layer_load(layer)
            if on_layer is not None:
                on_layer(layer)
            c.save_kv_layer(layer, None, None)
        if not sync:
            c.start_load_kv(None)
        c.wait_for_save()
        results = c.get_transfer_results(set())
        self.recving |= results.finished_recving
        self.failed_recving |= results.failed_recving
        self.invalid |= c.get_block_ids_with_load_errors()
        worker_meta = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        if worker_meta is not None:
            for job_id in worker_meta.completed_jobs:
                self.completed[job_id] = job_id not in worker_meta.failed_jobs

    def rows_of(self, layer: str, blocks: list[int]) -> torch.Tensor:
        return self.rows[layer][blocks, : self.page[layer]].clone()

    @property
    def statistics(self):
        return self.connector.connector_worker.worker.aiokv_worker.statistics()


def _spec(per_group: list[list[int]], starts: list[int] | None = None) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(
        [b for blocks in per_group for b in blocks],
        group_sizes=[len(b) for b in per_group],
        block_indices=starts or [0] * len(per_group),
    )


def test_a_steps_loads_merge_and_each_layer_reads_its_own_bytes(model_dir) -> None:
    rig = Rig(model_dir)
    # Step 1: two requests store 2 chunks per group each (chunk ids 0-7, group-major).
    src = {"a": [[1, 2, 3, 4], [5, 6, 7, 8]], "b": [[9, 10, 11, 12], [13, 14, 15, 16]]}
    chunks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    stored = {(r, layer): rig.rows_of(layer, src[r][g]) for r in src
              for g, names in enumerate(rig.layers_of) for layer in names}
    rig.step(stores={1: TransferJob("a", _spec(src["a"]), CPULoadStoreSpec(chunks["a"])),
                     2: TransferJob("b", _spec(src["b"]), CPULoadStoreSpec(chunks["b"]))})
    rig.step(flush={1, 2})  # waits for both stores
    rig.step()
    assert rig.completed == {1: True, 2: True}
    # Step 2: four synchronous loads; "a2" and "b2" start one block into their chunks.
    dst = {"a": [[20, 21, 22, 23], [24, 25, 26, 27]], "b": [[30, 31, 32, 33], [34, 35, 36, 37]],
           "a2": [[40, 41, 42], [43, 44, 45]], "b2": [[50, 51, 52], [53, 54, 55]]}
    jobs = {
        3: TransferJob("a", CPULoadStoreSpec(chunks["a"]), _spec(dst["a"]), sync=True),
        4: TransferJob("b", CPULoadStoreSpec(chunks["b"]), _spec(dst["b"]), sync=True),
        5: TransferJob("a2", CPULoadStoreSpec(chunks["a"]), _spec(dst["a2"], [1, 1]), sync=True),
        6: TransferJob("b2", CPULoadStoreSpec(chunks["b"]), _spec(dst["b2"], [1, 1]), sync=True),
    }
    for blocks in dst.values():
        for g, names in enumerate(rig.layers_of):
            for layer in names:
                rig.rows[layer][blocks[g]] = torch.randint_like(rig.rows[layer][blocks[g]], -128, 127)
    before = rig.statistics.completed.get("expedited_load", 0)
    layerwise_before = rig.statistics.layers.jobs
    seen = []

    def check(layer: str) -> None:  # the layer's attention: its loaded bytes are all there
        g = next(i for i, names in enumerate(rig.layers_of) if layer in names)
        for r in ("a", "b"):
            assert torch.equal(rig.rows_of(layer, dst[r][g]), stored[(r, layer)]), (r, layer)
        for r in ("a", "b"):
            assert torch.equal(rig.rows_of(layer, dst[r + "2"][g]), stored[(r, layer)][1:]), (r, layer)
        seen.append(layer)

    rig.step(loads=jobs, on_layer=check)
    assert seen == list(FORWARD)
    assert all(rig.completed[j] for j in jobs)
    # One job may start mid-chunk per group (it goes first): a, b and a2 merge, b2 is alone.
    assert rig.statistics.completed["expedited_load"] - before == 2
    assert rig.statistics.layers.jobs - layerwise_before == 2  # both layer by layer
    assert not rig.invalid and not rig.recving  # synchronous loads finish no receive
    rig.connector.shutdown()


@pytest.mark.parametrize("sync", [True, False])
def test_a_failed_load_of_a_two_group_model(model_dir, monkeypatch, sync: bool) -> None:
    """vLLM maps failed blocks to requests for one KV-cache group only: with two, a failed
    synchronous load raises after the forward (as vLLM's own worker does), and a failed
    asynchronous one is a failed receive of its request."""
    rig = Rig(model_dir)
    rig.step(stores={1: TransferJob("a", _spec([[1, 2], [3, 4]]), CPULoadStoreSpec([0, 1]))}, flush={1})
    rig.step(flush={1})

    def fail(self, plan):
        raise OSError("injected")

    monkeypatch.setattr(CpuLane, "_copy", fail)
    job = TransferJob("q", CPULoadStoreSpec([0, 1]), _spec([[5, 6], [7, 8]]), sync=sync)
    if sync:
        with pytest.raises(RuntimeError, match="one KV-cache group"):
            rig.step(loads={2: job})
        assert rig.statistics.failed[Direction.EXPEDITED_LOAD.value] == 1
    else:
        rig.step(loads={2: job})
        deadline = time.monotonic() + 60
        while 2 not in rig.completed and time.monotonic() < deadline:
            time.sleep(0.005)  # the copy runs on the lane's thread
            rig.step()
        assert rig.completed[2] is False and rig.recving == rig.failed_recving == {"q"}
    rig.connector.shutdown()


def test_a_packed_layout_moves_whole_jobs(model_dir) -> None:
    """One tensor for every layer has no layer to move alone: the worker falls back to
    whole jobs (waited before the forward), as vLLM's own worker moves them."""
    from aiokv.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    connector, _, _ = _connector(model_dir, KVConnectorRole.WORKER)
    cw = connector.connector_worker
    packed = CanonicalKVCacheTensor(torch.zeros(64, 4096, dtype=torch.int8), 4096)
    refs = [[CanonicalKVCacheRef(0, 4096)], [CanonicalKVCacheRef(0, 4096)]]
    cw._init_worker(CanonicalKVCaches([packed], refs))
    assert cw._layerwise is False
    data = np.random.default_rng(0).integers(-128, 127, (2, 4096), dtype=np.int8)
    packed.tensor[[3, 4]] = torch.from_numpy(data)
    store = TransferJob("a", _spec([[3], [4]]), CPULoadStoreSpec([0, 1]))
    meta = OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: store})
    connector.bind_connector_metadata(meta)
    connector.wait_for_save()
    connector.clear_connector_metadata()
    connector.handle_preemptions(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush={1}))
    load = TransferJob("a", CPULoadStoreSpec([0, 1]), _spec([[7], [8]]), sync=True)
    meta = OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={})
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    assert np.array_equal(packed.tensor[[7, 8]].numpy(), data)  # before any layer hook
    connector.shutdown()


def test_worker_metadata_of_two_ranks_adds_up_and_keeps_failures() -> None:
    """vLLM sums each job's completions over the ranks; a job failed on any rank failed."""
    from aiokv.integrations.vllm.connector_worker import AiokvWorkerMetadata

    rank0, rank1 = AiokvWorkerMetadata(), AiokvWorkerMetadata()
    rank0.mark_completed(1)
    rank0.mark_completed(2, success=False)
    rank0.transfer_stats.store.record(100, 0.5)
    rank1.mark_completed(1)
    rank1.mark_completed(2)
    rank1.mark_completed(3, success=False)
    rank1.transfer_stats.store.record(50, 0.25)
    total = rank0.aggregate(rank1)
    assert isinstance(total, AiokvWorkerMetadata)
    assert total.completed_jobs == {1: 2, 2: 2, 3: 1} and total.failed_jobs == {2, 3}
    assert total.transfer_stats.store.bytes == 150 and total.transfer_stats.store.sizes == [100, 50]
