"""``aiokv bench serve``: the model's paged prefill and FLOP count, the workload's tokens,
keys and segments, the arms' turns, the GPU pool, the lower bounds, the layerwise source,
greedy decode from restored KV, and the ``--quick`` command end to end on a small
conversation trace (every arm and hit class appears, and the invariants that make the
arms comparable hold whatever the machine's speed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from aiokv.__main__ import main
from aiokv.bench.serve import correctness
from aiokv.bench.serve.config import DEFAULT_ARMS, ServeConfig
from aiokv.bench.serve.correctness import blocks_needed, decode_check
from aiokv.bench.serve.measure import Device
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel, ModelConfig
from aiokv.bench.serve.pool import BlockPool
from aiokv.bench.serve.report import Ceilings, lower_bounds
from aiokv.bench.serve.served import Served
from aiokv.bench.serve.server import Server
from aiokv.bench.serve.sources import LayerwiseSource, Restored, Source
from aiokv.bench.serve.workload import (
    block_keys,
    prefix_workload,
    reuse_distances,
    trace_workload,
)
from aiokv.cache.offload import OffloadCache

from .layerwise_prefill import layerwise_prefill


def conversation_trace(path: Path, conversations: int = 24, turns: int = 4, seed: int = 0) -> Path:
    """Conversations that share a first block and grow turn by turn, in shuffled rounds: a
    turn's prefix comes back after the other conversations' turns, near and far."""
    rng = random.Random(seed)
    next_id, t = 1, 0
    history = {c: [0] for c in range(conversations)}
    with path.open("w") as f:
        for _ in range(turns):
            for c in rng.sample(range(conversations), conversations):
                k = rng.randint(1, 3)
                history[c] = history[c] + list(range(next_id, next_id + k))
                next_id += k
                row = {"timestamp": t, "input_length": 512 * len(history[c]) - rng.randint(0, 300),
                       "output_length": 8, "hash_ids": history[c]}
                f.write(json.dumps(row) + "\n")
                t += rng.randint(50, 500)
    return path


# -- the model ---------------------------------------------------------------------------


def test_llama3_8b_shapes_give_32_kib_pages() -> None:
    c = ModelConfig.llama3_8b()
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab) == \
        (32, 4096, 32, 8, 128, 14336, 128256)
    assert c.page_bytes(torch.bfloat16) == 32 << 10
    assert c.block_bytes(torch.bfloat16) == 2 * 32 * (32 << 10)
    assert c.params_per_layer() * 32 == pytest.approx(6.98e9, rel=0.01)  # 8B less embeddings
    assert ModelConfig.llama3_8b(4).with_layers(8).layers == 8
    # Cached tokens cost only the attention over them.
    assert c.prefill_flops(512, 512) < c.prefill_flops(1024, 0)


@pytest.mark.parametrize("split", [16, 48, 64, 100, 200])
def test_prefill_over_a_cached_prefix_equals_prefill_in_one_go(split: int) -> None:
    """Prefix, then the suffix over the prefix's KV read back from other (scattered) pages:
    the same logits and the same KV as one prefill of the whole prompt (float32)."""
    model = LlamaModel(ModelConfig.tiny(), seed=3)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab, 215)
    blocks = -(-len(prompt) // BLOCK_TOKENS)
    kv_one, kv_two = model.new_kv_cache(64), model.new_kv_cache(64)
    one_table = list(range(blocks))
    two_table = list(np.random.default_rng(1).permutation(np.arange(20, 64))[:blocks])
    whole = model.prefill(prompt, 0, one_table, kv_one)
    model.prefill(prompt[:split], 0, two_table, kv_two)
    parts = model.prefill(prompt[split:], split, two_table, kv_two)
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-4)
    positions = len(prompt)
    for a, b in zip(kv_one, kv_two):
        flat_a = a.view(2, -1, *a.shape[3:])[:, [one_table[p // 16] * 16 + p % 16 for p in range(positions)]]
        flat_b = b.view(2, -1, *b.shape[3:])[:, [two_table[p // 16] * 16 + p % 16 for p in range(positions)]]
        torch.testing.assert_close(flat_b, flat_a, rtol=1e-4, atol=1e-4)
    assert whole.abs().max() > 0.1  # not a degenerate model


def test_decoding_token_by_token_equals_prefill() -> None:
    model = LlamaModel(ModelConfig.tiny(), seed=4)
    prompt = np.random.default_rng(2).integers(0, model.config.vocab, 40)
    kv_a, kv_b = model.new_kv_cache(8), model.new_kv_cache(8)
    whole = model.prefill(prompt, 0, [0, 1, 2], kv_a)
    model.prefill(prompt[:33], 0, [5, 6, 7], kv_b)
    for pos in range(33, 40):
        last = model.prefill(prompt[pos:pos + 1], pos, [5, 6, 7], kv_b)
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cached, new", [(0, 100), (32, 64), (160, 40)])
def test_prefill_flops_count_gemms_of_new_tokens_and_attention_over_every_key(cached: int, new: int) -> None:
    """The MFU's numerator: torch's FLOP counter sees the GEMMs (projections, FFN and the
    LM head of the last token) of the new tokens only; attention adds 4 * heads * head_dim
    FLOPs per (query, visible key) pair, each new query seeing every key up to itself."""
    from torch.utils.flop_counter import FlopCounterMode

    model = LlamaModel(ModelConfig.tiny(), seed=0)
    c = model.config
    tokens = np.random.default_rng(0).integers(0, c.vocab, new)
    with FlopCounterMode(display=False) as counter:
        model.prefill(tokens, cached, list(range(20)), model.new_kv_cache(20))
    gemms = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert gemms == counter.get_total_flops()  # SDPA on the CPU is not counted by torch
    pairs = sum(p + 1 for p in range(cached, cached + new))  # (query, key) pairs, causal
    attention = c.layers * 4 * c.heads * c.head_dim * pairs
    assert c.prefill_flops(new, cached) == pytest.approx(gemms + attention, rel=1e-12)


def test_gate_runs_once_per_layer_before_its_prefix_is_read() -> None:
    """A layerwise load's gate: layer i's is called after layer i-1 ran and before layer i
    reads the prefix, so a load may still be writing layer i's pages until then."""
    model = LlamaModel(ModelConfig.tiny(4), seed=6)
    prompt = np.random.default_rng(4).integers(0, model.config.vocab, 100)
    kv = model.new_kv_cache(8)
    whole = model.prefill(prompt, 0, list(range(7)), model.new_kv_cache(8))
    model.prefill(prompt[:64], 0, list(range(7)), kv)
    saved = [layer[:, :4].clone() for layer in kv]
    for layer in kv:
        layer[:, :4] = 7.0  # the prefix is not there yet: each gate puts its layer back
    calls: list[int] = []

    def gate(i: int) -> None:
        calls.append(i)
        assert all(kv[j][:, :4].eq(7.0).all() for j in range(i, len(kv)))  # later layers: not yet
        kv[i][:, :4] = saved[i]

    out = model.prefill(prompt[64:], 64, list(range(7)), kv, gate=gate)
    assert calls == [0, 1, 2, 3]
    torch.testing.assert_close(out, whole, rtol=1e-4, atol=1e-4)
    model.prefill(prompt, 0, list(range(7)), kv, gate=gate)  # nothing cached: no gate
    assert calls == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_a_layerwise_restored_prefix_gives_the_logits_of_the_kv_as_computed() -> None:
    """The GPU test's shapes on the CPU backend: 64 cached blocks and 100 new tokens need a
    table of 71 blocks (the GPU test once gave 70, and the model refused the prefill)."""
    model = LlamaModel(ModelConfig.tiny(4), seed=3)
    kv = model.new_kv_cache(160)
    timeline = await layerwise_prefill(model, kv, Device("cpu"), cached_blocks=64, new_tokens=100)
    assert timeline.clock == "host"


