"""Per-request block tables over the block pool, with automatic prefix caching.

Prefix caching follows vLLM V1's design: only full blocks are cached; a block's key chains
its parent's key, its token ids and the request's ``cache_salt``; a new request reuses the
longest run of cached blocks of its prompt, always leaving its last prompt token to compute
so there are logits to sample from.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """SHA-256 of (parent hash, token ids, salt): the chained key of one full block.

    SHA-256 is collision resistant (no known collisions; 2**128 work for a birthday
    collision), so a key hit is taken as equal tokens without comparing them. Token ids are
    packed as fixed-width int64, so different token sequences never give the same bytes.
    """
    h = hashlib.sha256(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    if salt is not None and parent is None:  # the chain carries the salt to every later block
        h.update(b"salt:" + salt.encode())
    return h.digest()


class KVCacheManager:
    """Allocates blocks to requests as they grow and frees them when they end.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_caching: reuse cached full blocks across requests (prefix caching).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up, for the hit-rate metric
        self.prefix_hits = 0  # of those, tokens found in the cache

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks of the request's tokens, and its length in tokens."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size  # the last token is computed
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        ``computed_blocks`` are prefix hits for a request being admitted (its
        ``num_computed_tokens`` already counts them). ``num_lookahead_tokens`` are draft
        tokens: they get slots but are never entered into the prefix cache.

        Returns:
            False, changing nothing, if the pool has too few free blocks.
        """
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        block_ids = self.req_block_ids.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_needed = -(-num_total // self.block_size) - len(blocks) - len(computed_blocks)
        num_reusable = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if num_needed > self.pool.num_free_blocks - num_reusable:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            block_ids.extend(b.block_id for b in computed_blocks)
        if num_needed > 0:
            new_blocks = self.pool.get_new_blocks(num_needed)
            blocks.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            num_known = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, blocks, num_known // self.block_size)
        return True

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first (so its tail is evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.num_hashed_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep the blocks holding the first ``num_tokens`` slots; return the rest to the pool.

        Speculative decoding calls this after verification: the blocks that held only
        rejected draft tokens are empty again. They were never cached (only blocks full of
        known tokens are), so they rejoin the free queue without a hash.
        """
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None:
            return
        keep = -(-num_tokens // self.block_size)
        if keep >= len(blocks):
            return
        tail = blocks[keep:]
        del blocks[keep:]
        del self.req_block_ids[request.request_id][keep:]
        self.pool.free_blocks(reversed(tail))

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_block_ids[request_id]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        start = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_hashed_blocks[request.request_id] = num_full
