"""The workers' host pools as the scheduler sees them, for moving blocks to and from tiers.

vLLM runs its scheduler in one process and each GPU worker's host pool in that worker, so
with ``aiokv_tiers`` each worker makes its pool a shared file (``WorkerOptions.
host_pool_file``) and publishes, beside it, where each page of a chunk lies; the manager
maps every rank's pool once all of them are published (vLLM builds its workers before its
scheduler, so at its first step) and then removes the names, so nothing is left behind
if the processes die. A worker that dies before that (an engine whose start fails after
the pools were made, a worker killed) leaves its pool on the memory filesystem, holding
that memory: each worker claims its name (its pid) before it makes the pool, and the next
worker to start on the host removes the pools whose claimant is gone (``sweep``). Kept
free of vLLM imports.

A tier value is one rank's block of one KV-cache group, its pages in the layout's own order
(``cache/pages.PageMap``), padded to the widest such block so every value has one size.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...cache.pages import PageMap
from ...cache.tiers import codec

__all__ = ["PoolView", "RankPool", "attach", "claim", "pool_file", "publish", "sweep", "unpublish"]

_VERSION = 1


def pool_file(engine_id: str, rank: int) -> str:
    """Where rank ``rank`` of engine ``engine_id`` keeps its pool (``$AIOKV_SHM_DIR``, else
    ``/dev/shm`` where it can be written, else the temporary directory)."""
    base = os.environ.get("AIOKV_SHM_DIR")
    if not base:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else tempfile.gettempdir()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))[:80]
    return os.path.join(os.path.abspath(base), f"aiokv-{name}-rank{int(rank)}.pool")


def _pid_namespace() -> str | None:
    """This process's pid namespace (pids mean something only within one), or None."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _write_description(path: str, info: dict[str, object]) -> None:
    temp = f"{path}.json.{os.getpid()}"
    try:
        with open(temp, "w") as f:
            json.dump({"version": _VERSION, "pid": os.getpid(), "pidns": _pid_namespace(), **info}, f)
        os.replace(temp, f"{path}.json")
    except BaseException:  # a full filesystem, say: no half-written file left behind
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def claim(path: str) -> None:
    """Say, beside ``path``, that this process is about to make the pool there: if it dies
    before the scheduler maps the pool, ``sweep`` knows the pool is nobody's."""
    _write_description(path, {})


def sweep(directory: str) -> list[str]:
    """Remove the pools (and their descriptions) in ``directory`` whose worker is gone: the
    process that claimed or published them no longer exists in this pid namespace.

    Only this user's descriptions are read, and a pool is removed only while it is the one
    described (the same inode) where the description says which. Returns what it removed.
    """
    ns = _pid_namespace()
    if ns is None:
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        if not (name.startswith("aiokv-") and name.endswith(".pool.json")):
            continue
        described = os.path.join(directory, name)
        try:
            st = os.lstat(described)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            with open(described) as f:
                info = json.load(f)
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if info.get("pidns") != ns or pid <= 0 or _alive(pid):
            continue
        pool = described[: -len(".json")]
        with contextlib.suppress(OSError):
            if "inode" not in info or os.lstat(pool).st_ino == info["inode"]:
                os.unlink(pool)
                removed.append(pool)
        with contextlib.suppress(OSError):
            os.unlink(described)
            removed.append(described)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: it exists
        return True
    return True


def publish(path: str, *, rank: int, num_chunks: int, chunk_bytes: int, blocks_per_chunk: int,
            page_sizes: Sequence[Sequence[int]], page_offsets: Sequence[Sequence[int]]) -> None:
    """Write the description of the pool at ``path`` beside it (atomically), once the pool
    exists: the manager maps the pool only after reading this."""
    _write_description(path, {
        "inode": os.stat(path).st_ino, "rank": int(rank), "num_chunks": int(num_chunks),
        "chunk_bytes": int(chunk_bytes), "blocks_per_chunk": int(blocks_per_chunk),
        "page_sizes": [[int(s) for s in g] for g in page_sizes],
        "page_offsets": [[int(o) for o in g] for g in page_offsets]})


