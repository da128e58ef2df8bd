"""What one Redis value is to ``RedisTier``: the codec header then the payload, checked
before a payload counts as a hit. Pure functions, no I/O: they run on the tier's worker
threads or its loop, on replies its client fetched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import codec

__all__ = ["CORRUPT", "FAILED", "HIT", "MISS", "check_landed", "encode_headers",
           "encode_values", "groups_of", "land_replies", "verified"]

HIT, MISS, CORRUPT, FAILED = 0, 1, 2, 3
"""Per-key outcomes of a read (small ints: threads fill one shared list)."""


def groups_of(sizes: Sequence[int], group_bytes: int) -> list[list[int]]:
    """Indices cut into round trips of at most ``group_bytes`` (at least one key each)."""
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if current and total + size > group_bytes:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        groups.append(current)
    return groups


def verified(fingerprint: bytes, key: bytes, header: bytes | bytearray | memoryview,
             payload: memoryview) -> bool:
    """``codec.verify`` with ``checksum`` for the payload (same checks, same answer)."""
    parsed = codec.parse_header(memoryview(header))
    return (
        parsed is not None
        and parsed.size == len(header)
        and parsed.matches(fingerprint)
        and parsed.key == bytes(key)
        and parsed.payload_len == len(payload)
        and codec.checksum(payload) == parsed.crc
    )


def check_landed(fingerprint: bytes, keys: Sequence[bytes], views: Sequence[memoryview],
                 group: Sequence[int], landed: Sequence[object], status: list[int],
                 wrong_length: object) -> list[object]:
    """Verify payloads that ``redis_wire.read_into`` put in the caller's buffers, setting
    ``status``; the per-command errors met (e.g. NOAUTH), for the failure log."""
    errors: list[object] = []
    for i, reply in zip(group, landed):
        if reply is None:
            status[i] = MISS
        elif isinstance(reply, bytearray):
            status[i] = HIT if verified(fingerprint, keys[i], reply, views[i]) else CORRUPT
        elif reply is wrong_length:
            status[i] = CORRUPT
        else:
            status[i] = FAILED
            errors.append(reply)
    return errors


def land_replies(fingerprint: bytes, keys: Sequence[bytes], views: Sequence[memoryview],
                 group: Sequence[int], replies: Sequence[object], status: list[int]) -> list[object]:
    """Verify whole GET replies (the asyncio client's) and copy each payload into its
    buffer, setting ``status``; the per-command errors met."""
    errors: list[object] = []
    for i, reply in zip(group, replies):
        if reply is None:
            status[i] = MISS
        elif not isinstance(reply, bytes):
            status[i] = FAILED  # a per-command error (e.g. WRONGTYPE)
            errors.append(reply)
        else:
            value = memoryview(reply)
            size = codec.header_size(keys[i])
            payload = value[size:]
            if (len(value) == size + len(views[i])
                    and verified(fingerprint, keys[i], value[:size], payload)):
                # numpy copies without the GIL (a memoryview assignment holds it throughout)
                np.copyto(np.frombuffer(views[i], dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))
                status[i] = HIT
            else:
                status[i] = CORRUPT
    return errors


def encode_headers(fingerprint: bytes, keys: Sequence[bytes], views: Sequence[memoryview],
                   group: Sequence[int]) -> list[bytes]:
    """The header of each value of a group (the thread client sends the payload as is)."""
    return [codec.encode(fingerprint, keys[j], views[j], crc=codec.checksum(views[j])) for j in group]


def encode_values(fingerprint: bytes, keys: Sequence[bytes], views: Sequence[memoryview],
                  group: Sequence[int]) -> list[bytes]:
    """Header + payload as one value per key (the asyncio client sends whole values)."""
    return [b"".join((header, views[j]))
            for header, j in zip(encode_headers(fingerprint, keys, views, group), group)]

