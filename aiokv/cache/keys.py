"""Turning what callers pass (lists, numpy arrays, tensors) into keys and block ids."""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, cast

import numpy as np

from ..errors import InvalidSpec

__all__ = ["as_block_ids", "as_keys", "check_hashable_values", "unhashable"]


def as_keys(keys: Sequence[Hashable] | np.ndarray) -> Sequence[Hashable]:
    """A numpy array's or a tensor's keys as plain values (its elements would hash by
    identity, a tensor's, and never hit); any other sequence as it is, not copied:
    ``lookup`` is polled, and returns at the first miss."""
    if isinstance(keys, (str, bytes, bytearray)):
        raise InvalidSpec(f"keys must be a sequence of keys; got one {type(keys).__name__} "
                          "(it would be read as one key per element): wrap it in a list")
    tolist = getattr(keys, "tolist", None)
    if not callable(tolist):
        if not isinstance(keys, Sequence):  # a generator: read once, then counted and indexed
            return list(keys)
        return cast(Sequence[Hashable], keys)
    out = tolist()
    if not isinstance(out, list) or (out and isinstance(out[0], list)):
        shape = tuple(getattr(keys, "shape", ()))
        raise InvalidSpec(f"keys must be a 1-D sequence; got an array of shape {shape}")
    return out


def check_hashable_values(keys: Sequence[Hashable]) -> None:
    """Refuse keys that hash by identity (they would never hit)."""
    if any(_is_tensor(k) or isinstance(k, np.ndarray) for k in keys):
        raise InvalidSpec("keys must hash by value (ints, bytes, str, tuples); a tensor or array "
                          "hashes by identity and would never hit: pass tensor.tolist()")


def unhashable(exc: TypeError) -> InvalidSpec:
    return InvalidSpec(f"keys must be hashable (ints, bytes, str, tuples): {exc}")


def as_block_ids(keys: Sequence[Hashable], ids: Sequence[int] | np.ndarray) -> list[int]:
    """Plain Python ints, one per key (numpy arrays' and torch tensors' become ints).

    Their range is the worker's to check when they are submitted; a 0-d tensor hashes by
    identity and a 0-d array not at all, so they become ints here for the duplicate check.
    """
    out = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(out, (str, bytes)) or not isinstance(out, Iterable):
        raise InvalidSpec(f"GPU block ids must be a sequence of integers, one per key; "
                          f"got {type(ids).__name__}")
    blocks = list(out)
    if not all(map(_is_id, blocks)):
        raise InvalidSpec(f"GPU block ids must be integers; got {[type(b).__name__ for b in blocks][:5]}")
    if len(blocks) != len(keys):
        raise InvalidSpec(f"got {len(keys)} keys but {len(blocks)} GPU block ids; pass one block per key")
    return [operator.index(b) for b in blocks]


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "tolist")


def _is_id(value: Any) -> bool:
    """An integer (numpy and 0-d torch ones included), not a bool or a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True
