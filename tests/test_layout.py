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
        ([torch.randn(4, 8).t()], 0, "not contiguous"),
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
