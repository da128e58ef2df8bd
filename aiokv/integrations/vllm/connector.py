"""``AiokvConnector``: a KV connector for vLLM, loaded with ``kv_connector_module_path``.

It is vLLM's ``OffloadingConnector`` with aiokv's offloading spec built in (the scheduler
half, its manager and the worker are the spec plug-in's) and the per-layer hooks filled:
a step's synchronous loads run as one layerwise aiokv job that each attention layer waits
on for its own layer only, and a step's stores take each layer as its attention layer
finishes. By default every hit that leaves a token to compute loads synchronously, so
its request computes in the step that loads it. The hooks run between CUDA-graph pieces,
so the connector asks vLLM for piecewise CUDA graphs (docs/vllm.md, "The connector").
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from ._compat import check_vllm_version
from .connector_config import connector_extra_config
from .connector_worker import NATIVE_FAILED_JOBS, AiokvConnectorWorker, AiokvWorkerMetadata
from .spec import AiokvOffloadingSpec

__all__ = ["AiokvConnector"]


class AiokvConnector(OffloadingConnector):
    """vLLM KV connector backed by aiokv, layer by layer (select it with
    ``"kv_connector": "AiokvConnector", "kv_connector_module_path": "aiokv.integrations.vllm"``).

    Reads the same ``kv_connector_extra_config`` as ``AiokvOffloadingSpec`` (docs/vllm.md),
    plus vLLM's ``sync_load_budget_bytes`` (default: unbounded).

    Raises (at construction):
        UsageError: the installed vLLM is outside the tested range.
        InvalidSpec: what ``AiokvOffloadingSpec`` refuses, and a ``spec_name`` or
            ``spec_module_path`` naming another spec.
    """

    connector_worker: AiokvConnectorWorker | None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version(vllm.__version__)
        # vLLM's OffloadingConnector.__init__, with this spec instead of the one named in
        # the config (vLLM's factory would build whatever spec_name says).
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        config = build_offloading_config(vllm_config, kv_cache_config)
        config = replace(config, extra_config=connector_extra_config(config.extra_config))
        self._canonical_layout = config.canonical_layout
        spec = AiokvOffloadingSpec(config)
        self.connector_scheduler = None
        self.connector_worker = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = AiokvConnectorWorker(spec, vllm_config, kv_cache_config)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> Any:
        """vLLM's offloading metrics, declared by aiokv's spec: vLLM finds the spec from the
        configuration's ``spec_name``, which a user of this connector need not write, and
        its stats would otherwise carry the tier counters under names never declared."""
        config = copy.copy(vllm_config)
        transfer = copy.copy(vllm_config.kv_transfer_config)
        transfer.kv_connector_extra_config = connector_extra_config(transfer.kv_connector_extra_config)
        config.kv_transfer_config = transfer
        return super().build_prom_metrics(config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: the per-layer hooks run host code between attention layers, which a full
        CUDA graph would skip on replay; vLLM then switches FULL modes to PIECEWISE."""
        return True

    @property
    def _worker(self) -> AiokvConnectorWorker:
        if self.connector_worker is None:
            raise RuntimeError("AiokvConnector: a worker hook was called on the scheduler's connector")
        return self.connector_worker

    # -- worker side ------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:
            self.connector_worker.begin_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.end_step()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self._worker.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # -- scheduler side ---------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM 0.34 drops a failed store's chunks itself; 0.33 would publish them, so the
        manager is told which of them failed before vLLM completes the job."""
        meta = connector_output.kv_connector_worker_meta
        if not NATIVE_FAILED_JOBS and isinstance(meta, AiokvWorkerMetadata) and meta.failed_jobs:
            scheduler = self.scheduler
            jobs = scheduler._jobs  # vLLM's job id -> TransferJobStatus (keys, is_store)
            for job_id in meta.failed_jobs:
                status = jobs.get(job_id)
                if status is not None and status.is_store:
                    scheduler.manager.fail_store(status.keys)
        super().update_connector_output(connector_output)
