"""The bench's job shapes, for probes that rerun its rows (from ``aiokv.bench.cuda``)."""

import torch

from aiokv.bench import cuda as b


def two_mib(dev: torch.device) -> b._Setup:
    """One cross-layer tensor, 128 random blocks of 2 MiB per job."""
    kv = torch.randn(b.BLOCKS, b.LAYERS, 2, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    return b._Setup("2 MiB", [kv], block_dim=0, chunks=b.CHUNKS // 2, seed=2)


def one_alloc(dev: torch.device) -> b._Setup:
    """32 layer views of one allocation: each block's pages sit at one pitch."""
    layers = torch.randn(b.LAYERS, 2, b.BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device=dev)
    return b._Setup("32K one-alloc", list(layers.unbind(0)), block_dim=1, chunks=b.CHUNKS, seed=1)


def per_layer(dev: torch.device) -> b._Setup:
    """One tensor per layer, as most engines allocate: one copy per 32 KiB page."""
    shape = (2, b.BLOCKS, 16, 8, 128)
    tensors = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(b.LAYERS)]
    return b._Setup("32K per-layer", tensors, block_dim=1, chunks=b.CHUNKS, seed=1)
