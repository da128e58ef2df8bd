"""The connector's plans, free of vLLM: a step's jobs merged into few aiokv jobs, and the
KV layers in forward order.

Why merge: per direction, aiokv runs jobs in submission order, so two layerwise loads of
one step would copy job A's every layer before job B's first, and the forward's gate on
layer 0 would wait for all of A. One job holding every request's blocks copies layer 0 of
all of them first. A job's spec lists blocks group by group (``group_sizes``), and the
host chunks in the same order, each group starting ``block_indices[g] % blocks_per_chunk``
sub-blocks into its first chunk; so specs concatenate per group as long as only the first
part of a group starts mid-chunk and only the last ends mid-chunk. Jobs that cannot join
get a merged job of their own.

Why a layer order: a layerwise job's layer ``i`` is ``ref_layers``' ``i``; gates and pushes
come in forward order, so layers are numbered that way (layers without per-layer hooks,
such as Mamba state, first: they are waited on before the forward starts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...specs import CPULoadStoreSpec, GPULoadStoreSpec

__all__ = ["Batch", "JobSpec", "LayerOrder", "layer_index", "layer_order", "merge_jobs"]


@dataclass(frozen=True)
class _Part:
    """One job's blocks in one group."""

    gpu: np.ndarray
    chunks: np.ndarray
    start: int  # the job's block_indices[g]
    head: bool  # starts mid-chunk: must come first in the group
    tail: bool  # ends mid-chunk: must come last


