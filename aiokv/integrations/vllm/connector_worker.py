"""The worker half of ``AiokvConnector``: one engine step's transfers, layer by layer.

vLLM's model runner calls, per step: ``handle_preemptions`` (fence block reuse), bind the
metadata, ``start_load_kv`` (before the forward when the step has synchronous loads, after
it otherwise), ``wait_for_layer_load`` / ``save_kv_layer`` around each attention layer,
``wait_for_save``, then the results. Here a step's synchronous loads become one layerwise
aiokv job (every layer enqueued at once, each attention layer gated on its own layer), and
its stores one layerwise job opened when the metadata is bound, each layer pushed as its
attention layer finishes. Asynchronous loads stay whole jobs, as in vLLM's own worker.
Failures never raise inside the forward: a failed synchronous load is reported as blocks
to recompute (``get_block_ids_with_load_errors``), a failed asynchronous one as a failed
receive, a failed store as a failed job (never published).

The worker itself is the spec plug-in's (``AiokvOffloadingSpec.get_worker``); this class
reuses vLLM's ``OffloadingConnectorWorker`` only for turning the registered KV caches into
vLLM's canonical description.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
    TransferStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

from ... import LayerwiseJob
from ...errors import InvalidSpec
from .connector_jobs import Batch, JobSpec, layer_order, merge_jobs

__all__ = ["NATIVE_FAILED_JOBS", "AiokvConnectorWorker", "AiokvWorkerMetadata"]

_log = logging.getLogger("aiokv")

# vLLM 0.34's scheduler reads failed jobs from the worker metadata; 0.33's has no such field.
NATIVE_FAILED_JOBS = "failed_jobs" in {f.name for f in fields(OffloadingWorkerMetadata)}


@dataclass
class AiokvWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler metadata, with the failed jobs on every release (0.33's
    lacks them; ``AiokvConnector`` reads them there itself)."""

    failed_jobs: set[int] = field(default_factory=set)

    def mark_completed(self, job_id: int, success: bool = True) -> None:
        self.completed_jobs[job_id] = 1
        if not success:
            self.failed_jobs.add(job_id)

    def aggregate(self, other: Any) -> AiokvWorkerMetadata:
        merged = dict(self.completed_jobs)
        for job_id, count in other.completed_jobs.items():
            merged[job_id] = merged.get(job_id, 0) + count
        return AiokvWorkerMetadata(
            completed_jobs=merged,
            transfer_stats=self.transfer_stats.aggregate(other.transfer_stats),
            failed_jobs=self.failed_jobs | set(getattr(other, "failed_jobs", ())),
        )


@dataclass
class _KVWithLayers:
    """vLLM's canonical KV caches plus the layer of each ref (read by aiokv's layout)."""

    tensors: Any
    group_data_refs: Any
    ref_layers: list[list[int]]


@dataclass
class _Record:
    """One aiokv job in flight: what it stands for."""

    kind: str  # "store", "load" (asynchronous) or "sync"
    batch: Batch
    req_ids: dict[int, str]
    layers: LayerwiseJob | None = None  # the layerwise handle, if layerwise


@dataclass
class _Step:
    """The bound step's layerwise jobs."""

    loads: list[LayerwiseJob] = field(default_factory=list)
    sync_ids: list[int] = field(default_factory=list)
    stores: list[LayerwiseJob] = field(default_factory=list)
    whole_stores: list[Batch] = field(default_factory=list)
    pushed: set[int] = field(default_factory=set)
    saved: bool = False


