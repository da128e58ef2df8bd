"""The connector's vLLM-free plans: merging a step's jobs, the layer order, its config."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv.errors import InvalidSpec
from aiokv.integrations.vllm.connector_config import SYNC_LOADS_UNBOUNDED, connector_extra_config
from aiokv.integrations.vllm.connector_jobs import JobSpec, layer_index, layer_order, merge_jobs
from aiokv.layout import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from aiokv.plan import HostLayout, map_blocks
from aiokv.specs import CPULoadStoreSpec, GPULoadStoreSpec

GROUPS = 2
BPC = 3
CHUNKS = 400


def _layout() -> HostLayout:
    import torch

    tensors = [CanonicalKVCacheTensor(torch.zeros(64, 32, dtype=torch.int8), 32) for _ in range(GROUPS)]
    refs = [[CanonicalKVCacheRef(g, 32)] for g in range(GROUPS)]
    return HostLayout.build(CanonicalKVCaches(tensors, refs), BPC)


def _pairs(gpu_spec, cpu_spec, layout) -> list[set[tuple[int, int]]]:
    mapping = map_blocks(gpu_spec.block_ids, cpu_spec.block_ids, layout=layout, num_chunks=CHUNKS,
                         group_sizes=gpu_spec.group_sizes, block_indices=gpu_spec.block_indices)
    return [set(zip(g.tolist(), h.tolist())) for g, h in zip(mapping.gpu_blocks, mapping.host_slots)]


def _random_jobs(rng, count: int, ragged: bool):
    """Jobs with distinct GPU blocks and chunks; ``ragged`` ones may start and end mid-chunk."""
    blocks = iter(rng.permutation(64 * GROUPS))
    chunks = iter(rng.permutation(CHUNKS))
    jobs = []
    for job_id in range(count):
        ids, sizes, starts, chunk_ids = [], [], [], []
        for _ in range(GROUPS):
            n = int(rng.integers(0, 7))
            skip = int(rng.integers(0, BPC)) if ragged else 0
            if not ragged:
                n -= n % BPC
            start = BPC * int(rng.integers(0, 4)) + skip
            ids += [next(blocks) % 64 for _ in range(n)]
            sizes.append(n)
            starts.append(start)
            chunk_ids += [next(chunks) for _ in range(-(-(n + skip) // BPC) if n else 0)]
        jobs.append(JobSpec.read(job_id, GPULoadStoreSpec(np.array(ids, dtype=np.int32), sizes, starts),
                                 CPULoadStoreSpec(np.array(chunk_ids, dtype=np.int32)), GROUPS, BPC))
    return jobs


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_merged_jobs_move_exactly_the_blocks_of_their_jobs(seed: int, ragged: bool) -> None:
    rng = np.random.default_rng(seed)
    layout = _layout()
    jobs = _random_jobs(rng, 8, ragged)
    batches = merge_jobs(jobs, GROUPS)
    assert sorted(j for b in batches for j in b.job_ids) == list(range(8))
    if not ragged:
        assert len(batches) == 1  # chunk-aligned jobs always merge into one
    for batch in batches:
        want = [set(), set()]
        for job in batch.jobs:
            for g, pairs in enumerate(_pairs(job.gpu_spec, job.cpu_spec, layout)):
                want[g] |= pairs
        assert _pairs(batch.gpu_spec, batch.cpu_spec, layout) == want


def test_a_job_that_starts_and_ends_mid_chunk_keeps_its_group_to_itself() -> None:
    def job(job_id: int, ids: list[int], start: int, chunks: list[int]) -> JobSpec:
        gpu = GPULoadStoreSpec(ids, [len(ids)], [start])
        return JobSpec.read(job_id, gpu, CPULoadStoreSpec(chunks), 1, BPC)

    both = job(0, [1], 1, [7])  # one block in the middle of chunk 7
    head = job(1, [2, 3], 1, [8])  # starts mid-chunk, ends on its boundary
    tail = job(2, [4], 0, [9])  # ends mid-chunk
    aligned = job(3, [5, 6, 10], 0, [11])
    batches = merge_jobs([both, head, tail, aligned], 1)
    assert [b.job_ids for b in batches] == [[0], [1, 2, 3]]
    merged = batches[1]
    assert list(merged.gpu_spec.block_ids) == [2, 3, 5, 6, 10, 4]  # head first, tail last
    assert list(merged.cpu_spec.block_ids) == [8, 11, 9] and merged.gpu_spec.block_indices == [1]


def test_specs_that_do_not_add_up_stay_alone_and_as_given() -> None:
    # Two blocks but one chunk:
    bad = JobSpec.read(0, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([5]), 1, 1)
    good = JobSpec.read(1, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([6]), 1, 1)
    batches = merge_jobs([bad, good], 1)
    assert [b.job_ids for b in batches] == [[0], [1]]
    assert batches[0].gpu_spec is bad.gpu_spec and batches[0].cpu_spec is bad.cpu_spec


def test_failures_are_pinned_on_the_jobs_whose_blocks_failed() -> None:
    a = JobSpec.read(0, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([5, 6]), 1, 1)
    b = JobSpec.read(1, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([7]), 1, 1)
    (batch,) = merge_jobs([a, b], 1)
    assert batch.failed_jobs({3}) == {1}
    assert batch.failed_jobs({2, 3}) == {0, 1}
    assert batch.failed_jobs(set()) == set()
    assert batch.failed_jobs(None) == {0, 1}  # unknown blocks: every job failed


def test_layer_numbers_are_read_from_vllms_names() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("layers.0") == 0
    assert layer_index("l3") is None  # no dotted number
    assert layer_index("model.layers.1.experts.2.attn") is None  # ambiguous


def test_layers_follow_the_forward_with_hookless_layers_first() -> None:
    attn = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 3)]
    mamba = ["model.layers.1.mixer"]
    drafter = "model.layers.4.self_attn.attn"
    order = layer_order([attn, mamba + [drafter]], hooked=lambda n: n.endswith("attn"),
                        repeated=lambda n: n == drafter)
    assert order.layer_of == {
        mamba[0]: 0, attn[1]: 1, attn[0]: 2, attn[2]: 3, drafter: 4,
    }
    assert order.ref_layers == [[2, 1, 3], [0, 4]]
    assert order.early == (0,) and order.late_push == {0, 4} and order.num_layers == 5


def test_layers_without_numbers_keep_group_order() -> None:
    order = layer_order([["b", "a"], ["c"]], hooked=lambda n: True)
    assert order.layer_of == {"b": 0, "a": 1, "c": 2} and order.early == ()


def test_the_connector_names_its_spec_and_loads_synchronously_by_default() -> None:
    extra = {"cpu_bytes_to_use": 1 << 30}
    out = connector_extra_config(extra)
    assert out == {**extra, "spec_name": "AiokvOffloadingSpec", "spec_module_path": "aiokv.integrations.vllm",
                   "sync_load_budget_bytes": SYNC_LOADS_UNBOUNDED}
    assert "spec_name" not in extra  # the caller's config is left alone
    assert connector_extra_config({"sync_load_budget_bytes": 4e9})["sync_load_budget_bytes"] == 4_000_000_000
    assert connector_extra_config({"spec_name": "AiokvOffloadingSpec"})["sync_load_budget_bytes"] > 0


@pytest.mark.parametrize(("extra", "match"), [
    ({"spec_name": "CPUOffloadingSpec"}, "spec_name='CPUOffloadingSpec'"),
    ({"spec_module_path": "x.y"}, "spec_module_path='x.y'"),
    ({"sync_load_budget_bytes": -1}, "sync_load_budget_bytes"),
    ({"sync_load_budget_bytes": "lots"}, "sync_load_budget_bytes"),
    ({"sync_load_budget_bytes": 1.5}, "sync_load_budget_bytes"),
    ({"sync_load_budget_bytes": True}, "sync_load_budget_bytes"),
    ({"aiokv_worker_options": {"max_in_flight": 8}}, "max_in_flight"),
])
def test_the_connector_refuses_another_spec_and_bad_budgets(extra, match) -> None:
    with pytest.raises(InvalidSpec, match=match):
        connector_extra_config(extra)
