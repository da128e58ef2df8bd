"""The disk tier's bookkeeping: which blocks it holds, which are being read, written or
removed, room made through the eviction policy, and the counters. No I/O.

Everything here runs on the cache's event loop thread, between the tier's calls into its
worker threads: a key is in at most one of ``held`` (its file is in place), ``pending``
(being written) and ``removing`` (its file is being deleted), and a key in ``pins`` (being
read) is never chosen for eviction.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policies import EvictionPolicy, make_policy
from .base import TierStatistics
from .disk_io import FileEntry, ReadStatus

__all__ = ["DiskIndex"]

_COUNTERS = ("reads", "read_hits", "read_bytes", "writes", "write_bytes", "errors", "corrupt",
             "evictions")


class DiskIndex:
    """Keys of one disk tier, bounded by ``capacity_bytes`` of payload.

    Args:
        capacity_bytes: payload bytes held at most.
        policy: an eviction policy name or an unused ``EvictionPolicy`` instance; built once
            the block size (and so the capacity in blocks) is known.
    """

    def __init__(self, capacity_bytes: int, policy: str | EvictionPolicy) -> None:
        self.capacity_bytes = capacity_bytes
        self.block_bytes: int | None = None
        self.held: dict[bytes, None] = {}  # keys whose file is in place, oldest first
        self.pending: set[bytes] = set()  # keys being written
        self.removing: set[bytes] = set()  # keys whose file is being removed
        self.pins: dict[bytes, int] = {}  # keys being read (not evictable)
        self.policy: EvictionPolicy | None = None
        self.counts = dict.fromkeys(_COUNTERS, 0)
        self._policy_spec = policy

    def capacity_blocks(self) -> int:
        if self.block_bytes is None:
            raise AssertionError("the block size is not known yet")
        return self.capacity_bytes // self.block_bytes

    def make_policy(self) -> EvictionPolicy:
        if self.policy is None:
            self.policy = make_policy(self._policy_spec, max(1, self.capacity_blocks()))
        return self.policy

    def adopt(self, entries: Sequence[FileEntry], block_bytes: int) -> list[bytes]:
        """Index the files ``open`` found (oldest first); the keys whose files must go:
        another block size (not ours), or the oldest past the capacity."""
        self.block_bytes = block_bytes
        keep = [e.key for e in entries if e.payload_len == block_bytes]
        doomed = [e.key for e in entries if e.payload_len != block_bytes]
        self.counts["corrupt"] += len(doomed)
        limit = self.capacity_blocks()
        if len(keep) > limit:  # reopened with less capacity: the oldest go
            doomed += keep[: len(keep) - limit]
            self.counts["evictions"] += len(keep) - limit
            keep = keep[len(keep) - limit:]
        self.held = dict.fromkeys(keep)
        self.make_policy().on_insert(keep)
        return doomed

    # -- reads -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            left = self.pins[key] - 1
            if left:
                self.pins[key] = left
            else:
                del self.pins[key]

    def after_read(self, keys: Sequence[bytes], block_bytes: int, status: Sequence[int]) -> bool:
        """Count a read call and drop the keys whose files are gone or corrupt; whether an
        I/O error happened."""
        c = self.counts
        failed = False
        c["reads"] += len(keys)
        hits: list[bytes] = []
        for key, s in zip(keys, status):
            if s == ReadStatus.HIT:
                hits.append(key)
                c["read_hits"] += 1
                c["read_bytes"] += block_bytes
            elif s == ReadStatus.CORRUPT:
                c["corrupt"] += 1
                self._drop(key)
            elif s == ReadStatus.ABSENT:
                c["errors"] += 1
                self._drop(key)
            elif s == ReadStatus.ERROR:
                c["errors"] += 1
                failed = True
        if hits and self.policy is not None:
            self.policy.on_access([k for k in hits if k in self.held])
        return failed

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keys used again: held ones, and ones being written (ordered when their write
        was planned), move up in the eviction order, as a write of a held key does."""
        known = [k for k in keys if k in self.held or k in self.pending]
        if known and self.policy is not None:
            self.policy.on_access(known)

    # -- writes ----------------------------------------------------------------------------

    def plan_write(self, keys: Sequence[bytes], stored: list[bool | None]
                   ) -> tuple[list[int], list[bytes], dict[bytes, int]]:
        """Decide a write call before its I/O: which indices get written (marked pending),
        which held keys are evicted for them (marked removing), and each key's first index
        (a key repeated in one call shares its first fate). Sets ``stored`` for keys held
        already (True) or busy in another call or without room (False)."""
        policy = self.make_policy()
        first: dict[bytes, int] = {}
        todo: list[int] = []
        for i, key in enumerate(keys):
            if key in first:
                continue
            first[key] = i
            if key in self.held:
                stored[i] = True
            elif key in self.pending or key in self.removing:
                stored[i] = False  # another call is writing or removing it right now
            else:
                todo.append(i)
        held = [key for key, i in first.items() if stored[i]]
        if held:
            policy.on_access(held)
        todo, doomed = self._make_room(todo, keys, stored)
        for key in doomed:
            self._evict(key)
        self.pending.update(keys[i] for i in todo)
        self.removing.update(doomed)
        # Ordered now, in the order the cache decided, not when each write lands (which
        # depends on how fast the disk is); pending keys are never chosen as victims.
        policy.on_insert([keys[i] for i in todo])
        return todo, doomed, first

    def after_write(self, keys: Sequence[bytes], stored: Sequence[bool | None],
                    todo: Sequence[int], doomed: Sequence[bytes]) -> bool:
        """Index what a write call stored; whether an I/O error happened."""
        self.removing.difference_update(doomed)
        c = self.counts
        failed = False
        policy = self.make_policy()
        for i in todo:
            key = keys[i]
            self.pending.discard(key)
            if stored[i]:
                self.held[key] = None
                c["writes"] += 1
                c["write_bytes"] += self.block_bytes or 0
                continue
            policy.on_remove(key, evicted=False)  # ordered when planned: not held after all
            if stored[i] is False:
                c["errors"] += 1
                failed = True
            # None: never started (the call was cancelled first); the file may not exist.
        return failed

    def statistics(self, name: str) -> TierStatistics:
        c = self.counts
        blocks = len(self.held)
        return TierStatistics(name=name, blocks=blocks, bytes_held=blocks * (self.block_bytes or 0),
                              **c)

    # -- internals -------------------------------------------------------------------------

    def _make_room(self, todo: list[int], keys: Sequence[bytes],
                   stored: list[bool | None]) -> tuple[list[int], list[bytes]]:
        """Which of ``todo`` get written, and the held keys evicted to make room for them.

        Keys being read are not evictable. What does not fit even after evicting everything
        else is refused from the tail, so a request's head is what gets stored.
        """
        capacity = self.capacity_blocks()
        pinned = sum(1 for k in self.pins if k in self.held)
        used = len(self.held) + len(self.pending)
        fits = max(0, min(len(todo), capacity - used + len(self.held) - pinned))
        for i in todo[fits:]:
            stored[i] = False
        todo = todo[:fits]
        need = used + len(todo) - capacity
        if need <= 0:
            return todo, []
        policy = self.make_policy()
        held, pins = self.held, self.pins
        victims = policy.victims(need, lambda k: k in held and k not in pins)
        if victims is None:  # a policy that lost track of keys: store nothing rather than overfill
            for i in todo:
                stored[i] = False
            return [], []
        return todo, [k for k in victims if isinstance(k, bytes)]

    def _evict(self, key: bytes) -> None:
        del self.held[key]
        self.make_policy().on_remove(key, evicted=True)
        self.counts["evictions"] += 1

    def _drop(self, key: bytes) -> None:
        if key in self.held:
            del self.held[key]
            if self.policy is not None:
                self.policy.on_remove(key, evicted=False)
