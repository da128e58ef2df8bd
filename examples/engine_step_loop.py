"""A synchronous engine step loop driving ``SyncOffloadingWorker`` the way engines do.

Each step follows the offloading-worker contract (docs/engines.md):

1. flush the stores deferred from the previous step, then ``wait()`` on pending stores
   whose GPU blocks are about to be reused;
2. submit expedited loads and ``wait()`` on them before the forward pass;
3. run the forward pass (here: write each new request's KV, check each resumed one's);
4. submit ordinary (asynchronous) loads after the forward was launched;
5. queue this step's stores for the next step;
6. drain ``get_finished()`` and feed the results to the scheduler.

Job ids come from one counter shared by loads and stores. Requests are prefilled, evicted
to host memory, and resumed later into whatever GPU blocks are free; every resumed
request's KV is checked byte for byte against what it wrote. A failed transfer degrades
to recomputation, never to wrong KV. ``python examples/engine_step_loop.py``
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from aiokv import (
    CanonicalKVCaches,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SyncOffloadingWorker,
    TransferResult,
)

KV_PAGE = (16, 4, 32)  # tokens per block, heads, head_dim


@dataclass
class Request:
    """One request's KV: which GPU blocks and host chunks it holds, and what it must contain."""

    rid: int
    num_blocks: int
    gpu_blocks: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    resume_at: int = 0
    expedited: bool = False


@dataclass
class StepLoopReport:
    """What the run did; the test asserts on it."""

    steps: int = 0
    idle_steps: int = 0
    prefilled: int = 0
    recomputed: int = 0
    verified: int = 0
    stores: int = 0
    expedited_loads: int = 0
    async_loads: int = 0
    reuse_waits: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    job_ids: list[int] = field(default_factory=list)


