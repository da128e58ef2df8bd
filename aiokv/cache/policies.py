"""Eviction policies: which held key gives its chunk up when a store needs room.

A policy sees keys only, never chunks or data. The manager tells it what was inserted,
accessed and removed, and asks it for victims among the keys that are evictable now (not
being written, not pinned by a load, not part of the offer that needs the room). Keys of one
call arrive in prefix order (a request's first block first), which a policy may use: a later
block is only worth anything while every block before it is held.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from ..errors import InvalidSpec
from .registry import Registry, adopt

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyFactory",
    "PrefixLRUPolicy",
    "available_policies",
    "make_policy",
    "register_policy",
]


class EvictionPolicy(ABC):
    """Recency/frequency bookkeeping over held keys; decides eviction order."""

    @abstractmethod
    def on_insert(self, keys: Sequence[Hashable]) -> None:
        """Keys newly held (in prefix order)."""

    @abstractmethod
    def on_access(self, keys: Sequence[Hashable]) -> None:
        """Held keys that were just used (hits, loads, touches), in prefix order."""

    @abstractmethod
    def on_remove(self, key: Hashable, *, evicted: bool) -> None:
        """A key stopped being held: ``evicted`` for evictions, False for failed stores."""

    @abstractmethod
    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Pick ``n`` distinct evictable keys in eviction order, or None if there are fewer.

        Must not change any state: the manager may drop the plan (all-or-nothing stores).
        """

    def __len__(self) -> int:
        return 0


PolicyFactory = Callable[[int], EvictionPolicy]
"""Builds a policy for a cache of ``capacity`` chunks."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first; keys of one call are stamped in the order given."""

    def __init__(self, capacity: int = 0) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, keys: Sequence[Hashable]) -> None:
        order = self._order
        for key in keys:
            order[key] = None
            order.move_to_end(key)

    def on_access(self, keys: Sequence[Hashable]) -> None:
        move = self._order.move_to_end
        for key in keys:
            if key in self._order:
                move(key)

    def on_remove(self, key: Hashable, *, evicted: bool) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
        out: list[Hashable] = []
        if n <= 0:
            return out
        for key in self._order:
            if evictable(key):
                out.append(key)
                if len(out) == n:
                    return out
        return None

    def order(self) -> list[Hashable]:
        """Keys from next victim to most recently used (for tests and debugging)."""
        return list(self._order)


class PrefixLRUPolicy(LRUPolicy):
    """LRU that stamps a call's keys last-to-first, so a request's tail goes before its head.

    Why: a prefix cache serves blocks only up to the first miss, so evicting a request's
    first block makes the rest of it useless while they still take room.
    """

    def on_insert(self, keys: Sequence[Hashable]) -> None:
        super().on_insert(keys[::-1])

    def on_access(self, keys: Sequence[Hashable]) -> None:
        super().on_access(keys[::-1])


class AdaptivePolicy(PrefixLRUPolicy):
    """Prefix-ordered LRU paired with adaptive admission (the recommended default).

    Why: on the Mooncake traces, what is admitted matters more than what is evicted; an
    adaptive filter over a tail-first LRU is never worse than LRU at the sizes in
    docs/cache.md. Eviction order matters little behind the filter: frequency-weighted
    orders and orders by a predicted next use did no better.
    """

    preferred_admission = "adaptive"


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache (Megiddo and Modha): recency list T1, frequency list T2,
    ghost lists B1 and B2 of keys evicted from each, and a target size ``p`` for T1 that a
    ghost hit moves toward the list that would have kept the key. A one-pass scan only
    enters T1, so it cannot flush a set that is used repeatedly (T2).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise InvalidSpec("ARC needs capacity >= 1")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def on_insert(self, keys: Sequence[Hashable]) -> None:
        c = self.capacity
        for key in keys:
            if key in self.b1:
                self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
                del self.b1[key]
                self.t2[key] = None
            elif key in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
                del self.b2[key]
                self.t2[key] = None
            else:
                self.t1[key] = None
            self._trim_ghosts()

    def on_access(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)

    def on_remove(self, key: Hashable, *, evicted: bool) -> None:
        if key in self.t1:
            del self.t1[key]
            if evicted:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if evicted:
                self.b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def victims(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
        out: list[Hashable] = []
        if n <= 0:
            return out
        it1 = (k for k in self.t1 if evictable(k))
        it2 = (k for k in self.t2 if evictable(k))
        t1_len = len(self.t1)
        done1 = done2 = False
        while len(out) < n:
            prefer_t1 = not done1 and (done2 or (t1_len > 0 and t1_len > self.p))
            key = None
            if prefer_t1:
                key = next(it1, None)
                if key is None:
                    done1 = True
                else:
                    t1_len -= 1
            if key is None and not done2:
                key = next(it2, None)
                if key is None:
                    done2 = True
            if key is None and not done1:
                key = next(it1, None)
                if key is None:
                    done1 = True
                else:
                    t1_len -= 1
            if key is None:
                return None
            out.append(key)
        return out


_REGISTRY: Registry[EvictionPolicy] = Registry(
    "eviction policy",
    {"lru": LRUPolicy, "prefix-lru": PrefixLRUPolicy, "adaptive": AdaptivePolicy, "arc": ARCPolicy},
)


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``factory`` selectable by ``name`` in ChunkManager and the simulator."""
    _REGISTRY.register(name, factory, replace=replace)


def available_policies() -> list[str]:
    """Registered policy names."""
    return _REGISTRY.names()


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """A policy instance from a registered name (or the instance itself)."""
    if isinstance(policy, EvictionPolicy):
        # Shared, or with keys, it would evict keys its manager never held.
        return adopt(policy, "eviction policy", used=len(policy) > 0)
    return _REGISTRY.build(policy, capacity)
