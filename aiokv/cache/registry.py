"""A name -> factory table, shared by eviction and admission policies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..errors import InvalidSpec

T = TypeVar("T")

__all__ = ["Registry", "adopt", "release"]

_TAKEN = "_aiokv_taken"


def adopt(instance: T, kind: str, *, used: bool = False) -> T:
    """Give a caller's policy object to one cache: its bookkeeping must mirror one manager's
    keys, so an object already given to another (or ``used``: with history) is refused."""
    if used or getattr(instance, _TAKEN, False):
        raise InvalidSpec(f"this {kind} object already serves a cache (or tracks keys); pass a new one")
    try:
        setattr(instance, _TAKEN, True)
    except AttributeError:  # __slots__: only the length check applies
        pass
    return instance


def release(instance: object) -> None:
    """Undo ``adopt`` for a cache whose construction failed, so the caller may pass the
    object to another."""
    try:
        delattr(instance, _TAKEN)
    except AttributeError:
        pass


class Registry(Generic[T]):
    """Factories taking a capacity in chunks, selectable by a case-insensitive name."""

    def __init__(self, kind: str, entries: dict[str, Callable[[int], T]]) -> None:
        self.kind = kind
        self._entries = {name.lower(): factory for name, factory in entries.items()}

    def register(self, name: str, factory: Callable[[int], T], *, replace: bool = False) -> None:
        key = name.lower()
        if key in self._entries and not replace:
            raise InvalidSpec(f"{self.kind} {name!r} is already registered; pass replace=True")
        self._entries[key] = factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def build(self, name: str, capacity: int) -> T:
        try:
            factory = self._entries[name.lower()]
        except KeyError:
            raise InvalidSpec(f"unknown {self.kind} {name!r}; known: {self.names()}") from None
        return factory(capacity)
