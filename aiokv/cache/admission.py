"""Admission control: which offered blocks are worth a chunk at all.

Most blocks of real traffic are never requested again, and storing one evicts a block that
might be. An admission policy sees the offered keys that are not held yet (in prefix order)
and says which to store. ``admit`` (or ``admit_offer``, which also sees the whole offer) must
not change state (the manager may drop the plan when the store cannot fit); ``on_offer`` then
records the decision once it is final.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from .registry import Registry, adopt

__all__ = [
    "AdaptiveAdmission",
    "AdmissionPolicy",
    "AdmitAll",
    "SecondOfferAdmission",
    "available_admissions",
    "make_admission",
    "register_admission",
]


class AdmissionPolicy(ABC):
    """Decides which not-yet-held offered keys get stored."""

    @abstractmethod
    def admit(self, keys: Sequence[Hashable], free_chunks: int) -> list[bool]:
        """One flag per key (prefix order); no state change."""

    def admit_offer(
        self, offer: Sequence[Hashable], keys: Sequence[Hashable], free_chunks: int
    ) -> list[bool]:
        """Like ``admit`` for ``keys``, the not-held part of ``offer`` (every offered key, in
        prefix order); what the manager calls. Override to use the offer's shape."""
        return self.admit(keys, free_chunks)

    def on_offer(self, keys: Sequence[Hashable], admitted: Sequence[bool]) -> None:
        """The store went ahead with these decisions (same keys as ``admit``)."""

    def on_evict(self, key: Hashable) -> None:
        """A held key was evicted to make room."""

    def observe(self, offer: Sequence[Hashable]) -> None:
        """Every key of a committed offer, held or not (prefix order), before ``on_offer``."""


AdmissionFactory = Callable[[int], AdmissionPolicy]
"""Builds an admission policy for a cache of ``capacity`` chunks."""


class AdmitAll(AdmissionPolicy):
    """Store everything offered (plain caching)."""

    def __init__(self, capacity: int = 0) -> None:
        pass

    def admit(self, keys: Sequence[Hashable], free_chunks: int) -> list[bool]:
        return [True] * len(keys)


class _Ghost:
    """Bounded set of keys remembered in insertion order (oldest forgotten first)."""

    __slots__ = ("_keys", "size")

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        keys = self._keys
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.size:
            keys.popitem(last=False)

    def discard(self, key: Hashable) -> bool:
        return self._keys.pop(key, 0) is None


class SecondOfferAdmission(AdmissionPolicy):
    """Store a key on its second offer within a bounded memory of refused keys.

    Good when the cache is small (one-off blocks never displace reused ones); loses every
    block's first reuse, which costs a lot when the cache is large enough to keep it.
    """

    def __init__(self, capacity: int, ghost_factor: float = 2.0) -> None:
        self._ghost = _Ghost(int(capacity * ghost_factor))

    def admit(self, keys: Sequence[Hashable], free_chunks: int) -> list[bool]:
        ghost = self._ghost
        return [key in ghost for key in keys]

    def on_offer(self, keys: Sequence[Hashable], admitted: Sequence[bool]) -> None:
        ghost = self._ghost
        for key, ok in zip(keys, admitted):
            if ok:
                ghost.discard(key)
            else:
                ghost.add(key)


class _Shadow:
    """A miniature prefix cache over sampled keys, replaying one admission rule.

    Why: which rule wins depends on cache size and traffic, so each candidate is scored by
    replaying the traffic it would have seen on a cache scaled down by the sampling rate.
    """

    __slots__ = ("capacity", "ghost", "held", "score")

    def __init__(self, capacity: int, ghost_factor: float | None) -> None:
        self.capacity = max(1, capacity)
        self.held: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost = None if ghost_factor is None else _Ghost(int(self.capacity * ghost_factor))
        self.score = 0.0

    def step(self, keys: Sequence[Hashable], decay: float) -> None:
        held = self.held
        hits = 0
        for key in keys:
            if key not in held:
                break
            hits += 1
        for key in reversed(keys[:hits]):
            held.move_to_end(key)
        self.score = self.score * decay + hits
        ghost = self.ghost
        new = [k for k in keys[hits:] if k not in held]
        if ghost is not None:
            admitted = []
            for key in new:
                if ghost.discard(key):
                    admitted.append(key)
                else:
                    ghost.add(key)
            new = admitted
        protected = set(keys)
        for key in reversed(new):
            if len(held) >= self.capacity:
                victim = next((k for k in held if k not in protected), None)
                if victim is None:
                    return
                del held[victim]
            held[key] = None


