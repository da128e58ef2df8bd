"""The serve bench's pipelined server: admission in arrival order, restores beside each
other and the model, one forward at a time, the earliest restored arrival first; a restore
that raises is served by recompute; every block a run took is given back once, however
the run ends; and the oracle still mirrors the disk arm's hits.

A slow restore is one that waits for an event the test sets from another request's
forward: a server that served requests one at a time would never set it, and the test's
bound on a hang (not a timing) fails it."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from aiokv.bench.serve.arms import oracle_hits
from aiokv.bench.serve.measure import Device
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel, ModelConfig
from aiokv.bench.serve.pool import BlockPool
from aiokv.bench.serve.served import Served
from aiokv.bench.serve.server import Server
from aiokv.bench.serve.sources import CacheSource, Restored, Source
from aiokv.bench.serve.workload import ServeRequest, block_keys

HANG = 30.0  # seconds before a test calls the server stuck (a bound, not a timing)
PREFIX, SUFFIX = 64, 8
POOL = 64


def _requests(n: int, *, vocab: int = 512, seed: int = 0, gap: float = 1e-3) -> list[ServeRequest]:
    """``n`` prompts with prefixes of their own, arriving ``gap`` seconds apart."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(0, vocab, PREFIX + SUFFIX, dtype=np.int32)
        out.append(ServeRequest(i, tokens, block_keys(tokens), trace_ms=i, warm=False, arrival=i * gap))
    return out


