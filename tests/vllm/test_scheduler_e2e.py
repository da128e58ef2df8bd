"""vLLM's real Scheduler with the plug-in: requests that share prefixes, served for a few
hundred steps, every computed block of every running request checked each step.

The scheduler builds its own OffloadingConnector (and so the spec, through vLLM's factory)
from the documented config; the worker role gets CPU tensors. A block's bytes are a fixed
random function of its block hash, as real KV is of its tokens, so a block the connector
loaded from host memory must hold exactly what the forward pass wrote for that hash.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from .harness import Group, build_configs, layer_caches, model_runner_output, write_tiny_model

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def content(block_hash: bytes, layer: str, n: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(bytes(block_hash) + layer.encode(), digest_size=8).digest())
    return torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, n, dtype=np.int8))


@pytest.mark.parametrize(("policy", "sync_budget"), [("adaptive", 0), ("lru", 1 << 20)])
def test_vllm_scheduler_serves_offloaded_prefixes_byte_exact(
    model_dir, policy: str, sync_budget: int
) -> None:
    rng = np.random.default_rng(3)
    extra = {"blocks_per_chunk": 2, "aiokv_backend": "cpu", "aiokv_policy": policy}
    if sync_budget:  # vLLM then loads small hits synchronously, within the step
        extra["sync_load_budget_bytes"] = sync_budget
    vc, kc = build_configs(
        model_dir, extra=extra, groups=[Group(("l0", "l1"), pad_bytes=64)], num_gpu_blocks=40
    )
    chunk = -(-(kc.kv_cache_tensors[0].size // kc.num_blocks * 2) // 512) * 512
    vc.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = 24 * chunk
    vc.scheduler_config.async_scheduling = False
    caches, rows = layer_caches(kc, seed=5)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kc, vc)
    scheduler = Scheduler(
        vllm_config=vc,
        kv_cache_config=kc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    worker = OffloadingConnector(vc, KVConnectorRole.WORKER, kc)
    with set_current_vllm_config(vc):
        worker.register_kv_caches(caches)
    spec = worker.connector_worker.spec
    assert type(spec).__name__ == "AiokvOffloadingSpec"
    manager = scheduler.connector.connector_scheduler.manager
    assert type(manager).__name__ == "AiokvOffloadingManager"
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    layers = {name: kc.kv_cache_groups[0].kv_cache_spec.unpadded_page_size_bytes for name in ("l0", "l1")}
    docs = [rng.integers(10, 900, int(rng.integers(6, 10)) * BS).tolist() for _ in range(12)]
    blocks_of = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks

    def check(req: Request) -> int:
        ids = blocks_of[req.request_id]
        full = req.num_computed_tokens // BS
        for i in range(full):
            for layer, n in layers.items():
                got = rows[layer][ids[i].block_id, :n]
                assert torch.equal(got, content(req.block_hashes[i], layer, n)), (req.request_id, i, layer)
        return full

    loads = sync_loads = checked = 0
    added = 0
    for _ in range(400):
        if added < 80 and rng.random() < 0.6:
            doc = docs[int(rng.integers(len(docs)))]
            prompt = doc[: int(rng.integers(2, len(doc) // BS + 1)) * BS] + rng.integers(10, 900, 5).tolist()
            scheduler.add_request(
                Request(
                    request_id=f"q{added}",
                    prompt_token_ids=prompt,
                    pooling_params=None,
                    block_hasher=hasher,
                    sampling_params=SamplingParams(max_tokens=int(rng.integers(1, 6)), ignore_eos=True),
                )
            )
            added += 1
        if not scheduler.requests:
            if added >= 80:
                break
            continue
        out = scheduler.schedule()
        meta = out.kv_connector_metadata
        loads += len(meta.load_jobs)
        sync_loads += sum(job.sync for job in meta.load_jobs.values())
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        # The forward pass: blocks that became full this step get their hash's bytes.
        for rid, n in out.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            ids = blocks_of[rid]
            for i in range(
                (req.num_computed_tokens - n) // BS, min(req.num_computed_tokens // BS, len(req.block_hashes))
            ):
                for layer, size in layers.items():
                    rows[layer][ids[i].block_id, :size] = content(req.block_hashes[i], layer, size)
        if out.total_num_scheduled_tokens > 0:
            worker.wait_for_save()
        sending, recving = worker.get_finished(out.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        running = list(scheduler.running)
        scheduler.update_from_output(
            out,
            model_runner_output(
                [r.request_id for r in running],
                sampled_token_ids=[[int(rng.integers(10, 900))] for _ in running],
                logprobs=None,
                prompt_logprobs_dict={},
                pooler_output=None,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=sending,
                    finished_recving=recving,
                    kv_connector_worker_meta=worker_meta,
                ),
            ),
        )
        for req in scheduler.running:
            checked += check(req)
    assert not scheduler.requests, "requests left unfinished"
    stats = manager.chunks.stats()
    assert loads > 5 and stats.stores > 20 and stats.evictions > 0 and checked > 500, (loads, stats, checked)
    assert (sync_loads > 0) == bool(sync_budget), sync_loads
    worker.shutdown()
