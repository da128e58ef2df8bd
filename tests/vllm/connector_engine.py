"""vLLM's real Scheduler and AiokvConnector (or vLLM's OffloadingConnector with the spec) in
both roles, driven in the model runner's order, with a forward pass that runs layer by
layer (vLLM tests only).

The forward calls the connector's hooks around each attention layer as vLLM's attention
wrapper does: ``wait_for_layer_load``, then the layer reads its context and writes its new
tokens, then ``save_kv_layer``. A block's bytes are a fixed random function of its block
hash and layer, as real KV is of its tokens; blocks a step will write, and blocks a load
will fill, hold fresh garbage until then, so a store that copies a layer before it is
written, or a layer read before its load landed, shows as wrong bytes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
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

from aiokv.integrations.vllm.connector import AiokvConnector

from .harness import Group, build_configs, layer_caches, model_runner_output

BS = 16
# Listed out of forward order on purpose: the connector numbers layers by their names.
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in (1, 0, 2))
FORWARD = sorted(LAYERS)


def content(block_hash: bytes, layer: str, n: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(bytes(block_hash) + layer.encode(), digest_size=8).digest())
    return torch.from_numpy(np.random.default_rng(seed).integers(-128, 128, n, dtype=np.int8))


@dataclass
class Tally:
    steps: int = 0
    loads: int = 0
    loaded_blocks: int = 0  # GPU blocks the loads filled (hits from host memory)
    sync_loads: int = 0
    steps_with_sync_loads: int = 0
    flushes: int = 0  # store jobs a step had to finish before reusing their blocks
    checked_in_layer: int = 0
    checked: int = 0
    invalid_blocks: int = 0
    failed_recving: int = 0
    misread: set[str] = field(default_factory=set)  # requests that read a bad layer


class ConnectorEngine:
    """One engine: the scheduler, the worker-role connector over CPU tensors, the forward."""

    def __init__(self, model_dir: Path, *, extra: dict[str, Any], chunks: int = 24, gpu_blocks: int = 40,
                 seed: int = 3, blocks_per_chunk: int = 2, connector: str = "AiokvConnector") -> None:
        self.rng = np.random.default_rng(seed)
        extra = {"blocks_per_chunk": blocks_per_chunk, "aiokv_backend": "cpu", **extra}
        vc, kc = build_configs(model_dir, extra=extra, groups=[Group(LAYERS, pad_bytes=64)],
                               num_gpu_blocks=gpu_blocks, connector=connector)
        chunk = -(-(kc.kv_cache_tensors[0].size // kc.num_blocks // len(LAYERS) * len(LAYERS)
                    * blocks_per_chunk) // 512) * 512
        vc.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = chunks * chunk
        vc.scheduler_config.async_scheduling = False
        self.caches, self.rows = layer_caches(kc, seed=seed + 2)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kc, vc)
        self.scheduler = Scheduler(
            vllm_config=vc, kv_cache_config=kc, structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size, hash_block_size=hash_block_size, log_stats=True,
        )
        kind = AiokvConnector if connector == "AiokvConnector" else OffloadingConnector
        self.worker = kind(vc, KVConnectorRole.WORKER, kc)
        with set_current_vllm_config(vc):
            self.worker.register_kv_caches(self.caches)
        assert type(self.scheduler.connector) is kind
        self.vllm_config = vc
        self.manager = self.scheduler.connector.connector_scheduler.manager
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        self.page = {n: kc.kv_cache_groups[0].kv_cache_spec.unpadded_page_size_bytes for n in LAYERS}
        rng = self.rng
        self.docs = [rng.integers(10, 900, int(rng.integers(6, 10)) * BS).tolist() for _ in range(12)]
        self.blocks_of = self.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        self.added = 0
        self.tally = Tally()
        self.strict = True  # a bad byte fails at once (else it is recorded in tally.misread)

    @property
    def aiokv_worker(self) -> Any:
        return self.worker.connector_worker.worker.aiokv_worker

    def add_request(self, doc_index: int | None = None) -> None:
        rng = self.rng
        doc = self.docs[int(rng.integers(len(self.docs))) if doc_index is None else doc_index]
        prompt = doc[: int(rng.integers(2, len(doc) // BS + 1)) * BS] + rng.integers(10, 900, 5).tolist()
        self.scheduler.add_request(Request(
            request_id=f"q{self.added}", prompt_token_ids=prompt, pooling_params=None,
            block_hasher=self.hasher,
            sampling_params=SamplingParams(max_tokens=int(rng.integers(1, 6)), ignore_eos=True),
        ))
        self.added += 1

    def garbage(self, block_ids: Any) -> None:
        for name in LAYERS:
            for b in block_ids:
                self.rows[name][int(b)] = torch.from_numpy(
                    self.rng.integers(-128, 128, self.rows[name].shape[1], dtype=np.int8))

    def _expect(self, req: Request, i: int, layer: str) -> bool:
        n = self.page[layer]
        got = self.rows[layer][self.blocks_of[req.request_id][i].block_id, :n]
        ok = torch.equal(got, content(req.block_hashes[i], layer, n))
        if not ok:
            if self.strict:
                raise AssertionError(f"{req.request_id}: block {i} of {layer}")
            self.tally.misread.add(req.request_id)
        return ok

    def step(self) -> tuple[set[int], set[str]]:
        """One engine step; returns (invalid block ids, failed receives) it reported."""
        sched, worker, tally = self.scheduler, self.worker, self.tally
        out = sched.schedule()
        meta = out.kv_connector_metadata
        tally.steps += 1
        tally.loads += len(meta.load_jobs)
        tally.loaded_blocks += sum(len(job.dst_spec.block_ids) for job in meta.load_jobs.values())
        tally.sync_loads += sum(job.sync for job in meta.load_jobs.values())
        tally.flushes += len(meta.jobs_to_flush or ())
        worker.handle_preemptions(meta)
        new: dict[str, range] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            new[rid] = range((req.num_computed_tokens - n) // BS,
                             min(req.num_computed_tokens // BS, len(req.block_hashes)))
            self.garbage(self.blocks_of[rid][i].block_id for i in new[rid])
        for job in meta.load_jobs.values():
            self.garbage(job.dst_spec.block_ids)
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            tally.steps_with_sync_loads += 1
            worker.start_load_kv(None)
        if out.total_num_scheduled_tokens:
            for layer in FORWARD:
                worker.wait_for_layer_load(layer)
                n = self.page[layer]
                for rid in out.num_scheduled_tokens:
                    req = sched.requests[rid]
                    for i in range(new[rid].start):  # the context this layer's attention reads
                        tally.checked_in_layer += self._expect(req, i, layer)
                    for i in new[rid]:  # this layer's new KV
                        block = self.blocks_of[rid][i].block_id
                        self.rows[layer][block, :n] = content(req.block_hashes[i], layer, n)
                worker.save_kv_layer(layer, None, None)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        tally.invalid_blocks += len(invalid)
        tally.failed_recving += len(results.failed_recving)
        running = list(sched.running)
        sched.update_from_output(out, model_runner_output(
            [r.request_id for r in running],
            sampled_token_ids=[[int(self.rng.integers(10, 900))] for _ in running],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            ),
        ))
        for req in sched.running:
            for i in range(req.num_computed_tokens // BS):
                for layer in LAYERS:
                    tally.checked += self._expect(req, i, layer)
        return invalid, results.failed_recving

    def run(self, requests: int = 80, max_steps: int = 600) -> Tally:
        for _ in range(max_steps):
            if self.added < requests and self.rng.random() < 0.6:
                self.add_request()
            if not self.scheduler.requests:
                if self.added >= requests:
                    break
                continue
            self.step()
        assert not self.scheduler.requests, "requests left unfinished"
        return self.tally

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