def test_prefill_refuses_a_short_block_table() -> None:
    model = LlamaModel(ModelConfig.tiny(), seed=0)
    with pytest.raises(ValueError, match="block table"):
        model.prefill(np.arange(40), 0, [0, 1], model.new_kv_cache(4))
    with pytest.raises(ValueError, match=">= 1 token"):
        model.prefill(np.arange(0), 0, [0], model.new_kv_cache(4))


# -- the workload ------------------------------------------------------------------------


def test_equal_trace_prefixes_give_equal_tokens_and_keys(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [[0, 1, 2], [0, 1, 3], [5, 1, 2], [0, 1, 2, 4], [0, 1, 2]]
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids),
                                         "output_length": 1, "hash_ids": ids}) + "\n"
                             for i, ids in enumerate(rows)))
    w = trace_workload(trace, requests=4, warmup=1, block_tokens=32, max_tokens=100, vocab=512)
    a, b, c, d, e = w.requests
    assert len(a.tokens) == 96 and len(d.tokens) == 100  # cut at max_tokens
    assert np.array_equal(a.tokens[:64], b.tokens[:64]) and not np.array_equal(a.tokens[64:], b.tokens[64:])
    assert a.keys[:4] == b.keys[:4] and a.keys[4] != b.keys[4]
    assert not set(c.keys) & set(a.keys)  # a different first block changes every key after it
    assert d.keys[:6] == a.keys[:6]
    assert [r.warm for r in w.requests] == [True, False, False, False, False]
    # e repeats a: all of it was seen, but its last token is computed (its logits are the output)
    assert [r.reusable for r in w.requests] == [0, 64, 0, 96, 80] and np.array_equal(e.tokens, a.tokens)
    w.compress(2.0)
    assert [r.arrival for r in w.measured] == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ValueError):
        w.compress(0)


def test_block_keys_chain_the_whole_prefix() -> None:
    tokens = np.arange(50, dtype=np.int32)
    keys = block_keys(tokens)
    assert len(keys) == 3 and len(set(keys)) == 3 and all(0 <= k < 2**63 for k in keys)
    changed = tokens.copy()
    changed[3] = 999
    assert all(x != y for x, y in zip(block_keys(changed), keys))
    assert block_keys(tokens[:48]) == keys


def test_prefix_repetition_requests_share_their_prefix() -> None:
    w = prefix_workload(prefixes=3, prefix_tokens=64, suffix_tokens=8, requests=20, warmup=2, vocab=512)
    assert len(w.warm) == 5 and len(w.measured) == 20
    heads = {tuple(r.tokens[:64]) for r in w.requests}
    assert len(heads) == 3
    assert all(r.reusable == 64 for r in w.measured)  # every prefix was seen in the warm-up
    assert len({tuple(r.tokens[64:]) for r in w.requests}) == len(w.requests)


