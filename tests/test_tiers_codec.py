"""The tier value codec: stable keys, fingerprints, and headers that refuse foreign or torn values."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from aiokv.cache.tiers import codec
from aiokv.errors import InvalidSpec

FP = codec.layout_fingerprint(block_bytes=4096, page_sizes=[1024] * 4, dtypes=["torch.bfloat16"],
                              num_layers=4, block_size=16)


def value(key: bytes, payload: bytes, fp: bytes = FP) -> tuple[bytes, bytes]:
    return codec.encode(fp, key, payload), payload


def test_round_trip_verifies_random_payloads() -> None:
    rng = np.random.default_rng(7)
    for size in (1, 4096, 65537):
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        key = codec.key_bytes(("req", int(rng.integers(1 << 62))))
        header = codec.encode(FP, key, payload)
        assert len(header) == codec.header_size(key)
        assert codec.verify(FP, key, header, memoryview(payload))
        parsed = codec.parse_header(header + payload)
        assert parsed is not None and parsed.key == key and parsed.payload_len == size
        assert parsed.size == len(header) and parsed.matches(FP)


def test_foreign_values_do_not_verify() -> None:
    payload = os.urandom(4096)
    key = codec.key_bytes(12345)
    header = codec.encode(FP, key, payload)
    other_fp = codec.layout_fingerprint(block_bytes=4096, page_sizes=[1024] * 4,
                                        dtypes=["torch.float16"], num_layers=4, block_size=16)
    assert other_fp != FP
    assert not codec.verify(other_fp, key, header, payload)  # another layout
    assert not codec.verify(codec.namespaced(FP, "tenant-b"), key, header, payload)  # namespace
    assert not codec.verify(FP, codec.key_bytes(12346), header, payload)  # another key
    assert not codec.verify(FP, key, header, payload[:-1])  # truncated payload
    assert not codec.verify(FP, key, header, payload + b"\0")  # longer payload
    flipped = bytearray(payload)
    flipped[1234] ^= 0x10
    assert not codec.verify(FP, key, header, bytes(flipped))  # checksum


def test_namespaces_are_distinct_and_empty_namespace_is_none() -> None:
    a, b = codec.namespaced(FP, "a"), codec.namespaced(FP, b"b")
    assert len({a, b, FP}) == 3
    assert codec.namespaced(FP, None) == codec.namespaced(FP, "") == FP
    payload = os.urandom(100)
    assert codec.verify(a, b"k", codec.encode(a, b"k", payload), payload)
    assert not codec.verify(b, b"k", codec.encode(a, b"k", payload), payload)


def test_truncated_or_torn_headers_do_not_parse() -> None:
    key = codec.key_bytes(b"\x01" * 40)
    payload = os.urandom(512)
    header = codec.encode(FP, key, payload)
    for cut in (0, 3, codec.HEADER_FIXED_BYTES - 1, codec.HEADER_FIXED_BYTES, len(header) - 1):
        assert codec.parse_header(header[:cut]) is None
        assert not codec.verify(FP, key, header[:cut], payload)
    for at in range(0, len(header), 5):  # any flipped header byte is caught
        torn = bytearray(header)
        torn[at] ^= 0x01
        assert not codec.verify(FP, key, bytes(torn), payload), at
    assert not codec.verify(FP, key, header + b"x", payload)


def test_key_bytes_are_stable_and_equal_keys_agree() -> None:
    assert codec.key_bytes(1) == codec.key_bytes(True) == codec.key_bytes(np.int64(1))
    keys = [0, -1, 1 << 70, -(1 << 70), b"", b"ab", "ab", "é", (1, b"x", ("y", 2)), (), ((),)]
    encoded = [codec.key_bytes(k) for k in keys]
    assert len(set(encoded)) == len(keys)  # distinct keys, distinct bytes
    assert codec.key_bytes(("ab",)) != codec.key_bytes(("a", "b"))
    # Another process (its own hash seed) derives the same bytes.
    code = ("from aiokv.cache.tiers import codec; "
            "print(codec.key_bytes((1, b'x', ('y', 2), 'é')).hex())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out == codec.key_bytes((1, b"x", ("y", 2), "é")).hex()


@pytest.mark.parametrize("bad", [1.5, None, object(), [1, 2], frozenset({1})])
def test_key_bytes_refuses_keys_without_stable_bytes(bad: object) -> None:
    with pytest.raises(InvalidSpec, match="int, bytes, str"):
        codec.key_bytes((1, bad))


def test_fingerprint_input_checks() -> None:
    with pytest.raises(InvalidSpec):
        codec.layout_fingerprint(block_bytes=0)
    with pytest.raises(InvalidSpec, match="fingerprint"):
        codec.encode(b"short", b"k", b"payload")
    assert len(FP) == codec.FINGERPRINT_BYTES
    assert FP == codec.layout_fingerprint(block_bytes=4096, page_sizes=[1024] * 4,
                                          dtypes=["torch.bfloat16"], num_layers=4, block_size=16)


def test_the_fast_checksum_is_zlibs_crc32(monkeypatch: pytest.MonkeyPatch) -> None:
    """ISA-L's crc32 (when installed) gives zlib's value on random data of many lengths and
    views, so values either one wrote verify under the other; without ISA-L the codec uses
    zlib's."""
    import random
    import sys
    import zlib

    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    assert codec._pick_crc32() is codec._zlib_crc32
    monkeypatch.undo()

    rng = random.Random(5)
    for size in (0, 1, 7, 64, 4095, 1 << 16, (1 << 20) + 3):
        data = rng.randbytes(size)
        assert codec.checksum(data) == zlib.crc32(data) & 0xFFFFFFFF
        assert codec.checksum(memoryview(bytearray(data))[1:]) == zlib.crc32(data[1:]) & 0xFFFFFFFF


