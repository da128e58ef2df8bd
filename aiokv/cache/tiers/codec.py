"""Bytes on the wire and on disk: stable keys, layout fingerprints and the value header.

Every value a tier stores is ``header + payload``. The header names what the payload is
(the layout fingerprint and the full key) and how long it is, with a checksum of the
payload, so a value written for another layout, namespace or key, or one torn by a crash
mid-write, never verifies and is read as a miss instead of as wrong KV bytes::

    offset size  field
    0      4     magic b"AKVT"
    4      1     version (1)
    5      3     zero
    8      16    tag: blake2b-128 of the fingerprint (the tier's namespace folded in)
    24     4     key length K (little endian)
    28     8     payload length
    36     4     crc32 of the payload
    40     4     crc32 of bytes 0..39 and the key (a torn header fails here)
    44     K     the key

crc32 guards against tearing and truncation, not against an adversary: tiers that other
parties can write to must be trusted stores (docs/tiers.md). zlib releases the GIL while it
sums a large payload, so it runs beside the event loop.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ...errors import InvalidSpec

__all__ = [
    "FINGERPRINT_BYTES",
    "HEADER_FIXED_BYTES",
    "INLINE_KEY_BYTES",
    "MAGIC",
    "VERSION",
    "Header",
    "checksum",
    "checksum_parts",
    "default_fingerprint",
    "encode",
    "header_size",
    "key_bytes",
    "layout_fingerprint",
    "namespaced",
    "parse_header",
    "stored_key",
    "stored_keys",
    "verify",
]

MAGIC = b"AKVT"
VERSION = 1
FINGERPRINT_BYTES = 16
_FIXED = struct.Struct("<4sB3x16sIQII")
HEADER_FIXED_BYTES = _FIXED.size
INLINE_KEY_BYTES = 1024
"""Longest key a header holds as it is; longer keys are stored by digest (``stored_key``),
so a header always fits one 4 KiB page however long the cache's keys are."""
_DIGEST_MARK = b"\x00aiokv-key-blake2b-256:"
_MAX_KEY = INLINE_KEY_BYTES


def layout_fingerprint(
    *,
    block_bytes: int,
    page_sizes: Sequence[int] = (),
    dtypes: Sequence[str] = (),
    num_layers: int = 0,
    block_size: int = 0,
    extra: bytes = b"",
) -> bytes:
    """A 16-byte digest naming one KV layout: blocks of two layouts never share a key space.

    Args:
        block_bytes: bytes of one block (all layers), the payload length every value has.
        page_sizes: bytes of one block in each KV tensor, in the layout's order.
        dtypes: the tensors' dtype names (e.g. ``"torch.bfloat16"``).
        num_layers: attention layers the block spans.
        block_size: tokens per block.
        extra: anything else that changes what the bytes mean (a model name, a quantisation).
    """
    if block_bytes <= 0:
        raise InvalidSpec(f"block_bytes must be positive, got {block_bytes}")
    parts = [b"aiokv-layout-1", str(int(block_bytes)).encode(),
             b",".join(str(int(p)).encode() for p in page_sizes),
             b",".join(str(d).encode() for d in dtypes),
             str(int(num_layers)).encode(), str(int(block_size)).encode(), bytes(extra)]
    return hashlib.blake2b(_frame(parts), digest_size=FINGERPRINT_BYTES).digest()


def default_fingerprint(host_layout: Any) -> bytes:
    """The fingerprint a cache uses when it is given none: its worker's pages (group 0) in
    order, each by its size and, where the worker was built from tensors
    (``CanonicalKVCaches.from_tensors``), by its dtype and page shape, which holds the tokens
    per block. So an fp16 and a bf16 model, or two block sizes of one model, never share
    blocks. A layout described as raw bytes (vLLM's) has no formats: pass a fingerprint
    that names the model, dtype and block size, or a tier ``namespace=``.

    Args:
        host_layout: the worker's ``HostLayout`` (``worker.host_layout``).
    """
    sizes = [int(p) for p in host_layout.page_sizes[0]]
    groups = getattr(host_layout, "page_formats", ())
    formats = list(groups[0]) if groups else []
    dtypes = formats if any(formats) else []
    return layout_fingerprint(block_bytes=sum(sizes), page_sizes=sizes, dtypes=dtypes)


