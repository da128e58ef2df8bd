"""aiokv/cache/registry.py: the name -> factory table and one-owner adoption of policy objects."""

from __future__ import annotations

import pytest

from aiokv import ChunkManager, InvalidSpec
from aiokv.cache import LRUPolicy
from aiokv.cache.registry import Registry, adopt, release


class Thing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity


class Slotted:
    __slots__ = ("capacity",)


def test_names_are_case_insensitive_and_sorted() -> None:
    reg: Registry[Thing] = Registry("thing", {"Beta": Thing, "alpha": Thing})
    assert reg.names() == ["alpha", "beta"]
    built = reg.build("BETA", 7)
    assert isinstance(built, Thing) and built.capacity == 7
    assert reg.build("alpha", 3).capacity == 3


def test_unknown_name_lists_the_known_ones() -> None:
    reg: Registry[Thing] = Registry("thing", {"alpha": Thing})
    with pytest.raises(InvalidSpec, match=r"unknown thing 'gamma'; known: \['alpha'\]"):
        reg.build("gamma", 1)


def test_register_refuses_a_taken_name_unless_replacing() -> None:
    reg: Registry[Thing] = Registry("thing", {"alpha": Thing})
    with pytest.raises(InvalidSpec, match="already registered"):
        reg.register("ALPHA", lambda c: Thing(c + 1))
    assert reg.build("alpha", 1).capacity == 1  # unchanged by the refused register
    reg.register("ALPHA", lambda c: Thing(c + 1), replace=True)
    assert reg.build("alpha", 1).capacity == 2
    reg.register("delta", lambda c: Thing(c * 10))
    assert reg.names() == ["alpha", "delta"] and reg.build("Delta", 2).capacity == 20


def test_adopt_gives_an_object_to_one_owner_until_released() -> None:
    thing = Thing(1)
    assert adopt(thing, "thing") is thing
    with pytest.raises(InvalidSpec, match="already serves a cache"):
        adopt(thing, "thing")
    release(thing)
    assert adopt(thing, "thing") is thing
    release(thing)
    release(thing)  # releasing twice is harmless
    with pytest.raises(InvalidSpec, match="already serves a cache"):
        adopt(Thing(1), "thing", used=True)


def test_slotted_objects_pass_adopt_without_a_mark() -> None:
    obj = Slotted()
    assert adopt(obj, "thing") is obj
    assert adopt(obj, "thing") is obj  # nothing to mark: only the length check applies
    release(obj)


def test_a_policy_object_serves_one_manager_and_is_released_on_refusal() -> None:
    policy = LRUPolicy()
    ChunkManager(4, policy=policy)
    with pytest.raises(InvalidSpec, match="already serves a cache"):
        ChunkManager(4, policy=policy)
    fresh = LRUPolicy()
    with pytest.raises(InvalidSpec):
        ChunkManager(4, policy=fresh, admission="no-such-admission")
    ChunkManager(4, policy=fresh)  # the refused construction gave it back
