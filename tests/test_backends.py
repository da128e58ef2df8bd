"""Backend selection (``aiokv.backends``): a name it does not know, or CUDA where none is
usable, is ``InvalidSpec`` when the worker is built."""

from __future__ import annotations

import pytest
import torch

from aiokv import AsyncOffloadingWorker, InvalidSpec
from tests.conftest import make_layers


def test_constructor_rejects_unknown_and_unusable_backends() -> None:
    kv = make_layers(num_blocks=8)
    with pytest.raises(InvalidSpec, match="backend must be"):
        AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, backend="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidSpec, match="usable CUDA device"):
            AsyncOffloadingWorker(kv.kv, num_cpu_chunks=4, backend="cuda")