def test_reuse_distances_match_an_lru_stack(tmp_path: Path) -> None:
    w = trace_workload(conversation_trace(tmp_path / "c.jsonl", conversations=6, turns=3),
                       requests=9, warmup=9, block_tokens=16, max_tokens=4096, vocab=512)
    stack: list[int] = []
    expected = []
    for r in w.requests:
        lead = r.reusable // BLOCK_TOKENS
        for i, key in enumerate(r.keys):
            if key in stack:
                if not r.warm and i < lead:
                    expected.append(len(stack) - 1 - stack.index(key))
                stack.remove(key)
            stack.append(key)
    assert expected and reuse_distances(w).tolist() == expected


def test_pools_are_sized_from_reuse_and_hold_the_largest_request(tmp_path: Path) -> None:
    w = trace_workload(conversation_trace(tmp_path / "c.jsonl"), requests=48, warmup=48,
                       block_tokens=16, max_tokens=4096, vocab=512)
    cfg = ServeConfig.defaults(backend="cpu", quick=True)
    cfg.resolve_pools(w, 8192)
    assert cfg.gpu_blocks and cfg.host_blocks and cfg.disk_blocks
    assert w.max_blocks() <= cfg.gpu_blocks < cfg.host_blocks < cfg.disk_blocks
    small = ServeConfig.defaults(backend="cpu", quick=True, gpu_blocks=2)
    with pytest.raises(ValueError, match="largest request"):
        small.resolve_pools(w, 8192)


def test_segments_cut_the_measured_requests_in_order(tmp_path: Path) -> None:
    w = trace_workload(conversation_trace(tmp_path / "c.jsonl"), requests=50, warmup=46,
                       block_tokens=16, max_tokens=4096, vocab=512)
    parts = w.segments(4)
    assert sorted(len(p) for p in parts) == [12, 12, 13, 13]
    assert [r for p in parts for r in p] == w.measured
    assert len(w.segments(100)) == 50 and w.segments(1) == [w.measured]
    cfg = ServeConfig.defaults(backend="cpu", quick=True)
    assert cfg.segment_count(200) == 8 and cfg.segment_count(10) == 1
    assert ServeConfig.defaults(backend="cpu", quick=True, segments=3).segment_count(200) == 3


def test_arms_take_turns_rotated_with_compared_arms_back_to_back() -> None:
    cfg = ServeConfig.defaults(backend="cpu", quick=True)
    orders = [cfg.turns(k) for k in range(4)]
    assert orders[0] == ["recompute", "gpu", "host", "layerwise", "disk", "oracle"]
    for order in orders:
        assert sorted(order) == sorted(DEFAULT_ARMS)  # every arm once a segment
        assert order[order.index("disk") + 1] == "oracle"  # right after the arm it mirrors
        assert order[order.index("host") + 1] == "layerwise"
    assert len({order[0] for order in orders}) == 4  # no arm always goes first
    lone = ServeConfig.defaults(backend="cpu", quick=True, arms=("gpu", "layerwise", "oracle"))
    assert lone.mirrored_arm() == "layerwise"
    assert lone.turns(1) == ["layerwise", "oracle", "gpu"]
    assert lone.kv_owners() == ["oracle", "gpu", "layerwise"]
    assert cfg.kv_owners() == ["recompute", "gpu", "host", "layerwise", "disk"]  # the oracle shares


# -- the GPU pool ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_pool_evicts_least_recently_used_and_never_a_held_block() -> None:
    pool = BlockPool(4, caching=True)
    a = pool.take(2)
    assert a is not None
    pool.register([10, 11], a)
    pool.release(a)
    b = pool.take(2)
    assert b is not None and not set(a) & set(b)  # free blocks go first
    pool.register([20, 21], b)
    pool.release(b)
    assert pool.match([20, 21, 99]) == b  # 20, 21 held now, and most recent
    c = pool.take(2)
    assert c == a and pool.evictions == 2 and pool.match([10]) == []
    assert pool.take(1) is None  # everything is held
    pool.release(b + c)
    assert pool.match([20]) == b[:1]
    pool.release(b[:1])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(c)


@pytest.mark.anyio
async def test_pool_without_caching_registers_nothing() -> None:
    pool = BlockPool(2, caching=False)
    blocks = pool.take(2)
    assert blocks is not None
    pool.register([1, 2], blocks)
    pool.release(blocks)
    assert pool.match([1]) == [] and pool.cached() == 0 and pool.take(2) is not None


