"""The pool of KV cache blocks: reference counts, an LRU free queue, and the prefix-cache map.

A block is in exactly one place: referenced by one or more requests (``ref_cnt > 0``), or in
the free queue. A free block may still hold a cached prefix (its ``block_hash`` is kept): a
new request that hits it takes it out of the queue in O(1); otherwise it is evicted only
when it reaches the head of the queue and is reused, and only then is its hash dropped.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's K/V cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head first), O(1) removal anywhere."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: no None checks in the hot path
        self._tail = KVCacheBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next
        if block is self._tail:
            raise RuntimeError("no free KV cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """All KV cache blocks of one engine.

    Args:
        num_blocks: blocks in the cache (each layer's K and V caches have this many).
        enable_caching: keep full blocks' hashes so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue (the least recently freed).

        Raises:
            RuntimeError: if fewer than ``n`` blocks are free (callers check first).
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV cache blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict its cached prefix now that it is reused
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each (prefix-hit) block, taking free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Record a now-full block under its chained hash (first writer wins); whether it was entered."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks that reach zero join the queue's tail.

        Callers pass a request's blocks tail first, so its tail is evicted before its head.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