def namespaced(fingerprint: bytes, namespace: str | bytes | None) -> bytes:
    """The fingerprint with a tenant's namespace folded in (unchanged for None or empty), so
    values of another namespace fail ``verify`` even if their key names collided."""
    if not namespace:
        return bytes(fingerprint)
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return bytes(fingerprint) + hashlib.blake2b(ns, digest_size=FINGERPRINT_BYTES).digest()


def key_bytes(key: object) -> bytes:
    """Stable bytes for a cache key, the same in every process and Python version (no
    ``hash()``, which is salted per process). Keys equal in Python get equal bytes.

    Accepts ints (bools as ints), bytes, str and tuples of those; numpy integers are read
    as ints. Raises ``InvalidSpec`` for anything else (a float or an object has no stable
    meaning across processes).
    """
    out = bytearray()
    _put_key(out, key, 0)
    return bytes(out)


def stored_key(key: bytes) -> bytes:
    """The key a tier names and verifies a block by: ``key`` itself, or for a key longer
    than ``INLINE_KEY_BYTES`` a marked 256-bit digest of it.

    A key that starts with the digest's marker is digested too, so no short key can pose
    as a long key's digest: two keys share a stored key only if blake2b-256 collides.
    """
    if len(key) <= INLINE_KEY_BYTES and not key.startswith(_DIGEST_MARK):
        return key
    return _DIGEST_MARK + hashlib.blake2b(key, digest_size=32).digest()


def stored_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``stored_key`` of each tier key; a key that is not ``bytes`` is misuse."""
    out = []
    for key in keys:
        if type(key) is not bytes:
            raise InvalidSpec(f"tier keys are bytes (codec.key_bytes), got {type(key).__name__}")
        out.append(stored_key(key))
    return out


def _zlib_crc32(payload: memoryview | bytes, value: int = 0) -> int:
    return zlib.crc32(payload, value) & 0xFFFFFFFF


def _pick_crc32() -> Callable[[memoryview | bytes, int], int]:
    """ISA-L's crc32 when installed (``isal``, in the ``redis`` and ``test`` extras), else zlib's.

    Both compute the same function; zlib's held buffered disk reads and Redis restores to a
    fraction of their ceilings, ISA-L's does not (docs/tiers.md, "Figures"). ISA-L is used
    only after it agreed with zlib on a probe, so a mismatch can never
    turn every stored value into a corrupt one.
    """
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return _zlib_crc32

    def fast(payload: memoryview | bytes, value: int = 0) -> int:
        return int(crc32(payload, value)) & 0xFFFFFFFF

    probe = bytes(range(256)) * 37 + b"aiokv"
    if (fast(probe) != _zlib_crc32(probe) or fast(probe[:1]) != _zlib_crc32(probe[:1])
            or fast(probe[7:], fast(probe[:7])) != _zlib_crc32(probe)):
        return _zlib_crc32
    return fast


_crc32 = _pick_crc32()


def checksum(payload: memoryview | bytes) -> int:
    """crc32 of the payload (the GIL is released for large buffers)."""
    return _crc32(payload, 0)


def checksum_parts(parts: Sequence[memoryview | bytes]) -> int:
    """``checksum`` of the parts' bytes one after another, without joining them: a block
    read straight into a host chunk lies in its pages, in portable order (``pages.py``)."""
    crc = 0
    for part in parts:
        crc = _crc32(part, crc)
    return crc


def header_size(key: bytes) -> int:
    """Bytes of the header that ``encode`` writes for ``key``."""
    return HEADER_FIXED_BYTES + len(key)


def encode(fingerprint: bytes, key: bytes, payload: memoryview | bytes, *, crc: int | None = None) -> bytes:
    """The header to store before ``payload`` under ``key``.

    Args:
        fingerprint: the tier's fingerprint (``namespaced(layout_fingerprint(...), ns)``).
        key: the stored key (``stored_key(key_bytes(cache_key))``).
        payload: the block's bytes.
        crc: the payload's ``checksum`` if the caller computed it already.
    """
    if len(key) > _MAX_KEY:
        raise InvalidSpec(f"a header holds keys of at most {_MAX_KEY} bytes, got {len(key)}; "
                          "pass codec.stored_key(key)")
    crc = checksum(payload) if crc is None else crc
    fixed = _FIXED.pack(MAGIC, VERSION, _tag(bytes(fingerprint)), len(key), _nbytes(payload), crc, 0)
    head = zlib.crc32(key, zlib.crc32(fixed[:-4])) & 0xFFFFFFFF
    return fixed[:-4] + struct.pack("<I", head) + bytes(key)


@dataclass(frozen=True)
class Header:
    """A parsed header: whose value it is and what the payload must be."""

    tag: bytes
    key: bytes
    payload_len: int
    crc: int
    size: int

    def matches(self, fingerprint: bytes) -> bool:
        """Whether the value was written for this (namespaced) fingerprint."""
        return self.tag == _tag(bytes(fingerprint))


def parse_header(data: memoryview | bytes) -> Header | None:
    """The header at the start of ``data``, or None if it is truncated or torn (bad magic,
    version, or header checksum). Disk tiers use it to rebuild their index at start."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_FIXED_BYTES:
        return None
    magic, version, tag, klen, plen, crc, head = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or klen > _MAX_KEY:
        return None
    end = HEADER_FIXED_BYTES + klen
    if len(view) < end:
        return None
    key = bytes(view[HEADER_FIXED_BYTES:end])
    if zlib.crc32(key, zlib.crc32(view[: HEADER_FIXED_BYTES - 4])) & 0xFFFFFFFF != head:
        return None
    return Header(tag, key, plen, crc, end)