@dataclass(frozen=True)
class JobSpec:
    """One transfer job of vLLM's (its id and two sides), read once for merging.

    ``parts`` is None where the specs cannot be split by group (counts that do not add up:
    aiokv refuses the job when it is submitted on its own).
    """

    job_id: int
    gpu_spec: Any
    cpu_spec: Any
    blocks: np.ndarray  # every GPU block id of the job (failure attribution)
    parts: tuple[_Part | None, ...] | None

    @classmethod
    def read(
        cls, job_id: int, gpu_spec: Any, cpu_spec: Any, num_groups: int, blocks_per_chunk: int
    ) -> JobSpec:
        gpu = np.asarray(gpu_spec.block_ids, dtype=np.int64).reshape(-1)
        chunks = np.asarray(cpu_spec.block_ids, dtype=np.int64).reshape(-1)  # chunk ids (vLLM's name)
        sizes = _ints(getattr(gpu_spec, "group_sizes", None), [int(gpu.size)] if num_groups == 1 else None)
        starts = _ints(getattr(gpu_spec, "block_indices", None), [0] * num_groups)
        parts: list[_Part | None] | None = None
        if (sizes is not None and starts is not None and len(sizes) == len(starts) == num_groups
                and sum(sizes) == gpu.size and min(sizes + starts, default=0) >= 0):
            bpc = blocks_per_chunk
            skips = [s % bpc for s in starts]
            needed = [-(-(n + k) // bpc) if n else 0 for n, k in zip(sizes, skips)]
            if sum(needed) == chunks.size:
                parts = []
                b = c = 0
                for n, k, m, start in zip(sizes, skips, needed, starts):
                    parts.append(_Part(gpu[b:b + n], chunks[c:c + m], start, k != 0, (k + n) % bpc != 0)
                                 if n else None)
                    b, c = b + n, c + m
        return cls(job_id, gpu_spec, cpu_spec, gpu, tuple(parts) if parts is not None else None)


def _ints(values: Any, default: list[int] | None) -> list[int] | None:
    if values is None:
        return default
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        return None


@dataclass
class Batch:
    """One aiokv job standing for ``jobs`` (vLLM's), with the specs to submit."""

    jobs: list[JobSpec]
    gpu_spec: Any
    cpu_spec: Any

    @property
    def job_ids(self) -> list[int]:
        return [j.job_id for j in self.jobs]

    def failed_jobs(self, failed_blocks: Iterable[int] | None) -> set[int]:
        """vLLM's job ids among ``jobs`` that hold a failed block (all of them where the
        failed blocks are unknown, None)."""
        if failed_blocks is None:
            return set(self.job_ids)
        bad = np.fromiter(failed_blocks, dtype=np.int64)
        return {j.job_id for j in self.jobs if bad.size and np.isin(j.blocks, bad).any()}


@dataclass
class _Open:
    """A batch being filled: per group, its head part, middle parts and tail part."""

    num_groups: int
    jobs: list[JobSpec] = field(default_factory=list)
    heads: list[_Part | None] = field(default_factory=list)
    middles: list[list[_Part]] = field(default_factory=list)
    tails: list[_Part | None] = field(default_factory=list)
    sealed: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        g = self.num_groups
        self.heads, self.tails, self.sealed = [None] * g, [None] * g, [False] * g
        self.middles = [[] for _ in range(g)]

    def admits(self, job: JobSpec) -> bool:
        if job.parts is None or any(j.parts is None for j in self.jobs):
            return False
        for g, part in enumerate(job.parts):
            if part is None:
                continue
            empty = self.heads[g] is None and not self.middles[g] and self.tails[g] is None
            if self.sealed[g] or (part.head and part.tail and not empty):
                return False
            if (part.head and self.heads[g] is not None) or (part.tail and self.tails[g] is not None):
                return False
        return True

    def add(self, job: JobSpec) -> None:
        self.jobs.append(job)
        for g, part in enumerate(job.parts or ()):
            if part is None:
                continue
            if part.head:
                self.heads[g] = part
                self.sealed[g] = part.tail  # first and last at once: nothing else fits
            elif part.tail:
                self.tails[g] = part
            else:
                self.middles[g].append(part)

    def build(self) -> Batch:
        if len(self.jobs) == 1:  # as given: nothing to translate
            job = self.jobs[0]
            return Batch(self.jobs, job.gpu_spec, job.cpu_spec)
        gpu, chunks, sizes, starts = [], [], [], []
        for g in range(self.num_groups):
            head, tail = self.heads[g], self.tails[g]
            parts = ([head] if head else []) + self.middles[g] + ([tail] if tail else [])
            gpu += [p.gpu for p in parts]
            chunks += [p.chunks for p in parts]
            sizes.append(sum(int(p.gpu.size) for p in parts))
            starts.append(head.start if head else 0)
        return Batch(
            self.jobs,
            GPULoadStoreSpec(_cat(gpu), group_sizes=sizes, block_indices=starts),
            CPULoadStoreSpec(_cat(chunks)),
        )


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def merge_jobs(jobs: Sequence[JobSpec], num_groups: int) -> list[Batch]:
    """``jobs`` as few batches as their chunk boundaries allow (one where every job starts
    and ends on a chunk boundary, as every job does with one block per chunk). Jobs keep
    their order within a group, except that a part starting mid-chunk goes first and one
    ending mid-chunk last."""
    batches: list[_Open] = []
    for job in jobs:
        for batch in batches:
            if batch.admits(job):
                batch.add(job)
                break
        else:
            batch = _Open(num_groups)
            batch.add(job)
            batches.append(batch)
    return [b.build() for b in batches]


# -- layers ------------------------------------------------------------------------------

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(name: str) -> int | None:
    """The layer number in a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12), or
    None unless the name holds exactly one."""
    found = _INDEX.findall(name)
    return int(found[0]) if len(found) == 1 else None


@dataclass(frozen=True)
class LayerOrder:
    """aiokv's layer numbers for vLLM's layer names.

    Attributes:
        ref_layers: per KV-cache group, the layer of each of its layer names (the refs of
            vLLM's ``CanonicalKVCaches``, one per layer name).
        layer_of: layer name -> layer number.
        early: layers without per-layer hooks, numbered first: a load's are waited on
            before the forward starts.
        late_push: layers a store copies only once the step's forward is over: those
            without a save hook, and those whose save hook may come more than once a step.
    """

    ref_layers: list[list[int]]
    layer_of: dict[str, int]
    early: tuple[int, ...]
    late_push: frozenset[int]

    @property
    def num_layers(self) -> int:
        return len(set(self.layer_of.values()))


def layer_order(
    groups: Sequence[Sequence[str]],
    hooked: Callable[[str], bool],
    repeated: Callable[[str], bool] = lambda name: False,
) -> LayerOrder:
    """Number the layer names of ``groups``: names without per-layer hooks (``hooked``
    False) first, in group order; then hooked names by the layer number in their name
    (group order where a name has none). ``repeated`` names (a drafter's layers, run more
    than once per step) are stored only once the step's forward is over."""
    names = list(dict.fromkeys(n for group in groups for n in group))
    position = {n: i for i, n in enumerate(names)}
    plain = [n for n in names if not hooked(n)]
    with_hooks = [n for n in names if hooked(n)]
    numbers = {n: layer_index(n) for n in with_hooks}
    if all(v is not None for v in numbers.values()):
        with_hooks.sort(key=lambda n: (numbers[n], position[n]))
    order = plain + with_hooks
    layer_of = {n: i for i, n in enumerate(order)}
    late = frozenset(layer_of[n] for n in names if not hooked(n) or repeated(n))
    return LayerOrder(
        ref_layers=[[layer_of[n] for n in group] for group in groups],
        layer_of=layer_of,
        early=tuple(range(len(plain))),
        late_push=late,
    )
