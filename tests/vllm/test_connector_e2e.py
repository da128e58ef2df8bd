"""vLLM's real Scheduler serving requests through AiokvConnector, layer by layer.

The scheduler builds the connector (and so aiokv's spec and manager) from the documented
``--kv-transfer-config``; the worker-role connector runs on CPU tensors, and a forward
pass calls its per-layer hooks in the model runner's order (tests/vllm/connector_engine.py).
Every layer a forward reads, and every full block of every running request after each
step, must hold its block hash's bytes, whether computed, found in the GPU prefix cache
or loaded from host memory.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from aiokv.backends.cpu import CpuLane
from aiokv.specs import Direction

from .connector_engine import ConnectorEngine
from .harness import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize(("policy", "budget"), [("adaptive", None), ("lru", 0)])
def test_vllm_scheduler_serves_prefixes_through_the_connector(
    model_dir, policy: str, budget: int | None
) -> None:
    """By default every hit loads synchronously, in the step that computes the rest of
    its prompt; ``sync_load_budget_bytes: 0`` makes every load asynchronous."""
    extra = {"aiokv_policy": policy}
    if budget is not None:
        extra["sync_load_budget_bytes"] = budget
    engine = ConnectorEngine(model_dir, extra=extra)
    tally = engine.run()
    stats = engine.manager.chunks.stats()
    assert tally.loads > 5 and stats.stores > 20 and stats.evictions > 0, (tally, stats)
    assert tally.checked > 500 and tally.checked_in_layer > 500, tally
    layers = engine.aiokv_worker.statistics().layers
    assert layers.pushed > 3 * 20 and layers.failed_layers == 0, layers  # stores went layer by layer
    if budget is None:  # each synchronous load: one layerwise job, gated at each attention layer
        assert tally.sync_loads == tally.loads
        assert layers.gates >= 3 * tally.steps_with_sync_loads > 0, (layers, tally)
    else:
        assert tally.sync_loads == layers.gates == 0
    assert tally.invalid_blocks == tally.failed_recving == 0
    engine.close()


def test_slow_copies_never_let_a_layer_or_a_reused_block_go_early(model_dir, monkeypatch) -> None:
    """Copies slowed to a crawl: a layer's attention must still read its loaded bytes (its
    gate waited for them, while later layers still copy), and blocks whose stores are still
    running when vLLM reuses them are flushed first (else the stores would copy the new
    request's bytes under the old keys, which later loads would show)."""
    real = CpuLane._copy

    def slow(self, plan):
        time.sleep(0.02 if self.direction.to_host else 0.002)
        return real(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", slow)
    engine = ConnectorEngine(model_dir, extra={"aiokv_policy": "lru"}, seed=11, gpu_blocks=28)
    tally = engine.run(requests=50)
    assert tally.sync_loads > 3 and tally.checked_in_layer > 100 and tally.flushes > 0, tally
    engine.close()


@pytest.mark.parametrize(("fail", "budget"), [(Direction.EXPEDITED_LOAD, None), (Direction.STORE, None),
                                              (Direction.LOAD, 0)])
def test_failed_transfers_are_recomputed_never_served(model_dir, monkeypatch, fail: Direction,
                                                      budget: int | None) -> None:
    """Every third copy of one direction fails. A failed synchronous load is reported in
    its own step as blocks to recompute (vLLM discards that step's token of the request
    and recomputes them); a failed asynchronous load as a failed receive; a failed store
    is never published. Only requests reported so may have read a bad layer, and every
    block of every running request is right after each step."""
    real = CpuLane._copy
    count = [0]

    def flaky(self, plan):
        if self.direction is fail:
            count[0] += 1
            if count[0] % 3 == 0:
                raise OSError("injected copy failure")
        return real(self, plan)

    monkeypatch.setattr(CpuLane, "_copy", flaky)
    extra: dict[str, object] = {"aiokv_policy": "lru"}
    if budget is not None:
        extra["sync_load_budget_bytes"] = budget
    engine = ConnectorEngine(model_dir, extra=extra, seed=5)
    engine.strict = False
    reported: set[str] = set()
    sched = engine.scheduler
    for _ in range(600):
        if engine.added < 60 and engine.rng.random() < 0.6:
            engine.add_request()
        if not sched.requests:
            if engine.added >= 60:
                break
            continue
        before = set(engine.tally.misread)
        running = {r.request_id: r for r in sched.running}
        invalid, failed = engine.step()
        reported |= failed
        for rid in engine.tally.misread - before:  # read garbage: must have been reported
            req = running.get(rid) or sched.requests.get(rid)
            blocks = {b.block_id for b in engine.blocks_of.get(rid, ())} if req else set()
            assert rid in failed or blocks & invalid, rid
    assert not sched.requests
    assert count[0] >= 3
    tally = engine.tally
    if fail is Direction.EXPEDITED_LOAD:
        assert tally.invalid_blocks > 0 and tally.misread, tally
    elif fail is Direction.LOAD:
        assert tally.failed_recving > 0, tally
    else:
        assert tally.invalid_blocks == tally.failed_recving == 0 and not tally.misread, tally
    assert engine.aiokv_worker.statistics().failed[fail.value] > 0
    engine.close()
