"""aiokv.extras: one helper per optional extra, one message that names the extra and the
command that installs it; a package that is present imports as itself."""

from __future__ import annotations

import sys

import pytest

from aiokv.errors import InvalidSpec, MissingExtra, UsageError
from aiokv.extras import EXTRAS, require


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_a_missing_package_names_its_extra_and_the_install_command(
        extra: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = EXTRAS[extra].module
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(MissingExtra) as caught:
        require(extra)
    message = str(caught.value)
    assert f"'{extra}' extra" in message
    assert f"python3 -m pip install -e '.[{extra}]'" in message
    assert EXTRAS[extra].feature in message
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, UsageError)
    assert caught.value.name == module


def test_a_present_package_is_returned() -> None:
    redis = pytest.importorskip("redis")
    assert require("redis") is redis
    assert require("redis", "redis.exceptions") is sys.modules["redis.exceptions"]


def test_a_broken_dependency_inside_the_package_is_not_a_missing_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("redis")
    monkeypatch.setitem(sys.modules, "redis.nonexistent_part", None)
    with pytest.raises(MissingExtra):  # a submodule of the extra's own package: still the extra
        require("redis", "redis.nonexistent_part")
    with pytest.raises(ImportError) as caught:
        require("redis", "json.no_such_module")
    assert not isinstance(caught.value, MissingExtra)


def test_an_unknown_extra_is_misuse() -> None:
    with pytest.raises(InvalidSpec, match="no optional extra"):
        require("gpu")
