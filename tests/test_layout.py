from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aiokv import CanonicalKVCaches, InvalidSpec


def test_kv_split_layout_makes_one_page_tensor_per_k_and_v() -> None:
    layers = [torch.randn(2, 10, 4, 8) for _ in range(3)]
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    assert len(kv.tensors) == 6 and len(kv.group_data_refs) == 1
    assert [r.tensor_idx for r in kv.group_data_refs[0]] == list(range(6))
    page = kv.tensors[3].tensor  # layer 1, V
    assert page.shape == (10, 4 * 8 * 4) and page.dtype == torch.uint8
    assert torch.equal(page[7], layers[1][1, 7].contiguous().view(torch.uint8).flatten())


def test_block_major_and_cross_layer_layouts_take_block_dim_0() -> None:
    cross = torch.randn(12, 5, 2, 16)  # (num_blocks, layers, ...)
    kv = CanonicalKVCaches.from_tensors([cross])
    assert len(kv.tensors) == 1 and kv.tensors[0].page_size_bytes == 5 * 2 * 16 * 4
    assert torch.equal(kv.tensors[0].tensor[11], cross[11].view(torch.uint8).flatten())


def test_rows_may_be_strided() -> None:
    # (num_blocks, 2, ...) with block_dim=0: K and V together form one page per block.
    t = torch.randn(6, 2, 3, 4)
    kv = CanonicalKVCaches.from_tensors([t], block_dim=0)
    assert kv.tensors[0].tensor.shape == (6, 2 * 3 * 4 * 4)


@pytest.mark.parametrize(
    "tensors, block_dim, message",
    [
        ([], 0, "at least one"),
        ([torch.randn(4, 8)], 1, "last dimension"),
        ([torch.randn(4, 8)], 3, "out of range"),
        ([torch.randn(4, 8).t()], 0, "not one dense range"),
        ([torch.randn(4, 8, 6)[:, :, :4]], 0, "not one dense range"),
        ([torch.randn(2, 0, 4)], 1, "empty"),
        (["not a tensor"], 0, "torch.Tensor"),
    ],
)
def test_bad_layouts_are_rejected_with_a_clear_message(tensors, block_dim, message) -> None:
    with pytest.raises(InvalidSpec, match=message):
        CanonicalKVCaches.from_tensors(tensors, block_dim=block_dim)


def test_an_engines_own_description_is_read_by_attribute() -> None:
    from types import SimpleNamespace

    from aiokv.core import OffloadCore

    t = torch.randint(0, 255, (8, 64), dtype=torch.uint8)
    foreign = SimpleNamespace(
        tensors=[SimpleNamespace(tensor=t, page_size_bytes=64)],
        group_data_refs=[[SimpleNamespace(tensor_idx=0, page_size_bytes=48)]],
    )
    kv = CanonicalKVCaches.coerce(foreign)
    assert kv.tensors[0].tensor is t and kv.group_data_refs[0][0].page_size_bytes == 48
    core = OffloadCore(foreign, num_cpu_chunks=2)
    assert core.layout.page_sizes == ((48,),)
    core.close()
    with pytest.raises(InvalidSpec, match="CanonicalKVCaches"):
        CanonicalKVCaches.coerce(object())


def test_leading_dimensions_are_split_without_copying() -> None:
    # (2, layers, blocks, page) made by a transpose: reshape would copy; unbind must not.
    base = torch.randn(4, 2, 6, 8)
    t = base.transpose(0, 1)
    kv = CanonicalKVCaches.from_tensors([t], block_dim=2)
    assert len(kv.tensors) == 8
    for page in kv.tensors:
        assert page.tensor.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    kv.tensors[5].tensor[3] = 7  # writes through to the caller's tensor: K/V 1, layer 1, block 3
    assert torch.equal(t[1, 1, 3].view(torch.uint8), torch.full((32,), 7, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.int8])
def test_one_byte_dtypes_round_trip_byte_exact_on_the_cpu_backend(dtype: torch.dtype) -> None:
    """fp8 KV caches (which numpy cannot hold) and bools (which it would convert) move as bytes,
    through from_tensors and through an engine's byte view of that dtype."""
    import anyio

    from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec

    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (2, 8, 4, 16), dtype=torch.uint8, generator=g)
    t = (raw % 2).bool() if dtype is torch.bool else raw.view(dtype)
    ours = CanonicalKVCaches.from_tensors([t], block_dim=1)
    engine = SimpleNamespace(  # an engine's own description, its byte views in the cache's dtype
        tensors=[SimpleNamespace(tensor=p.tensor.view(dtype), page_size_bytes=p.page_size_bytes)
                 for p in ours.tensors],
        group_data_refs=ours.group_data_refs,
    )

    async def round_trip(kv: object) -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu") as w:  # type: ignore[arg-type]
            await w.submit_store(1, GPULoadStoreSpec([0, 5]), CPULoadStoreSpec([0, 1]))
            await w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([2, 3]))

    for kv in (ours, engine):
        v = t.view(torch.uint8)
        v[:, 2:4] = 0
        anyio.run(round_trip, kv)
        assert torch.equal(v[:, 2], v[:, 0]) and torch.equal(v[:, 3], v[:, 5])


