"""The KV block pool: integer block ids, reference counts, an LRU free list and the prefix-cache map.

NOTE invariants:
- free + used == total, and a block is free exactly when its ref_cnt is 0;
- block.block_hash is set exactly when the hash map sends that hash to that block;
- only full blocks are hashed (the KV manager's duty: the pool never sees token counts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class FreeBlockQueue:
    """Free blocks, least recently freed first; removal from the middle is O(1)."""

    def __init__(self, blocks: Iterable[Block] = ()):
        self._blocks: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks)

    def popleft(self) -> Block:
        return self._blocks.popitem(last=False)[1]

    def append(self, block: Block) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: Block) -> None:
        del self._blocks[block.block_id]

    def __contains__(self, block: Block) -> bool:
        return block.block_id in self._blocks

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}
        self.cache_version = 0          # grows whenever `cached` changes
        self.evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding a hash: evictable, but a prefix hit can revive them."""
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block. Callers pass a request's blocks tail first,
        so its tail is evicted before its head (a head is more likely to be shared)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than used")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-cache hits, reviving free cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: Block, block_hash: int) -> None:
        # A block computed twice (two requests with one prefix) stays unhashed: one hash, one block.
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self.cache_version += 1

    def get_cached_block(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; for tests and debugging."""
        for block in self.blocks:
            if block.ref_cnt < 0 or (block.ref_cnt == 0) != (block in self.free_queue):
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                                     f"free-listed {block in self.free_queue}")
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} holds a hash the map does not know")
        if any(b.block_hash != h for h, b in self.cached.items()):
            raise AssertionError("the hash map sends a hash to a block holding another")

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        block.block_hash = None
        self.evictions += 1
        self.cache_version += 1