@pytest.mark.anyio
async def test_pool_take_waiting_waits_for_a_release() -> None:
    pool = BlockPool(2, caching=True)
    held = pool.take(2)
    assert held is not None
    got: list[list[int]] = []

    async def want() -> None:
        got.append(await pool.take_waiting(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(0.01)
        assert not got
        pool.release(held[:1])
    assert got == [held[:1]]
    with pytest.raises(ValueError, match="pool has 2"):
        await pool.take_waiting(3)


# -- the lower bound ---------------------------------------------------------------------


def test_lower_bound_queues_first_come_first_served() -> None:
    ceil = Ceilings(1.0, "copy", 1e12, "gemm", block_bytes=16 * 10**6)  # 1 GB/s, 1 MB a token
    served = [
        Served(0, 100, 0, arrival=0.0, start=0.0, first_token=1.0, token=1, host_tokens=16, prefill_s=0.5),
        Served(1, 100, 0, arrival=0.1, start=1.0, first_token=1.5, token=1, prefill_s=0.2),
        Served(2, 100, 0, arrival=5.0, start=5.0, first_token=5.5, token=1, prefill_s=0.3),
    ]
    bounds = lower_bounds(served, ceil)
    assert bounds[0] == pytest.approx(0.516)  # 16 MB at 1 GB/s, then 0.5 s
    assert bounds[1] == pytest.approx(0.516 + 0.2 - 0.1)  # queued behind the first
    assert bounds[2] == pytest.approx(0.3)
    assert lower_bounds(served, ceil, moves=False)[0] == pytest.approx(0.5)


def test_lower_bound_starts_each_segment_from_an_empty_queue_and_overlaps_layerwise_loads() -> None:
    ceil = Ceilings(1.0, "copy", 1e12, "gemm", block_bytes=16 * 10**6)
    served = [
        Served(0, 100, 0, arrival=0.0, start=0.0, first_token=1.0, token=1, prefill_s=1.0, segment=0),
        # arrives while the first one runs, but in the next segment: served from an empty queue
        Served(1, 100, 0, arrival=0.5, start=0.5, first_token=0.8, token=1, host_tokens=16,
               prefill_s=0.3, stall_s=0.1, segment=1),
        Served(2, 100, 0, arrival=0.6, start=0.8, first_token=1.2, token=1, prefill_s=0.4, segment=1),
    ]
    plain = lower_bounds(served, ceil)
    assert plain[1] == pytest.approx(0.016 + 0.2)  # its transfer, then its forward less its waits
    assert plain[2] == pytest.approx(0.5 + 0.216 + 0.4 - 0.6)
    overlap = lower_bounds(served, ceil, overlap=True)
    assert overlap[1] == pytest.approx(0.2)  # the load ran beside the forward
    served[1].host_tokens = 16 * 20  # 320 MB: the load is the longer one
    assert lower_bounds(served, ceil, overlap=True)[1] == pytest.approx(0.32)


def test_the_layerwise_bound_lets_a_queued_load_run_while_its_request_waits() -> None:
    """The server submits a queued layerwise request's load at admission, so its copy runs
    while the model serves the requests ahead: at the ceilings its forward ends once its
    own time after the model took it has passed and its load has landed, whichever is
    later. The bound is that schedule (every request ready at arrival, the model in
    arrival order), never above it: a figure under its lower bound would read as
    impossible."""
    ceil = Ceilings(1.0, "copy", 1e12, "gemm", block_bytes=16 * 10**6)  # 1 GB/s, 1 MB a token
    served = [
        Served(0, 100, 0, arrival=0.0, start=0.0, first_token=0.5, token=1, host_tokens=16, prefill_s=0.5),
        # 320 MB: its load lands at 0.33 s, while request 0's forward still runs
        Served(1, 100, 0, arrival=0.01, start=0.01, first_token=0.6, token=1, host_tokens=320, prefill_s=0.1),
    ]
    bounds = lower_bounds(served, ceil, overlap=True)
    assert bounds[0] == pytest.approx(0.5) and bounds[1] == pytest.approx(0.5 + 0.1 - 0.01)
    rng = np.random.default_rng(47)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        arrivals = np.sort(rng.uniform(0.0, 0.4, n))
        served = [Served(i, 100, 0, arrival=float(a), start=float(a), first_token=float(a) + 1.0, token=1,
                         host_tokens=int(rng.integers(0, 400)), prefill_s=float(rng.uniform(0.01, 0.3)),
                         stall_s=float(rng.uniform(0.0, 0.005)))
                  for i, a in enumerate(arrivals)]
        reached: dict[int, float] = {}
        clock = float("-inf")
        for s in served:  # arrival order: each is ready (its load running) at its arrival
            clock = max(max(clock, s.arrival) + s.compute_s, s.arrival + s.host_tokens * 1e6 / 1e9)
            reached[s.index] = clock - s.arrival
        bounds = lower_bounds(served, ceil, overlap=True)
        assert bounds == pytest.approx(reached)


def test_lower_bound_lets_a_restored_later_arrival_pass_a_slow_restore() -> None:
    """As the server does: a disk hit's 1 s restore runs beside the model, so the host hit
    arriving after it (restored in 16 ms) takes the model first, and the miss after both
    waits only for the model."""
    ceil = Ceilings(1.0, "copy", 1e12, "gemm", block_bytes=16 * 10**6, disk_gbps=0.5)  # 1 MB a token
    served = [
        Served(0, 100, 0, arrival=0.0, start=0.0, first_token=2.0, token=1, disk_tokens=500, prefill_s=0.2),
        Served(1, 100, 0, arrival=0.1, start=0.1, first_token=0.5, token=1, host_tokens=16, prefill_s=0.3),
        Served(2, 100, 0, arrival=0.2, start=0.2, first_token=0.7, token=1, prefill_s=0.1),
    ]
    bounds = lower_bounds(served, ceil)
    assert bounds[1] == pytest.approx(0.016 + 0.3)  # never behind request 0's restore
    assert bounds[2] == pytest.approx(0.416 + 0.1 - 0.2)  # behind request 1's forward
    assert bounds[0] == pytest.approx(1.0 + 0.2)  # 500 MB at 0.5 GB/s, the model free by then


class _FailingLoad(Source):
    """A layerwise load whose layers all fail: the server must compute those tokens."""

    def __init__(self) -> None:
        self.gated: list[int] = []

    def lookup(self, keys):  # type: ignore[no-untyped-def]
        return len(keys)

    async def restore(self, keys, blocks):  # type: ignore[no-untyped-def]
        restored = Restored(len(keys), take_stalls=lambda: [0.0, 0.0])

        def gate(i: int) -> bool:
            self.gated.append(i)
            restored.failed = True
            return False

        async def end() -> bool:
            return False

        restored.gate, restored.end = gate, end
        return restored

    async def offload(self, keys, blocks) -> None:  # type: ignore[no-untyped-def]
        await anyio.lowlevel.checkpoint()

    async def drain(self) -> None:
        await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
async def test_a_failed_layerwise_load_is_recomputed(tmp_path: Path) -> None:
    model = LlamaModel(ModelConfig.tiny(), seed=2)
    w = prefix_workload(prefixes=1, prefix_tokens=64, suffix_tokens=8, requests=1, warmup=0, vocab=512)
    req = w.measured[0]
    kv = model.new_kv_cache(16)
    expected = int(model.prefill(req.tokens, 0, list(range(5)), model.new_kv_cache(16)).argmax())
    source = _FailingLoad()
    async with Server(model, kv, Device("cpu"), BlockPool(16, caching=True), source=source) as server:
        [served] = await server.serve([req])
    assert source.gated == [0, 1]  # the forward gated each layer, then the load failed
    assert served.host_tokens == 0 and served.recomputed == 64 and served.computed == len(req.tokens)
    assert served.token == expected


class _WatchedPlan:
    """A planned load that records where and when the server submits it."""

    def __init__(self, source: _PlannedSource, keys: list[int], blocks: list[int]) -> None:
        self.source, self.keys, self.blocks = source, keys, blocks
        self.restored = Restored(len(keys))
        self.cancelled = False

    @property
    def submitted(self) -> bool:
        return self.restored.gate is not None

    def submit(self):  # type: ignore[no-untyped-def]
        import threading

        src = self.source
        src.events.append(("submit", threading.get_ident(), src.pool.held()))

        def gate(i: int) -> bool:
            src.events.append((f"gate {i}", threading.get_ident(), 0))
            return True

        self.restored.gate = gate
        return gate

    def cancel(self) -> None:  # the server calls it after every prefill: a no-op once submitted
        self.cancelled = self.cancelled or self.restored.gate is None


class _PlannedSource(Source):
    """Serves every key from blocks the prefill already holds (their KV was prefilled)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.events: list[tuple[str, int, int]] = []
        self.plans: list[_WatchedPlan] = []

    def lookup(self, keys):  # type: ignore[no-untyped-def]
        return len(keys)

    def plan(self, keys, blocks):  # type: ignore[no-untyped-def]
        self.plans.append(_WatchedPlan(self, list(keys), list(blocks)))
        return self.plans[-1]

    async def offload(self, keys, blocks) -> None:  # type: ignore[no-untyped-def]
        await anyio.lowlevel.checkpoint()

    async def drain(self) -> None:
        await anyio.lowlevel.checkpoint()


@pytest.mark.anyio
async def test_a_layerwise_load_is_submitted_between_the_inputs_and_the_forward() -> None:
    """The whole block table is held before the submit, the inputs are prepared before it,
    the submit runs on the loop's thread, and the forward's gates on the model's thread."""
    import threading

    model = LlamaModel(ModelConfig.tiny(), seed=3)
    w = prefix_workload(prefixes=1, prefix_tokens=64, suffix_tokens=24, requests=1, warmup=0, vocab=512)
    req = w.measured[0]
    pool = BlockPool(16, caching=True)
    source = _PlannedSource(pool)
    prepared: list[int] = []
    real_prepare = model.prepare

    def prepare(*args, **kwargs):  # type: ignore[no-untyped-def]
        source.events.append(("prepare", threading.get_ident(), 0))
        prepared.append(threading.get_ident())
        return real_prepare(*args, **kwargs)

    model.prepare = prepare  # type: ignore[method-assign]
    async with Server(model, model.new_kv_cache(16), Device("cpu"), pool, source=source) as server:
        [served] = await server.serve([req])
    loop_thread = threading.get_ident()
    names = [e[0] for e in source.events]
    assert names == ["prepare", "submit", "gate 0", "gate 1"]
    (_, prep_thread, _), (_, submit_thread, held), (_, gate_thread, _) = source.events[:3]
    assert prep_thread == submit_thread == loop_thread != gate_thread
    blocks = -(-len(req.tokens) // BLOCK_TOKENS)
    assert held == blocks  # the prefix's blocks and the new tokens' before anything moved
    [plan] = source.plans
    assert len(plan.blocks) == len(plan.keys) == req.cacheable_blocks and not plan.cancelled
    assert served.host_tokens == len(plan.keys) * BLOCK_TOKENS
    assert served.computed == len(req.tokens) - served.host_tokens


@pytest.mark.anyio
async def test_a_planned_load_is_unpinned_when_the_inputs_fail_to_prepare() -> None:
    """The server plans a layerwise load (its chunks pinned) before it prepares the
    forward's inputs: if that raises, the load is never submitted and its pins go."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches

    model = LlamaModel(ModelConfig.tiny(), seed=3)
    kv = model.new_kv_cache(16)
    w = prefix_workload(prefixes=1, prefix_tokens=64, suffix_tokens=24, requests=1, warmup=0, vocab=512)
    req = w.measured[0]
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=8, backend="cpu") as worker:
        source = LayerwiseSource(worker, 8, "lru")
        n = req.cacheable_blocks
        await source.offload(req.keys[:n], list(range(n)))
        assert source.lookup(req.keys[:n]) == n

        def prepare(*_args, **_kwargs):  # type: ignore[no-untyped-def]
            assert source.manager.stats().pinned_keys == n  # planned: pinned, not submitted
            raise RuntimeError("no inputs")

        model.prepare = prepare  # type: ignore[method-assign]
        async with Server(model, kv, Device("cpu"), BlockPool(16, caching=True), source=source) as server:
            with pytest.raises(BaseException) as caught:
                await server.serve([req])
        assert caught.group_contains(RuntimeError, match="no inputs")
        assert source.manager.stats().pinned_keys == 0


# -- the layerwise arm's source ----------------------------------------------------------


@pytest.mark.anyio
async def test_layerwise_source_restores_the_exact_bytes_layer_by_layer() -> None:
    """Random KV stored through the source's own host index comes back byte for byte with
    one layerwise load, each layer gated from the model's thread; pins go once it ends."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches

    gen = torch.Generator().manual_seed(11)
    kv = [torch.randn(2, 12, BLOCK_TOKENS, 2, 16, generator=gen) for _ in range(3)]
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    keys, src, dst = [101, 102, 103, 104], [0, 1, 2, 3], [8, 9, 10, 11]
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=6, backend="cpu") as worker:
        source = LayerwiseSource(worker, 6, "lru")
        assert source.lookup(keys) == 0
        await source.offload(keys, src)
        assert source.lookup(keys) == 4 and source.lookup([101, 999, 103]) == 1
        for layer in kv:
            layer[:, dst] = -1.0
        got = await source.restore(keys, dst)
        assert got.host == 4 and got.gate is not None and got.end is not None
        assert got.take_stalls is not None and source.manager.stats().pinned_keys == 4
        assert got.forward_start_s is None  # no gate yet
        gated = await anyio.to_thread.run_sync(lambda: [bool(got.gate(i)) for i in range(3)])  # type: ignore[misc]
        assert gated == [True] * 3 and not got.failed
        # The forward's start: from the submit's call to its first gate, on the host clock.
        assert got.forward_start_s is not None and got.forward_start_s >= got.submit_s > 0
        stalls = got.take_stalls()
        assert len(stalls) == 3 and all(s >= 0 for s in stalls)
        assert await got.end() and got.load_s > 0
        for layer in kv:
            assert torch.equal(layer[:, dst], layer[:, src])
        assert source.manager.stats().pinned_keys == 0
        assert source.new_stalls() == []  # nothing since
        await source.offload([201, 202, 203, 204], dst)  # evicts the least recently used
        assert source.lookup(keys) < 4
        missed = await source.restore(keys, [4, 5, 6, 7])  # looked up before: now a miss
        assert missed.host == 0 and missed.gate is None and source.manager.stats().pinned_keys == 0


# -- greedy decode from restored KV ------------------------------------------------------


@pytest.mark.anyio
async def test_greedy_decode_from_restored_kv_equals_recompute(tmp_path: Path) -> None:
    model = LlamaModel(ModelConfig.tiny(), seed=5)
    kv = model.new_kv_cache(blocks_needed(6, 12))
    rows = await decode_check(model, kv, Device("cpu"), prompt_blocks=6, decode_tokens=12,
                              tier_dir=str(tmp_path))
    assert [r.name for r in rows] == ["host restore: tokens equal to recompute",
                                      "disk restore: tokens equal to recompute"]
    for row in rows:
        assert not row.failed and row.value == 12 and "bytes equal, tokens equal" in row.note
        assert row.extra["tokens"] == row.extra["reference"] and len(set(row.extra["tokens"])) > 1
    assert "6 of them from the disk tier" in rows[1].note
    assert not list(tmp_path.iterdir())  # the tier's folder is gone


@pytest.mark.anyio
async def test_decode_check_fails_when_restored_bytes_are_wrong(tmp_path: Path, monkeypatch) -> None:
    class Corrupting(OffloadCache):
        async def restore(self, keys, gpu_block_ids, **kw):  # type: ignore[no-untyped-def]
            result = await super().restore(keys, gpu_block_ids, **kw)
            kv[0][0, int(gpu_block_ids[-1]), 3].add_(1.0)  # one K vector of the last block
            return result

    monkeypatch.setattr(correctness, "OffloadCache", Corrupting)
    model = LlamaModel(ModelConfig.tiny(), seed=5)
    kv = model.new_kv_cache(blocks_needed(4, 4))
    rows = await decode_check(model, kv, Device("cpu"), prompt_blocks=4, decode_tokens=4,
                              tier_dir=str(tmp_path))
    assert all(r.failed and "BYTES DIFFER" in r.note for r in rows)


# -- the command -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, str, Path]:
    tmp = tmp_path_factory.mktemp("serve")
    trace = conversation_trace(tmp / "conversation_trace.jsonl")
    out = tmp / "serve.json"
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "serve", "--quick", "--trace", str(trace), "--requests", "48",
                     "--warmup", "48", "--tier-dir", str(tmp), "--json", str(out)])
    return code, json.loads(out.read_text()), stdout.getvalue(), tmp


