"""Mooncake request traces, and offline replays of them through ``ChunkManager`` (the host
policy alone, and Belady's offline reference) for ``aiokv bench cache``.

A trace is JSON lines with ``timestamp``, ``input_length``, ``output_length`` and
``hash_ids`` (one id per 512-token prefix block). The replay scores a cache the way a prefix
cache is used: a request is served from its first block up to the first miss, and every
block of it is offered for storing after the lookup.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cache.admission import AdmissionPolicy
from ..cache.manager import ChunkManager
from ..cache.policies import EvictionPolicy

__all__ = ["FULL_TRACES", "PACKAGED_TRACE", "Request", "SimResult", "belady_hit_rate", "load_trace",
           "replay", "simulate"]

FULL_TRACES = "https://github.com/kvcache-ai/Mooncake/tree/main/FAST25-release/traces"
"""Where the full Mooncake traces are published (Apache-2.0)."""
PACKAGED_TRACE = Path(__file__).parent / "data" / "conversation_first400.jsonl"
"""The first 400 requests of Mooncake's conversation trace, shipped in the package (with its
licence and source in data/README.md) so ``aiokv bench serve --quick`` runs anywhere."""


@dataclass(frozen=True)
class Request:
    """One traced request."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class SimResult:
    """What a replay counted; ``hit_rate`` is leading hits over all block references."""

    hits: int
    references: int
    rejected_by_admission: int
    evictions: int
    refused_requests: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.references if self.references else 0.0


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSON-lines trace (the first ``limit`` requests if given)."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(
                    Request(
                        int(row.get("timestamp", 0)),
                        int(row.get("input_length", 0)),
                        int(row.get("output_length", 0)),
                        tuple(row["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                what = "no hash_ids" if isinstance(exc, KeyError) else exc
                raise ValueError(f"{path}, line {number}: not a Mooncake request ({what})") from exc
    return out


def _blocks(trace: Iterable[Request | Sequence[Hashable]]) -> Iterable[Sequence[Hashable]]:
    for req in trace:
        yield req.hash_ids if isinstance(req, Request) else req


def replay(
    trace: Iterable[Request | Sequence[Hashable]],
    capacity: int,
    policy: str | EvictionPolicy = "lru",
    admission: str | AdmissionPolicy | None = None,
) -> SimResult:
    """Replay ``trace`` (requests or plain key lists) through a ChunkManager of ``capacity``.

    Per request: count leading hits and touch them; then offer every block for storing and
    complete the store at once. Requests whose admitted blocks cannot fit store nothing.
    """
    mgr = ChunkManager(capacity, policy=policy, admission=admission)
    hits = refs = refused = 0
    for keys in _blocks(trace):
        refs += len(keys)
        n = mgr.count_leading_hits(keys)
        if n:
            hits += n
            mgr.touch(keys[:n])
        plan = mgr.prepare_store(keys)
        if plan is None:
            refused += 1
        elif plan.keys_to_store:
            mgr.complete_store(plan.keys_to_store, success=True)
        mgr.take_events()
    st = mgr.stats()
    return SimResult(hits, refs, st.rejected_by_admission, st.evictions, refused)


def simulate(
    trace: Iterable[Request | Sequence[Hashable]],
    capacity: int,
    policy: str | EvictionPolicy = "lru",
    admission: str | AdmissionPolicy | None = None,
) -> float:
    """Hit rate (leading hits / block references) of ``replay``."""
    return replay(trace, capacity, policy, admission).hit_rate


def belady_hit_rate(trace: Iterable[Request | Sequence[Hashable]], capacity: int) -> float:
    """An offline reference (Belady's rule): on a miss, keep the keys used again soonest.

    A block not held is stored only if it is used again sooner than the held block used
    latest (bypass otherwise). Among blocks next used by the same request, the one deepest
    in the request it was last seen in goes first: only leading hits count, so a request's
    first blocks are worth more than its last. Not a strict ceiling, for the same reason:
    Belady's rule optimises hits on single blocks, not runs of leading ones.
    """
    reqs = [list(k) for k in _blocks(trace)]
    never = len(reqs)
    # next_use[i][j]: index of the next request that references reqs[i][j] (or ``never``).
    next_use: list[list[int]] = [[] for _ in reqs]
    seen: dict[Hashable, int] = {}
    for i in range(len(reqs) - 1, -1, -1):
        row = next_use[i]
        for key in reqs[i]:
            row.append(seen.get(key, never))
        for key in reqs[i]:
            seen[key] = i
    held: dict[Hashable, int] = {}  # key -> its next use
    heap: list[tuple[int, int, int, Hashable]] = []  # (-next use, -depth, tick, key); lazy deletion
    hits = refs = tick = 0
    for i, keys in enumerate(reqs):
        refs += len(keys)
        for key in keys:
            if key not in held:
                break
            hits += 1
        for depth, (key, nxt) in enumerate(zip(keys, next_use[i])):
            tick += 1
            if key in held:
                held[key] = nxt
                heapq.heappush(heap, (-nxt, -depth, tick, key))
                continue
            if nxt >= never:
                continue
            if len(held) >= capacity:
                while heap and held.get(heap[0][3]) != -heap[0][0]:
                    heapq.heappop(heap)
                if not heap or -heap[0][0] <= nxt:
                    continue
                victim = heapq.heappop(heap)[3]
                del held[victim]
            held[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, tick, key))
    return hits / refs if refs else 0.0
