"""The transfer vocabulary as a worker reads it: job ids and ``expedited`` as the types they
claim (numpy's too, never bools), specs read by attribute (an engine's own classes work),
and a spec on the wrong side refused by what its class says it describes."""

from __future__ import annotations

import numpy as np
import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidSpec,
)
from tests.conftest import make_layers, same_bytes

pytestmark = pytest.mark.anyio


class Spec:
    """An engine's own spec object: only attributes matter."""

    def __init__(self, block_ids, group_sizes=None, block_indices=None) -> None:
        self.block_ids = block_ids
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@pytest.mark.parametrize("job_id", [[1], "1", 1.0, True, None])
async def test_a_job_id_that_is_no_int_is_invalid_spec(job_id) -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(job_id, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_load(job_id, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]))
        assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}


@pytest.mark.parametrize("expedited", ["no", 1, None])
async def test_expedited_must_be_a_bool(expedited) -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        with pytest.raises(InvalidSpec, match="expedited must be a bool"):
            worker.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]), expedited=expedited)
        assert (await worker.submit_load(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([1]),
                                         expedited=np.bool_(True))).success
        assert worker.statistics().completed == {"store": 0, "load": 0, "expedited_load": 1}


async def test_foreign_spec_objects_with_numpy_int32_ids_work() -> None:
    kv = make_layers(num_blocks=8)
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4) as worker:
        want = kv.kv.tensors[0].tensor[[6, 7]].clone()
        src = Spec(np.array([6, 7], dtype=np.int32), group_sizes=[2], block_indices=[0])
        assert (await worker.submit_store(1, src, Spec(np.array([3, 0], dtype=np.int32)))).success
        kv.kv.tensors[0].tensor[[6, 7]] = 0
        await worker.submit_load(2, Spec(np.array([3, 0], dtype=np.int32)), Spec(np.array([6, 7], np.int32)))
        assert same_bytes(kv.kv.tensors[0].tensor[[6, 7]], want)


class CPULoadStoreSpecLike:
    """An engine's host spec (vLLM names its classes so): ids by attribute."""

    def __init__(self, ids: list[int]) -> None:
        self.block_ids = np.asarray(ids, dtype=np.int32)


class GPULoadStoreSpecLike(CPULoadStoreSpecLike):
    pass


@pytest.mark.parametrize("ours", [True, False], ids=["ours", "engine's"])
async def test_specs_swapped_between_source_and_destination_are_refused(ours: bool) -> None:
    """A store given (CPU spec, GPU spec) used to copy host chunks 0, 1 into blocks 3, 7."""
    gpu_spec, cpu_spec = (GPULoadStoreSpec, CPULoadStoreSpec) if ours else (GPULoadStoreSpecLike,
                                                                            CPULoadStoreSpecLike)
    kv = make_layers(num_blocks=8)
    before = [t.clone() for t in kv.layers]
    async with AsyncOffloadingWorker(kv.kv, num_cpu_chunks=8) as worker:
        with pytest.raises(InvalidSpec, match="swapped"):
            worker.submit_store(1, cpu_spec([0, 1]), gpu_spec([3, 7]))
        with pytest.raises(InvalidSpec, match=r"GPU side of a load got a CPULoadStoreSpec"):
            worker.submit_load(2, cpu_spec([0, 1]), cpu_spec([3, 7]))
        with pytest.raises(InvalidSpec, match=r"CPU side of a expedited_load got a GPU"):
            worker.submit_load(3, gpu_spec([0, 1]), gpu_spec([3, 7]), expedited=True)
        assert worker.statistics().in_flight == {"store": 0, "load": 0, "expedited_load": 0}
        assert (await worker.submit_store(1, gpu_spec([3, 7]), cpu_spec([0, 1]))).success
        assert (await worker.submit_load(2, cpu_spec([0, 1]), gpu_spec([4, 5]))).success
    assert all(same_bytes(a[:, :4], b[:, :4]) and same_bytes(a[:, 6:], b[:, 6:])
               for a, b in zip(kv.layers, before))
    assert all(same_bytes(a[:, 4:6], b[:, [3, 7]]) for a, b in zip(kv.layers, before))


async def test_numpy_integer_job_ids_and_sizes_are_accepted_bools_are_not() -> None:
    kv = make_layers(num_blocks=8)
    worker = AsyncOffloadingWorker(kv.kv, num_cpu_chunks=np.int64(8), blocks_per_chunk=np.int32(1),
                                   options={"max_in_flight": np.int64(4)})
    assert type(worker.num_cpu_chunks) is int and worker.num_cpu_chunks == 8
    assert AsyncOffloadingWorker(kv.kv, cpu_bytes=np.uint64(3 * worker.chunk_bytes + 1)).num_cpu_chunks == 3
    async with worker:
        fut = worker.submit_store(np.int64(5), GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        result = await fut
        assert result.job_id == 5 and type(result.job_id) is int and fut.job_id == 5
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(True, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(np.bool_(True), GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
        with pytest.raises(InvalidSpec, match="job_id must be an int"):
            worker.submit_store(5.0, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    with pytest.raises(InvalidSpec, match="positive int"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=np.float64(8))
