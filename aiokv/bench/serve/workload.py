"""The requests a serve run replays: a Mooncake trace turned into tokens, or prefix repetition.

A Mooncake request names its prompt as ``hash_ids``, one per 512-token block, where equal
leading ids mean an equal prefix. Each id becomes ``block_tokens`` tokens drawn from a
generator seeded by the id, so equal prefixes give equal tokens and the KV cache keys
(chained hashes of each 16-token block, as a prefix cache computes them) match exactly
where the trace says the prompts share a prefix. Timestamps are divided by a compression
factor; the first ``warmup`` requests only fill the caches.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass

import numpy as np

from ..trace import load_trace  # Mooncake traces load as the cache bench loads them
from .model import BLOCK_TOKENS

__all__ = ["ServeRequest", "Workload", "block_keys", "describe", "prefix_workload", "reuse_distances",
           "trace_workload"]

TRACE_BLOCK_TOKENS = 512
"""Tokens behind one Mooncake hash id."""


@dataclass
class ServeRequest:
    """One prompt: its tokens, its full blocks' cache keys and when it arrives."""

    index: int
    tokens: np.ndarray
    keys: list[int]
    trace_ms: float
    warm: bool
    reusable: int = 0  # leading tokens some earlier request computed (any cache could hold)
    arrival: float = 0.0  # seconds after the measured part starts, once compressed

    @property
    def cacheable_blocks(self) -> int:
        """Leading blocks a cache may serve: full blocks, leaving at least the last token
        to compute (its logits give the first output token)."""
        return min(len(self.keys), (len(self.tokens) - 1) // BLOCK_TOKENS)


@dataclass
class Workload:
    """Requests in arrival order, the warm-up ones first."""

    name: str
    requests: list[ServeRequest]

    @property
    def warm(self) -> list[ServeRequest]:
        return [r for r in self.requests if r.warm]

    @property
    def measured(self) -> list[ServeRequest]:
        return [r for r in self.requests if not r.warm]

    def compress(self, factor: float) -> None:
        """Arrivals of the measured part: trace time since its first request, / ``factor``."""
        if not factor > 0:
            raise ValueError(f"the compression factor must be > 0, got {factor}")
        measured = self.measured
        t0 = measured[0].trace_ms if measured else 0.0
        for r in measured:
            r.arrival = (r.trace_ms - t0) / 1000.0 / factor

    @property
    def span_seconds(self) -> float:
        """Trace seconds from the first to the last measured arrival (uncompressed)."""
        measured = self.measured
        return (measured[-1].trace_ms - measured[0].trace_ms) / 1000.0 if measured else 0.0

    def segments(self, count: int) -> list[list[ServeRequest]]:
        """The measured requests cut into ``count`` runs of consecutive arrivals, as even
        as can be (fewer if there are fewer requests)."""
        measured = self.measured
        bounds = np.linspace(0, len(measured), min(count, len(measured)) + 1).round().astype(int)
        return [measured[a:b] for a, b in itertools.pairwise(bounds)]

    def max_blocks(self) -> int:
        return max(-(-len(r.tokens) // BLOCK_TOKENS) for r in self.requests)


def reuse_distances(workload: Workload) -> np.ndarray:
    """LRU stack distance of every block a prefix cache could serve to a measured request
    (a leading block some earlier request had): the distinct blocks used since its last
    use, which is the capacity an LRU cache needs to still hold it."""
    refs = [(k, not r.warm and i < r.reusable // BLOCK_TOKENS) for r in workload.requests
            for i, k in enumerate(r.keys)]
    tree = [0] * (len(refs) + 1)  # a Fenwick tree over time: 1 where a key was last used

    def add(i: int, delta: int) -> None:
        i += 1
        while i < len(tree):
            tree[i] += delta
            i += i & -i

    def prefix(i: int) -> int:  # marks at times < i
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    out = []
    for t, (key, wanted) in enumerate(refs):
        before = last.get(key)
        if before is not None:
            if wanted:
                out.append(prefix(t) - prefix(before + 1))
            add(before, -1)
        add(t, 1)
        last[key] = t
    return np.asarray(out, dtype=np.int64)


def block_keys(tokens: np.ndarray) -> list[int]:
    """One key per full 16-token block: a hash of the previous key and the block's tokens,
    so a key names its whole prefix (63-bit ints: stable across processes and tiers)."""
    keys: list[int] = []
    prev = b""
    data = np.ascontiguousarray(tokens, dtype=np.int32)
    for i in range(len(data) // BLOCK_TOKENS):
        digest = hashlib.blake2b(prev + data[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].tobytes(),
                                 digest_size=8).digest()
        keys.append(int.from_bytes(digest, "little") >> 1)
        prev = digest
    return keys


def _finish(name: str, requests: list[ServeRequest]) -> Workload:
    """Mark each request's reusable prefix: the leading keys some earlier request had."""
    seen: set[int] = set()
    for r in requests:
        run = 0
        for key in r.keys[: r.cacheable_blocks]:
            if key not in seen:
                break
            run += 1
        r.reusable = run * BLOCK_TOKENS
        seen.update(r.keys)
    if not any(not r.warm for r in requests):
        raise ValueError("the workload has no measured request: give more requests than warm-up ones")
    return Workload(name, requests)


def trace_workload(path: str | os.PathLike[str], *, requests: int, warmup: int, block_tokens: int,
                   max_tokens: int, vocab: int, seed: int = 0) -> Workload:
    """The first ``warmup + requests`` requests of a Mooncake trace (the first ``warmup``
    only fill the caches), each 512-token hash block scaled to ``block_tokens`` tokens and
    the prompt cut at ``max_tokens``."""
    if block_tokens < 1 or max_tokens < 2 or requests < 1 or warmup < 0:
        raise ValueError(f"need block_tokens >= 1, max_tokens >= 2, requests >= 1 and warmup >= 0 "
                         f"(got {block_tokens}, {max_tokens}, {requests}, {warmup})")
    trace = load_trace(path, warmup + requests)
    if not trace:
        raise ValueError(f"trace {path} has no requests")
    blocks: dict[int, np.ndarray] = {}

    def tokens_of(hash_id: int) -> np.ndarray:
        if hash_id not in blocks:
            rng = np.random.default_rng([seed, int(hash_id)])
            blocks[hash_id] = rng.integers(0, vocab, block_tokens, dtype=np.int32)
        return blocks[hash_id]

    out: list[ServeRequest] = []
    for i, req in enumerate(trace):
        if not req.hash_ids:
            continue
        length = -(-req.input_length * block_tokens // TRACE_BLOCK_TOKENS)
        length = max(2, min(length, len(req.hash_ids) * block_tokens, max_tokens))
        need = -(-length // block_tokens)
        tokens = np.concatenate([tokens_of(h) for h in req.hash_ids[:need]])[:length]
        out.append(ServeRequest(i, tokens, block_keys(tokens), float(req.timestamp), warm=i < warmup))
    name = os.path.basename(os.fspath(path)).removesuffix(".jsonl").removesuffix("_trace")
    return _finish(name, out)


def prefix_workload(*, prefixes: int, prefix_tokens: int, suffix_tokens: int, requests: int,
                    warmup: int, vocab: int, seed: int = 0) -> Workload:
    """Prefix repetition (as vLLM's ``prefix_repetition`` dataset): ``prefixes`` long shared
    prefixes, each request one of them (drawn at random) and a short suffix of its own;
    Poisson arrivals at one a second of trace time, before compression. The warm-up
    requests are one per prefix (then ``warmup`` more at random)."""
    if prefixes < 1 or prefix_tokens < 1 or suffix_tokens < 1 or requests < 1 or warmup < 0:
        raise ValueError("prefix repetition needs positive prefixes, token counts and requests")
    rng = np.random.default_rng(seed)
    heads = [np.random.default_rng([seed, 1, p]).integers(0, vocab, prefix_tokens, dtype=np.int32)
             for p in range(prefixes)]
    choice = [*range(prefixes)] + list(rng.integers(0, prefixes, warmup + requests))
    gaps = rng.exponential(1000.0, len(choice))
    out: list[ServeRequest] = []
    t = 0.0
    for i, p in enumerate(choice):
        t += float(gaps[i])
        tail = np.random.default_rng([seed, 2, i]).integers(0, vocab, suffix_tokens, dtype=np.int32)
        tokens = np.concatenate([heads[int(p)], tail])
        out.append(ServeRequest(i, tokens, block_keys(tokens), t, warm=i < prefixes + warmup))
    return _finish("prefix repetition", out)


def describe(workload: Workload) -> str:
    """One line: request counts and prompt lengths of the measured part."""
    lengths = np.array([len(r.tokens) for r in workload.measured])
    reuse = sum(r.reusable for r in workload.measured) / max(1, int(lengths.sum()))
    return (f"{workload.name}: {len(workload.warm)} warm-up + {len(lengths)} measured requests, "
            f"prompt tokens mean {lengths.mean():.0f}, p50 {np.percentile(lengths, 50):.0f}, "
            f"max {lengths.max()}; {reuse:.0%} of prompt tokens reusable")

