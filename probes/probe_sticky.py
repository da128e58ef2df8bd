"""Timeline of driver return codes around a sticky device assert while a store waits.

Run on the GPU machine from the repo root: python3 probes/probe_sticky.py (device run 1).
Note: this is the version that poisoned on the legacy default stream, which the host waited
on (see docs/performance.md); the GPU test uses the corrected scenario.
"""

import sys
import time

import torch
from cuda.bindings import driver as cu

from aiokv import CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec
from aiokv.core import OffloadCore
from aiokv.specs import Direction

mode = sys.argv[1] if len(sys.argv) > 1 else "after"
t = [torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16, device="cuda")]
kv = CanonicalKVCaches.from_tensors(t, block_dim=1)
core = OffloadCore(kv, num_cpu_chunks=8, backend="cuda")
ref = torch.cat([t[0][0, 1].reshape(-1).view(torch.uint8), t[0][1, 1].reshape(-1).view(torch.uint8)]).cpu()
drv = core.backend.driver
idx = torch.tensor([100], device="cuda")
small = torch.zeros(4, device="cuda")
side = torch.cuda.Stream()
torch.cuda.synchronize()
T0 = time.perf_counter()


def now():
    return f"{(time.perf_counter() - T0) * 1e3:8.2f} ms"


if mode == "after":
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)
    job = core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), after=side)
else:  # a big copy in flight, no dependency
    job = core.submit(Direction.STORE, 1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
print(now(), "submitted", flush=True)
torch.cuda._sleep(100_000_000)
small.index_select(0, idx)
print(now(), "poison enqueued", flush=True)
comp = job.completion
done = comp._events.done
lane_stream = core.handlers[Direction.STORE].lane.stream if hasattr(core, "handlers") else None
probe_ev = drv.create_event()
probe_st = drv.create_stream()
last = None
end = time.perf_counter() + 3.0
while time.perf_counter() < end:
    codes = (
        ("evq_done", int(cu.cuEventQuery(done)[0])),
        ("streamq_side", int(cu.cuStreamQuery(cu.CUstream(side.cuda_stream))[0])),
        ("rec_probe", int(cu.cuEventRecord(probe_ev, probe_st)[0])),
        ("evq_probe", int(cu.cuEventQuery(probe_ev)[0])),
        ("streamq_probe", int(cu.cuStreamQuery(probe_st)[0])),
        ("ctx_flags", int(cu.cuCtxGetFlags()[0])),
    )
    if codes != last:
        print(now(), " ".join(f"{k}={v}" for k, v in codes), flush=True)
        last = codes
    time.sleep(0.002)
pool = core.pool.tensor[core.layout.chunk_bytes : core.layout.chunk_bytes + ref.numel()]
print(now(), "data landed:", bool(torch.equal(pool, ref)), "pool nonzero:", bool(pool.any()))
print(now(), "cuStreamSynchronize(probe)", int(cu.cuStreamSynchronize(probe_st)[0]))
print(now(), "cuCtxSynchronize", int(cu.cuCtxSynchronize()[0]))
print(now(), "completion.query()", comp.query(), "error", repr(comp.error)[:200])
