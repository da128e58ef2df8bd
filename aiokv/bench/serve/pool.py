"""The GPU block pool of the served model, with its own prefix cache (LRU over GPU blocks).

Blocks are reference counted: a request holds the blocks of its prompt while it runs, and
an offload holds them until its copy is over, so no block is overwritten while something
still reads it. A full block's key is registered when its request is done; a registered
block nobody holds is a prefix-cache entry, evicted least recently used first when the pool
needs room. With ``caching=False`` (the recompute and oracle arms) nothing is registered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import anyio

__all__ = ["BlockPool"]


class BlockPool:
    """``num_blocks`` GPU blocks: free ones, prefix-cached ones (LRU) and held ones."""

    def __init__(self, num_blocks: int, *, caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered, unheld blocks
        self._released = anyio.Event()
        self.evictions = 0

    def match(self, keys: Sequence[int]) -> list[int]:
        """Hold the blocks of the leading keys this pool has cached; their block ids."""
        if not self.caching:
            return []
        out: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._hold(block)
            out.append(block)
        return out

    def take(self, n: int) -> list[int] | None:
        """Hold ``n`` blocks that hold nothing anyone needs (free first, then the least
        recently used cached ones), or None (nothing taken) if there are not enough."""
        if n > len(self._free) + len(self._lru):
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    async def take_waiting(self, n: int) -> list[int]:
        """``take``, waiting for held blocks to be given back (offloads in flight)."""
        if n > self.num_blocks:
            raise ValueError(f"a request needs {n} blocks and the pool has {self.num_blocks}")
        while (blocks := self.take(n)) is None:
            if self.held() == 0:
                raise RuntimeError("the pool has no room and nothing holds a block")
            await self._released.wait()
        return blocks

    def register(self, keys: Sequence[int], blocks: Sequence[int]) -> None:
        """Name held blocks by the keys they now hold (a key cached already keeps its block)."""
        if not self.caching:
            return
        for key, block in zip(keys, blocks):
            if key in self._block_of or block in self._key_of:
                continue
            self._block_of[key] = block
            self._key_of[block] = key

    def hold(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self._hold(block)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block; unheld ones become cache entries or free blocks."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} released more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        self._released.set()
        self._released = anyio.Event()

    def held(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    def cached(self) -> int:
        return len(self._key_of)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0 and block in self._lru:
            del self._lru[block]
        self._refs[block] += 1