def test_quick_serve_runs_every_arm_and_hit_class(quick_run) -> None:
    code, payload, table, tmp = quick_run
    assert code == 0
    rows = payload["rows"]
    sections = {r["section"].split(",")[0] for r in rows}
    for arm in DEFAULT_ARMS:
        assert f"serve arm: {arm}" in sections
        assert f"== serve arm: {arm}," in table
    overall = {r["extra"]["arm"]: r for r in rows if "ttft_ms" in r["extra"]}
    assert set(overall) == set(DEFAULT_ARMS)
    for arm, row in overall.items():
        assert len(row["extra"]["ttft_ms"]) == 48 and row["ceiling"] > 0
        if arm in ("recompute", "gpu", "oracle"):  # nothing moved: the bound is the same queue
            # with only the measured prefills in it, so it never exceeds the figure
            assert all(b <= t + 1e-6 for b, t in zip(row["extra"]["bound_ms"], row["extra"]["ttft_ms"]))
    assert set(overall["recompute"]["extra"]["hit"]) == {"miss"}
    assert {"gpu", "host", "disk"} <= set(overall["disk"]["extra"]["hit"])
    assert "host" in overall["host"]["extra"]["hit"]
    assert overall["oracle"]["extra"]["hit"] == overall["disk"]["extra"]["hit"]  # the same hits
    names = {(r["section"].split(",")[0], r["name"]) for r in rows}
    for cls in ("GPU", "host", "disk"):
        assert ("serve arm: disk", f"TTFT p50 {cls} hits") in names
    assert ("serve arm: recompute", "TTFT p50 misses") in names
    assert ("serve arm: recompute", "model FLOP utilisation") in names
    assert ("serve arm: host", "GPU-seconds saved vs recompute") in names
    for name in ("host arm / recompute", "disk arm / oracle", "layerwise arm / oracle",
                 "layerwise arm / host arm", "layerwise service / max(load, prefill)",
                 "same prefill, oracle / disk", "oracle / disk TTFT p50",
                 "host / recompute TTFT p50, per segment"):
        assert any(r["name"] == name for r in rows), name
    # The service starts before the block table and the inputs, which the prefill counts.
    [service] = [r["note"] for r in rows if r["name"] == "layerwise service / max(load, prefill)"]
    assert "restore's submit" not in service and "its inputs' preparation" in service
    assert ("serve arm: layerwise", "layer stall p99") in names
    for name in ("layerwise submit p50", "forward start after the submit p50",
                 "forward computed while the prefix arrived p50"):
        assert ("serve arm: layerwise", name) in names, name
    pushes = {r["name"]: r for r in rows if r["section"].startswith("serve: layerwise stores")}
    assert pushes["push host time p50"]["value"] > 0 and pushes["forward with pushes / without"]["target"]
    assert ("serve arm: oracle", "model utilisation") in names
    checks = [r for r in rows if r["section"].startswith("serve correctness")]
    assert len(checks) == 2 and not any(r["failed"] for r in rows)
    assert payload["meta"]["backend"] == "cpu" and payload["meta"]["model"]["name"] == "tiny"
    assert not [p for p in tmp.iterdir() if p.name.startswith("aiokv-serve")]  # tier folders removed


