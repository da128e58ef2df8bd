"""The serve bench's model thread (``runner.ModelThread``): forwards run in arrival order on
one thread, a failing forward fails its own request only, closing ends with forwards still
queued, on CUDA the launcher does not wait for a forward's end; and the layerwise arm's
forward start splits into the submit, the hand-over and layer 0's work before its gate."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import numpy as np
import pytest
import torch

from aiokv.bench.serve.measure import Device, Launched, Prepared
from aiokv.bench.serve.model import BLOCK_TOKENS, LlamaModel, ModelConfig
from aiokv.bench.serve.overlap import forward_start_rows
from aiokv.bench.serve.pool import BlockPool
from aiokv.bench.serve.runner import ModelThread
from aiokv.bench.serve.served import Served
from aiokv.bench.serve.server import Server
from aiokv.bench.serve.workload import prefix_workload
from aiokv.errors import UsageError

VOCAB = 97
HANG = 30.0  # seconds a test waits on a thread before it calls the thread stuck


@dataclass
class _Recorder:
    """A model whose forward ``i`` (its first token) records its order and thread, writes
    "layer 0" at once, can be held or made to fail, and returns a one-hot at a token
    drawn for it (so a result cannot come back to the wrong request)."""

    answers: list[int]
    order: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    hold: dict[int, threading.Event] = field(default_factory=dict)
    began: dict[int, threading.Event] = field(default_factory=dict)
    fail: set[int] = field(default_factory=set)

    def prepare(self, tokens: np.ndarray, start: int, table: Sequence[int]) -> int:
        return int(tokens[0])

    def forward(self, i: int, kv: object, *, gate: object = None, after_layer=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        self.order.append(i)
        self.threads.append(threading.get_ident())
        if after_layer is not None:
            after_layer(0)
        self.began.setdefault(i, threading.Event()).set()
        if i in self.hold:
            assert self.hold[i].wait(HANG), f"forward {i} was never released"
        if i in self.fail:
            raise ValueError(f"forward {i} failed")
        out = torch.zeros(VOCAB)
        out[self.answers[i]] = 1.0
        return out


def _recorder(n: int) -> _Recorder:
    return _Recorder([int(x) for x in np.random.default_rng(n).integers(0, VOCAB, n)])


async def _prefill(runner: ModelThread, model: _Recorder, i: int) -> int:
    got = await runner.prefill(model, np.array([i]), 0, [0], [])  # type: ignore[arg-type]
    assert got.seconds >= 0
    return got.token


@pytest.mark.anyio
async def test_forwards_run_in_arrival_order_on_one_thread_off_the_loop() -> None:
    model = _recorder(12)
    model.hold[0] = threading.Event()  # the others queue up behind the first
    handed: list[int] = []
    tokens: dict[int, int] = {}
    async with ModelThread(Device("cpu")) as runner:
        async def one(i: int) -> None:
            handed.append(i)  # the hand-over is synchronous up to the first await
            tokens[i] = await _prefill(runner, model, i)

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
            while len(handed) < 12:
                await anyio.sleep(0)
            model.hold[0].set()
        assert runner.running
    assert not runner.running
    assert model.order == handed and sorted(handed) == list(range(12))
    assert tokens == dict(enumerate(model.answers))
    assert len(set(model.threads)) == 1 and model.threads[0] != threading.get_ident()


@pytest.mark.anyio
async def test_a_failing_forward_fails_its_request_and_the_thread_serves_on() -> None:
    model = _recorder(6)
    model.fail = {2, 4}
    async with ModelThread(Device("cpu")) as runner:
        got: dict[int, int | str] = {}

        async def one(i: int) -> None:
            try:
                got[i] = await _prefill(runner, model, i)
            except ValueError as exc:
                got[i] = str(exc)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
        assert await _prefill(runner, model, 5) == model.answers[5]  # after the failures too
        assert runner.running
    assert got == {0: model.answers[0], 1: model.answers[1], 2: "forward 2 failed",
                   3: model.answers[3], 4: "forward 4 failed", 5: model.answers[5]}
    assert len(set(model.threads)) == 1


@pytest.mark.anyio
async def test_closing_with_forwards_queued_ends_the_thread() -> None:
    """The forward running ends (its result delivered); the queued ones fail with
    ``UsageError`` instead of running; nothing is handed over after."""
    model = _recorder(4)
    model.hold[0] = threading.Event()
    model.began[0] = threading.Event()
    runner = ModelThread(Device("cpu"))
    got: dict[int, int | str] = {}

    async def one(i: int) -> None:
        try:
            got[i] = await _prefill(runner, model, i)
        except UsageError as exc:
            assert "closed" in str(exc)
            got[i] = "closed"

    async with anyio.create_task_group() as tg:
        for i in range(4):  # one after the other (trio runs a batch of new tasks in any order)
            tg.start_soon(one, i)
            while runner._handed <= i:
                await anyio.sleep(0)
        assert await anyio.to_thread.run_sync(model.began[0].wait, HANG)
        tg.start_soon(runner.aclose)
        while not runner.closed:
            await anyio.sleep(0)
        model.hold[0].set()
    assert not runner.running
    assert got == {0: model.answers[0], 1: "closed", 2: "closed", 3: "closed"}
    assert model.order == [0]
    with pytest.raises(UsageError, match="is closed"):
        await _prefill(runner, model, 1)
    await runner.aclose()  # twice is fine


class _FakeCuda(Device):
    """A "cuda" device whose forward's end is a threading event the test sets: what the
    model thread's launcher and its end waiter see of CUDA, without CUDA."""

    def __init__(self) -> None:
        super().__init__("cuda")
        object.__setattr__(self, "ends", {})
        object.__setattr__(self, "launches", [])

    def launch(self, model, tokens, start, table, kv, gate=None, after_layer=None,  # type: ignore[no-untyped-def]
               prepared: Prepared | None = None) -> Launched:
        i = int(tokens[0])
        self.launches.append(i)  # type: ignore[attr-defined]
        if after_layer is not None:
            after_layer(0)
        self.ends.setdefault(i, threading.Event())  # type: ignore[attr-defined]
        return Launched(torch.tensor(i * 3), prepared, marks=(i, i))  # type: ignore[arg-type]

    def finish(self, launched: Launched) -> tuple[int, float]:
        i = int(launched.token)
        assert self.ends[i // 3].wait(HANG), "never ended"  # type: ignore[attr-defined]
        return int(launched.token), 0.001 * i


@pytest.mark.anyio
async def test_on_cuda_the_launcher_does_not_wait_for_a_forward_to_end() -> None:
    """Forward 1 is launched while forward 0 has not ended; ends come back in launch order
    with each forward's own result."""
    device = _FakeCuda()
    device.ends[0] = threading.Event()  # type: ignore[attr-defined]
    got: dict[int, tuple[int, float]] = {}
    async with ModelThread(device) as runner:
        async def one(i: int) -> None:
            ran = await runner.prefill(None, np.array([i]), 0, [0], [])  # type: ignore[arg-type]
            got[i] = (ran.token, ran.seconds)

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 0)
            while not device.launches:  # type: ignore[attr-defined]
                await anyio.sleep(0)
            tg.start_soon(one, 1)
            device.ends.setdefault(1, threading.Event()).set()  # type: ignore[attr-defined]
            while len(device.launches) < 2:  # type: ignore[attr-defined]
                await anyio.sleep(0.001)
            assert got == {}  # 1 launched, and 0 has not ended: nothing is back
            device.ends[0].set()  # type: ignore[attr-defined]
    assert device.launches == [0, 1]  # type: ignore[attr-defined]
    assert got == {0: (0, 0.0), 1: (3, pytest.approx(0.003))}


