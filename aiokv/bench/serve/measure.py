"""What the serve bench times with: a prefill's launch and end, the same-run ceilings
(a contiguous copy of KV bytes, a GEMM for the FLOP peak) and a prefill-time calibration.

On CUDA a prefill is timed with CUDA events around its kernels: ``Device.launch`` enqueues
them, ``Device.finish`` waits for the end event (the server's model thread does the one,
its waiter thread the other: ``runner.ModelThread``); on the CPU the launch is the forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .model import LlamaModel, PrefillInputs

__all__ = ["Device", "Launched", "PrefillFit", "Prepared", "load_ceiling", "peak_flops"]

Gate = Callable[[int], object]
"""Called before layer ``i`` reads the cached prefix (``LlamaModel.prefill``)."""


@dataclass(frozen=True)
class Device:
    """Where the model runs ("cpu" or "cuda") and how its prefills are timed."""

    kind: str

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()

    def empty_cache(self) -> None:
        """Give freed device memory back (between the arms' pools and what follows)."""
        if self.kind == "cuda":
            torch.cuda.empty_cache()

    def prepare(self, model: LlamaModel, tokens: np.ndarray, start: int, table: Sequence[int]) -> Prepared:
        """A prefill's inputs (``LlamaModel.prepare``), timed as part of its prefill: what
        the server does on the loop's thread before it starts a request's layerwise load
        (one not submitted early), so that the forward can follow the submit at once."""
        if self.kind == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            inputs = model.prepare(tokens, start, table)
            end.record()
            return Prepared(inputs, marks=(begin, end))
        t0 = time.perf_counter()
        inputs = model.prepare(tokens, start, table)
        return Prepared(inputs, seconds=time.perf_counter() - t0)

    def launch(self, model: LlamaModel, tokens: np.ndarray, start: int, table: Sequence[int],
               kv: Sequence[torch.Tensor], gate: Gate | None = None, after_layer: Gate | None = None,
               prepared: Prepared | None = None) -> Launched:
        """Start one prefill: on CUDA its kernels are enqueued between two timing events and
        this returns without waiting for them; on the CPU the forward is the work, and it is
        done when this returns (``finish`` says what the arguments mean)."""
        if self.kind == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            inputs = prepared.inputs if prepared is not None else model.prepare(tokens, start, table)
            token = model.forward(inputs, kv, gate=gate, after_layer=after_layer).argmax()
            end.record()
            return Launched(token, prepared, marks=(begin, end))
        t0 = time.perf_counter()
        inputs = prepared.inputs if prepared is not None else model.prepare(tokens, start, table)
        token = model.forward(inputs, kv, gate=gate, after_layer=after_layer).argmax()
        return Launched(token, prepared, seconds=time.perf_counter() - t0)

    def finish(self, launched: Launched) -> tuple[int, float]:
        """Wait for a launched prefill's end (on CUDA its end event: the thread blocks, not
        the device) and return ``prefill_sync``'s (token, seconds)."""
        prepared = launched.prepared
        if launched.marks is not None:
            begin, end = launched.marks
            end.synchronize()
            spent = begin.elapsed_time(end)
            if prepared is not None and prepared.marks is not None:
                spent += prepared.marks[0].elapsed_time(prepared.marks[1])
            return int(launched.token.item()), spent / 1e3
        spent = launched.seconds + (prepared.seconds if prepared is not None else 0.0)
        return int(launched.token.item()), spent

    def prefill_sync(self, model: LlamaModel, tokens: np.ndarray, start: int, table: Sequence[int],
                     kv: Sequence[torch.Tensor], gate: Gate | None = None,
                     after_layer: Gate | None = None, prepared: Prepared | None = None) -> tuple[int, float]:
        """Run one prefill to its first token: (greedy token, seconds the device spent,
        waits on ``gate`` included: on CUDA the stream's, on the CPU the thread's).
        ``after_layer``: ``LlamaModel.prefill``'s. With ``prepared`` (``prepare``'s, for
        these tokens and table) only the forward runs here, and the seconds are the
        preparation's and the forward's, not the time between them (a submit's)."""
        return self.finish(self.launch(model, tokens, start, table, kv, gate, after_layer, prepared))


@dataclass
class Prepared:
    """A prefill's inputs and how long preparing them took: CUDA events around it, or the
    host seconds on the CPU."""

    inputs: PrefillInputs
    marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    seconds: float = 0.0


@dataclass
class Launched:
    """A prefill ``Device.launch`` started: its token (a device tensor), and its timing
    events on CUDA or the forward's host seconds on the CPU."""

    token: torch.Tensor
    prepared: Prepared | None
    marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    seconds: float = 0.0


def load_ceiling(device: Device, nbytes: int, page_bytes: int, reps: int = 5) -> tuple[float, str]:
    """GB/s of the fastest contiguous host-to-device copy of ``nbytes``, and what it was.

    The transfer bench's ceiling code: a pinned copy on CUDA (``Contiguous``), on the CPU
    backend the best of one numpy copy and page-sized pieces (the CPU lane's own copies).
    """
    nbytes = max(nbytes, page_bytes)
    if device.kind == "cuda":
        from ..cuda_setup import Contiguous

        rate = Contiguous(nbytes).rates(reps)["load"]
        torch.cuda.empty_cache()
        return rate, f"contiguous pinned copy of {_size(nbytes)}"
    from ..transfer import _best_rate, _contiguous_copies

    gen = torch.Generator().manual_seed(3)
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    copies = _contiguous_copies(host, dev, "cpu", page_bytes)
    rate = max(_best_rate(fn, "cpu", nbytes, reps) for kind, fn in copies.items() if kind.startswith("load"))
    return rate, f"contiguous numpy copy of {_size(nbytes)} (whole or in pages)"


def peak_flops(device: Device, seconds: float = 1.0) -> tuple[float, str]:
    """FLOP/s of a GEMM measured now, and its name: the peak the model's utilisation is
    measured against (bf16 8192^3 on CUDA, float32 1024^3 on one CPU thread's torch)."""
    if device.kind == "cuda":
        from ..cuda_setup import Gemm

        return Gemm(8192, 8192, 8192).alone(seconds) * 1e12, "bf16 GEMM 8192^3 in this run"
    n = 1024
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best, f"float32 GEMM {n}^3 in this run"


@dataclass(frozen=True)
class PrefillFit:
    """Prefill seconds of a prompt from scratch, interpolated between measured lengths."""

    lengths: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, tokens: int) -> float:
        xs, ys = np.asarray(self.lengths, float), np.asarray(self.seconds, float)
        if tokens <= xs[-1]:
            return float(np.interp(tokens, xs, ys))
        return float(ys[-1] * (tokens / xs[-1]) ** 2)  # past the longest: attention grows

    @classmethod
    def measure(cls, model: LlamaModel, kv: Sequence[torch.Tensor], device: Device,
                max_tokens: int, num_blocks: int, reps: int = 3) -> PrefillFit:
        """Time prefills of a few lengths up to ``max_tokens`` (the median of ``reps``
        after a warm-up run, which also loads kernels before anything is timed: a best
        case would understate the load the compression offers on a busy host)."""
        top = max(16, min(max_tokens, num_blocks * 16))
        lengths = sorted({int(x) for x in np.geomspace(16, top, 6)})
        table = list(range(-(-top // 16)))
        gen = np.random.default_rng(5)
        seconds = []
        for n in lengths:
            tokens = gen.integers(0, model.config.vocab, n)
            device.prefill_sync(model, tokens, 0, table, kv)
            seconds.append(float(np.median([device.prefill_sync(model, tokens, 0, table, kv)[1]
                                            for _ in range(reps)])))
        return cls(tuple(lengths), tuple(seconds))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"
