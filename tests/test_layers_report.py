"""What a layerwise job reports on the CPU backend: a store's ``transfer_time`` is its
copies' time, not the gaps between pushes (``TransferResult``: "seconds the copies took"),
and ``LayerwiseJob``'s repr counts the layers that are done. Also: every bool flag of
``submit_*`` is checked the same way on both faces, with nothing enqueued."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from aiokv import (
    AsyncOffloadingWorker,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    InvalidSpec,
    LayerStatus,
    SyncOffloadingWorker,
)

from .conftest import make_layers

GAP = 0.2  # seconds the forward "computes" between two pushes


def test_a_layerwise_stores_time_is_its_copies_not_the_gaps_between_pushes() -> None:
    w = SyncOffloadingWorker(make_layers(num_layers=4).kv, num_cpu_chunks=8, backend="cpu")
    store = w.submit_store(1, GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 1]), layerwise=True)
    for layer in range(4):
        if layer:
            time.sleep(GAP)
        store.push(layer)
    w.wait([1])
    (result,) = w.get_finished()
    assert result.success and result.transfer_time is not None
    copies = [c._elapsed for c in store._run.layers]
    assert all(c is not None and c > 0 for c in copies)
    assert result.transfer_time == pytest.approx(sum(copies))  # type: ignore[arg-type]
    assert result.transfer_time < GAP, "the gaps between pushes were counted as copy time"
    # A layerwise load's layers run back to back: its time is their copies too.
    load = w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([5, 6]), layerwise=True)
    w.wait([2])
    (result,) = w.get_finished()
    copies = [c._elapsed for c in load._run.layers]
    assert result.transfer_time == pytest.approx(sum(copies))  # type: ignore[arg-type]
    w.shutdown()


def test_a_jobs_repr_counts_the_layers_done() -> None:
    w = SyncOffloadingWorker(make_layers(num_layers=4).kv, num_cpu_chunks=8, backend="cpu")
    store = w.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), layerwise=True)
    assert "layers=0/4 done" in repr(store)
    store.push(0)
    store.push(1)
    assert store.wait_layer(1, timeout=10) is LayerStatus.READY
    assert store.wait_layer(0, timeout=10) is LayerStatus.READY
    assert "layers=2/4 done" in repr(store)
    store.push(2)
    store.push(3)
    w.wait([1])
    load = w.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([3]), layerwise=True)
    for layer in range(4):
        assert load.gate(layer) is LayerStatus.READY  # a CPU gate returns once the layer is done
    assert "layers=4/4 done" in repr(load)
    w.wait([2])
    assert load.done() and "layers=4/4 done" in repr(load) and "layers=4/4 done" in repr(store)
    w.shutdown()


# -- bool flags -------------------------------------------------------------------------------

BAD_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("store", {"layerwise": "yes"}),
    ("store", {"layerwise": 1}),
    ("store", {"layerwise": None}),
    ("load", {"layerwise": "yes"}),
    ("load", {"layerwise": "no"}),
    ("load", {"expedited": "yes"}),
    ("load", {"expedited": 0}),
    ("load", {"expedited": True, "layerwise": "yes"}),
]


def _submit(w: Any, kind: str, job_id: int, flags: dict[str, Any]) -> Any:
    if kind == "store":
        return w.submit_store(job_id, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]), **flags)
    return w.submit_load(job_id, CPULoadStoreSpec([0]), GPULoadStoreSpec([2]), **flags)


@pytest.mark.parametrize(("kind", "flags"), BAD_FLAGS)
def test_the_sync_face_refuses_a_flag_that_is_no_bool_with_nothing_enqueued(kind: str,
                                                                           flags: dict[str, Any]) -> None:
    w = SyncOffloadingWorker(make_layers(num_layers=2).kv, num_cpu_chunks=8, backend="cpu")
    name = next(iter(k for k, v in flags.items() if not isinstance(v, bool)))
    with pytest.raises(InvalidSpec, match=f"{name} must be a bool"):
        _submit(w, kind, 1, flags)
    assert w.in_flight == 0 and w.statistics().layers.jobs == 0
    # numpy's bools are bools; the worker is still usable, the id still free.
    assert _submit(w, kind, 1, {k: np.bool_(False) for k in flags}) is True
    w.wait([1])
    assert [r.success for r in w.get_finished()] == [True]
    w.shutdown()


@pytest.mark.anyio
@pytest.mark.parametrize(("kind", "flags"), BAD_FLAGS)
async def test_the_async_face_refuses_a_flag_that_is_no_bool_with_nothing_enqueued(
    kind: str, flags: dict[str, Any],
) -> None:
    async with AsyncOffloadingWorker(make_layers(num_layers=2).kv, num_cpu_chunks=8, backend="cpu") as w:
        name = next(iter(k for k, v in flags.items() if not isinstance(v, bool)))
        with pytest.raises(InvalidSpec, match=f"{name} must be a bool"):
            _submit(w, kind, 1, flags)
        assert w.in_flight == 0 and w.statistics().layers.jobs == 0
        # numpy's bools are bools (a layerwise store would wait for pushes: not one here).
        good = {k: np.bool_(k == "expedited") for k in flags}
        assert (await _submit(w, kind, 1, good)).success
