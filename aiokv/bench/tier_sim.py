"""An offline replay of a trace through a host cache with tiers below it, as ``OffloadCache``
runs them: host evictions, and offered blocks the host turns away, go to the nearest tier
that is not write-through; write-through tiers get every stored block; a lookup's leading
run may mix host and tier blocks. It assumes no demotion is dropped (a tier that keeps up)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from ..cache.manager import ChunkManager
from ..cache.policies import EvictionPolicy
from .trace import Request

__all__ = ["SimTier", "TierSimResult", "replay_tiers"]


@dataclass(frozen=True)
class SimTier:
    """A lower tier of ``capacity`` blocks, evicting its least recently used."""

    name: str
    capacity: int
    write_through: bool = False


@dataclass(frozen=True)
class TierSimResult:
    """Leading hits per place (``"host"`` and each tier's name) over all block references."""

    hits: dict[str, int]
    references: int

    @property
    def hit_rate(self) -> float:
        return sum(self.hits.values()) / self.references if self.references else 0.0

    def rate(self, name: str) -> float:
        return self.hits.get(name, 0) / self.references if self.references else 0.0


class _Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys

    def touch(self, key: Hashable) -> None:
        self.keys.move_to_end(key)

    def put(self, key: Hashable) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


def replay_tiers(
    trace: Iterable[Request | Sequence[Hashable]],
    host_capacity: int,
    tiers: Sequence[SimTier],
    policy: str | EvictionPolicy = "adaptive",
    admission: str | None = None,
) -> TierSimResult:
    """Per request: count the leading run across host and tiers (touching what it used), then
    offer every block to the host; what the host evicts goes down, as the cache does it."""
    mgr = ChunkManager(host_capacity, policy=policy, admission=admission)
    lrus = [_Lru(t.capacity) for t in tiers]
    down = next((i for i, t in enumerate(tiers) if not t.write_through), None)
    through = [i for i, t in enumerate(tiers) if t.write_through]
    hits = {"host": 0, **{t.name: 0 for t in tiers}}
    refs = 0
    for req in trace:
        keys = req.hash_ids if isinstance(req, Request) else req
        refs += len(keys)
        used_host: list[Hashable] = []
        for key in keys:
            if mgr.count_leading_hits((key,)):
                hits["host"] += 1
                used_host.append(key)
                continue
            where = next((i for i, lru in enumerate(lrus) if key in lru), None)
            if where is None:
                break
            hits[tiers[where].name] += 1
            lrus[where].touch(key)
        if used_host:
            mgr.touch(used_host)
        held = {k for k in keys if k in mgr}
        plan = mgr.prepare_store(keys)
        if down is not None:
            for key in keys:  # turned away by the host: straight to the tier
                if key not in held and key not in mgr and key not in lrus[down]:
                    lrus[down].put(key)
        if plan is not None and plan.keys_to_store:
            mgr.complete_store(plan.keys_to_store, success=True)
            for i in through:
                for key in plan.keys_to_store:
                    lrus[i].put(key)
        if plan is not None and down is not None:
            for key in plan.evicted:
                if key not in lrus[down]:
                    lrus[down].put(key)
        mgr.take_events()
    return TierSimResult(hits, refs)
