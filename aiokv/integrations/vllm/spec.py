"""``AiokvOffloadingSpec``: what vLLM's ``OffloadingSpecFactory`` builds by name.

vLLM constructs one spec in the scheduler process and one in each GPU worker process, all
from the same ``OffloadingConfig``. Each derives the same chunk count from
``cpu_bytes_to_use``, so the chunk ids the scheduler's manager hands out are valid in every
rank's own host pool (tensor parallel ranks hold different heads, hence different bytes,
under the same ids). With ``aiokv_tiers`` each worker's pool is a shared file the
scheduler's manager maps (``shared_pool``), since the manager moves blocks between the
pools and the tiers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import vllm
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata, OffloadingSpec

from ...cache.tiers.codec import layout_fingerprint
from ...errors import InvalidSpec
from ._compat import check_vllm_version
from .manager import AiokvOffloadingManager
from .options import PluginOptions, read_cpu_bytes, size_host_pool
from .shared_pool import PoolView, claim, pool_file, sweep, unpublish
from .tier_metrics import TIER_COUNTER_DOCS, TIER_COUNTERS, TIER_LABEL
from .worker import AiokvOffloadingWorker

__all__ = ["AiokvOffloadingSpec"]

_log = logging.getLogger("aiokv")


class AiokvOffloadingSpec(OffloadingSpec):
    """vLLM offloading spec backed by aiokv (select it with ``spec_name`` and
    ``spec_module_path="aiokv.integrations.vllm"`` in ``kv_connector_extra_config``).

    Raises (at construction):
        UsageError: the installed vLLM is outside the tested range.
        InvalidSpec: an unknown or misspelled ``aiokv_`` key, a bad value (a tier URL
            among them), a missing, too small or too large ``cpu_bytes_to_use``, or vLLM's
            canonical layout (not supported).
        HostMemoryError: one rank's share of ``cpu_bytes_to_use`` exceeds this host's
            available memory.
        MissingExtra: a Redis tier without the ``redis`` package installed.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The tier counters (``tier_metrics``), declared where ``aiokv_tiers`` is set."""
        if not extra_config.get("aiokv_tiers"):
            return {}
        return {name: OffloadingCounterMetadata(documentation=TIER_COUNTER_DOCS[field],
                                                labelnames=(TIER_LABEL,))
                for name, field in TIER_COUNTERS.items()}

    def __init__(self, config: Any) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(config)
        self.options = PluginOptions.from_extra_config(self.extra_config)
        self.cpu_bytes_to_use = read_cpu_bytes(self.extra_config)
        if config.canonical_layout:
            raise InvalidSpec(
                "AiokvOffloadingSpec does not support canonical_layout (parallelism-free host "
                "pages); remove canonical_layout from kv_connector_extra_config"
            )
        # Each rank owns a private pool, so no rank can skip a store for another (vLLM's
        # CPU spec sets this only when ranks share one mapped region).
        self.replicated_layout = False
        self.world_size = max(1, int(config.parallel.world_size))
        # Derived before any worker exists, so the scheduler and every rank agree on it.
        self.kv_bytes_per_chunk, self.num_chunks = size_host_pool(
            self.cpu_bytes_to_use,
            int(config.worker_kv_bytes_per_block) * self.blocks_per_chunk,
            self.world_size,
        )
        self._manager: AiokvOffloadingManager | None = None
        self._worker: AiokvOffloadingWorker | None = None

    def _check_sized(self) -> None:
        if self.num_chunks < 1:
            raise InvalidSpec(
                "vLLM reported no KV bytes per block (worker_kv_bytes_per_block=0), so the host "
                "pool cannot be sized; is this layer group offloadable?"
            )

    def get_manager(self) -> AiokvOffloadingManager:
        """The scheduler's manager (one per spec)."""
        if self._manager is None:
            self._check_sized()
            par = self.config.parallel
            self._manager = AiokvOffloadingManager(
                self.num_chunks,
                policy=self.options.policy,
                admission=self.options.admission,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                # vLLM hands every data-parallel engine the same URLs; a directory serves
                # one engine at a time, so each takes a subdirectory (``for_data_parallel``).
                tiers=tuple(t.for_data_parallel(int(getattr(par, "data_parallel_index", 0)),
                                                int(getattr(par, "data_parallel_size", 1)))
                            for t in self.options.tiers),
                engine_id=str(self.config.engine_id),
                world_size=self.world_size,
                fingerprint=self._fingerprint,
            )
        return self._manager

    def _fingerprint(self, view: PoolView) -> bytes:
        """Names what a tier's bytes mean: the model, its dtype, the block and chunk sizes,
        the parallel layout and every rank's and group's page sizes. Two servers agreeing
        on all of it read each other's blocks (and a restart reads its own)."""
        cfg = self.config
        par = cfg.parallel
        groups = ";".join(f"{g.tokens_per_block}:{','.join(g.layer_names)}" for g in cfg.groups)
        extra = "|".join(str(x) for x in (
            "vllm-aiokv-1", cfg.model.name, self.blocks_per_chunk, cfg.cache.tokens_per_hash,
            par.world_size, par.tp_size, par.pp_size, par.pcp_size, par.dcp_size,
            getattr(cfg, "kv_cache_layout", None), groups))
        return layout_fingerprint(
            block_bytes=view.block_bytes, page_sizes=view.describe(), dtypes=[cfg.model.dtype],
            num_layers=sum(len(g.layer_names) for g in cfg.groups),
            block_size=cfg.groups[0].tokens_per_block if cfg.groups else 0, extra=extra.encode())

    def get_worker(self, kv_caches: Any) -> AiokvOffloadingWorker:
        """This rank's worker over ``kv_caches`` (one per spec): CUDA copies where the
        tensors are on a usable CUDA device, else the CPU backend (``aiokv_backend``)."""
        if self._worker is None:
            self._check_sized()
            options = self.options
            shared = None
            if options.tiers:  # the scheduler's manager maps this pool to reach the tiers
                shared = pool_file(str(self.config.engine_id), int(self.config.parallel.rank))
                options = replace(options, worker_options=replace(options.worker_options,
                                                                  host_pool_file=shared))
                for path in sweep(os.path.dirname(shared)):
                    _log.warning("aiokv: removed %s, left by a worker that died before its "
                                 "scheduler mapped it", path)
                claim(shared)
            try:
                self._worker = AiokvOffloadingWorker(
                    kv_caches,
                    num_chunks=self.num_chunks,
                    blocks_per_chunk=self.blocks_per_chunk,
                    options=options,
                    publish_rank=None if shared is None else int(self.config.parallel.rank),
                )
            except BaseException:
                if shared is not None:
                    unpublish(shared)
                raise
            actual = self._worker.aiokv_worker.statistics().chunk_bytes
            if actual > self.kv_bytes_per_chunk:
                _log.warning(
                    "aiokv: a host chunk takes %d bytes on this rank, not the %d the pool was sized "
                    "by, so the pool uses %d bytes more than cpu_bytes_to_use's share",
                    actual, self.kv_bytes_per_chunk, (actual - self.kv_bytes_per_chunk) * self.num_chunks,
                )
        return self._worker