class _TailReuse:
    """Learns whether the last key of an offer is ever offered again, against the key before it.

    Why: a serving engine that hashes a request's partial last block offers a key that the
    next turn never sends again (the block grows and hashes anew). On a chat trace such last
    keys come back far less often than the others (docs/cache.md, "The default policy"), so
    storing them only displaces blocks that will be used. Engines that offer only full blocks
    re-send their last key like any other, and then nothing is skipped.

    Each offer of two or more keys remembers its last and its second-to-last key in two
    windows of equal length; a later offer of a remembered key counts a return for its side.
    Both sides enter one key per offer, so their return counts compare directly; counts
    halve every few windows so the verdict follows the traffic. ``skip`` holds while last
    keys return less than ``ratio`` times as often as the others (the default ratio skips
    them on the chat trace and keeps them on the synthetic one, where skipping cost hits at
    large sizes).
    """

    __slots__ = (
        "_body",
        "_offers",
        "_period",
        "_tail",
        "body_returns",
        "min_returns",
        "ratio",
        "skip",
        "tail_returns",
    )

    def __init__(self, window: int, *, ratio: float = 0.1, min_returns: int = 32) -> None:
        self._tail = _Ghost(window)
        self._body = _Ghost(window)
        self.tail_returns = 0.0
        self.body_returns = 0.0
        self.ratio = ratio
        self.min_returns = min_returns
        self.skip = False
        self._offers = 0
        self._period = 4 * max(1, window)

    def observe(self, offer: Sequence[Hashable]) -> None:
        tail, body = self._tail, self._body
        if len(tail) or len(body):
            for key in offer:
                if tail.discard(key):
                    self.tail_returns += 1
                if body.discard(key):
                    self.body_returns += 1
        if len(offer) < 2:
            return
        tail.add(offer[-1])
        body.add(offer[-2])
        self._offers += 1
        if self._offers >= self._period:
            self._offers = 0
            self.tail_returns /= 2
            self.body_returns /= 2
        b = self.body_returns
        self.skip = b >= self.min_returns and self.tail_returns < self.ratio * b


class AdaptiveAdmission(AdmissionPolicy):
    """Admit everything or only second offers, whichever a miniature simulation says wins.

    Storing every block is right when the cache can keep blocks until their first reuse;
    a second-offer filter is right when it cannot and one-off blocks would flush the reused
    ones. Two shadow caches (sampled keys, capacity scaled by the sampling rate) replay both
    rules on the live traffic; decayed hit counts pick the rule, with hysteresis. An offer
    whose new keys all fit in the free chunks is admitted whole. The second-offer ghost is
    kept up to date in both modes so a switch takes effect at once.

    In both modes, for an offer that does not fit, its last key is turned away while
    ``_TailReuse`` finds such keys rarely come back (a request's partial last block).
    """

    def __init__(
        self,
        capacity: int,
        *,
        ghost_factor: float = 4.0,
        shadow_size: int = 1024,
        min_rate: float = 1 / 32,
        half_life: float = 4.0,
        margin: float = 0.02,
    ) -> None:
        self._ghost = _Ghost(int(capacity * ghost_factor))
        self.rate = min(1.0, max(min_rate, shadow_size / max(1, capacity)))
        self._threshold = int(self.rate * (1 << 32))
        scaled = max(1, round(capacity * self.rate))
        self._all = _Shadow(scaled, None)
        self._filtered = _Shadow(scaled, ghost_factor)
        # Scores halve every ``half_life`` shadow capacities of sampled references.
        self._decay_per_ref = 0.5 ** (1.0 / (half_life * scaled))
        self._margin = margin
        self.filtering = False
        self.tail = _TailReuse(max(1024, capacity))

    def _sampled(self, key: Hashable) -> bool:
        return ((hash(key) * 0x9E3779B97F4A7C15) >> 16) & 0xFFFFFFFF < self._threshold

    def admit(self, keys: Sequence[Hashable], free_chunks: int) -> list[bool]:
        if not self.filtering or free_chunks >= len(keys):
            return [True] * len(keys)
        ghost = self._ghost
        return [key in ghost for key in keys]

    def admit_offer(
        self, offer: Sequence[Hashable], keys: Sequence[Hashable], free_chunks: int
    ) -> list[bool]:
        flags = self.admit(keys, free_chunks)
        if self.tail.skip and free_chunks < len(keys) and len(offer) >= 2 and keys[-1] == offer[-1]:
            flags[-1] = False
        return flags

    def on_offer(self, keys: Sequence[Hashable], admitted: Sequence[bool]) -> None:
        ghost = self._ghost
        for key, ok in zip(keys, admitted):
            if key in ghost:
                ghost.discard(key)
            elif not ok or not self.filtering:
                ghost.add(key)

    def observe(self, offer: Sequence[Hashable]) -> None:
        self.tail.observe(offer)
        sample = [k for k in offer if self._sampled(k)]
        if not sample:
            return
        decay = self._decay_per_ref ** len(sample)
        self._all.step(sample, decay)
        self._filtered.step(sample, decay)
        a, f = self._all.score, self._filtered.score
        if self.filtering and a > f * (1 + self._margin):
            self.filtering = False
        elif not self.filtering and f > a * (1 + self._margin):
            self.filtering = True


_REGISTRY: Registry[AdmissionPolicy] = Registry(
    "admission policy",
    {"all": AdmitAll, "second-offer": SecondOfferAdmission, "adaptive": AdaptiveAdmission},
)


def register_admission(name: str, factory: AdmissionFactory, *, replace: bool = False) -> None:
    """Make ``factory`` selectable by ``name``."""
    _REGISTRY.register(name, factory, replace=replace)


def available_admissions() -> list[str]:
    """Registered admission names."""
    return _REGISTRY.names()


def make_admission(admission: str | AdmissionPolicy | None, capacity: int) -> AdmissionPolicy:
    """An admission instance from a name, an instance, or None (admit everything)."""
    if admission is None:
        return AdmitAll()
    if isinstance(admission, AdmissionPolicy):
        return adopt(admission, "admission policy")
    return _REGISTRY.build(admission, capacity)