def unpublish(path: str) -> None:
    """Remove the description (the pool's own name goes with the pool)."""
    with contextlib.suppress(OSError):
        os.unlink(f"{path}.json")


@dataclass
class RankPool:
    """One rank's pool, mapped here: the bytes and where a group's block lies in a chunk."""

    rank: int
    pool: np.ndarray  # (num_chunks, chunk_bytes) uint8 over the shared mapping
    pages: list[PageMap]  # per KV-cache group, pages of all blocks of a chunk

    def block(self, group: int, chunk: int) -> memoryview | None:
        """The chunk's block of ``group`` as one view into the pool, where its pages lie in
        the layout's order from the chunk's start; None where they do not (copy through
        ``gather``/``scatter`` then)."""
        pages = self.pages[group]
        if not pages.identity:
            return None
        return memoryview(self.pool[chunk, : pages.payload_bytes].data)

    def gather(self, group: int, chunk: int, out: np.ndarray) -> None:
        """The block's pages in the layout's order into ``out`` (which may be longer)."""
        pages = self.pages[group]
        out[: pages.payload_bytes] = pages.gather(self.pool.reshape(-1), [chunk])[0]

    def scatter(self, group: int, chunk: int, row: np.ndarray) -> None:
        """The layout-ordered ``row`` (which may be longer) into the chunk's pages."""
        pages = self.pages[group]
        pages.scatter(self.pool.reshape(-1), [chunk], row[None, : pages.payload_bytes])


@dataclass
class PoolView:
    """Every rank's pool, and the one value size the tiers hold."""

    ranks: list[RankPool]
    num_chunks: int
    block_bytes: int  # the widest block of any rank and group

    def tier_key(self, key: object, rank: int) -> bytes:
        """The tier key of one rank's block of ``key`` (the key alone with one rank)."""
        return codec.key_bytes(key if len(self.ranks) == 1 else (key, rank))

    def payload(self, rank: int, group: int) -> int:
        return self.ranks[rank].pages[group].payload_bytes

    def describe(self) -> list[int]:
        """Every rank's and group's block size, for the layout fingerprint."""
        return [p.payload_bytes for r in self.ranks for p in r.pages]


def attach(engine_id: str, world_size: int, num_chunks: int) -> PoolView | None:
    """Map every rank's pool once all are published (None before), then remove their names.

    Raises:
        ValueError: a published pool that does not match (another chunk count, a pool file
            replaced since it was described, a description of another version).
    """
    paths = [pool_file(engine_id, r) for r in range(world_size)]
    infos = []
    for path in paths:
        try:
            with open(f"{path}.json") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        if "inode" not in info:  # claimed, the pool not made yet
            return None
        infos.append(info)
    ranks = []
    for rank, (path, info) in enumerate(zip(paths, infos)):
        if (info.get("version"), info.get("rank"), info.get("num_chunks")) != (_VERSION, rank, num_chunks):
            raise ValueError(f"{path}.json describes another pool than this engine's rank {rank} with "
                             f"{num_chunks} chunks: {info}")
        chunk = int(info["chunk_bytes"])
        with open(path, "r+b") as f:
            if os.fstat(f.fileno()).st_ino != info["inode"]:
                raise ValueError(f"{path} was replaced after it was described")
            mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
        pool = np.frombuffer(mapping, dtype=np.uint8, count=num_chunks * chunk).reshape(num_chunks, chunk)
        bpc = int(info["blocks_per_chunk"])
        pages = [PageMap(chunk, [s * bpc for s in sizes], offsets)
                 for sizes, offsets in zip(info["page_sizes"], info["page_offsets"])]
        ranks.append(RankPool(rank, pool, pages))
    for path in paths:  # mapped: the memory lives as long as a mapping does
        unpublish(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
    widest = max(p.payload_bytes for r in ranks for p in r.pages)
    return PoolView(ranks, num_chunks, widest)
