"""Hundreds of engine steps through vLLM's own connector worker and our manager.

The spec is built by vLLM's ``OffloadingConnector`` through ``OffloadingSpecFactory`` from
the documented config (both roles, as two processes would). A small scheduler here calls
the manager and ``OffloadingConnectorWorker`` in vLLM's per-step order: flush and deferred
stores, loads (some synchronous), the forward pass, this step's stores, finished jobs.
Every block's bytes are a fixed random function of its key, as real KV is of its tokens,
so every loaded block is checked byte for byte against what was stored under its key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key

from .harness import Group, build_configs, connectors, layer_caches, write_tiny_model

BPC = 2  # GPU blocks per host chunk
GROUPS = [Group(("l0", "l1"), pad_bytes=64), Group(("l2",), head_size=16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@dataclass
class Req:
    rid: str
    chunks: list[bytes]  # chunk hashes, prefix order
    blocks: list[int]  # one GPU block per (chunk, sub-block), shared by every group's table
    ctx: ReqContext
    hit: int = 0  # chunks loaded
    skip: int = 0  # blocks of the first chunk already on the GPU (not loaded)
    computed: bool = False
    ttl: int = 0
    load_job: int | None = None
    stores: set[int] = field(default_factory=set)


class Rig:
    """The scheduler half of the loop (what OffloadingConnectorScheduler would do), kept
    small enough to state every expectation."""

    def __init__(self, model_dir, *, policy: str, seed: int, num_gpu_blocks: int = 96, chunks: int = 40):
        self.rng = np.random.default_rng(seed)
        extra = {"blocks_per_chunk": BPC, "aiokv_policy": policy, "aiokv_backend": "cpu"}
        vc, kc = build_configs(model_dir, extra=extra, groups=GROUPS, num_gpu_blocks=num_gpu_blocks)
        # cpu_bytes_to_use for ``chunks`` chunks, as the spec sizes one (512-byte aligned).
        chunk = -(-(kc.kv_cache_tensors[0].size // num_gpu_blocks * BPC) // 512) * 512
        vc.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = chunks * chunk
        self.caches, self.rows = layer_caches(kc, seed)
        scheduler, worker = connectors(vc, kc, self.caches)
        self.spec = worker.connector_worker.spec
        self.manager = scheduler.connector_scheduler.manager
        assert self.spec.num_chunks == self.manager.num_chunks == chunks
        self.cw = worker.connector_worker
        self.unpadded = {
            n: g.kv_cache_spec.unpadded_page_size_bytes for g in kc.kv_cache_groups for n in g.layer_names
        }
        self.layers = [list(g.layer_names) for g in kc.kv_cache_groups]
        self.free = list(range(1, kc.num_blocks))
        self.pending_on_block: dict[int, set[int]] = {}
        self.jobs: dict[int, tuple[str, list[bytes], Req, bool]] = {}
        self.next_job = 0
        self.reqs: dict[str, Req] = {}
        self.docs = [
            [hashlib.sha256(f"{seed}/{d}/{i}".encode()).digest() for i in range(8)] for d in range(6)
        ]
        self.loaded_blocks = 0
        self.sync_loads = 0
        self.flushes = 0
        self.failed_stores = 0
        self.refused_stores = 0
        self.evicted: set[bytes] = set()
        self.n = 0

    # -- content -----------------------------------------------------------------------

    def content(self, key: bytes, sub: int, layer: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(key + bytes([sub]) + layer.encode(), digest_size=8).digest())
        return np.random.default_rng(seed).integers(-128, 128, self.unpadded[layer], dtype=np.int8)

    def key(self, chunk: bytes, g: int) -> bytes:
        return make_offload_key(chunk, g)

    def write_block(self, req: Req, c: int, sub: int) -> None:
        b = req.blocks[c * BPC + sub]
        for g, layers in enumerate(self.layers):
            for layer in layers:
                self.rows[layer][b, : self.unpadded[layer]] = _t(
                    self.content(self.key(req.chunks[c], g), sub, layer)
                )

    def check_block(self, req: Req, c: int, sub: int) -> None:
        b = req.blocks[c * BPC + sub]
        for g, layers in enumerate(self.layers):
            for layer in layers:
                got = self.rows[layer][b, : self.unpadded[layer]].numpy()
                want = self.content(self.key(req.chunks[c], g), sub, layer)
                assert np.array_equal(got, want), (
                    f"{req.rid}: chunk {c}.{sub} of group {g} ({layer}) in block {b}"
                )

    # -- one engine step ---------------------------------------------------------------

    def step(self) -> None:
        self.n += 1
        load_jobs: dict[int, TransferJob] = {}
        flush: set[int] = set()
        with self.manager.lock:
            for _ in range(int(self.rng.integers(0, 3))):
                self.admit(load_jobs, flush)
        meta = OffloadingConnectorMetadata(load_jobs=load_jobs, store_jobs={}, jobs_to_flush=flush or None)
        self.flushes += len(flush)
        # Worker, in the model runner's order.
        self.cw.handle_preemptions(meta)
        for jid in load_jobs:  # written only now: a flushed store may have been reading them
            req = self.jobs[jid][2]
            for sub in range(req.skip):
                self.write_block(req, 0, sub)
        self.cw.start_kv_transfers(meta)
        for jid, job in load_jobs.items():
            if job.sync:  # waited on before the forward: its bytes are there now
                self.check_loaded(self.jobs[jid][2])
        # The forward: requests whose prefix is in place compute the rest.
        with self.manager.lock:
            store_jobs: dict[int, TransferJob] = {}
            for req in list(self.reqs.values()):
                if not req.computed and req.load_job is None:
                    self.compute(req, store_jobs)
                elif req.computed:
                    req.ttl -= 1
                    if req.ttl <= 0:
                        self.finish(req)
        # Queued by the connector, submitted at the start of the next step (vLLM's deferral).
        self.cw.prepare_store_kv(OffloadingConnectorMetadata(load_jobs={}, store_jobs=store_jobs))
        _, recving = self.cw.get_finished(set())
        done = self.cw.build_connector_worker_meta()
        with self.manager.lock:
            for jid in done.completed_jobs if done else {}:
                self.complete(jid)
        for rid in recving:
            assert self.reqs[rid].load_job is None

    def admit(self, load_jobs: dict[int, TransferJob], flush: set[int]) -> None:
        doc = self.docs[int(self.rng.integers(len(self.docs)))]
        chunks = doc[: int(self.rng.integers(1, len(doc) + 1))]
        chunks = chunks + [self.rng.bytes(32) for _ in range(int(self.rng.integers(0, 3)))]
        need = len(chunks) * BPC
        if need > len(self.free):
            return
        blocks = [self.free.pop(int(self.rng.integers(len(self.free)))) for _ in range(need)]
        for b in blocks:  # reused while a store may still read it: flush first (vLLM's fence)
            flush |= self.pending_on_block.pop(b, set())
        rid = f"r{self.n}-{len(self.reqs)}-{self.rng.integers(1 << 30)}"
        req = Req(rid, chunks, blocks, ReqContext(req_id=rid), ttl=int(self.rng.integers(1, 4)))
        self.manager.on_new_request(req.ctx)
        self.reqs[rid] = req
        hit = 0
        for chunk in chunks:
            if any(
                self.manager.lookup(self.key(chunk, g), req.ctx) is not LookupResult.HIT
                for g in range(len(self.layers))
            ):
                break
            hit += 1
        if hit == 0:
            return
        keys = [self.key(c, g) for g in range(len(self.layers)) for c in chunks[:hit]]
        src = self.manager.prepare_load(keys, req.ctx)
        req.hit = hit
        req.skip = int(self.rng.integers(0, BPC))  # the GPU prefix cache holds these blocks
        ids = [b for _ in self.layers for b in blocks[req.skip : hit * BPC]]
        dst = GPULoadStoreSpec(
            ids,
            group_sizes=[hit * BPC - req.skip] * len(self.layers),
            block_indices=[req.skip] * len(self.layers),
        )
        sync = bool(self.rng.random() < 0.4)
        jid = self.new_job("load", keys, req, sync)
        req.load_job = None if sync else jid
        load_jobs[jid] = TransferJob(req_id=rid, src_spec=src, dst_spec=dst, sync=sync)
        self.sync_loads += sync

    def check_loaded(self, req: Req) -> None:
        for c in range(req.hit):
            for sub in range(req.skip if c == 0 else 0, BPC):
                self.check_block(req, c, sub)
                self.loaded_blocks += 1

    def compute(self, req: Req, store_jobs: dict[int, TransferJob]) -> None:
        for c in range(req.hit, len(req.chunks)):
            for sub in range(BPC):
                self.write_block(req, c, sub)
        req.computed = True
        new = req.chunks[req.hit :]
        if not new:
            return
        keys = [self.key(c, g) for g in range(len(self.layers)) for c in new]
        out = self.manager.prepare_store(keys, req.ctx)
        if out is None:
            self.refused_stores += 1
            return
        for k in out.evicted_keys:
            assert self.manager.lookup(k, req.ctx) is LookupResult.MISS
            self.evicted.add(k)
        if not out.keys_to_store:
            return
        chosen = set(out.keys_to_store)
        ids, sizes, starts = [], [], []
        for g in range(len(self.layers)):
            first = None
            n = 0
            for i, c in enumerate(new):
                if self.key(c, g) in chosen:
                    idx = (req.hit + i) * BPC
                    first = idx if first is None else first
                    ids += req.blocks[idx : idx + BPC]
                    n += BPC
            sizes.append(n)
            starts.append(first or 0)
        fail = bool(self.rng.random() < 0.05)
        jid = self.new_job("store", list(out.keys_to_store), req, fail)
        req.stores.add(jid)
        store_jobs[jid] = TransferJob(
            req_id=req.rid,
            src_spec=GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=starts),
            dst_spec=out.store_spec,
        )

    def finish(self, req: Req) -> None:
        """Finished or preempted: its blocks go back; stores still reading them fence reuse."""
        for b in req.blocks:
            if req.stores:
                self.pending_on_block[b] = set(req.stores)
            self.free.append(b)
        self.manager.on_request_finished(req.ctx)
        del self.reqs[req.rid]

    def new_job(self, kind: str, keys: list[bytes], req: Req, flag: bool) -> int:
        self.next_job += 1
        self.jobs[self.next_job] = (kind, keys, req, flag)
        return self.next_job

    def complete(self, jid: int) -> None:
        kind, keys, req, flag = self.jobs.pop(jid)
        if kind == "load":
            if not flag:  # an asynchronous load: reported once its bytes landed
                self.check_loaded(req)
            self.manager.complete_load(keys, req.ctx)
            req.load_job = None
            return
        for blocks in self.pending_on_block.values():
            blocks.discard(jid)
        req.stores.discard(jid)
        if flag:  # the store is reported lost: its keys must never load
            self.manager.complete_store(keys, req.ctx, success=False)
            self.failed_stores += 1
            for k in keys:
                assert self.manager.lookup(k, req.ctx) is LookupResult.MISS
        else:
            self.manager.complete_store(keys, req.ctx)

    def check_all_running(self) -> None:
        for req in self.reqs.values():
            if req.computed:
                for c in range(len(req.chunks)):
                    for sub in range(BPC):
                        self.check_block(req, c, sub)


def _t(a: np.ndarray):
    import torch

    return torch.from_numpy(a)


@pytest.mark.parametrize("policy", ["adaptive", "lru", "arc"])
def test_hundreds_of_steps_load_what_was_stored(model_dir, policy: str) -> None:
    rig = Rig(model_dir, policy=policy, seed=7)
    assert type(rig.spec).__name__ == "AiokvOffloadingSpec"
    assert type(rig.manager).__name__ == "AiokvOffloadingManager"
    assert type(rig.cw.worker).__name__ == "AiokvOffloadingWorker"
    for i in range(300):
        rig.step()
        if i % 10 == 0:
            rig.check_all_running()
    while rig.jobs:
        rig.step()
        if rig.n > 2000:
            raise AssertionError("jobs never finished")
    rig.manager.chunks.check_invariants()
    stats = rig.manager.chunks.stats()
    assert stats.pinned_keys == 0 and stats.pending_keys == 0
    # The run exercised what it claims to.
    assert rig.loaded_blocks > 200 and rig.sync_loads > 10, (rig.loaded_blocks, rig.sync_loads)
    assert rig.flushes > 0 and rig.failed_stores > 0 and stats.evictions > 0
    rig.cw.shutdown()
