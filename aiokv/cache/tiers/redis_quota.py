"""What one process keeps in a shared Redis store, for ``RedisTier(capacity_bytes=...)``.

A shared store is best bounded on the server (``maxmemory`` with ``allkeys-lru``); this
quota is the per-process bound instead: it remembers the blocks this process wrote, least
recently used first (reads and rewrites make a block recent), and names its own oldest
blocks to delete before a write would take it past ``capacity_bytes``. It never sees what
other processes store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["WriteQuota"]


class WriteQuota:
    """Bytes and blocks this process holds in the store, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._held: OrderedDict[bytes, int] = OrderedDict()
        self.bytes_held = 0

    @property
    def blocks(self) -> int:
        return len(self._held)

    def fitting(self, sizes: Sequence[int]) -> list[int]:
        """Indices of one batch's payloads that fit the capacity together, in order."""
        fitting, total = [], 0
        for i, size in enumerate(sizes):
            if total + size <= self.capacity_bytes:
                fitting.append(i)
                total += size
        return fitting

    def make_room(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[bytes]:
        """Forget and return this process's least recently used keys (never one of
        ``keys``) until ``keys`` fit; the caller deletes them from the store."""
        incoming = set(keys)
        need = sum(sizes) - sum(self._held.get(k, 0) for k in incoming)
        victims: list[bytes] = []
        for key in list(self._held):
            if self.bytes_held + need <= self.capacity_bytes:
                break
            if key not in incoming:
                self.bytes_held -= self._held.pop(key)
                victims.append(key)
        return victims

    def remember(self, key: bytes, size: int) -> None:
        """A block this process stored (now the most recently used)."""
        self.bytes_held += size - self._held.pop(key, 0)
        self._held[key] = size

    def touch(self, key: bytes) -> None:
        """A block read back: the most recently used, if this process holds it."""
        if key in self._held:
            self._held.move_to_end(key)
