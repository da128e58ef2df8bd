"""GETs read straight into the caller's buffers, SETs sent straight from them (worker threads).

redis-py's parsers copy a large bulk reply several times (socket buffer, hiredis' buffer,
a new ``bytes``) before the tier checksums it and copies it once more into pinned host
memory; a SET joins header and payload and packs the command, two more copies. Here the
tier borrows a connection from redis-py's pool (which owns connecting, AUTH, TLS and the
timeouts) and speaks the few commands itself: a GET reply's header goes into a small
buffer and its payload with ``recv_into`` into the caller's view; a SET sends the header
and the caller's payload view as they are. The bytes cross user space once. Anything
unexpected drops the connection (the pool opens a fresh one next time) and raises, which
the tier counts as an error and a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = ["WRONG_LENGTH", "exist", "read_into", "write_from"]

WRONG_LENGTH = object()  # a value of another length: never this layout's block, a miss
_LINE_READ = 256


class _Reader:
    """Reads RESP from one socket, keeping what a line read took beyond the line."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.pending = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(_LINE_READ)
        if not chunk:
            raise RedisConnectionError("the Redis server closed the connection")
        self.pending += chunk

    def line(self) -> bytes:
        while True:
            end = self.pending.find(b"\r\n")
            if end >= 0:
                line = bytes(self.pending[:end])
                del self.pending[: end + 2]
                return line
            if len(self.pending) > 1 << 16:
                raise RedisConnectionError("a reply line without an end: not a RESP stream")
            self._fill()

    def into(self, view: memoryview) -> None:
        taken = min(len(self.pending), len(view))
        if taken:
            view[:taken] = self.pending[:taken]
            del self.pending[:taken]
        while taken < len(view):
            got = self.sock.recv_into(view[taken:])
            if got == 0:
                raise RedisConnectionError("the Redis server closed the connection mid-value")
            taken += got

    def skip(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
        while nbytes > 0:
            step = scratch[: min(nbytes, len(scratch))]
            self.into(step)
            nbytes -= len(step)


def read_into(client: Any, names: Sequence[bytes], header_sizes: Sequence[int],
              views: Sequence[memoryview]) -> list[object]:
    """Pipelined ``GET names[i]`` whose payloads land in ``views[i]``.

    Returns per key: None (absent), the header ``bytearray`` (the payload is in the view,
    still unverified), ``WRONG_LENGTH``, or a ``ResponseError`` (e.g. WRONGTYPE). Raises
    for connection trouble.
    """
    return _on_connection(client, lambda conn: _exchange(conn, names, header_sizes, views))


def write_from(client: Any, names: Sequence[bytes], headers: Sequence[bytes],
               payloads: Sequence[memoryview], ttl: int | None) -> list[object]:
    """Pipelined ``SET names[i] headers[i]+payloads[i] [EX ttl]``, sent from the caller's
    buffers as they are (no joined copy of header and payload, no packed command).

    Returns per key True or a ``ResponseError`` (e.g. OOM). Raises for connection trouble.
    """
    return _on_connection(client, lambda conn: _send_sets(conn, names, headers, payloads, ttl))


def exist(client: Any, names: Sequence[bytes]) -> list[object]:
    """Pipelined ``EXISTS names[i]``: per key True/False or a ``ResponseError``."""
    return _on_connection(client, lambda conn: _ask_exists(conn, names))


def _ask_exists(conn: Any, names: Sequence[bytes]) -> list[object]:
    conn.send_packed_command(conn.pack_commands([(b"EXISTS", name) for name in names]))
    reader = _Reader(_socket(conn))
    replies: list[object] = []
    for _ in names:
        line = reader.line()
        if line[:1] == b":":
            replies.append(int(line[1:]) == 1)
        elif line[:1] == b"-":
            replies.append(ResponseError(line[1:].decode(errors="replace")))
        else:
            raise RedisConnectionError(f"unexpected reply {line[:40]!r} to EXISTS")
    if reader.pending:
        raise RedisConnectionError("bytes after the last reply: the stream is out of step")
    return replies


def _on_connection(client: Any, exchange: Callable[[Any], list[object]]) -> list[object]:
    """Run ``exchange`` on a connection borrowed from the client's pool. A pooled connection
    the server dropped (a restart) is retried once on a fresh one; timeouts are not."""
    pool = client.connection_pool
    for attempt in (0, 1):
        conn = pool.get_connection()
        try:
            return exchange(conn)
        except (RedisConnectionError, ConnectionError):
            conn.disconnect()
            if attempt:
                raise
        except BaseException:
            conn.disconnect()  # a timeout or cancellation mid-reply leaves the stream unusable
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")


def _socket(conn: Any) -> Any:
    sock = conn._sock  # redis-py keeps the connected (TLS-wrapped) socket here
    if sock is None:
        raise RedisConnectionError("the connection has no socket")
    return sock


def _send_sets(conn: Any, names: Sequence[bytes], headers: Sequence[bytes],
               payloads: Sequence[memoryview], ttl: int | None) -> list[object]:
    sock = _socket(conn)
    tail = b"\r\n"
    if ttl is not None:
        seconds = str(int(ttl)).encode()
        tail += b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(seconds), seconds)
    pending = b""
    for name, header, payload in zip(names, headers, payloads):
        command = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
            3 if ttl is None else 5, len(name), name, len(header) + len(payload))
        sock.sendall(pending + command + header)
        sock.sendall(payload)
        pending = tail
    sock.sendall(pending)
    reader = _Reader(sock)
    replies = [_status_reply(reader) for _ in names]
    if reader.pending:
        raise RedisConnectionError("bytes after the last reply: the stream is out of step")
    return replies


