"""``AiokvOffloadingSpec``: what vLLM's ``OffloadingSpecFactory`` builds by name.

vLLM constructs one spec in the scheduler process and one in each GPU worker process, all
from the same ``OffloadingConfig``. Each derives the same chunk count from
``cpu_bytes_to_use``, so the chunk ids the scheduler's manager hands out are valid in every
rank's own host pool (tensor parallel ranks hold different heads, hence different bytes,
under the same ids).
"""

from __future__ import annotations

import logging
from typing import Any

import vllm
from vllm.v1.kv_offload.base import OffloadingSpec

from ...errors import InvalidSpec
from ._compat import check_vllm_version
from .manager import AiokvOffloadingManager
from .options import PluginOptions, read_cpu_bytes, size_host_pool
from .worker import AiokvOffloadingWorker

__all__ = ["AiokvOffloadingSpec"]

_log = logging.getLogger("aiokv")


class AiokvOffloadingSpec(OffloadingSpec):
    """vLLM offloading spec backed by aiokv (select it with ``spec_name`` and
    ``spec_module_path="aiokv.integrations.vllm"`` in ``kv_connector_extra_config``).

    Raises (at construction):
        UsageError: the installed vLLM is outside the tested range.
        InvalidSpec: an unknown or misspelled ``aiokv_`` key, a bad value, a missing,
            too small or too large ``cpu_bytes_to_use``, or vLLM's canonical layout (not
            supported).
        HostMemoryError: one rank's share of ``cpu_bytes_to_use`` exceeds this host's
            available memory.
    """

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
            self._manager = AiokvOffloadingManager(
                self.num_chunks,
                policy=self.options.policy,
                admission=self.options.admission,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> AiokvOffloadingWorker:
        """This rank's worker over ``kv_caches`` (one per spec): CUDA copies where the
        tensors are on a usable CUDA device, else the CPU backend (``aiokv_backend``)."""
        if self._worker is None:
            self._check_sized()
            self._worker = AiokvOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                options=self.options,
            )
            actual = self._worker.aiokv_worker.statistics().chunk_bytes
            if actual > self.kv_bytes_per_chunk:
                _log.warning(
                    "aiokv: a host chunk takes %d bytes on this rank, not the %d the pool was sized "
                    "by, so the pool uses %d bytes more than cpu_bytes_to_use's share",
                    actual, self.kv_bytes_per_chunk, (actual - self.kv_bytes_per_chunk) * self.num_chunks,
                )
        return self._worker