def _per_request(payload: dict) -> dict[str, dict]:
    return {r["extra"]["arm"]: r["extra"] for r in payload["rows"] if "ttft_ms" in r["extra"]}


def test_quick_serve_arms_take_turns_on_the_same_requests(quick_run) -> None:
    """Comparable by construction: every arm serves the same requests at the same arrival
    times in the same segments, and every arm serves a segment before any starts the next,
    in the rotated order of ``ServeConfig.turns``, so no arm has a stretch of the machine
    to itself. TTFT counts the wait in the queue: it is never less than the service."""
    _, payload, _, _ = quick_run
    arms = _per_request(payload)
    first = arms["recompute"]
    for arm, e in arms.items():
        assert e["index"] == first["index"] and e["arrival_ms"] == first["arrival_ms"]
        assert e["segment"] == first["segment"]
        assert all(t >= b - 1e-6 for t, b in zip(e["ttft_ms"], e["busy_ms"])), arm
    assert any(t > b + 0.05 for t, b in zip(first["ttft_ms"], first["busy_ms"]))  # some queued
    segments = sorted(set(first["segment"]))
    assert len(segments) == 2  # 48 requests, one segment per 25
    cfg = ServeConfig.defaults(backend="cpu", quick=True)
    for k in segments:
        walls = {arm: [w for w, s in zip(e["wall_s"], e["segment"]) if s == k] for arm, e in arms.items()}
        assert sorted(walls, key=lambda a: min(walls[a])) == cfg.turns(k)
        for arm in walls:  # an arm's turn ends before the next arm's begins
            later = [a for a in walls if min(walls[a]) > min(walls[arm])]
            assert all(max(walls[arm]) < min(walls[a]) for a in later)
        if k + 1 in segments:
            assert max(max(w) for w in walls.values()) < min(
                w for e in arms.values() for w, s in zip(e["wall_s"], e["segment"]) if s == k + 1)


