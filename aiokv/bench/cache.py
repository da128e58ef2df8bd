"""``aiokv bench cache``: prefix-cache hit rates on request traces, beside the offline optimum.

Per trace and capacity it replays the trace through a real ``OffloadCache`` (``replay.py``)
with the chosen policy and with LRU, and puts each hit rate beside the offline optimum
(Belady's rule, which sees the future; a reference rather than a strict ceiling, as it
optimises single blocks, not leading runs) computed in the same run, so the ratio column
reads "fraction of optimum". Then it drives a slice of each trace through a cache on an
``AsyncOffloadingWorker`` of larger blocks (CUDA when usable, else the CPU backend) for the
restore latency and throughput.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import numpy as np
import torch

from ..cache.offload import DEFAULT_POLICY, OffloadCache
from ..cache.policies import make_policy
from ..layout import CanonicalKVCaches
from ..worker import AsyncOffloadingWorker
from .replay import replay_cache
from .report import BenchRow
from .trace import FULL_TRACES, Request, belady_hit_rate, load_trace, simulate

__all__ = ["DEFAULT_CAPACITIES", "find_traces", "run_cache_bench"]

DEFAULT_CAPACITIES = (2000, 8000, 32000)
QUICK_REQUESTS = 3000
"""``--quick`` replays this many leading requests of each trace."""
FACE_REQUESTS = 2000
FACE_REQUESTS_QUICK = 300
"""Requests of each trace driven through a real OffloadCache (the simulator does the rest)."""
FACE_LAYERS, FACE_PAGE = 8, (16, 4, 32)
"""Small KV blocks for the face: 8 layers of 4 KiB bf16 K and V pages, 64 KiB a block."""

Progress = Callable[[str], None]


def _search_dirs() -> list[Path]:
    repo = Path(__file__).resolve().parents[2]
    cwd = Path.cwd()
    dirs = []
    if env := os.environ.get("AIOKV_TRACE_DIR"):
        dirs.append(Path(env))
    for base in (repo, cwd):
        dirs += [base.parent / "shared" / "data" / "mooncake", base / "shared" / "data" / "mooncake",
                 base / "data" / "mooncake"]
    return list(dict.fromkeys(dirs))


def find_traces(paths: Sequence[str | os.PathLike[str]] | None = None) -> list[Path]:
    """The trace files to replay: ``paths`` (files, or folders of ``*.jsonl``), else the
    Mooncake traces in $AIOKV_TRACE_DIR or ``../shared/data/mooncake`` beside the repo or the
    current directory. Raises FileNotFoundError saying what to pass."""
    if paths:
        found: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                files = sorted(p.glob("*.jsonl"))
                if not files:
                    raise FileNotFoundError(f"no *.jsonl trace in folder {p}; pass --trace FILE")
                found += files
            elif p.is_file():
                found.append(p)
            else:
                raise FileNotFoundError(
                    f"trace not found: {p}; pass --trace PATH to a Mooncake JSON-lines file"
                )
        return found
    searched = _search_dirs()
    for d in searched:
        files = sorted(d.glob("*.jsonl")) if d.is_dir() else []
        if files:
            return files
    where = ", ".join(str(d) for d in searched)
    raise FileNotFoundError(
        f"no Mooncake traces found (looked in {where}); pass --trace PATH (repeatable) "
        "or set AIOKV_TRACE_DIR to the folder holding conversation_trace.jsonl and synthetic_trace.jsonl "
        f"(download them from {FULL_TRACES})"
    )


def run_cache_bench(
    traces: Sequence[str | os.PathLike[str]] | None = None,
    capacities: Sequence[int] | None = None,
    policy: str | None = None,
    quick: bool = False,
    progress: Progress | None = None,
) -> list[BenchRow]:
    """Hit rates (policy, LRU, offline optimum) per trace and capacity, and the face's
    restore latency and GB/s on a slice of each trace."""
    say = progress or (lambda _msg: None)
    paths = find_traces(traces)
    caps = list(capacities or DEFAULT_CAPACITIES)
    if any(int(c) != c or c < 1 for c in caps):
        raise ValueError(f"capacities must be positive block counts, got {caps}")
    name = DEFAULT_POLICY if policy is None else policy
    make_policy(name, 1)  # unknown names fail now, with the list of known ones
    limit = QUICK_REQUESTS if quick else None
    rows: list[BenchRow] = []
    labels = [p.stem.removesuffix("_trace") for p in paths]
    for path, label in zip(paths, labels):
        trace = load_trace(path, limit)
        if not trace:
            raise ValueError(f"trace {path} has no requests")
        if labels.count(label) > 1:  # two folders' traces of one name: keep their sections apart
            label = f"{path.parent.name}/{label}"
        refs = sum(len(r.hash_ids) for r in trace)
        distinct = len({k for r in trace for k in r.hash_ids})
        unbounded = simulate(trace, max(1, distinct), "lru")
        say(f"{label}: {len(trace):,} requests, {refs:,} block references, {distinct:,} distinct blocks"
            f"{' (quick: a prefix)' if quick else ''}")
        rows += _hit_rate_rows(trace, label, caps, name, unbounded, say)
        face_n = FACE_REQUESTS_QUICK if quick else FACE_REQUESTS
        rows += _face_rows(trace[:face_n], label, min(caps), name, say)
    return rows


def _hit_rate_rows(
    trace: list[Request], label: str, caps: list[int], policy: str, unbounded: float, say: Progress
) -> list[BenchRow]:
    section = f"cache hit rate: {label}, real cache (reference: offline optimum, Belady's rule)"
    policy = policy.lower()  # names are case-insensitive: "LRU" must not replay LRU twice
    rows: list[BenchRow] = []
    distinct = len({k for r in trace for k in r.hash_ids})
    for cap in caps:
        t0 = time.perf_counter()
        opt = belady_hit_rate(trace, cap)
        # A pool larger than the trace's distinct blocks evicts nothing more: the same hits
        # without a pool sized for a capacity the trace never fills.
        chunks = min(cap, max(1, distinct))
        lru = anyio.run(partial(replay_cache, trace, chunks, policy="lru"))
        chosen = lru if policy == "lru" else anyio.run(partial(replay_cache, trace, chunks, policy=policy))
        wrong = lru.wrong_blocks + (chosen.wrong_blocks if chosen is not lru else 0)
        if lru.hit_rate:
            vs = f"{chosen.hit_rate / lru.hit_rate:.2f}x LRU"
        else:
            vs = "LRU had no hits" + ("" if chosen.hit_rate else ", nor this policy")
        extra = {"capacity": cap, "optimum": opt, "lru": lru.hit_rate, "unbounded": unbounded}
        if policy != "lru":
            rows.append(BenchRow(
                section, f"{policy} @ {cap:,} blocks", chosen.hit_rate * 100, "%", opt * 100,
                note=f"{vs}; unbounded {unbounded:.1%}"
                     + (f"; WRONG BYTES in {wrong} blocks" if wrong else ""),
                extra={**extra, "hit_rate": chosen.hit_rate, "evictions": chosen.evictions,
                       "rejected_by_admission": chosen.rejected_by_admission}, failed=wrong > 0,
            ))
        rows.append(BenchRow(
            section, f"lru @ {cap:,} blocks", lru.hit_rate * 100, "%", opt * 100,
            note="baseline" + (f"; unbounded {unbounded:.1%}" if policy == "lru" else ""),
            extra={**extra, "hit_rate": lru.hit_rate, "evictions": lru.evictions}, failed=wrong > 0,
        ))
        say(f"{label} @ {cap:,} blocks: {policy} {chosen.hit_rate:.3f}, lru {lru.hit_rate:.3f}, "
            f"optimum {opt:.3f} ({time.perf_counter() - t0:.1f}s)")
    return rows


# -- the face: a real cache on a real worker --------------------------------------------


@dataclass
class _FaceRun:
    backend: str
    hits: int
    references: int
    latencies: list[float]
    restored_blocks: int
    wrong_blocks: int
    load_bytes: int
    load_seconds: float
    store_bytes: int
    store_seconds: float
    load_ceiling: float
    store_ceiling: float


def _face_rows(trace: list[Request], label: str, capacity: int, policy: str, say: Progress) -> list[BenchRow]:
    from ..backends import cuda_usable

    device = "cuda" if cuda_usable() else "cpu"
    say(f"{label}: first {len(trace)} requests through OffloadCache({policy}) at {capacity:,} blocks "
        f"on the {device} backend")
    run = anyio.run(_drive_face, trace, capacity, policy, device)
    sim = simulate(trace, capacity, policy)
    opt = belady_hit_rate(trace, capacity)
    section = f"cache face: {label}, {len(trace)} requests @ {capacity:,} blocks ({run.backend})"
    hit = run.hits / run.references if run.references else 0.0
    lat = np.asarray(run.latencies) * 1e6 if run.latencies else np.zeros(1)
    n = len(run.latencies)
    blocks = run.restored_blocks / n if n else 0.0
    check = "bytes verified" if run.wrong_blocks == 0 else f"WRONG BYTES in {run.wrong_blocks} blocks"
    e2e = run.load_bytes / sum(run.latencies) / 1e9 if run.latencies else 0.0
    rows = [
        BenchRow(section, "hit rate through the face", hit * 100, "%", opt * 100,
                 note=f"simulator {sim:.1%}; {check}" + ("" if n else "; nothing was restored"),
                 extra={"simulator": sim}, failed=run.wrong_blocks > 0),
    ]
    if n:  # no restore, no latency to show (zeros would read as measured)
        rows += [
            BenchRow(section, "restore latency p50", float(np.percentile(lat, 50)), "us",
                     note=f"{n} restores, {blocks:.1f} blocks ({blocks * _block_bytes() / 1e6:.2f} MB) mean"),
            BenchRow(section, "restore latency p99", float(np.percentile(lat, 99)), "us"),
            BenchRow(section, "restore GB/s (copy time)", _gbps(run.load_bytes, run.load_seconds), "GB/s",
                     run.load_ceiling, note="ceiling: one contiguous copy of a mean restore's bytes"),
            BenchRow(section, "restore GB/s (await to return)", e2e, "GB/s", run.load_ceiling,
                     note="includes submit, queueing and wake-up"),
        ]
    rows.append(BenchRow(section, "offload GB/s (copy time)", _gbps(run.store_bytes, run.store_seconds),
                         "GB/s", run.store_ceiling,
                         note="ceiling: one contiguous copy of a mean offload's bytes"))
    latency = "no restores"
    if n:
        latency = f"restore p50 {np.percentile(lat, 50):.0f} us, p99 {np.percentile(lat, 99):.0f} us"
    say(f"{label}: face hit rate {hit:.3f} (simulator {sim:.3f}), {latency}; {check}")
    return rows


def _block_bytes() -> int:
    return FACE_LAYERS * 2 * int(np.prod(FACE_PAGE)) * 2


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


async def _drive_face(trace: list[Request], capacity: int, policy: str, device: str) -> _FaceRun:
    """Serve the requests one after another: look up, restore the leading hits (and check a
    stamp in every restored block), "compute" the rest, offload the whole prefix."""
    width = max(len(r.hash_ids) for r in trace)
    layers = [torch.zeros(2, width, *FACE_PAGE, dtype=torch.bfloat16, device=device)
              for _ in range(FACE_LAYERS)]
    stamp = layers[0].view(torch.int16)[0, :, 0, 0, :2]  # two int16 per block hold its key
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    latencies: list[float] = []
    hits = refs = restored = wrong = stores = 0
    # A pool larger than the slice's distinct blocks evicts nothing more: the same hits, without
    # a host pool sized for a capacity the slice never fills (1,000,000 blocks is 65 GB).
    distinct = len({k for r in trace for k in r.hash_ids})
    chunks = max(1, min(capacity, distinct))
    async with AsyncOffloadingWorker(kv, num_cpu_chunks=chunks, backend=device) as worker:
        cache = OffloadCache(worker, policy=policy)
        for req in trace:
            keys = list(req.hash_ids)
            refs += len(keys)
            n = cache.lookup(keys)
            if n:
                stamp[:n] = -1
                t0 = time.perf_counter()
                ok = await cache.restore(keys[:n], np.arange(n))
                latencies.append(time.perf_counter() - t0)
                if ok:
                    hits += n
                    restored += n
                    wrong += int((stamp[:n].cpu() != _stamps(keys[:n])).any(dim=1).sum())
            stamp[n : len(keys)] = _stamps(keys[n:]).to(device)
            stores += (await cache.offload(keys, np.arange(len(keys)))).stored > 0
        st = cache.stats()
        # Each ceiling at its own mean job size: small copies run far below large ones.
        mean_load = max(_block_bytes(), int(st.load_bytes / max(1, len(latencies))))
        mean_store = max(_block_bytes(), int(st.store_bytes / max(1, stores)))
        load_ceiling = _contiguous_gbps(worker.host_pool, mean_load, device)[0]
        store_ceiling = _contiguous_gbps(worker.host_pool, mean_store, device)[1]
    return _FaceRun(device, hits, refs, latencies, restored, wrong, st.load_bytes, st.load_seconds,
                    st.store_bytes, st.store_seconds, load_ceiling, store_ceiling)


def _stamps(keys: Sequence[int]) -> torch.Tensor:
    k = torch.tensor(keys, dtype=torch.int64)
    return torch.stack([k & 0x7FFF, k >> 15], dim=1).to(torch.int16)


def _contiguous_gbps(pool: torch.Tensor, nbytes: int, device: str, reps: int = 15) -> tuple[float, float]:
    """Best GB/s of one contiguous copy of ``nbytes`` between the host pool and the device.

    On the CPU backend the copy is a numpy slice assignment, as the CPU lane's copies are
    (torch's threaded CPU copy is erratic for small sizes on a busy host).
    """
    nbytes = min(nbytes, pool.numel())
    if device == "cuda":
        host = pool[:nbytes]
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def load() -> None:
            dev.copy_(host, non_blocking=True)

        def store() -> None:
            host.copy_(dev, non_blocking=True)
    else:
        host_np = pool[:nbytes].numpy()
        # Written, not zeros: pages never touched read faster, which inflated a ceiling.
        dev_np = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)

        def load() -> None:
            dev_np[:] = host_np

        def store() -> None:
            host_np[:] = dev_np

    def best(copy: Callable[[], None]) -> float:
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    return best(load), best(store)
