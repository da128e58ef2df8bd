"""aiokv.bench.replay: replays size the cache by the cache's own rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from aiokv.bench.replay import host_chunks_for
from aiokv.cache import protocol


@pytest.mark.parametrize("default", [protocol.DEFAULT_STAGING_CHUNKS, 8])
def test_a_replayed_host_tier_holds_the_blocks_asked_for(monkeypatch: pytest.MonkeyPatch,
                                                         default: int) -> None:
    """The pool a replay builds leaves exactly ``host`` chunks to the host tier under the
    cache's default staging, whatever that default is (one rule, not a copy of it)."""
    monkeypatch.setattr(protocol, "DEFAULT_STAGING_CHUNKS", default)
    for host in (1, 2, 7, 31, 100, 2000):
        worker = SimpleNamespace(num_cpu_chunks=host_chunks_for(host))
        _chunks, held, staging = protocol.split_chunks(worker, None, None, tiers=True)  # type: ignore[arg-type]
        assert len(held) == host and 1 <= len(staging) <= default