class Engine:
    """A toy scheduler + model runner. Everything runs on the caller's thread."""

    def __init__(self, worker: SyncOffloadingWorker, layers: list[torch.Tensor], num_chunks: int) -> None:
        self.worker = worker
        self.layers = layers
        self.free_blocks: deque[int] = deque(range(layers[0].shape[1]))
        self.free_chunks: deque[int] = deque(range(num_chunks))
        self.job_ids = itertools.count()  # one counter for loads and stores
        self.deferred_stores: list[Request] = []  # queued this step, submitted next step
        self.store_of_block: dict[int, int] = {}  # GPU block -> store job still reading it
        self.stores: dict[int, Request] = {}  # store job -> request being evicted
        self.loads: dict[int, Request] = {}  # load job -> request being resumed
        self.parked: list[Request] = []  # stored, waiting to be resumed
        self.ready: list[Request] = []  # KV on the GPU, to be checked by the next forward
        self.waiting: list[Request] = []  # not admitted yet (or recomputing)
        self.report = StepLoopReport()

    # -- the model: deterministic per-request KV, so a resumed request can be checked ---------

    def expected_kv(self, req: Request, layer: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(req.rid * 1000 + layer)
        kv = torch.randn(2, req.num_blocks, *KV_PAGE, generator=gen)
        return kv.to(self.layers[layer].dtype).to(self.layers[layer].device)

    def forward(self, prefill: list[Request], resumed: list[Request]) -> None:
        """Write the KV of new requests; read (and check) the KV of resumed ones."""
        for req in prefill:
            for i, layer in enumerate(self.layers):
                layer[:, req.gpu_blocks] = self.expected_kv(req, i)
        for req in resumed:
            for i, layer in enumerate(self.layers):
                if not torch.equal(layer[:, req.gpu_blocks], self.expected_kv(req, i)):
                    raise AssertionError(f"request {req.rid}: restored KV differs from what it wrote")
            self.report.verified += 1
            self.release_blocks(req)
            self.free_chunks.extend(req.chunks)
            req.chunks = []

    # -- block bookkeeping -------------------------------------------------------------------

    def allocate_blocks(self, n: int) -> list[int] | None:
        if len(self.free_blocks) < n:
            return None
        return [self.free_blocks.popleft() for _ in range(n)]

    def release_blocks(self, req: Request) -> None:
        self.free_blocks.extend(req.gpu_blocks)
        req.gpu_blocks = []

    def wait_for_reuse(self, blocks: list[int]) -> None:
        """Contract step 1: a store may still read blocks we are about to overwrite."""
        pending = {self.store_of_block[b] for b in blocks if b in self.store_of_block}
        if pending:
            self.worker.wait(pending)
            self.report.reuse_waits += 1

    # -- one engine step ----------------------------------------------------------------------

    # --8<-- [start:step]
    def step(self, step: int, arrivals: list[Request]) -> None:
        # 1. Flush: stores deferred from the previous step go first.
        for req in self.deferred_stores:
            job = next(self.job_ids)
            self.worker.submit_store(job, GPULoadStoreSpec(req.gpu_blocks), CPULoadStoreSpec(req.chunks))
            self.report.job_ids.append(job)
            self.stores[job] = req
            for b in req.gpu_blocks:
                self.store_of_block[b] = job
            self.release_blocks(req)  # freed now; whoever reuses them waits on the store
            self.parked.append(req)
        self.deferred_stores = []

        # Schedule: resume parked requests that are due, admit new ones while blocks last.
        # Load and store directions are independent: a request is loaded only once its store
        # was reported, or the load could read a chunk before the store wrote it.
        due = [r for r in self.parked if r.resume_at <= step]
        to_load: list[Request] = []
        for req in due:
            if self._stored(req) and (blocks := self.allocate_blocks(req.num_blocks)) is not None:
                self.parked.remove(req)
                req.gpu_blocks = blocks
                to_load.append(req)
        prefill: list[Request] = []
        claimed = 0  # chunks this step's admissions will take in step 5
        for req in arrivals:
            blocks = self.allocate_blocks(req.num_blocks)
            if blocks is None or len(self.free_chunks) - claimed < req.num_blocks:
                if blocks is not None:
                    self.free_blocks.extendleft(reversed(blocks))
                self.waiting.append(req)
                continue
            req.gpu_blocks = blocks
            claimed += req.num_blocks
            prefill.append(req)
        self.wait_for_reuse([b for r in prefill + to_load for b in r.gpu_blocks])

        # 2. Expedited loads: submitted and waited on before the forward.
        expedited = [r for r in to_load if r.expedited]
        waited: set[int] = set()
        for req in expedited:
            job = next(self.job_ids)
            self.worker.submit_load(job, CPULoadStoreSpec(req.chunks), GPULoadStoreSpec(req.gpu_blocks), True)
            self.report.job_ids.append(job)
            self.loads[job] = req
            waited.add(job)
        self.worker.wait(waited)
        # wait() reports nothing: whether a load succeeded comes from get_finished(), which
        # never blocks, so drain it here too and let failed loads recompute instead.
        for result in self.worker.get_finished():
            self.on_finished(result)

        # 3. Forward: new requests write KV; resumed requests (loads reported done) read it.
        self.forward(prefill, self.ready)
        self.ready = []
        self.report.prefilled += len(prefill)

        # 4. Ordinary loads go after the forward was launched; they finish in the background.
        for req in to_load:
            if not req.expedited:
                job = next(self.job_ids)
                self.worker.submit_load(job, CPULoadStoreSpec(req.chunks), GPULoadStoreSpec(req.gpu_blocks))
                self.report.job_ids.append(job)
                self.loads[job] = req

        # 5. This step's requests are evicted: queue their stores for the next step.
        for req in prefill:
            req.chunks = [self.free_chunks.popleft() for _ in range(req.num_blocks)]
            req.resume_at = step + 2
            self.deferred_stores.append(req)

        # 6. Drain finished jobs; results feed the scheduler.
        for result in self.worker.get_finished():
            self.on_finished(result)
    # --8<-- [end:step]

    def on_finished(self, result: TransferResult) -> None:
        if result.job_id in self.stores:
            req = self.stores.pop(result.job_id)
            for b in [b for b, j in self.store_of_block.items() if j == result.job_id]:
                del self.store_of_block[b]
            if result.success:
                self.report.stores += 1
                self.report.bytes_stored += result.transfer_size or 0
            else:  # degrade to a miss: the request recomputes its KV
                self._recompute(req)
        elif result.job_id in self.loads:
            req = self.loads.pop(result.job_id)
            if not result.success:
                self.release_blocks(req)
                self._recompute(req)
                return
            self.report.bytes_loaded += result.transfer_size or 0
            if req.expedited:
                self.report.expedited_loads += 1
            else:
                self.report.async_loads += 1
            self.ready.append(req)  # its KV is on the GPU: the next forward may read it

    def _recompute(self, req: Request) -> None:
        self.report.recomputed += 1
        if req in self.parked:
            self.parked.remove(req)
        self.free_chunks.extend(req.chunks)
        req.chunks = []
        self.waiting.append(req)

    def _stored(self, req: Request) -> bool:
        return not any(r is req for r in self.stores.values())

    @property
    def busy(self) -> bool:
        return bool(self.deferred_stores or self.stores or self.loads or self.parked or self.ready)

    def run(self, requests: list[Request], per_step: int, timeout: float = 60.0) -> StepLoopReport:
        self.waiting = list(requests)
        step = 0
        deadline = time.monotonic() + timeout
        while self.waiting or self.busy:
            arrivals, self.waiting = self.waiting[:per_step], self.waiting[per_step:]
            done_before = self.report.prefilled + self.report.verified
            self.step(step, arrivals)
            step += 1
            if self.report.prefilled + self.report.verified == done_before:
                # Nothing to compute: only transfers are outstanding. A real engine would be
                # running other requests' forward passes here; the toy just takes a breath.
                self.report.idle_steps += 1
                time.sleep(0.001)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the step loop made no progress in {timeout} s: {self.worker!r}")
        self.report.steps = step
        return self.report


def main(
    num_requests: int = 32,
    num_layers: int = 4,
    num_gpu_blocks: int = 24,
    per_step: int = 3,
    device: str | None = None,
) -> StepLoopReport:
    """Run the loop until every request was prefilled, evicted, resumed and verified."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Poison the whole cache with random bytes, so a missed copy cannot pass as zeros.
    layers = [torch.randn(2, num_gpu_blocks, *KV_PAGE, device=device) for _ in range(num_layers)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    num_chunks = 4 * num_gpu_blocks
    worker = SyncOffloadingWorker(kv, num_cpu_chunks=num_chunks)
    requests = [Request(rid, num_blocks=1 + rid % 4, expedited=rid % 2 == 0) for rid in range(num_requests)]
    try:
        report = Engine(worker, layers, num_chunks).run(requests, per_step)
    finally:
        worker.shutdown()
        worker.get_finished()
    print(
        f"{report.steps} steps ({report.idle_steps} idle): "
        f"{report.verified}/{num_requests} requests restored and verified "
        f"({report.expedited_loads} expedited, {report.async_loads} async loads, {report.stores} stores, "
        f"{report.reuse_waits} waits before block reuse, {report.recomputed} recomputed)"
    )
    return report


if __name__ == "__main__":
    main()
