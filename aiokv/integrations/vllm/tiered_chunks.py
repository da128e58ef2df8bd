"""The host pool's bookkeeping with tiers below it: lookups that look below the host,
promotions, and demotions of what the host evicts.

``ChunkManager`` decides which key holds which chunk; here those chunks are *slots*, each
backed by one of the pool's physical chunks. A few physical chunks are kept spare: when
the host evicts a key, its slot takes a spare chunk for the next store and the evicted
bytes stay where they are until their write to the tier ends (then that chunk is spare
again). So the scheduler never copies a byte, never waits, and a block is never
overwritten while it is on its way down; with no spare chunk left, an eviction is dropped
(counted). A key the host lacks is looked up below it: a local tier answers at once
(``TierIO.holds``), a remote one after a round trip (``RETRY`` meanwhile). A key found
below gets a slot as a pending store (``HIT_PENDING``) and is read into it on the tiers'
thread; it becomes a hit once its bytes are in, or a miss if the read failed. Runs on the
scheduler's thread under its lock; kept free of vLLM imports.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...cache import ChunkManager, StorePlan
from ...cache import LookupResult as HostLookup
from .tier_io import Done, Op, TierIO

__all__ = ["ABSENT_SECONDS", "TierCounts", "TierEvent", "TieredChunks", "Where", "default_spare"]

ABSENT_SECONDS = 5.0
"""How long a key no tier holds (or whose read failed) is a miss without asking again."""
_ABSENT_LIMIT = 1 << 18  # keys remembered as absent at most (oldest forgotten first)
_LOCATED_LIMIT = 1 << 18  # remote answers kept for a read not started yet, at most (same)


class Where(enum.Enum):
    """A lookup's answer, as vLLM's ``LookupResult`` has it."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # held, or being read up from a tier: not loadable yet
    RETRY = "retry"  # a remote tier is being asked


@dataclass
class TierCounts:
    """What one tier did for the host since the manager started (blocks and bytes)."""

    found: int = 0  # host misses this tier held: reads started
    promoted: int = 0
    promote_failed: int = 0
    read_bytes: int = 0
    demoted: int = 0
    written_through: int = 0
    write_bytes: int = 0
    dropped: int = 0  # blocks meant for this tier that it never got
    promote_seconds: float = 0.0  # from each read up's start to the lookup that saw it end


@dataclass(frozen=True)
class TierEvent:
    """Blocks a tier took (``stored``) or could no longer give back."""

    keys: tuple[Hashable, ...]
    tier: int
    stored: bool