def _expected(model: LlamaModel, reqs: Sequence[ServeRequest]) -> dict[int, int]:
    """Each prompt's first token, prefilled in one go on a KV pool of its own."""
    blocks = list(range(-(-(PREFIX + SUFFIX) // BLOCK_TOKENS)))
    return {r.index: int(model.prefill(r.tokens, 0, blocks, model.new_kv_cache(len(blocks))).argmax())
            for r in reqs}


def _ids(reqs: Sequence[ServeRequest]) -> dict[tuple[int, ...], int]:
    """A request by the last tokens of its prompt (always computed, never restored)."""
    return {tuple(int(t) for t in r.tokens[-4:]): r.index for r in reqs}


class _Pages(Source):
    """Every request's prefix KV, prefilled beforehand, copied into the blocks a restore
    names: byte for byte what the forward would have written. ``hold[i]`` keeps request
    ``i``'s restore waiting until set (from any thread); ``fail`` makes a restore raise;
    keys in ``on_disk`` come back as disk hits."""

    def __init__(self, model: LlamaModel, kv: Sequence[torch.Tensor], reqs: Sequence[ServeRequest]) -> None:
        self.kv = kv
        self.pages: dict[int, list[torch.Tensor]] = {}
        self.owner: dict[int, int] = {}
        n = PREFIX // BLOCK_TOKENS
        scratch = model.new_kv_cache(n)
        for r in reqs:
            model.prefill(r.tokens[:PREFIX], 0, list(range(n)), scratch)
            for b, key in enumerate(r.keys[:n]):
                self.pages[key] = [layer[:, b].clone() for layer in scratch]
                self.owner[key] = r.index
        self.hold: dict[int, threading.Event] = {}
        self.fail: set[int] = set()
        self.on_disk: set[int] = set()
        self.started: dict[int, anyio.Event] = {}
        self.restored: list[int] = []
        self.in_flight = self.most_in_flight = 0
        self.drained = 0

    def lookup(self, keys: Sequence[int]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    async def restore(self, keys: Sequence[int], blocks: list[int]) -> Restored:
        i = self.owner[keys[0]]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            self.started.setdefault(i, anyio.Event()).set()
            for _ in range(5):  # let the other restores admitted meanwhile begin
                await anyio.sleep(0)
            hold = self.hold.get(i)
            while hold is not None and not hold.is_set():
                await anyio.sleep(0.001)
            if i in self.fail:
                raise RuntimeError(f"tier unreachable for request {i}")
            for key, block in zip(keys, blocks):
                for layer, page in zip(self.kv, self.pages[key]):
                    layer[:, block] = page
            self.restored.append(i)
            disk = sum(key in self.on_disk for key in keys)
            return Restored(len(keys) - disk, disk, load_s=1e-3)
        finally:
            self.in_flight -= 1

    async def offload(self, keys: Sequence[int], blocks: list[int]) -> None:
        await anyio.lowlevel.checkpoint()

    async def drain(self) -> None:
        self.drained += 1
        await anyio.lowlevel.checkpoint()


class _Watched:
    """The model's forward, watched on the model thread: which request each forward was,
    how many ran at once, and an optional hook before the forward (``before[i]``)."""

    def __init__(self, model: LlamaModel, reqs: Sequence[ServeRequest]) -> None:
        self.ids = _ids(reqs)
        self.order: list[int] = []
        self.running = self.most = 0
        self.before: dict[int, object] = {}
        self.raise_for: set[int] = set()
        real = model.forward

        def forward(inputs, kv, **kwargs):  # type: ignore[no-untyped-def]
            i = self.ids[tuple(int(t) for t in inputs.ids[-4:].tolist())]
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                self.order.append(i)
                hook = self.before.get(i)
                if hook is not None:
                    hook()  # type: ignore[operator]
                if i in self.raise_for:
                    raise RuntimeError(f"forward {i} failed")
                return real(inputs, kv, **kwargs)
            finally:
                self.running -= 1

        model.forward = forward  # type: ignore[method-assign]


def _setup(n: int, seed: int = 0) -> tuple[LlamaModel, list[torch.Tensor], list[ServeRequest], dict[int, int],
                                            _Pages, _Watched]:
    model = LlamaModel(ModelConfig.tiny(), seed=seed + 7)
    reqs = _requests(n, seed=seed)
    expected = _expected(model, reqs)
    kv = model.new_kv_cache(POOL)
    source = _Pages(model, kv, reqs)
    for layer in kv:
        layer.normal_()  # what no restore brings back is noise
    return model, kv, reqs, expected, source, _Watched(model, reqs)


def _pool_is_whole(pool: BlockPool) -> None:
    """Every block back: none held, each free or cached exactly once."""
    assert pool.held() == 0
    assert sorted(pool._free + list(pool._lru)) == list(range(pool.num_blocks))
    assert all(r == 0 for r in pool._refs)


async def _serve_with_restore_0_held(model: LlamaModel, kv: list[torch.Tensor], reqs: list[ServeRequest],
                                     source: _Pages, watched: _Watched, pool: BlockPool) -> list[Served]:
    """Serve ``reqs`` with request 0's restore held until request 1's forward has begun."""
    source.hold[0] = threading.Event()
    watched.before[1] = source.hold[0].set
    async with Server(model, kv, Device("cpu"), pool, source=source) as server:
        with anyio.fail_after(HANG):
            return await server.serve(reqs)


@pytest.mark.anyio
async def test_a_slow_restore_does_not_delay_a_later_request_whose_restore_is_fast() -> None:
    """Request 0's restore waits until request 1's forward has begun: only a server that
    restores beside the model serves both. Both tokens are the ones computed in one go."""
    model, kv, reqs, expected, source, watched = _setup(2)
    pool = BlockPool(POOL, caching=False)
    served = await _serve_with_restore_0_held(model, kv, reqs, source, watched, pool)
    assert watched.order == [1, 0] and source.restored == [1, 0]
    assert [s.index for s in served] == [0, 1]  # reported in arrival order
    first, second = served
    assert [s.token for s in served] == [expected[0], expected[1]]
    assert first.host_tokens == second.host_tokens == PREFIX and first.computed == SUFFIX
    assert first.model_at >= second.first_token  # the model took it after the later one
    assert first.ready_at >= second.model_at  # its restore was still running then
    assert first.start <= second.start  # admitted in arrival order
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_the_model_takes_the_earliest_restored_arrival_first_one_forward_at_a_time() -> None:
    """While request 0's forward runs, requests 1..3 restore in reverse order (3, 2, 1):
    the model then takes them in arrival order, never two forwards at once."""
    model, kv, reqs, expected, source, watched = _setup(4)
    del source.pages[reqs[0].keys[0]]  # request 0 is a miss: it goes straight to the model
    for i in (1, 2):
        source.hold[i] = threading.Event()
    restored = threading.Event()

    async def relay() -> None:  # each restore's end lets the one before it end
        for i in (3, 2, 1):
            await source.started.setdefault(i, anyio.Event()).wait()
            while i not in source.restored:
                await anyio.sleep(0.001)
            if i > 1:
                source.hold[i - 1].set()
        restored.set()

    watched.before[0] = lambda: restored.wait(HANG)  # its forward, until 1..3 are restored
    pool = BlockPool(POOL, caching=False)
    async with Server(model, kv, Device("cpu"), pool, source=source) as server:
        with anyio.fail_after(HANG):
            async with anyio.create_task_group() as tg:
                tg.start_soon(relay)
                served = await server.serve(reqs)
    assert source.restored == [3, 2, 1]
    assert watched.order == [0, 1, 2, 3] and watched.most == 1
    assert [s.token for s in served] == [expected[i] for i in range(4)]
    assert served[3].ready_at <= served[2].ready_at <= served[1].ready_at
    for a, b in itertools.pairwise(served):  # the model's turns, one after the other
        assert a.first_token <= b.model_at
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_no_more_requests_than_ahead_sit_between_admission_and_the_model() -> None:
    model, kv, reqs, expected, source, watched = _setup(5)
    for r in reqs:
        r.arrival = 0.0  # all due at once: admission runs until the bound stops it
    pool = BlockPool(POOL, caching=False)
    async with Server(model, kv, Device("cpu"), pool, source=source, ahead=2) as server:
        with anyio.fail_after(HANG):
            served = await server.serve(reqs)
    assert source.most_in_flight == 2
    assert [s.token for s in served] == [expected[i] for i in range(5)] and watched.most == 1
    _pool_is_whole(pool)
    with pytest.raises(ValueError, match="at least one"):
        Server(model, kv, Device("cpu"), pool, ahead=0)


@pytest.mark.anyio
async def test_a_restore_that_raises_is_served_by_recompute_and_the_others_are_not_touched() -> None:
    model, kv, reqs, expected, source, _ = _setup(3)
    source.fail.add(1)
    pool = BlockPool(POOL, caching=False)
    async with Server(model, kv, Device("cpu"), pool, source=source) as server:
        with anyio.fail_after(HANG):
            served = await server.serve(reqs)
    assert [s.token for s in served] == [expected[i] for i in range(3)]
    bad = served[1]
    assert bad.host_tokens == 0 and bad.computed == PREFIX + SUFFIX and bad.recomputed == PREFIX
    assert "tier unreachable for request 1" in bad.restore_error
    for s in (served[0], served[2]):
        assert s.host_tokens == PREFIX and not s.restore_error and not s.recomputed
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_a_cancelled_run_ends_and_gives_every_block_back_once() -> None:
    """Cancelled while request 0's restore waits and request 1 may be anywhere: the run
    ends, the source is drained before the blocks of the cut restore go back, the model
    thread stops."""
    model, kv, reqs, _, source, watched = _setup(3)
    source.hold[0] = threading.Event()  # never set
    pool = BlockPool(POOL, caching=False)
    server = Server(model, kv, Device("cpu"), pool, source=source)
    with anyio.fail_after(HANG):
        async with server, anyio.create_task_group() as tg:
            tg.start_soon(server.serve, reqs)
            await source.started.setdefault(0, anyio.Event()).wait()
            while 2 not in watched.order:
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
    assert source.drained >= 1
    _pool_is_whole(pool)
    assert server.runner is not None and not server.runner.running


@pytest.mark.anyio
async def test_a_forward_that_raises_ends_the_run_with_its_error_and_no_block_held() -> None:
    model, kv, reqs, _, source, watched = _setup(3)
    source.hold[0] = threading.Event()  # its restore is cut by the failure
    watched.raise_for.add(1)
    pool = BlockPool(POOL, caching=False)
    with anyio.fail_after(HANG):
        async with Server(model, kv, Device("cpu"), pool, source=source) as server:
            with pytest.raises(BaseException) as caught:
                await server.serve(reqs)
    assert caught.group_contains(RuntimeError, match="forward 1 failed")
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_the_oracle_mirrors_the_disk_arm_request_by_request() -> None:
    """A disk arm whose second request restores behind a slow first one; the oracle, handed
    its hits, serves the same tokens from the same places, moving nothing."""
    model, kv, reqs, expected, source, watched = _setup(4)
    source.on_disk.update(reqs[0].keys[2:4] + reqs[2].keys[:4])  # disk hits: 0 (partly) and 2
    pool = BlockPool(POOL, caching=True)
    served = await _serve_with_restore_0_held(model, kv, reqs, source, watched, pool)
    assert [s.hit for s in served] == ["disk", "host", "disk", "host"]
    assert [s.token for s in served] == [expected[i] for i in range(4)]
    hits = oracle_hits(served)
    oracle_pool = BlockPool(POOL, caching=False)
    async with Server(model, model.new_kv_cache(POOL), Device("cpu"), oracle_pool, oracle=hits) as oracle:
        with anyio.fail_after(HANG):
            mirrored = await oracle.serve(reqs)
    assert [(s.index, s.gpu_tokens, s.host_tokens, s.disk_tokens, s.computed) for s in mirrored] == [
        (s.index, s.gpu_tokens, s.host_tokens, s.disk_tokens, s.computed) for s in served]
    assert all(s.load_s == 0.0 for s in mirrored)
    _pool_is_whole(pool)
    _pool_is_whole(oracle_pool)


@pytest.mark.anyio
async def test_a_real_disk_backed_cache_restores_beside_the_model(tmp_path: Path) -> None:
    """An ``OffloadCache`` over a ``DiskTier``: the first serve stores every request's
    blocks; after noise over the GPU pages, the second restores them (request 0's held
    until request 1's forward began) and gives the tokens computed in one go."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches
    from aiokv.cache.offload import OffloadCache
    from aiokv.cache.tiers.disk import DiskTier

    model = LlamaModel(ModelConfig.tiny(), seed=11)
    reqs = _requests(3, seed=4)
    expected = _expected(model, reqs)
    kv = model.new_kv_cache(POOL)
    watched = _Watched(model, reqs)
    gate = threading.Event()

    class Slow(CacheSource):
        async def restore(self, keys, blocks):  # type: ignore[no-untyped-def]
            if keys[0] == reqs[0].keys[0]:
                while not gate.is_set():
                    await anyio.sleep(0.001)
            return await super().restore(keys, blocks)

    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    block_bytes = sum(layer[:, 0].numel() * layer.element_size() for layer in kv)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=8 + 4, backend="cpu") as worker:
        tier = DiskTier(tmp_path / "tier", capacity_bytes=64 * block_bytes)
        async with OffloadCache(worker, tiers=[tier], staging_chunks=8) as cache:
            source = Slow(cache)
            pool = BlockPool(POOL, caching=False)
            async with Server(model, kv, Device("cpu"), pool, source=source) as server:
                with anyio.fail_after(HANG):
                    stored = await server.serve(reqs)
                    assert [s.hit for s in stored] == ["miss"] * 3
                    for layer in kv:
                        layer.normal_()
                    watched.order.clear()
                    watched.before[1] = gate.set
                    served = await server.serve(reqs)
    assert sorted(watched.order) == [0, 1, 2] and watched.order.index(1) < watched.order.index(0)
    assert watched.most == 1
    assert [s.token for s in served] == [expected[i] for i in range(3)]
    assert all(s.host_tokens + s.disk_tokens == PREFIX for s in served)
    # The host holds 4 blocks, so the rest came from the disk; which requests' blocks were
    # demoted first depends on when the background demotions ran.
    assert {s.hit for s in served} <= {"disk", "host"} and sum(s.disk_tokens for s in served) > 0
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_a_wait_for_blocks_another_request_holds_is_queueing_not_service() -> None:
    """A pool of one request's blocks: request 1's admission waits until request 0 is
    served and gives its table back. That wait is on another request, so it counts in
    its queue wait, not in its service."""
    model, kv, reqs, expected, source, _watched = _setup(2)
    per_request = -(-(PREFIX + SUFFIX) // BLOCK_TOKENS)
    pool = BlockPool(per_request, caching=False)
    async with Server(model, kv, Device("cpu"), pool, source=source) as server:
        with anyio.fail_after(HANG):
            served = await server.serve(reqs)
    first, second = served
    assert [s.token for s in served] == [expected[0], expected[1]]
    assert second.ready_at >= first.first_token  # its table was request 0's, given back
    assert 0.0 < second.blocks_wait <= second.ready_at - second.start
    assert second.restore_wait == pytest.approx(second.ready_at - second.start - second.blocks_wait)
    waits = second.start - second.arrival + second.blocks_wait + second.model_wait
    assert second.queue_s == pytest.approx(waits)
    assert second.service_s == pytest.approx(second.restore_wait + second.busy)
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_a_submitted_layerwise_load_is_drained_before_its_blocks_go_back() -> None:
    """A forward that raises after its layerwise load was submitted: the load's copies may
    still land in the request's blocks, so the source drains before the table goes back,
    as it does for a cut restore."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches
    from aiokv.bench.serve.sources import LayerwiseSource

    model = LlamaModel(ModelConfig.tiny(), seed=5)
    reqs = _requests(1, seed=6)
    req = reqs[0]
    kv = model.new_kv_cache(POOL)
    watched = _Watched(model, reqs)
    watched.raise_for.add(0)
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=8, backend="cpu") as worker:
        drained: list[bool] = []

        class Spied(LayerwiseSource):
            async def drain(self) -> None:
                drained.append(True)
                await super().drain()

        source = Spied(worker, 8, "lru")
        n = req.cacheable_blocks
        await source.offload(req.keys[:n], list(range(n)))
        assert source.lookup(req.keys[:n]) == n  # a host hit: its load is planned, then submitted
        pool = BlockPool(POOL, caching=False)
        gone_back: list[bool] = []  # per release: had the source drained by then?
        real = pool.release

        def release(blocks: Sequence[int]) -> None:
            gone_back.append(bool(drained))
            real(blocks)

        pool.release = release  # type: ignore[method-assign]
        with anyio.fail_after(HANG):
            async with Server(model, kv, Device("cpu"), pool, source=source) as server:
                with pytest.raises(BaseException) as caught:
                    await server.serve(reqs)
    assert caught.group_contains(RuntimeError, match="forward 0 failed")
    assert gone_back == [True]
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_a_run_cancelled_mid_forward_gives_its_table_back_after_the_forward() -> None:
    """Cancelled while request 0's forward runs on the model thread: that forward writes
    into its table until it ends, so the table goes back only after it."""
    model, kv, reqs, _, source, watched = _setup(1)
    pool = BlockPool(POOL, caching=False)
    entered, go = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        go.wait(HANG)

    watched.before[0] = hold
    releases: list[int] = []
    real_release = pool.release

    def release(blocks):  # type: ignore[no-untyped-def]
        releases.append(watched.running)
        return real_release(blocks)

    pool.release = release  # type: ignore[method-assign]
    server = Server(model, kv, Device("cpu"), pool, source=source)
    with anyio.fail_after(HANG):
        async with server, anyio.create_task_group() as tg:
            tg.start_soon(server.serve, reqs)
            while not entered.is_set():
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
            threading.Timer(0.05, go.set).start()  # the forward ends after the cancel
    assert releases and all(running == 0 for running in releases)
    _pool_is_whole(pool)


# -- the layerwise arm: a load submitted early while its request waits for the model -----


class _Loads:
    """A ``LayerwiseSource`` over a CPU worker holding every request's prefix (prefilled,
    stored, then noise over the GPU pages), watched: ``log`` gets ("prepare", i),
    ("submit", i) and ("forward end", i) in the order they happened, from any thread;
    ``futures[i]`` is request ``i``'s load, ``blocks[i]`` its blocks; ``completed[i]``
    counts the unpins of its chunks; a submit of a request in ``fail`` raises in the
    worker's ``submit_load``."""

    def __init__(self, worker: object, model: LlamaModel, reqs: Sequence[ServeRequest]) -> None:
        from aiokv.bench.serve.sources import LayerwiseSource

        self.source = LayerwiseSource(worker, 16, "lru")  # type: ignore[arg-type]
        self.model, self.reqs, self.ids = model, reqs, _ids(reqs)
        self.owner = {r.keys[0]: r.index for r in reqs}
        self.log: list[tuple[str, int]] = []
        self.submitted = {r.index: threading.Event() for r in reqs}
        self.futures: dict[int, object] = {}
        self.blocks: dict[int, list[int]] = {}
        self.completed = {r.index: 0 for r in reqs}
        self.fail: set[int] = set()

    async def fill(self, kv: Sequence[torch.Tensor]) -> None:
        n = PREFIX // BLOCK_TOKENS
        for r in self.reqs:
            self.model.prefill(r.tokens[:PREFIX], 0, list(range(n)), kv)
            await self.source.offload(r.keys[:n], list(range(n)))
        for layer in kv:
            layer.normal_()  # what no load brings back is noise
        self._watch()

    def _who(self, tokens: object) -> int:
        return self.ids[tuple(int(t) for t in list(tokens)[-4:])]  # type: ignore[call-overload]

    def _watch(self) -> None:
        src, model, log = self.source, self.model, self.log
        real_prepare, real_forward, real_plan = model.prepare, model.forward, src.plan
        real_submit, real_complete = src.worker.submit_load, src.manager.complete_load
        current: list[int] = []

        def prepare(tokens, start, table):  # type: ignore[no-untyped-def]
            log.append(("prepare", self._who(tokens)))
            return real_prepare(tokens, start, table)

        def forward(inputs, kv, **kwargs):  # type: ignore[no-untyped-def]
            i = self._who(inputs.ids[-4:].tolist())
            try:
                return real_forward(inputs, kv, **kwargs)
            finally:
                log.append(("forward end", i))

        def submit_load(*args, **kwargs):  # type: ignore[no-untyped-def]
            i = current[-1]
            if i in self.fail:
                raise RuntimeError(f"no lane for request {i}")
            self.futures[i] = fut = real_submit(*args, **kwargs)
            return fut

        def complete_load(keys):  # type: ignore[no-untyped-def]
            self.completed[self.owner[keys[0]]] += 1
            real_complete(keys)

        def plan(keys, blocks):  # type: ignore[no-untyped-def]
            planned = real_plan(keys, blocks)
            assert planned is not None
            submit, i = planned.submit, self.owner[keys[0]]
            self.blocks[i] = list(blocks)

            def watched():  # type: ignore[no-untyped-def]
                log.append(("submit", i))
                current.append(i)
                try:
                    return submit()
                finally:
                    self.submitted[i].set()

            planned.submit = watched  # type: ignore[method-assign]
            return planned

        model.prepare = prepare  # type: ignore[method-assign]
        model.forward = forward  # type: ignore[method-assign]
        src.plan = plan  # type: ignore[method-assign]
        src.worker.submit_load = submit_load  # type: ignore[method-assign]
        src.manager.complete_load = complete_load  # type: ignore[method-assign]

    def at(self, event: str, i: int) -> int:
        return self.log.index((event, i))

    def settled(self) -> bool:
        """No pin left, no copy in flight, each load's chunks unpinned once."""
        return (self.source.manager.stats().pinned_keys == 0 and not self.source._in_flight
                and all(self.completed[i] == 1 for i in self.futures))


@contextlib.asynccontextmanager
async def _layerwise_loads(model: LlamaModel, kv: list[torch.Tensor], reqs: list[ServeRequest]
                           ) -> AsyncIterator[tuple[_Loads, _Watched]]:
    """A CPU worker whose host chunks hold every request's prefix, its layerwise source,
    and the model watched: what the early-submit tests serve with."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches

    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=16, backend="cpu") as worker:
        loads = _Loads(worker, model, reqs)
        await loads.fill(kv)
        yield loads, _Watched(model, reqs)


def _layerwise_setup(n: int, seed: int) -> tuple[LlamaModel, list[torch.Tensor], list[ServeRequest],
                                                  dict[int, int]]:
    model = LlamaModel(ModelConfig.tiny(), seed=seed + 7)
    reqs = _requests(n, seed=seed)
    return model, model.new_kv_cache(POOL), reqs, _expected(model, reqs)


@pytest.mark.anyio
async def test_a_queued_layerwise_request_submits_its_load_before_the_model_is_free() -> None:
    """Request 0 finds the model idle: its inputs are prepared, then its load submitted,
    then its forward runs (held until requests 1 and 2 have submitted). Those two arrive
    while it runs, so they submit at admission, before forward 0 ends and before their
    own inputs; their forwards gate on the layers landed. The tokens are the ones computed
    in one go; only request 0's forward start is counted as one."""
    from aiokv.bench.serve.overlap import forward_start_rows

    model, kv, reqs, expected = _layerwise_setup(3, seed=5)
    async with _layerwise_loads(model, kv, reqs) as (loads, watched):

        def hold_0() -> None:  # on the model thread: the later requests must submit meanwhile
            for i in (1, 2):
                assert loads.submitted[i].wait(HANG), f"request {i}'s load waited for the model"

        watched.before[0] = hold_0
        pool = BlockPool(POOL, caching=False)
        async with Server(model, kv, Device("cpu"), pool, source=loads.source) as server:
            with anyio.fail_after(HANG):
                served = await server.serve(reqs)
        assert loads.settled()
    assert watched.order == [0, 1, 2] and watched.most == 1
    assert loads.at("prepare", 0) < loads.at("submit", 0) < loads.at("forward end", 0)
    for i in (1, 2):
        assert loads.at("submit", i) < loads.at("forward end", 0) < loads.at("prepare", i)
    assert [s.token for s in served] == [expected[i] for i in range(3)]
    assert all(s.host_tokens == PREFIX and not s.recomputed and not s.late_failure for s in served)
    assert [s.early_submit for s in served] == [False, True, True]
    assert served[0].handover_s is not None and served[1].handover_s is None is served[2].handover_s
    rows = {r.name: r for r in forward_start_rows("s", served)}
    assert "n=1 of 3 loads" in rows["forward start after the submit p50"].note
    assert "n=2 of 3 loads" in rows["early submit to its forward's first gate p50"].note
    _pool_is_whole(pool)


@pytest.mark.anyio
async def test_a_cancel_drains_the_early_loads_of_requests_waiting_for_the_model() -> None:
    """Cancelled while requests 1 and 2 have their loads submitted and wait behind forward
    0: the source drains before their tables go back, each load has ended by then and
    unpinned its chunks once, and the model thread stops."""

    model, kv, reqs, _ = _layerwise_setup(3, seed=6)
    release = threading.Event()
    async with _layerwise_loads(model, kv, reqs) as (loads, watched):
        drains: list[int] = []
        real_drain = loads.source.drain

        async def drain() -> None:
            await real_drain()
            drains.append(len(loads.log))

        loads.source.drain = drain  # type: ignore[method-assign]
        watched.before[0] = lambda: release.wait(HANG)
        pool = BlockPool(POOL, caching=False)
        gone_back: dict[int, tuple[bool, bool]] = {}  # request: (drained, its load ended)
        real_release = pool.release
        tables: dict[int, set[int]] = {}

        def release_blocks(blocks: Sequence[int]) -> None:
            for i, table in tables.items():
                if table <= set(blocks):
                    gone_back[i] = (bool(drains), loads.futures[i].done())  # type: ignore[attr-defined]
            real_release(blocks)

        pool.release = release_blocks  # type: ignore[method-assign]
        server = Server(model, kv, Device("cpu"), pool, source=loads.source)
        with anyio.fail_after(HANG):
            async with server, anyio.create_task_group() as tg:
                tg.start_soon(server.serve, reqs)
                for i in (1, 2):
                    while not loads.submitted[i].is_set():
                        await anyio.sleep(0.001)
                    tables[i] = set(loads.blocks[i])
                assert watched.order == [0]
                tg.cancel_scope.cancel()
                release.set()
        assert loads.settled()
    assert watched.order == [0]  # 1 and 2 never forwarded
    assert gone_back == {1: (True, True), 2: (True, True)}
    _pool_is_whole(pool)
    assert server.runner is not None and not server.runner.running


@pytest.mark.anyio
async def test_an_early_submit_that_raises_is_served_by_recompute() -> None:
    """Request 1's submit raises in its restore stage: it is a miss, its prefix computed
    (byte-exact token), its chunks unpinned once; the others are not touched."""

    model, kv, reqs, expected = _layerwise_setup(3, seed=8)
    async with _layerwise_loads(model, kv, reqs) as (loads, watched):
        loads.fail.add(1)
        watched.before[0] = lambda: loads.submitted[2].wait(HANG)
        pool = BlockPool(POOL, caching=False)
        async with Server(model, kv, Device("cpu"), pool, source=loads.source) as server:
            with anyio.fail_after(HANG):
                served = await server.serve(reqs)
        assert loads.settled() and loads.completed[1] == 1
    assert [s.token for s in served] == [expected[i] for i in range(3)]
    bad = served[1]
    assert bad.host_tokens == 0 and bad.recomputed == PREFIX and "no lane for request 1" in bad.restore_error
    assert not bad.early_submit and served[2].early_submit
    assert served[0].host_tokens == served[2].host_tokens == PREFIX
    _pool_is_whole(pool)
