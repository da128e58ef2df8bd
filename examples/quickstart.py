"""Quickstart: offload KV blocks to host memory, clobber them on the device, load them back.

Runs on a GPU when there is one and on the CPU backend otherwise (``backend="auto"``
follows where the KV tensors live). ``python examples/quickstart.py``
"""

from __future__ import annotations

import anyio
import torch

from aiokv import AsyncOffloadingWorker, CanonicalKVCaches, CPULoadStoreSpec, GPULoadStoreSpec


async def run(num_layers: int = 4, num_blocks: int = 64, device: str | None = None) -> int:
    """Store four blocks, overwrite them, load them back; return the bytes verified."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = (2, num_blocks, 16, 8, 64)  # K/V, block, tokens per block, heads, head_dim
    layers = [torch.randn(shape, dtype=torch.float16, device=device) for _ in range(num_layers)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    blocks, chunks = [3, 4, 5, 9], [0, 1, 2, 3]
    expected = [layer[:, blocks].clone() for layer in layers]

    async with AsyncOffloadingWorker(kv, num_cpu_chunks=16) as worker:
        stored = await worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
        for layer in layers:  # the blocks are reused by someone else...
            layer[:, blocks] = torch.randn_like(layer[:, blocks])
        await worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))  # ...and restored

    assert all(torch.equal(layer[:, blocks], want) for layer, want in zip(layers, expected, strict=True))
    print(f"{worker.backend}: stored and restored {stored.transfer_size} bytes, verified")
    return stored.transfer_size or 0


def main(num_layers: int = 4, num_blocks: int = 64, device: str | None = None) -> int:
    return anyio.run(run, num_layers, num_blocks, device)


if __name__ == "__main__":
    main()
