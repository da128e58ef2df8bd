"""An async HTTP service that offloads finished requests' KV and restores prefix hits.

A toy model (a few attention layers standing in for an LLM) serves prompts that share
long prefixes (system prompts). Each prompt is cut into blocks of 16 tokens whose K/V live
in a paged KV cache on the device; each full block is named by a hash of the prefix it
ends. aiokv's ``OffloadCache`` does the rest over an ``AsyncOffloadingWorker``:

- ``cache.lookup(hashes)``: how many leading blocks of this prompt host memory holds;
- ``await cache.restore(hashes[:n], blocks[:n])``: load them instead of recomputing
  (``False`` is a miss: a failed load is recomputed, never used);
- ``await cache.offload(hashes, blocks)``: after the response, store the blocks it does not
  hold yet (what to store and what to evict is the cache's policy).

The forward runs in a worker thread, one at a time; the event loop meanwhile accepts
requests and awaits other requests' transfers.

Both ways need ``python3 -m pip install -e '.[examples]'`` (fastapi, httpx, uvicorn). Run
the simulation (no network)::

    python examples/async_server.py --requests 64

or serve it (``--metrics`` also serves Prometheus metrics; needs ``.[metrics]`` too)::

    python examples/async_server.py --serve --port 8000 --metrics
    curl -s localhost:8000/generate -H 'content-type: application/json' \
         -d '{"prompt": "You are a helpful assistant. Hi!"}'
    curl -s localhost:8000/stats
    curl -s localhost:8000/metrics
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import string
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx
import torch
import torch.nn.functional as F
from fastapi import BackgroundTasks, FastAPI, HTTPException, Response
from pydantic import BaseModel
from torch import nn

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, OffloadCache

# -- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256  # tokens are UTF-8 bytes
    hidden: int = 256
    num_layers: int = 4
    heads: int = 4
    head_dim: int = 64
    block_size: int = 16


class ToyModel(nn.Module):
    """A few attention layers over a paged KV cache.

    Each block of tokens attends to every earlier token's K/V, read from the cache, so a
    block restored from host memory is used exactly like a recomputed one.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        inner = cfg.heads * cfg.head_dim
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.hidden) for _ in range(cfg.num_layers))
        self.qkv = nn.ModuleList(nn.Linear(cfg.hidden, 3 * inner) for _ in range(cfg.num_layers))
        self.proj = nn.ModuleList(nn.Linear(inner, cfg.hidden) for _ in range(cfg.num_layers))
        self.head = nn.Linear(cfg.hidden, cfg.vocab)

    def new_kv_cache(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """Per-layer ``(K/V, block, token, head, head_dim)`` tensors, filled with noise so
        that a block nobody wrote cannot pass for a computed one."""
        c = self.cfg
        shape = (2, num_blocks, c.block_size, c.heads, c.head_dim)
        return [torch.randn(shape, device=device) for _ in range(c.num_layers)]

    @torch.inference_mode()
    def forward_block(self, tokens: torch.Tensor, kv: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
        """Compute the block ``blocks[-1]`` (``tokens``, at most one block), write its K/V
        into the cache and return its hidden states. ``blocks[:-1]`` hold the prefix."""
        c = self.cfg
        n, past = tokens.numel(), (len(blocks) - 1) * c.block_size
        total = past + n
        # Query i (position past + i) sees keys 0 .. past + i.
        positions = torch.arange(total, device=tokens.device)
        mask = positions[None, :] <= positions[past:, None]
        x = self.embed(tokens)
        for layer in range(c.num_layers):
            q, k, v = self.qkv[layer](self.norms[layer](x)).view(n, 3, c.heads, c.head_dim).unbind(1)
            kv[layer][0, blocks[-1], :n] = k
            kv[layer][1, blocks[-1], :n] = v
            keys = kv[layer][0, blocks].reshape(-1, c.heads, c.head_dim)[:total]
            values = kv[layer][1, blocks].reshape(-1, c.heads, c.head_dim)[:total]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask
            )
            x = x + self.proj[layer](out.transpose(0, 1).reshape(n, -1))
        return x

    def prefill(
        self, tokens: torch.Tensor, kv: list[torch.Tensor], blocks: list[int], first: int
    ) -> dict[str, Any]:
        """Compute blocks ``first..`` of a prompt whose earlier blocks are already in the cache."""
        bs = self.cfg.block_size
        x = torch.empty(0)
        for b in range(first, len(blocks)):
            x = self.forward_block(tokens[b * bs : (b + 1) * bs], kv, blocks[: b + 1])
        last = x[-1]
        with torch.inference_mode():
            next_token = int(self.head(last).argmax())  # also waits for the device
        digest = hashlib.sha256(last.float().cpu().numpy().tobytes()).hexdigest()[:16]
        return {"next_token": next_token, "digest": digest}

    def reference(self, prompt: str, device: torch.device | str = "cpu") -> dict[str, Any]:
        """The same prompt computed from scratch in a private cache (what a hit must match)."""
        tokens = tokenize(prompt, device)
        n = math.ceil(tokens.numel() / self.cfg.block_size)
        return self.prefill(tokens, self.new_kv_cache(n, device), list(range(n)), 0)


def tokenize(prompt: str, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(list(prompt.encode()), dtype=torch.long, device=device)


def prefix_hashes(tokens: torch.Tensor, block_size: int) -> list[bytes]:
    """One hash per full block, chained: block i's hash names the whole prefix it ends."""
    hashes, h = [], b"aiokv-example"
    ids = tokens.tolist()
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hashlib.sha256(h + bytes(ids[start : start + block_size])).digest()
        hashes.append(h)
    return hashes


# -- the server ----------------------------------------------------------------------------


@dataclass
class ServerStats:
    requests: int = 0
    prompt_blocks: int = 0  # full blocks, the ones a cache can hold
    hit_blocks: int = 0  # restored from host memory
    computed_blocks: int = 0  # includes each prompt's last (partial) block
    compute_seconds: float = 0.0
    load_seconds: float = 0.0  # time requests spent awaiting restores

    def as_dict(self, cache: OffloadCache) -> dict[str, Any]:
        st = cache.stats()
        per_block = self.compute_seconds / self.computed_blocks if self.computed_blocks else 0.0
        return {
            **asdict(self),
            "hit_rate": self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0,
            # Restored blocks at the mean compute time per block, less the time spent loading.
            "time_saved_seconds": self.hit_blocks * per_block - self.load_seconds,
            "stored_blocks": st.stored_keys,
            "evicted_blocks": st.evictions,
            "failed_loads": st.failed_loads,
        }


@dataclass
class Finished:
    """A request whose KV waits to be offloaded; it owns its device blocks until then."""

    blocks: list[int]
    hashes: list[bytes]
    ready: Any  # what the store must wait for (a CUDA event), None on the CPU


class PrefixCacheServer:
    """The model, its paged KV cache, the worker and the ``OffloadCache`` over it.

    Use as ``async with server:`` (the app's lifespan does it). ``generate`` serves one
    prompt; ``offload`` stores a finished request's blocks and frees them.
    """

    def __init__(
        self,
        cfg: ModelConfig | None = None,
        *,
        num_gpu_blocks: int = 256,
        num_cpu_chunks: int = 1024,
        device: str | None = None,
        policy: str | None = None,
        metrics_registry: Any = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = ToyModel(cfg or ModelConfig()).to(self.device).eval()
        self.cfg = self.model.cfg
        self.kv = self.model.new_kv_cache(num_gpu_blocks, self.device)
        kv = CanonicalKVCaches.from_tensors(self.kv, block_dim=1)
        self.worker = AsyncOffloadingWorker(kv, num_cpu_chunks=num_cpu_chunks)  # backend follows self.kv
        self.metrics = None
        if metrics_registry is not None:
            from aiokv.metrics import OffloadMetrics

            # The worker's counters, and per-copy histograms the cache feeds.
            self.metrics = OffloadMetrics(self.worker, registry=metrics_registry)
        # policy=None: the recommended policy
        self.cache = OffloadCache(self.worker, policy=policy, metrics=self.metrics)
        if metrics_registry is not None:
            from aiokv.metrics import CacheCollector

            metrics_registry.register(CacheCollector(self.cache))  # hits, stores, evictions...
        self.num_gpu_blocks = num_gpu_blocks
        self._free_blocks = list(range(num_gpu_blocks))  # the engine's own device allocator
        self._blocks_freed: anyio.Condition | None = None
        self._compute_limiter: anyio.CapacityLimiter | None = None
        self.stats = ServerStats()

    async def __aenter__(self) -> PrefixCacheServer:
        self._blocks_freed = anyio.Condition()
        self._compute_limiter = anyio.CapacityLimiter(1)
        await self.worker.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.cache.aclose()  # waits for its copies, then frees its chunks
        finally:
            await self.worker.aclose()

    async def generate(self, prompt: str) -> tuple[dict[str, Any], Finished]:
        tokens = tokenize(prompt, self.device)
        if tokens.numel() == 0:
            raise HTTPException(400, "empty prompt")
        bs = self.cfg.block_size
        num_blocks = math.ceil(tokens.numel() / bs)
        if num_blocks > self.num_gpu_blocks:
            raise HTTPException(413, f"prompt needs {num_blocks} blocks; the cache has {self.num_gpu_blocks}")
        hashes = prefix_hashes(tokens, bs)
        blocks = await self._allocate(num_blocks)
        try:
            # The last token is always computed (its hidden state is the answer).
            hits = self.cache.lookup(hashes[: (tokens.numel() - 1) // bs])
            if hits:
                start = time.perf_counter()
                # Shielded: a request cancelled meanwhile (a client gone) still waits out the
                # copy, so its blocks are not handed to another request while it writes them.
                with anyio.CancelScope(shield=True):
                    restored = await self.cache.restore(hashes[:hits], blocks[:hits])
                self.stats.load_seconds += time.perf_counter() - start
                hits = hits if restored else 0  # a miss: the blocks are recomputed
            # One forward at a time in a thread, so the loop keeps serving other requests'
            # transfers; a real server would batch requests into one forward instead.
            out, ready, seconds = await anyio.to_thread.run_sync(
                self._compute, tokens, blocks, hits, limiter=self._compute_limiter
            )
        except BaseException:
            await self._release(blocks)
            raise
        self.stats.requests += 1
        self.stats.prompt_blocks += len(hashes)
        self.stats.hit_blocks += hits
        self.stats.computed_blocks += num_blocks - hits
        self.stats.compute_seconds += seconds
        body = {**out, "prompt_tokens": tokens.numel(), "hit_blocks": hits,
                "computed_blocks": num_blocks - hits}
        return body, Finished(blocks, hashes, ready)

    def _compute(
        self, tokens: torch.Tensor, blocks: list[int], first: int
    ) -> tuple[dict[str, Any], Any, float]:
        start = time.perf_counter()
        out = self.model.prefill(tokens, self.kv, blocks, first)
        seconds = time.perf_counter() - start
        ready = None
        if self.device.type == "cuda":
            # This thread's stream wrote the KV; the store is submitted from the loop thread,
            # whose current stream knows nothing of it, so it passes after=ready.
            ready = torch.cuda.Event()
            ready.record()
        return out, ready, seconds

    async def offload(self, done: Finished) -> None:
        """Offer the request's full blocks to the cache, then free its device blocks."""
        try:
            with anyio.CancelScope(shield=True):  # the blocks are freed below: never mid-copy
                await self.cache.offload(done.hashes, done.blocks[: len(done.hashes)], after=done.ready)
        finally:
            await self._release(done.blocks)

    async def _allocate(self, n: int) -> list[int]:
        assert self._blocks_freed is not None, "use `async with server:` first"
        async with self._blocks_freed:
            while len(self._free_blocks) < n:
                await self._blocks_freed.wait()
            blocks, self._free_blocks = self._free_blocks[:n], self._free_blocks[n:]
        return blocks

    async def _release(self, blocks: list[int]) -> None:
        assert self._blocks_freed is not None
        async with self._blocks_freed:
            self._free_blocks.extend(blocks)
            self._blocks_freed.notify_all()


# -- the app -------------------------------------------------------------------------------


class GenerateRequest(BaseModel):
    prompt: str


def create_app(server: PrefixCacheServer) -> FastAPI:
    """The HTTP face; its lifespan opens the server (and the worker) on the serving loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with server:
            yield

    app = FastAPI(title="aiokv prefix-cache example", lifespan=lifespan)

    @app.post("/generate")
    async def generate(req: GenerateRequest, background: BackgroundTasks) -> dict[str, Any]:
        body, finished = await server.generate(req.prompt)
        background.add_task(server.offload, finished)  # after the response is sent
        return body

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**server.stats.as_dict(server.cache), "worker": asdict(server.worker.statistics())}

    @app.get("/metrics")
    async def metrics() -> Response:
        if server.metrics is None:
            raise HTTPException(404, "metrics are off; start with --metrics (or pass metrics_registry=)")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# -- the driver ----------------------------------------------------------------------------


def make_prompts(
    n: int, num_prefixes: int = 4, prefix_blocks: int = 8, block_size: int = 16, seed: int = 0
) -> list[str]:
    """``n`` prompts: one of ``num_prefixes`` system prompts plus a short unique question."""
    rng = random.Random(seed)
    letters = string.ascii_letters + " "
    prefixes = ["".join(rng.choices(letters, k=prefix_blocks * block_size)) for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + f"Q{i}: " + "".join(rng.choices(letters, k=rng.randint(5, 40)))
        for i in range(n)
    ]


@dataclass
class SimulationReport:
    stats: dict[str, Any]
    responses: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    seconds: float = 0.0


async def simulate(
    n_requests: int = 32,
    server: PrefixCacheServer | None = None,
    *,
    num_prefixes: int = 4,
    concurrency: int = 8,
    seed: int = 0,
) -> SimulationReport:
    """Drive the app in-process (httpx's ASGI transport, no network).

    The first request of each prefix goes alone and warms the cache; the rest run
    ``concurrency`` at a time. Returns every (prompt, response) pair and the final stats.
    """
    server = server or PrefixCacheServer()
    app = create_app(server)
    prompts = make_prompts(n_requests, num_prefixes, block_size=server.cfg.block_size, seed=seed)
    report = SimulationReport(stats={})
    limiter = anyio.Semaphore(concurrency)
    start = time.perf_counter()
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://aiokv.example") as client:

            async def send(prompt: str) -> None:
                async with limiter:
                    resp = await client.post("/generate", json={"prompt": prompt})
                    resp.raise_for_status()
                    report.responses.append((prompt, resp.json()))

            for prompt in prompts[:num_prefixes]:
                await send(prompt)
            async with anyio.create_task_group() as tg:
                for prompt in prompts[num_prefixes:]:
                    tg.start_soon(send, prompt)
            report.stats = (await client.get("/stats")).json()
    report.seconds = time.perf_counter() - start
    return report


def build_server(*, metrics: bool = False, **options: Any) -> PrefixCacheServer:
    """The server ``--serve`` runs; with ``metrics`` its ``/metrics`` exports the worker's
    and the cache's series from a registry of its own."""
    registry = None
    if metrics:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    return PrefixCacheServer(metrics_registry=registry, **options)


def main(argv: list[str] | None = None) -> SimulationReport | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests to simulate")
    parser.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--serve", action="store_true", help="serve over HTTP with uvicorn instead")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--metrics", action="store_true",
                        help="--serve: expose Prometheus metrics at /metrics (needs the metrics extra)")
    args = parser.parse_args(argv)
    if args.metrics and not args.serve:
        parser.error("--metrics goes with --serve (the simulation has no /metrics to scrape)")
    if args.serve:
        import uvicorn

        uvicorn.run(create_app(build_server(metrics=args.metrics)), host=args.host, port=args.port)
        return None
    report = anyio.run(
        lambda: simulate(args.requests, num_prefixes=args.prefixes, concurrency=args.concurrency)
    )
    s = report.stats
    print(
        f"{s['requests']} requests in {report.seconds:.2f} s on {s['worker']['backend']}: "
        f"hit rate {s['hit_rate']:.0%} ({s['hit_blocks']}/{s['prompt_blocks']} prompt blocks restored "
        f"instead of recomputed)"
    )
    print(
        f"compute {s['compute_seconds']:.3f} s for {s['computed_blocks']} blocks, waiting on loads "
        f"{s['load_seconds']:.3f} s; estimated time saved {s['time_saved_seconds']:.3f} s"
    )
    return report


if __name__ == "__main__":
    main()