def _status_reply(reader: _Reader) -> object:
    line = reader.line()
    if line == b"+OK":
        return True
    if line[:1] == b"-":
        return ResponseError(line[1:].decode(errors="replace"))
    if line[:1] == b"!":
        message = bytearray(int(line[1:]) + 2)
        reader.into(memoryview(message))
        return ResponseError(bytes(message[:-2]).decode(errors="replace"))
    raise RedisConnectionError(f"unexpected reply {line[:40]!r} to SET")


def _exchange(conn: Any, names: Sequence[bytes], header_sizes: Sequence[int],
              views: Sequence[memoryview]) -> list[object]:
    conn.send_packed_command(conn.pack_commands([(b"GET", name) for name in names]))
    sock = _socket(conn)
    reader = _Reader(sock)
    replies = [_one_reply(reader, size, view) for size, view in zip(header_sizes, views)]
    if reader.pending:
        raise RedisConnectionError("bytes after the last reply: the stream is out of step")
    return replies


def _one_reply(reader: _Reader, header_size: int, view: memoryview) -> object:
    line = reader.line()
    kind, rest = line[:1], line[1:]
    if kind == b"-":
        return ResponseError(rest.decode(errors="replace"))
    if kind == b"_":  # RESP3's null (redis-py may speak RESP3)
        return None
    if kind == b"!":  # RESP3's blob error
        message = bytearray(int(rest) + 2)
        reader.into(memoryview(message))
        return ResponseError(bytes(message[:-2]).decode(errors="replace"))
    if kind != b"$":
        raise RedisConnectionError(f"unexpected reply type {kind!r} to GET")
    length = int(rest)
    if length < 0:
        return None
    if length != header_size + len(view):
        reader.skip(length + 2)
        return WRONG_LENGTH
    header = bytearray(header_size)
    reader.into(memoryview(header))
    reader.into(view)
    crlf = bytearray(2)
    reader.into(memoryview(crlf))
    if crlf != b"\r\n":
        raise RedisConnectionError("a bulk reply did not end with CRLF")
    return header
