"""What both faces tell about the worker they drive: its sizes, layout and backend.

One definition for the async and the sync face, read from the core they each build, so the
two can never disagree about the same arguments.
"""

from __future__ import annotations

from typing import Any

from .core import OffloadCore, WorkerStatistics
from .host_layout import HostLayout
from .layout import CanonicalKVCaches

__all__ = ["WorkerFacts"]


class WorkerFacts:
    """Read-only facts of a worker; a face sets ``_core`` in its constructor."""

    _core: OffloadCore

    @property
    def num_cpu_chunks(self) -> int:
        """Chunks in the host pool (chunk ids must be below this)."""
        return self._core.num_cpu_chunks

    @property
    def blocks_per_chunk(self) -> int:
        """GPU blocks each host chunk holds."""
        return self._core.layout.blocks_per_chunk

    @property
    def num_gpu_blocks(self) -> int:
        """GPU blocks addressable in every group (block ids must be below this)."""
        return self._core.num_gpu_blocks

    @property
    def num_groups(self) -> int:
        """KV-cache groups in the layout (hybrid models have several; specs then need
        ``group_sizes``)."""
        return self._core.layout.num_groups

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one host chunk: ``blocks_per_chunk`` blocks of every KV tensor."""
        return self._core.layout.chunk_bytes

    @property
    def host_layout(self) -> HostLayout:
        """Where each page of a chunk lies in the host pool (read-only). Lower cache tiers
        use it to write blocks in the layout's own page order, which is the same on every
        worker of one layout, rather than in this pool's order."""
        return self._core.layout

    @property
    def kv_caches(self) -> CanonicalKVCaches:
        """The KV caches this worker moves blocks of, as it reads them."""
        return self._core.kv_caches

    @property
    def backend(self) -> str:
        """The backend copies run on: "cpu" or "cuda"."""
        return self._core.backend.name

    @property
    def host_pool(self) -> Any:
        """The host pool as one flat uint8 tensor (for inspection and tests)."""
        return self._core.pool.tensor

    @property
    def closed(self) -> bool:
        """True once closing has let go of the lanes (and freed or kept the pool)."""
        return self._core.closed

    def statistics(self) -> WorkerStatistics:
        """A snapshot: jobs in flight, completed and failed, and bytes moved, per direction."""
        return self._core.statistics()
