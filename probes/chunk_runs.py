"""How many host DMA runs the cache's jobs make: blocks per run of each store and load when
the Mooncake traces are replayed through ``ChunkManager``, with its free chunks handed out
lowest id first (the manager) or last freed first (a LIFO free list, the manager before
session 18). A run is a stretch of neighbouring chunks, counted in host order, as the
staged strategy plans a job; each run is one DMA descriptor, ~1 us of driver time.

Runs on CPU, no GPU needed: python3 probes/chunk_runs.py [trace dir, default ../shared/data/mooncake]
"""

import sys
from pathlib import Path

import numpy as np

from aiokv.cache.manager import ChunkManager
from aiokv.cache.offload import DEFAULT_POLICY
from aiokv.cache.trace import load_trace


class LifoChunkManager(ChunkManager):
    """The same manager with a LIFO free list."""

    def __init__(self, num_chunks: int, policy: str) -> None:
        super().__init__(num_chunks, policy=policy)
        self._free.reverse()

    def _take_chunks(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def _give_chunk(self, chunk: int) -> None:
        self._free.append(chunk)


def runs(chunks: list[int]) -> int:
    a = np.sort(np.asarray(chunks))
    return 1 + int((a[1:] != a[:-1] + 1).sum()) if a.size else 0


def replay(mgr: ChunkManager, path: Path) -> str:
    """Per request: load the leading hits, then store the rest (as ``trace.replay`` does)."""
    stored = store_runs = loaded = load_runs = hits = refs = 0
    for req in load_trace(path):
        keys = list(req.hash_ids)
        refs += len(keys)
        n = mgr.count_leading_hits(keys)
        if n:
            hits += n
            chunks = mgr.prepare_load(keys[:n])
            mgr.complete_load(keys[:n])
            loaded, load_runs = loaded + len(chunks), load_runs + runs(chunks)
        plan = mgr.prepare_store(keys)
        if plan is not None and plan.keys_to_store:
            stored, store_runs = stored + len(plan.chunk_ids), store_runs + runs(plan.chunk_ids)
            mgr.complete_store(plan.keys_to_store)
        mgr.take_events()
    return (f"stores {stored / max(store_runs, 1):5.2f} blocks/run, loads {loaded / max(load_runs, 1):5.2f}"
            f" blocks/run, hit rate {hits / refs:.3f}")


def main() -> None:
    default = Path(__file__).resolve().parents[2] / "shared/data/mooncake"
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    for path in sorted(folder.glob("*.jsonl")):
        for policy in ("lru", DEFAULT_POLICY):
            for capacity in (2000, 8000, 32000):
                for label, mgr in (("lowest first", ChunkManager(capacity, policy=policy)),
                                   ("LIFO", LifoChunkManager(capacity, policy))):
                    line = replay(mgr, path)
                    print(f"{path.stem:18} {policy:8} {capacity:6} chunks {label:12} {line}", flush=True)


if __name__ == "__main__":
    main()