def test_quick_serve_hits_per_arm(quick_run) -> None:
    """Each arm's hit classes are those its stack can have; the oracle has the disk arm's
    hits, token for token; the layerwise arm gated every layer of each load once."""
    _, payload, _, _ = quick_run
    arms = _per_request(payload)
    tokens = {arm: [tuple(t) for t in e["tokens"]] for arm, e in arms.items()}
    assert set(arms["recompute"]["hit"]) == {"miss"} and {t[:3] for t in tokens["recompute"]} == {(0, 0, 0)}
    assert set(arms["gpu"]["hit"]) <= {"miss", "gpu"} and all(t[1] == t[2] == 0 for t in tokens["gpu"])
    for arm in ("host", "layerwise"):
        assert "host" in arms[arm]["hit"] and all(t[2] == 0 for t in tokens[arm])
    assert tokens["oracle"] == tokens["disk"] and arms["oracle"]["hit"] == arms["disk"]["hit"]
    rows = {(r["section"].split(",")[0], r["name"]): r for r in payload["rows"]}
    stalls = rows[("serve arm: layerwise", "layer stall p50")]["extra"]["stalls_us"]
    loads = sum(1 for t in tokens["layerwise"] if t[1])
    assert loads and len(stalls) == 2 * loads and min(stalls) >= 0  # two layers, a gate each