class AiokvConnectorWorker(OffloadingConnectorWorker):
    """Runs each step's transfers on the spec plug-in's worker, layer by layer where the KV
    caches have a tensor per layer (whole jobs otherwise, as vLLM's own worker does)."""

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        groups = [kv_cache_config.kv_cache_groups[g] for g in get_offloading_group_ids(kv_cache_config)]
        hooked = {name for g in groups for name in g.layer_names if _has_hooks(g.kv_cache_spec, name)}
        repeated = {name for g in groups if getattr(g, "is_eagle_group", False) for name in g.layer_names}
        if vllm_config.parallel_config.use_ubatching:  # each layer runs once per micro-batch
            repeated = {name for g in groups for name in g.layer_names}
        self.order = layer_order([g.layer_names for g in groups], hooked.__contains__, repeated.__contains__)
        self._num_groups = len(groups)
        # vLLM maps failed blocks back to requests only for one KV-cache group.
        self._block_errors_ok = len(kv_cache_config.kv_cache_groups) == 1
        self._layerwise = False
        self._jobs: dict[int, _Record] = {}
        self._aiokv_of: dict[int, int] = {}  # vLLM job id -> aiokv job id
        self._req_of: dict[int, str] = {}  # vLLM job id -> request id, until submitted
        self._next_id = 0
        self._step: _Step | None = None
        self._meta = AiokvWorkerMetadata()
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()

    # -- registration -------------------------------------------------------------------

    def _init_worker(self, kv_caches: Any) -> None:
        """The spec plug-in's worker over vLLM's canonical caches, each ref tagged with its
        layer, so layerwise jobs move layers in forward order."""
        self._kv_caches = kv_caches
        refs = kv_caches.group_data_refs
        tensors = {int(r.tensor_idx) for group in refs for r in group}
        per_layer = ([len(group) for group in refs] == [len(g) for g in self.order.ref_layers]
                     and len(tensors) >= 2 and self.order.num_layers >= 2)
        if per_layer:
            kv_caches = _KVWithLayers(kv_caches.tensors, refs, self.order.ref_layers)
        else:
            _log.warning("aiokv: vLLM's KV caches here have no tensor per layer (a packed layout), so "
                         "the connector moves whole jobs, not layer by layer")
        self.worker = self.spec.get_worker(kv_caches)
        self._sync = self.worker.aiokv_worker
        self._layerwise = per_layer

    # -- the step -----------------------------------------------------------------------

    def handle_preemptions(self, metadata: Any) -> None:
        """Before the forward may overwrite blocks that older stores still read: finish
        those stores (vLLM's ``jobs_to_flush``)."""
        self._finish_step()
        flush = metadata.jobs_to_flush or set()
        for job_id in flush:
            entry = metadata.store_jobs.pop(job_id, None)
            if entry is not None:  # never started: copy it whole now
                self._submit_batches("store", [(job_id, entry)], layerwise=False)
        waits = [self._aiokv_of[j] for j in flush if j in self._aiokv_of]
        if waits:
            self._sync.wait(waits)

    def begin_step(self, metadata: Any) -> None:
        """The metadata is bound: open this step's stores, so the forward can push layers."""
        self._finish_step()
        step = self._step = _Step()
        stores = list(metadata.store_jobs.items())
        if not stores:
            return
        if self._layerwise:
            ids = self._submit_batches("store", stores, layerwise=True)
            step.stores = self._handles(ids)
        else:
            step.whole_stores = self._batches(stores, store=True)

    def start_load_kv(self, metadata: Any) -> None:
        """Submit the step's loads: asynchronous ones whole, synchronous ones as one
        layerwise job whose layers without hooks are waited on now."""
        if self._step is None:
            self._step = _Step()
        step = self._step
        sync = [(j, e) for j, e in metadata.load_jobs.items() if e.sync]
        for job in metadata.load_jobs.items():
            if not job[1].sync:
                self._submit_batches("load", [job], layerwise=False)
        if not sync:
            return
        ids = self._submit_batches("sync", sync, layerwise=self._layerwise)
        step.sync_ids += ids
        if not self._layerwise:  # whole jobs: done before the forward, as in vLLM's worker
            self._sync.wait(ids)
            return
        handles = self._handles(ids)
        step.loads += handles
        for layer in self.order.early:
            for handle in handles:
                handle.gate(layer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the forward wait for this layer of the step's synchronous loads (on CUDA
        its stream waits on the layer's event; the host does not block)."""
        step = self._step
        layer = self.order.layer_of.get(layer_name)
        if step is None or not step.loads or layer is None:
            return
        for handle in step.loads:
            handle.gate(layer)  # a failed layer is reported after the forward, not here

    def save_kv_layer(self, layer_name: str) -> None:
        """This layer's KV is written (its attention ran): push it to the step's stores,
        behind the compute enqueued so far."""
        step = self._step
        layer = self.order.layer_of.get(layer_name)
        if step is None or not step.stores or layer is None or layer in step.pushed:
            return
        if layer in self.order.late_push:
            return
        step.pushed.add(layer)
        for handle in step.stores:
            handle.push(layer)

    def wait_for_save(self) -> None:
        """The step's forwards are over: push every layer not pushed yet (or submit the
        step's stores whole), so the stores complete without blocking the step."""
        step = self._step
        if step is None or step.saved:
            return
        step.saved = True
        for layer in range(self.order.num_layers if step.stores else 0):
            if layer not in step.pushed:
                step.pushed.add(layer)
                for handle in step.stores:
                    handle.push(layer)
        for batch in step.whole_stores:
            self._submit_batch("store", batch, layerwise=False)
        step.whole_stores = []

    def _finish_step(self) -> None:
        """Close the previous step if vLLM never called ``wait_for_save`` for it."""
        if self._step is not None:
            self.wait_for_save()
        self._step = None

    def end_step(self) -> None:
        self._finish_step()

    # -- results ------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished sending: always empty, stores report through the worker metadata;
        finished receiving: requests whose asynchronous load ended, failed or not)."""
        self._settle()
        recving, self._recving = self._recving, set()
        return set(), recving

    def take_failed_recving(self) -> set[str]:
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of this step's synchronous loads that must be recomputed (their
        request's token this step is discarded by vLLM's scheduler)."""
        self._settle()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> AiokvWorkerMetadata | None:
        if not self._meta.completed_jobs:
            return None
        meta, self._meta = self._meta, AiokvWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        self._step = None
        if self.worker is not None:
            self.worker.shutdown()

    def _settle(self) -> None:
        """Wait for this step's synchronous loads (the forward has been enqueued behind
        them, so this costs the host at most the load's tail), then collect every result."""
        step = self._step
        if step is not None and step.sync_ids:
            ids, step.sync_ids = step.sync_ids, []
            self._sync.wait(ids)
        for result in self._sync.get_finished():
            self._report(result)

    def _report(self, result: Any) -> None:
        record = self._jobs.pop(result.job_id)
        for job_id in record.batch.job_ids:
            self._aiokv_of.pop(job_id, None)
        if result.success:
            failed: set[int] = set()
            if result.transfer_size is not None and result.transfer_time is not None:
                stats: TransferStats = self._meta.transfer_stats
                side = stats.store if record.kind == "store" else stats.load
                side.record(result.transfer_size, result.transfer_time)
        else:
            blocks = record.layers.failed_blocks() if record.layers is not None else None
            failed = record.batch.failed_jobs(blocks or None)
        bad_blocks: set[int] = set()
        for job in record.batch.jobs:
            ok = job.job_id not in failed
            self._meta.mark_completed(job.job_id, ok)
            if record.kind == "load":
                req = record.req_ids[job.job_id]
                self._recving.add(req)
                if not ok:
                    self._failed_recving.add(req)
            elif record.kind == "sync" and not ok:
                bad_blocks.update(int(b) for b in job.blocks)
        if bad_blocks:
            if not self._block_errors_ok:
                raise RuntimeError(
                    f"aiokv: synchronous KV load job(s) {sorted(failed)} failed, and vLLM can only "
                    "recompute single blocks of a model with one KV-cache group"
                )
            self._load_errors |= bad_blocks

    # -- submitting ---------------------------------------------------------------------

    def _handles(self, ids: list[int]) -> list[LayerwiseJob]:
        """The layerwise handles of the aiokv jobs ``ids``."""
        return [h for i in ids if (h := self._jobs[i].layers) is not None]

    def _batches(self, jobs: Iterable[tuple[int, Any]], store: bool) -> list[Batch]:
        """vLLM's jobs ``(job id, TransferJob)`` merged into as few aiokv jobs as fit."""
        bpc = self.spec.blocks_per_chunk
        specs = []
        for job_id, entry in jobs:
            gpu, cpu = (entry.src_spec, entry.dst_spec) if store else (entry.dst_spec, entry.src_spec)
            specs.append(JobSpec.read(job_id, gpu, cpu, self._num_groups, bpc))
            self._req_of[job_id] = entry.req_id
        return merge_jobs(specs, self._num_groups)

    def _submit_batches(self, kind: str, jobs: list[tuple[int, Any]], *, layerwise: bool) -> list[int]:
        ids: list[int] = []
        for batch in self._batches(jobs, kind == "store"):
            ids += self._submit_batch(kind, batch, layerwise=layerwise)
        return ids

    def _submit_batch(self, kind: str, batch: Batch, *, layerwise: bool) -> list[int]:
        """Submit ``batch`` as one aiokv job (its id listed); a merged batch aiokv refuses
        is submitted job by job, so only the bad job raises."""
        try:
            return [self._submit_one(kind, batch, layerwise)]
        except InvalidSpec:
            if len(batch.jobs) == 1:
                raise
        ids: list[int] = []
        for job in batch.jobs:
            ids += self._submit_batch(kind, Batch([job], job.gpu_spec, job.cpu_spec), layerwise=layerwise)
        return ids

    def _submit_one(self, kind: str, batch: Batch, layerwise: bool) -> int:
        job_id = self._next_id
        sync = self._sync
        layers = None
        if kind == "store":
            if layerwise:
                layers = sync.submit_store(job_id, batch.gpu_spec, batch.cpu_spec, layerwise=True)
            else:
                sync.submit_store(job_id, batch.gpu_spec, batch.cpu_spec)
        elif layerwise:
            layers = sync.submit_load(job_id, batch.cpu_spec, batch.gpu_spec, kind == "sync", layerwise=True)
        else:
            sync.submit_load(job_id, batch.cpu_spec, batch.gpu_spec, kind == "sync")
        self._next_id += 1
        reqs = {j: self._req_of.pop(j) for j in batch.job_ids}
        self._jobs[job_id] = _Record(kind, batch, reqs, layers)
        for vllm_id in batch.job_ids:
            self._aiokv_of[vllm_id] = job_id
        return job_id


def _has_hooks(group_spec: Any, layer_name: str) -> bool:
    """Whether vLLM calls the per-layer hooks around this layer: attention layers do."""
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        group_spec = group_spec.kv_cache_specs.get(layer_name, group_spec)
    return isinstance(group_spec, AttentionSpec)