def default_spare(num_chunks: int) -> int:
    """Chunks kept aside for evicted blocks on their way down: an eighth of the pool (a
    quarter of a small one, up to 4), between 1 and 64. One store evicting more blocks at
    once than are spare drops the rest, so a tiny pool keeps a larger share."""
    if num_chunks < 2:
        return 0
    return min(64, max(1, num_chunks // 8, min(4, num_chunks // 4)))


class TieredChunks:
    """``num_chunks`` physical host chunks, tracked by a ``ChunkManager`` over slots.

    Args:
        num_chunks: physical chunks in every rank's pool.
        policy: eviction policy name for the slots.
        admission: admission policy name, or None for the policy's own.
        io: the tiers' thread, or None (then exactly a ``ChunkManager`` of every chunk).
        group_of: the KV-cache group of a key (which page layout its block has).
        spare: chunks kept aside for demotions (default ``default_spare``).
        clock: seconds, for how long absences are remembered.
    """

    def __init__(self, num_chunks: int, *, policy: str, admission: str | None, io: TierIO | None,
                 group_of: Callable[[Any], int], spare: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.io = io
        spare = 0 if io is None else (default_spare(num_chunks) if spare is None else spare)
        slots = num_chunks - spare
        self.num_chunks = num_chunks
        self.chunks = ChunkManager(slots, policy=policy, admission=admission)
        self._policy, self._admission = policy, admission
        self._phys = list(range(slots))  # slot -> physical chunk
        self._spare = list(range(slots, num_chunks))
        self._group_of = group_of
        self._clock = clock
        self._draining: dict[Hashable, int] = {}  # evicted key -> its chunk, being written down
        self._promoting: dict[Hashable, tuple[int, float]] = {}  # key -> (its chunk, when asked)
        self._through: dict[int, Hashable] = {}  # id(op) of a write-through -> its pinned key
        self._located: dict[Hashable, int] = {}  # key -> the remote tier that holds it
        self._asking: set[Hashable] = set()
        self._absent: dict[Hashable, float] = {}  # key -> until when it is a miss
        self._pending: dict[int, Op] = {}  # id(op) -> every op handed over, until answered
        self._fences: dict[int, list[Any]] = {}  # chunk -> [placeholder, ops] held since a reset
        self._fenced: set[int] = set()  # id(op) of the ops those fences wait for
        self._held = False  # promotions held since a reset, until ``reset_flushed``
        self._ops: list[Op] = []
        self.events: list[TierEvent] = []
        self.sources: dict[Hashable, int] = {}  # key read up, not loaded yet -> its tier
        tiers = io.tiers if io is not None else []
        self.counts = [TierCounts() for _ in tiers]
        self._demote_to = next((i for i, t in enumerate(tiers) if not t.write_through), -1)
        self._through_to = [i for i, t in enumerate(tiers) if t.write_through]
        self._remote = [i for i, t in enumerate(tiers) if t.remote]

    # -- state ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether tier work is queued or in flight (vLLM keeps stepping meanwhile)."""
        return bool(self._ops) or (self.io is not None and self.io.in_flight > 0)

    @property
    def spare_free(self) -> int:
        """Spare chunks free now (the rest hold evicted blocks on their way down)."""
        return len(self._spare)

    @property
    def promoting(self) -> int:
        """Keys being read up from a tier now (each a pending store of one slot)."""
        return len(self._promoting)

    def physical(self, slots: Sequence[int]) -> list[int]:
        """The physical chunks of ``slots`` (what a worker's spec names)."""
        phys = self._phys
        return [phys[s] for s in slots]

    # -- the host's own calls ---------------------------------------------------------------

    def lookup(self, key: Hashable, protect: Container[Hashable] = ()) -> Where:
        """Where ``key`` is; a key found below the host starts its way up (never waits).

        ``protect``: keys the caller found held just before (the same request's prefix, a
        set), which the chunk a read up takes may not be made by evicting; without that, a
        prefix longer than the host could evict its own head to bring up its tail, for
        ever. Kept by reference, so a read up costs the same however long that prefix.
        """
        self.poll()
        held = self.chunks.lookup(key)
        if held is HostLookup.HIT:
            return Where.HIT
        if held is HostLookup.HIT_PENDING:
            return Where.HIT_PENDING
        io = self.io
        if io is None or not io.ready or self._held:
            return Where.MISS
        absent = self._absent.get(key)
        if absent is not None:
            if absent > self._clock():
                return Where.MISS
            del self._absent[key]
        if key in self._draining:
            return Where.RETRY  # readable from its tier once its write there ends
        tier = io.holds(key)
        if tier < 0:
            tier = self._located.get(key, -1)
        if tier >= 0:
            return self._promote(key, tier, protect)
        if key in self._asking:
            return Where.RETRY
        if any(io.usable(t) for t in self._remote):
            self._asking.add(key)
            self._queue(Op("locate", key))
            self._flush()
            return Where.RETRY
        return Where.MISS

    def prepare_load(self, keys: Sequence[Hashable], *, touch: bool = True) -> list[int]:
        """Pin ``keys`` (``ChunkManager.prepare_load``); their physical chunks."""
        return self.physical(self.chunks.prepare_load(keys, touch=touch))

    def prepare_store(self, keys: Sequence[Hashable]) -> StorePlan | None:
        """``ChunkManager.prepare_store`` in physical chunks; what it evicts goes down."""
        self.poll()
        plan = self.chunks.prepare_store(keys)
        if plan is None:
            return None
        self._evicted(plan)
        self._flush()
        return replace(plan, chunk_ids=self.physical(plan.chunk_ids),
                       evicted_chunks=[])  # the evicted bytes are no longer in those chunks

    def complete_store(self, keys: Sequence[Hashable], success: bool = True) -> None:
        """``ChunkManager.complete_store``; stored keys also go to write-through tiers."""
        keys = list(keys)
        landed = [k for k in keys if self.chunks.lookup(k) is HostLookup.HIT_PENDING] \
            if success and self._through_to else []
        self.chunks.complete_store(keys, success)
        if landed and self._through_to:
            self._write_through(landed)
            self._flush()

    # -- the tiers' answers -----------------------------------------------------------------

    def poll(self) -> None:
        """Apply every answer the tiers' thread has given since the last call."""
        io = self.io
        if io is None:
            return
        for done in io.results():
            op = done.op
            self._pending.pop(id(op), None)
            fenced = id(op) in self._fenced
            if fenced:
                self._unfence(op)
            if op.kind == "promote":
                self._promoted(done, fenced=fenced)
            elif op.kind == "write":
                self._written(done)
            else:
                self._asking.discard(op.key)
                if done.ok:
                    _remember(self._located, op.key, done.tier, _LOCATED_LIMIT)
                else:
                    self._forget(op.key)

    def reset(self) -> None:
        """Forget every host block (vLLM's ``reset_cache``). A chunk a tier read or write
        still touches stays out of use until that ends, held by a placeholder.

        Reads up are held (a key the host lacks is a miss) until ``reset_flushed``: a
        worker's copy in flight at the reset may still write a chunk the reset freed, and
        vLLM's workers order only their own jobs after it, not the tiers' thread."""
        self.poll()
        self._held = self.io is not None
        self.chunks = ChunkManager(len(self._phys), policy=self._policy, admission=self._admission)
        self.sources.clear()
        self._located.clear()
        self._promoting.clear()
        self._through.clear()
        self._fences.clear()
        self._fenced.clear()
        # Every chunk a read or write in flight still touches is held in the new manager by
        # a placeholder store that never completes, until that read or write answers.
        where = {chunk: slot for slot, chunk in enumerate(self._phys)}
        phys = self._phys
        for ident, op in self._pending.items():
            if op.kind == "locate" or op.tag == "demote":  # a demoted block's chunk has no slot
                continue
            fence = self._fences.get(op.chunk)
            if fence is None:
                placeholder = ("aiokv-fence", op.chunk)
                plan = self.chunks.prepare_store([placeholder], admit=False)
                if plan is None or not plan.chunk_ids:  # an empty manager always has room
                    continue
                slot, other = plan.chunk_ids[0], where[op.chunk]
                phys[slot], phys[other] = phys[other], phys[slot]
                where[phys[slot]], where[phys[other]] = slot, other
                fence = self._fences[op.chunk] = [placeholder, 0]
            fence[1] += 1
            self._fenced.add(ident)

    def reset_flushed(self) -> None:
        """Every worker job in flight at the last reset has ended (vLLM's
        ``on_reset_flushed``): no late copy can write a freed chunk, so reads up resume."""
        self._held = False

    def _unfence(self, op: Op) -> None:
        self._fenced.discard(id(op))
        fence = self._fences.get(op.chunk)
        if fence is None:
            return
        fence[1] -= 1
        if fence[1] <= 0:
            del self._fences[op.chunk]
            self.chunks.complete_store([fence[0]], False, counted=False)

    # -- internals --------------------------------------------------------------------------

    def _queue(self, op: Op) -> None:
        self._ops.append(op)
        self._pending[id(op)] = op

    def _flush(self) -> None:
        if self._ops and self.io is not None:
            ops, self._ops = self._ops, []
            self.io.submit(ops)

    def _promote(self, key: Hashable, tier: int, protect: Container[Hashable]) -> Where:
        if len(self._promoting) >= max(1, self.chunks.num_chunks // 2):
            return Where.RETRY  # half the host is being read up: let those land first
        plan = self.chunks.prepare_store([key], admit=False, keep=protect)
        if plan is None or not plan.chunk_ids:
            return Where.MISS  # no room: every other block is pinned, being written or protected
        self._evicted(plan)
        self._located.pop(key, None)
        chunk = self._phys[plan.chunk_ids[0]]
        self._promoting[key] = (chunk, self._clock())
        self.counts[tier].found += 1
        self._queue(Op("promote", key, self._group_of(key), chunk, tier))
        self._flush()
        return Where.HIT_PENDING

    def _promoted(self, done: Done, *, fenced: bool) -> None:
        op = done.op
        counts = self.counts[op.tier]
        asked = self._promoting.get(op.key)
        if fenced or asked is None or asked[0] != op.chunk:
            return  # reset meanwhile: the key is no longer the host's
        del self._promoting[op.key]
        counts.promote_seconds += self._clock() - asked[1]
        if done.ok:
            self.chunks.complete_store([op.key], True)
            self.sources[op.key] = op.tier
            counts.promoted += 1
            counts.read_bytes += done.nbytes
            return
        self.chunks.complete_store([op.key], False, counted=False)
        counts.promote_failed += 1
        self._forget(op.key)
        self.events.append(TierEvent((op.key,), op.tier, stored=False))

    def _evicted(self, plan: StorePlan) -> None:
        """Send what ``plan`` evicts down to the demotion tier, each evicted slot taking a
        spare chunk for the store that reuses it."""
        if not plan.evicted:
            return
        target = self._demote_to
        io = self.io
        can = target >= 0 and io is not None and io.usable(target)
        for key, slot in zip(plan.evicted, plan.evicted_chunks):
            self.sources.pop(key, None)
            if can and self._spare and key not in self._draining:
                chunk = self._phys[slot]
                self._phys[slot] = self._spare.pop()
                self._draining[key] = chunk
                self._queue(Op("write", key, self._group_of(key), chunk, target, tag="demote"))
            elif target >= 0 and key not in self._draining:
                self.counts[target].dropped += 1

    def _write_through(self, keys: list[Hashable]) -> None:
        io = self.io
        for tier in self._through_to:
            if io is None or not io.usable(tier):
                self.counts[tier].dropped += len(keys)
                continue
            room = max(0, self.chunks.num_chunks // 2 - self.chunks.stats().pinned_keys)
            took, rest = keys[:room], keys[room:]
            self.counts[tier].dropped += len(rest)  # pinned half the pool: the tier is behind
            if not took:
                continue
            chunks = self.prepare_load(took, touch=False)  # a copy down is no reuse
            for key, chunk in zip(took, chunks):
                op = Op("write", key, self._group_of(key), chunk, tier, tag="through")
                self._through[id(op)] = key
                self._queue(op)

    def _written(self, done: Done) -> None:
        op = done.op
        counts = self.counts[op.tier]
        if op.tag == "demote":
            chunk = self._draining.pop(op.key, None)
            if chunk is not None:
                self._spare.append(chunk)
        else:
            key = self._through.pop(id(op), None)
            if key is not None:
                self.chunks.complete_load([key])
        if not done.ok:
            counts.dropped += 1
            return
        if op.tag == "demote":
            counts.demoted += 1
        else:
            counts.written_through += 1
        counts.write_bytes += done.nbytes
        self._absent.pop(op.key, None)
        self.events.append(TierEvent((op.key,), op.tier, stored=True))

    def _forget(self, key: Hashable) -> None:
        """Remember ``key`` as held by no tier for ``ABSENT_SECONDS``."""
        _remember(self._absent, key, self._clock() + ABSENT_SECONDS, _ABSENT_LIMIT)


def _remember(memo: dict[Hashable, Any], key: Hashable, value: Any, limit: int) -> None:
    """``memo[key] = value``, forgetting the oldest quarter first when ``limit`` is reached
    (answers never used again, as for keys vLLM stopped looking up, must not pile up)."""
    if len(memo) >= limit and key not in memo:
        for old in list(memo)[: max(1, limit // 4)]:
            del memo[old]
    memo[key] = value
