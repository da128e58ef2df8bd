"""Which ``OffloadCache`` owns which chunks of a worker's host pool, and the job ids the
caches of one worker share (so they never collide on ids)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from ..errors import InvalidSpec

__all__ = ["Owners", "owners_of"]


class _Owner(Protocol):
    chunks: range


class Owners:
    """The caches of one worker that own chunks now (a closed cache gives its chunks back;
    one dropped unclosed gives them back with its last reference)."""

    def __init__(self) -> None:
        self._caches: weakref.WeakSet[Any] = weakref.WeakSet()
        self.job_ids: Iterator[int] = itertools.count(1)

    def claim(self, cache: _Owner) -> None:
        """Record ``cache`` as the owner of ``cache.chunks``; ``InvalidSpec`` if another
        owns any of them."""
        chunks = cache.chunks
        for other in self._caches:
            both = range(max(chunks.start, other.chunks.start), min(chunks.stop, other.chunks.stop))
            if both:
                raise InvalidSpec(
                    f"chunks {both.start}..{both.stop - 1} of this worker already belong to another "
                    f"OffloadCache ({other.chunks!r}); give each cache its own chunks=range(...), or "
                    "close the other first (`async with cache:` or `await cache.aclose()`)"
                )
        self._caches.add(cache)

    def release(self, cache: _Owner) -> None:
        self._caches.discard(cache)


_OWNERS: weakref.WeakKeyDictionary[Any, Owners] = weakref.WeakKeyDictionary()


def owners_of(worker: Any) -> Owners:
    """The ``Owners`` of ``worker``'s pool (made on first use)."""
    return _OWNERS.setdefault(worker, Owners())