def verify(fingerprint: bytes, key: bytes, header: memoryview | bytes,
           payload: memoryview | bytes) -> bool:
    """Whether ``header`` + ``payload`` is exactly the value ``encode`` made for this
    fingerprint and key: same layout and namespace, same key, full length, same checksum."""
    parsed = parse_header(header)
    return (
        parsed is not None
        and parsed.size == len(memoryview(header).cast("B"))
        and parsed.matches(fingerprint)
        and parsed.key == bytes(key)
        and parsed.payload_len == _nbytes(payload)
        and checksum(payload) == parsed.crc
    )


# -- internals --------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _tag(fingerprint: bytes) -> bytes:
    if len(fingerprint) < FINGERPRINT_BYTES:
        raise InvalidSpec(f"a tier fingerprint has at least {FINGERPRINT_BYTES} bytes, "
                          f"got {len(fingerprint)}; make it with codec.layout_fingerprint")
    return hashlib.blake2b(fingerprint, digest_size=16).digest()


def _nbytes(payload: memoryview | bytes) -> int:
    return memoryview(payload).nbytes


def _frame(parts: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _put_key(out: bytearray, key: object, depth: int) -> None:
    if depth > 32:
        raise InvalidSpec("cache keys nest tuples at most 32 deep")
    if isinstance(key, bytes):
        out += b"b" + struct.pack("<I", len(key)) + key
    elif isinstance(key, str):
        data = key.encode("utf-8", "surrogatepass")
        out += b"s" + struct.pack("<I", len(data)) + data
    elif isinstance(key, tuple):
        out += b"t" + struct.pack("<I", len(key))
        for item in key:
            _put_key(out, item, depth + 1)
    else:
        index = getattr(type(key), "__index__", None)
        if index is None or isinstance(key, float):
            raise InvalidSpec(
                f"a cache key stored in a lower tier must be an int, bytes, str or a tuple of "
                f"those (stable across processes); got {type(key).__name__}"
            )
        value = int(index(key))
        size = (value.bit_length() + 8) // 8
        out += b"i" + struct.pack("<I", size) + value.to_bytes(size, "little", signed=True)
