"""Worker side: vLLM's ``OffloadingWorker`` over aiokv's step-loop worker.

vLLM's connector calls ``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait`` /
``shutdown`` from the model runner's thread. aiokv's ``SyncOffloadingWorker`` has exactly
that face; this class reads vLLM 0.34's ``DevicePointers`` back as block ids (0.33 passes
block ids already), turns aiokv's results into vLLM's ``TransferResult`` (the type vLLM's
statistics read) and keeps vLLM's return conventions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from ...sync import SyncOffloadingWorker
from .options import PluginOptions
from .pointers import PointerMap, is_device_pointers
from .shared_pool import publish, unpublish

__all__ = ["AiokvOffloadingWorker"]


class AiokvOffloadingWorker(OffloadingWorker):
    """Moves blocks between this rank's KV cache and its own host pool of ``num_chunks``.

    Takes vLLM's ``CanonicalKVCaches`` as the connector builds them (padded pages, several
    groups, packed layouts), the device side of a job as vLLM 0.34's ``DevicePointers``
    (addresses into those tensors) or vLLM 0.33's ``GPULoadStoreSpec`` (numpy int32
    ``block_ids``, ``group_sizes``, ``block_indices``), and the null block 0 as a placeholder
    inside a stored chunk. Bad specs, and addresses that are not exactly a block of the
    registered tensors, raise ``aiokv.InvalidSpec`` before anything is enqueued; a transfer
    that fails on the device is reported with ``success=False``, never as a hit.

    With ``publish_rank`` (and ``WorkerOptions.host_pool_file``) the pool is a shared file
    whose layout is published beside it for the scheduler's manager (``shared_pool``).
    """

    def __init__(
        self, kv_caches: Any, *, num_chunks: int, blocks_per_chunk: int, options: PluginOptions,
        publish_rank: int | None = None,
    ) -> None:
        self._sync = SyncOffloadingWorker(
            kv_caches,
            num_cpu_chunks=num_chunks,
            blocks_per_chunk=blocks_per_chunk,
            backend=options.backend,
            options=options.worker_options,
        )
        self._pointers = PointerMap(kv_caches)
        self._published = options.worker_options.host_pool_file if publish_rank is not None else None
        if self._published is not None:
            layout = self._sync.host_layout
            try:
                publish(self._published, rank=int(publish_rank or 0), num_chunks=num_chunks,
                        chunk_bytes=layout.chunk_bytes, blocks_per_chunk=blocks_per_chunk,
                        page_sizes=layout.page_sizes, page_offsets=layout.page_offsets)
            except BaseException:  # (a filesystem the pool just filled): undescribed, the
                self._sync.shutdown()  # pool's name would never be removed; closing does
                raise

    @property
    def aiokv_worker(self) -> SyncOffloadingWorker:
        """The aiokv worker underneath (statistics, ``repr``)."""
        return self._sync

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._sync.submit_store(job_id, self._device_spec(src_spec), dst_spec)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._sync.submit_load(job_id, src_spec, self._device_spec(dst_spec), expedited)

    def _device_spec(self, spec: Any) -> Any:
        """The device side as block ids: 0.34's pointers translated, 0.33's spec as it is."""
        return self._pointers.to_spec(spec) if is_device_pointers(spec) else spec

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.transfer_size,
                transfer_time=r.transfer_time,
            )
            for r in self._sync.get_finished()
        ]

    def wait(self, job_ids: Iterable[int]) -> None:
        self._sync.wait(job_ids)

    def shutdown(self) -> None:
        if self._published is not None:
            unpublish(self._published)
        self._sync.shutdown()