def test_overlapping_blocks_and_odd_inputs_are_invalid_spec() -> None:
    with pytest.raises(InvalidSpec, match="pages overlap"):
        CanonicalKVCaches.from_tensors([torch.zeros(1, 8).expand(4, 8)], block_dim=0)
    page = torch.zeros(2, 6).half().t()[:, :1]  # a one-element page whose stride is not 1
    assert CanonicalKVCaches.from_tensors([page], block_dim=0).tensors[0].page_size_bytes == 2
    gen = CanonicalKVCaches.from_tensors((t for t in [torch.zeros(4, 8)]), block_dim=0)
    assert len(gen.tensors) == 1
    for bad in ([SimpleNamespace(tensor=np.zeros((2, 2), np.uint8), page_size_bytes=2)],
                [SimpleNamespace(tensor=torch.zeros(2, 2, dtype=torch.uint8), page_size_bytes="x")]):
        with pytest.raises(InvalidSpec, match="kv_caches must be"):
            CanonicalKVCaches.coerce(SimpleNamespace(tensors=bad, group_data_refs=[]))


def test_a_permuted_view_of_dense_pages_moves_each_page_as_its_bytes() -> None:
    """An HND allocation (K/V, blocks, heads, tokens, dim) seen as NHD by the model: each
    block's page is still one dense range, so it is accepted and round-trips byte-exact."""
    import anyio

    from aiokv import AsyncOffloadingWorker, CPULoadStoreSpec, GPULoadStoreSpec

    g = torch.Generator().manual_seed(5)
    physical = torch.randint(0, 256, (2, 8, 4, 16, 8), dtype=torch.uint8, generator=g).view(torch.bfloat16)
    nhd = physical.permute(0, 1, 3, 2, 4)  # (2, blocks, tokens, heads, dim), not contiguous
    assert not nhd.is_contiguous()
    kv = CanonicalKVCaches.from_tensors([nhd], block_dim=1)
    assert [t.page_size_bytes for t in kv.tensors] == [4 * 16 * 4 * 2] * 2

    async def round_trip() -> None:
        async with AsyncOffloadingWorker(kv, num_cpu_chunks=4, backend="cpu") as w:
            await w.submit_store(1, GPULoadStoreSpec([1, 6]), CPULoadStoreSpec([0, 1]))
            await w.submit_load(2, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 4]))

    raw = physical.view(torch.uint8)
    raw[:, 3:5] = 0
    anyio.run(round_trip)
    assert torch.equal(raw[:, 3], raw[:, 1]) and torch.equal(raw[:, 4], raw[:, 6])
    assert torch.equal(nhd[:, 3].view(torch.int16), nhd[:, 1].view(torch.int16))  # the model's view too


def test_a_kv_split_without_block_dim_is_refused_not_read_as_two_blocks() -> None:
    """``(2, num_blocks, ...)`` with the old default ``block_dim=0`` moved K and V as two
    blocks of a cache of 2; the mistake surfaced later as a range error with no hint."""
    layers = [torch.randn(2, 16, 4, 8) for _ in range(3)]
    with pytest.raises(InvalidSpec, match=r"pass block_dim=1 for a \(2, num_blocks, \.\.\.\) K/V layout"):
        CanonicalKVCaches.from_tensors(layers)
    kv = CanonicalKVCaches.from_tensors(layers, block_dim=1)
    assert len(kv.tensors) == 6 and all(t.tensor.shape[0] == 16 for t in kv.tensors)
    two_blocks = CanonicalKVCaches.from_tensors(layers, block_dim=0)  # said out loud: 2 blocks
    assert all(t.tensor.shape[0] == 2 for t in two_blocks.tensors)
    # Without a 2 in front, the default is still dimension 0.
    assert CanonicalKVCaches.from_tensors([torch.randn(16, 4, 8)]).tensors[0].tensor.shape == (16, 128)


@pytest.mark.parametrize("bad", [1.0, "1", True, None.__class__])
def test_a_block_dim_that_is_no_int_is_invalid_spec(bad: object) -> None:
    with pytest.raises(InvalidSpec, match="block_dim must be an int"):
        CanonicalKVCaches.from_tensors([torch.randn(2, 16, 4)], block_dim=bad)  # type: ignore[arg-type]


def test_a_numpy_block_dim_is_accepted() -> None:
    kv = CanonicalKVCaches.from_tensors([torch.randn(2, 16, 4)], block_dim=np.int64(1))
    assert [t.tensor.shape for t in kv.tensors] == [(16, 16), (16, 16)]