def test_quick_serve_table_has_prefix_buckets_and_lower_bounds(quick_run) -> None:
    _, payload, table, _ = quick_run
    assert "TTFT p50 prefix 1-1023" in table and "this arm's lower bound" in table
    setup = {r["name"]: r for r in payload["rows"] if r["section"].startswith("serve setup")}
    assert {"load ceiling", "peak FLOP/s", "timestamp compression", "disk tier read ceiling",
            "GPU pool", "host pool", "disk tier"} <= set(setup)
    assert setup["load ceiling"]["value"] > 0 and setup["disk tier read ceiling"]["value"] > 0


def test_correctness_mode_alone(tmp_path: Path, capsys) -> None:
    assert main(["bench", "serve", "--mode", "correctness", "--quick", "--decode-tokens", "6",
                 "--tier-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "host restore: tokens equal to recompute" in out and "serve arm" not in out


@pytest.mark.parametrize("argv, message", [
    (["--arms", "recompute,warp"], "--arms takes names"),
    (["--arms", "recompute,oracle"], "mirrors a caching arm"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--load", "0"], "--load must be"),
    (["--compress", "-1"], "--compress must be > 0"),
    (["--tier-dir", "/no/such/folder"], "is not a folder"),
    (["--model", "llama3-8b"], "runs on CUDA"),
])
def test_bad_serve_options_exit_2_before_running(argv, message, capsys, tmp_path: Path) -> None:
    trace = conversation_trace(tmp_path / "c.jsonl", conversations=2, turns=2)
    assert main(["bench", "serve", "--quick", "--trace", str(trace), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["bench", "--requests", "10"],
    ["bench", "cache", "--layers", "2"],
    ["bench", "serve", "--capacity", "10"],
    ["bench", "serve", "--tiers", "host=1,disk=2"],
])
def test_options_of_another_bench_are_refused(argv, capsys) -> None:
    assert main(argv) == 2
    assert "is an option of `aiokv bench " in capsys.readouterr().err


def test_plot_draws_cdfs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from aiokv.bench.report import BenchRow
    from aiokv.bench.serve.report import plot_cdfs

    rows = [BenchRow("s", "TTFT p50", 1.0, "ms", extra={"arm": a, "ttft_ms": [1.0, 2.0, 5.0]})
            for a in ("recompute", "host")]
    plot_cdfs(rows, str(tmp_path / "cdf.png"), "t")
    assert (tmp_path / "cdf.png").stat().st_size > 1000


@pytest.mark.anyio
async def test_a_planned_layerwise_load_pins_until_its_submit_or_cancel() -> None:
    """A plan pins its keys' chunks and moves nothing; cancel unpins them once; a submit
    after cancel (or a second submit) is refused."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches

    gen = torch.Generator().manual_seed(12)
    kv = [torch.randn(2, 8, BLOCK_TOKENS, 2, 16, generator=gen) for _ in range(2)]
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    keys = [11, 12, 13]
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=4, backend="cpu") as worker:
        source = LayerwiseSource(worker, 4, "lru")
        await source.offload(keys, [0, 1, 2])
        before = [layer[:, [5, 6, 7]].clone() for layer in kv]
        planned = source.plan(keys, [5, 6, 7])
        assert planned is not None and planned.restored.host == 3 and planned.restored.gate is None
        assert source.manager.stats().pinned_keys == 3
        planned.cancel()
        planned.cancel()
        assert source.manager.stats().pinned_keys == 0
        with pytest.raises(RuntimeError):
            planned.submit()
        assert all(torch.equal(layer[:, [5, 6, 7]], b) for layer, b in zip(kv, before))
        again = source.plan(keys, [5, 6, 7])
        assert again is not None
        gate = again.submit()
        with pytest.raises(RuntimeError):
            again.submit()
        assert await anyio.to_thread.run_sync(lambda: [bool(gate(i)) for i in range(2)]) == [True, True]
        assert again.restored.end is not None and await again.restored.end()
        again.cancel()  # after the submit: nothing to drop twice
        assert source.manager.stats().pinned_keys == 0
        for layer in kv:
            assert torch.equal(layer[:, [5, 6, 7]], layer[:, [0, 1, 2]])