def test_stored_keys_are_the_key_or_a_marked_digest() -> None:
    short, long_ = b"k" * codec.INLINE_KEY_BYTES, b"k" * (codec.INLINE_KEY_BYTES + 1)
    assert codec.stored_key(short) == short
    digest = codec.stored_key(long_)
    assert digest != long_ and len(digest) < 64 and codec.stored_key(long_) == digest
    assert codec.stored_key(long_ + b"x") != digest
    # A short key that copies a digest is digested itself: it never poses as the long key.
    assert codec.stored_key(digest) not in (digest, long_)
    assert codec.header_size(digest) <= 4096
    assert codec.stored_keys([short, long_]) == [short, digest]
    with pytest.raises(InvalidSpec):
        codec.stored_keys(["text"])  # type: ignore[list-item]
    with pytest.raises(InvalidSpec):
        codec.encode(FP, long_, b"payload")  # raw long keys go through stored_key first


def test_the_default_fingerprint_sees_dtype_and_page_shape() -> None:
    import torch

    from aiokv.layout import CanonicalKVCaches
    from aiokv.plan import HostLayout

    def fp(dtype: torch.dtype, page: tuple[int, ...], block_dim: int = 1) -> bytes:
        layers = [torch.zeros(2, 4, *page, dtype=dtype) for _ in range(2)]
        kv = CanonicalKVCaches.from_tensors(layers, block_dim)
        return codec.default_fingerprint(HostLayout.build(kv, 1))

    base = fp(torch.bfloat16, (16, 8, 64))
    assert base == fp(torch.bfloat16, (16, 8, 64))
    assert base != fp(torch.float16, (16, 8, 64))  # same bytes, another dtype
    assert base != fp(torch.bfloat16, (32, 4, 64))  # same bytes, another block size
    assert base != fp(torch.bfloat16, (8, 16, 64))  # HND instead of NHD
    # A description of raw bytes (vLLM's) has no formats: sizes only, as before.
    kv = CanonicalKVCaches.from_tensors([torch.zeros(2, 4, 16 * 8 * 64 * 2, dtype=torch.uint8)], 1)
    for t in kv.tensors:
        t.page_format = ""
    raw = HostLayout.build(kv, 1)
    size = 16 * 8 * 64 * 2
    assert codec.default_fingerprint(raw) == codec.layout_fingerprint(block_bytes=2 * size,
                                                                      page_sizes=[size, size])