# -- the server's model thread, and the forward start's parts ---------------------------


@pytest.mark.anyio
async def test_a_server_closes_its_model_thread_after_a_forward_raised() -> None:
    model = LlamaModel(ModelConfig.tiny(), seed=3)
    w = prefix_workload(prefixes=1, prefix_tokens=32, suffix_tokens=8, requests=1, warmup=0, vocab=512)
    forward_threads: list[int] = []

    def forward(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        forward_threads.append(threading.get_ident())
        raise RuntimeError("no forward")

    model.forward = forward  # type: ignore[method-assign]
    server = Server(model, model.new_kv_cache(8), Device("cpu"), BlockPool(8, caching=True))
    with pytest.raises(BaseException) as caught:
        async with server:
            await server.serve(w.measured)
    assert caught.group_contains(RuntimeError, match="no forward")
    assert forward_threads and forward_threads[0] != threading.get_ident()
    assert server.runner is not None and not server.runner.running and server.runner.closed


@pytest.mark.anyio
async def test_a_layerwise_load_splits_its_forward_start_into_three_parts() -> None:
    """Served through the layerwise source on the CPU backend: the submit, the hand-over
    and the way to the first gate are filled in, none negative, and add up to the forward
    start; the token is the one computed over the prefix as prefilled."""
    from aiokv import AsyncOffloadingWorker, CanonicalKVCaches
    from aiokv.bench.serve.sources import LayerwiseSource

    model = LlamaModel(ModelConfig.tiny(), seed=5)
    kv = model.new_kv_cache(16)
    w = prefix_workload(prefixes=1, prefix_tokens=64, suffix_tokens=24, requests=1, warmup=0, vocab=512)
    req = w.measured[0]
    n = req.cacheable_blocks
    expected = int(model.prefill(req.tokens, 0, list(range(8, 14)), model.new_kv_cache(16)).argmax())
    model.prefill(req.tokens[:n * BLOCK_TOKENS], 0, list(range(n)), kv)
    layout = CanonicalKVCaches.from_tensors(kv, block_dim=1)
    async with AsyncOffloadingWorker(layout, num_cpu_chunks=8, backend="cpu") as worker:
        source = LayerwiseSource(worker, 8, "lru")
        await source.offload(req.keys[:n], list(range(n)))
        for layer in kv:
            layer.normal_()  # what the load does not bring back is noise
        async with Server(model, kv, Device("cpu"), BlockPool(16, caching=True), source=source) as server:
            [served] = await server.serve([req])
    assert served.host_tokens == n * BLOCK_TOKENS and served.token == expected
    assert served.forward_start_s is not None and served.handover_s is not None
    assert served.first_gate_s is not None
    assert served.submit_s > 0 and served.handover_s >= 0 and served.first_gate_s >= 0
    assert served.submit_s + served.handover_s + served.first_gate_s == pytest.approx(served.forward_start_s,
                                                                                        abs=1e-9)


def _load(index: int, submit_ms: float, handover_ms: float | None, gate_ms: float, *,
          early: bool = False) -> Served:
    total = submit_ms + (handover_ms or 0.0) + gate_ms
    return Served(index, 1000, 900, 0.0, 0.0, 0.01, 1, host_tokens=512, submit_s=submit_ms / 1e3,
                  forward_start_s=total / 1e3, handover_s=None if handover_ms is None else handover_ms / 1e3,
                  first_gate_s=gate_ms / 1e3, early_submit=early)


def test_the_forward_start_row_gives_its_parts_beside_it() -> None:
    loads = [_load(0, 0.3, 0.2, 0.1), _load(1, 0.5, 0.1, 0.4), _load(2, 0.4, 0.7, 0.2)]
    rows = {r.name: r for r in forward_start_rows("s", loads)}
    start = rows["forward start after the submit p50"]
    assert start.value == pytest.approx(1.0) and start.target == ("<=", 1.0)
    assert start.extra["submit_ms"] == pytest.approx([0.3, 0.5, 0.4])
    assert start.extra["handover_ms"] == pytest.approx([0.2, 0.1, 0.7])
    assert start.extra["to_first_gate_ms"] == pytest.approx([0.1, 0.4, 0.2])
    assert all(a + b + c == pytest.approx(t) for a, b, c, t in zip(
        start.extra["submit_ms"], start.extra["handover_ms"], start.extra["to_first_gate_ms"],
        start.extra["forward_start_ms"]))
    assert "(b) hand-over 0.20" in start.note and "(c) to the first gate 0.20" in start.note
    assert rows["forward start: hand-over p50"].value == pytest.approx(0.2)
    assert rows["forward start: to the first gate p50"].value == pytest.approx(0.2)
    # Loads without the parts (no model thread stamp) still give the start, not the parts.
    bare = {r.name: r for r in forward_start_rows("s", [_load(0, 0.3, None, 0.1)])}
    assert set(bare) == {"forward start after the submit p50"} and "handover_ms" not in bare[
        "forward start after the submit p50"].extra


def test_a_load_submitted_early_is_not_read_as_a_slow_forward_start() -> None:
    """Loads submitted in their restore stage waited for the model after the submit: they
    are left out of the start and its parts, and reported in a row of their own, with no
    target, as the head start their copy had."""
    loads = [_load(0, 0.3, 0.2, 0.1), _load(1, 0.4, None, 40.0, early=True),
             _load(2, 0.4, 0.7, 0.2), _load(3, 0.2, None, 90.0, early=True)]
    rows = {r.name: r for r in forward_start_rows("s", loads)}
    start = rows["forward start after the submit p50"]
    assert start.extra["forward_start_ms"] == pytest.approx([0.6, 1.3]) and start.value == pytest.approx(0.95)
    assert "n=2 of 4 loads" in start.note and start.extra["handover_ms"] == pytest.approx([0.2, 0.7])
    assert rows["forward start: hand-over p50"].note.startswith("n=2;")
    early = rows["early submit to its forward's first gate p50"]
    assert early.extra["early_submit_to_first_gate_ms"] == pytest.approx([40.4, 90.2])
    assert early.target is None and "n=2 of 4 loads" in early.note and "queueing" in early.note
    only_early = forward_start_rows("s", [loads[1], loads[3]])
    assert [r.name for r in only_early] == ["early submit to its forward's first gate p50"]


class _Abort(BaseException):
    """Not an ``Exception``: what a forward's callback may still raise (``SystemExit``, a
    ``KeyboardInterrupt`` in a gate, a test's ``pytest.fail``)."""


@pytest.mark.anyio
async def test_a_forward_raising_a_base_exception_fails_its_request_only() -> None:
    """The launcher hands a ``BaseException`` back to the forward's request as it does an
    ``Exception``: the thread lives on, serves the next forward, and closes."""
    model = _recorder(3)

    def forward(i: int, kv: object, *, gate: object = None, after_layer=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if i == 1:
            raise _Abort("forward 1 aborted")
        return _Recorder.forward(model, i, kv, gate=gate, after_layer=after_layer)

    model.forward = forward  # type: ignore[method-assign]
    async with ModelThread(Device("cpu")) as runner:
        with anyio.fail_after(HANG):  # a bound on a hang, not a timing
            assert await _prefill(runner, model, 0) == model.answers[0]
            with pytest.raises(_Abort, match="forward 1 aborted"):
                await _prefill(runner, model, 1)
            assert await _prefill(runner, model, 2) == model.answers[2]
        assert runner.running
    assert not runner.running and model.order == [0, 2]


@pytest.mark.anyio
async def test_on_cuda_an_end_raising_a_base_exception_fails_its_request_only() -> None:
    """The end waiter does the same with a ``BaseException`` from a forward's end: the
    forwards after it are still handed back."""
    class _Ends(_FakeCuda):
        def finish(self, launched: Launched) -> tuple[int, float]:
            if int(launched.token) == 3:
                raise _Abort("the end of forward 1")
            return super().finish(launched)

    device = _Ends()
    for i in range(3):
        device.ends[i] = threading.Event()  # type: ignore[attr-defined]
        device.ends[i].set()  # type: ignore[attr-defined]
    async with ModelThread(device) as runner:
        with anyio.fail_after(HANG):  # a bound on a hang, not a timing
            assert (await runner.prefill(None, np.array([0]), 0, [0], [])).token == 0  # type: ignore[arg-type]
            with pytest.raises(_Abort, match="the end of forward 1"):
                await runner.prefill(None, np.array([1]), 0, [0], [])  # type: ignore[arg-type]
            assert (await runner.prefill(None, np.array([2]), 0, [0], [])).token == 6  # type: ignore[arg-type]
    assert not runner.running
