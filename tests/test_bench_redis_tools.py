"""aiokv.bench.redis_tools: the bench's checks of a user's Redis say what is wrong as the
rest of aiokv says it."""

from __future__ import annotations

import sys

import pytest

from aiokv.bench.redis_tools import ping
from aiokv.extras import EXTRAS, install_hint


def test_a_missing_redis_package_is_reported_as_every_extra_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # as if not installed
    with pytest.raises(ValueError) as caught:  # what the bench CLI prints without a traceback
        ping("redis://127.0.0.1:6379/0")
    message = str(caught.value)
    assert "'redis' extra" in message and install_hint("redis") in message
    assert EXTRAS["redis"].feature in message


def test_a_server_that_does_not_answer_is_named() -> None:
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="does not answer"):
        ping("redis://127.0.0.1:1/0")
