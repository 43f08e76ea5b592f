"""Per-request block tables over the block pool, with automatic prefix caching.

Each KV cache group (``core/kv_cache_groups.py``) has its own block table per request; all
groups draw from one pool. A sliding-window group lets go of the blocks that no scheduled
token's window can reach any more (vLLM's sliding-window KV cache manager), so a long
request holds about ``window / block_size + 1`` blocks there, not its whole length. A
released block's entry stays in the table as ``NULL_BLOCK_ID`` (never read: attention
starts at the window), so positions are never renumbered.

Prefix caching follows vLLM V1's design: only full blocks are cached; a block's key chains
its parent's key, its token ids, the request's ``cache_salt`` and LoRA adapter, plus the group's index
(the same tokens have other K/V in other layers); a new request reuses the longest run of
cached blocks of its prompt that every group can serve, always leaving its last prompt
token to compute so there are logits to sample from. A global group must hold the whole
run; a sliding-window group only the blocks inside the window of the first token computed.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.kv_events import BlockOp, BlockOpKind, BlockTableUpdate
from pagedllm.core.request import Request

NULL_BLOCK_ID = 0  # table entry of a released sliding-window block; attention never reads it
_GLOBAL = (KVCacheGroup((), 0),)


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None, lora: str | None = None) -> bytes:
    """SHA-256 of (parent hash, token ids, salt, LoRA adapter key): the chained key of one full block.

    SHA-256 is collision resistant (no known collisions; 2**128 work for a birthday
    collision), so a key hit is taken as equal tokens without comparing them. Token ids are
    packed as fixed-width int64, so different token sequences never give the same bytes.
    """
    h = hashlib.sha256(parent or b"\x00")
    h.update(array("q", token_ids).tobytes())
    if parent is None:  # the chain carries salt and adapter to every later block
        if salt is not None:
            h.update(b"salt:" + salt.encode())
        if lora is not None:
            h.update(b"\x00lora:" + lora.encode())
    return h.digest()


def _group_key(block_hash: bytes, group: int) -> bytes:
    """The cache key of a block in one group: group 0 uses the chain hash itself."""
    return block_hash + group.to_bytes(2, "little") if group else block_hash


class KVCacheManager:
    """Allocates blocks to requests as they grow and frees them when they end.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_caching: reuse cached full blocks across requests (prefix caching).
        groups: the model's KV cache groups; default one global group.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup] = _GLOBAL,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = list(groups)
        self.pool = BlockPool(num_blocks, enable_caching)
        # Per request, per group: blocks (None where released) and their ids.
        self.req_blocks: dict[str, list[list[KVCacheBlock | None]]] = {}
        self.req_block_ids: dict[str, list[list[int]]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        # Per request, per group: the first table index changed since take_block_updates (None: none).
        self.req_changed: dict[str, list[int | None]] = {}
        self.prefix_queries = 0  # prompt tokens looked up, for the hit-rate metric (count_prefix_hit)
        self.prefix_hits = 0  # of those, tokens found in the cache
        # Block events since a consumer last drained them; None: nobody asked (nothing recorded).
        self.events: list[BlockOp] | None = None

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock | None]], int]:
        """Cached blocks of the request's longest servable prefix, per group, and its length in tokens.

        A lookup only: the scheduler may look a waiting request up every step until it fits,
        and counts the hit it was admitted with (``count_prefix_hit``).
        """
        hits: list[list[KVCacheBlock | None]] = [[] for _ in self.groups]
        if not self._looks_up(request):
            return hits, 0
        self._update_hashes(request)
        num = (request.num_tokens - 1) // self.block_size  # the last token is computed
        for g, group in enumerate(self.groups):
            if not group.window:
                num = min(num, self._cached_run(request.block_hashes, g, 0, num))
        while num and any(
            self._cached_run(request.block_hashes, g, group.first_needed_block(num * self.block_size, self.block_size), num)
            < num
            for g, group in enumerate(self.groups)
            if group.window
        ):
            num -= 1
        if num:
            for g, group in enumerate(self.groups):
                first = group.first_needed_block(num * self.block_size, self.block_size)
                hits[g] = [None] * first + [
                    self.pool.get_cached_block(_group_key(h, g)) for h in request.block_hashes[first:num]
                ]
        return hits, num * self.block_size

    def count_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count a request's first admission in the hit-rate metric: its tokens were looked up
        and ``num_hit_tokens`` of them found (nothing is counted for a request not looked up)."""
        if self._looks_up(request):
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[list[KVCacheBlock | None]] | None = None,
        num_lookahead_tokens: int = 0,
        num_reserved_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        ``computed_blocks`` are prefix hits (per group) for a request being admitted (its
        ``num_computed_tokens`` already counts them). ``num_lookahead_tokens`` are draft
        tokens: they get slots but are never entered into the prefix cache. Sliding-window
        groups first release the blocks before the window of this step's first token.
        ``num_reserved_tokens``: tokens after these whose blocks must be free too, though none
        is allocated now (a chunked prompt's later chunks; a sliding-window group counts at most
        the blocks its window spans).

        Returns:
            False, allocating nothing, if the pool has too few free blocks.
        """
        rid = request.request_id
        tables = self.req_blocks.setdefault(rid, [[] for _ in self.groups])
        ids = self.req_block_ids.setdefault(rid, [[] for _ in self.groups])
        changed = self.req_changed.setdefault(rid, [0] * len(self.groups))  # a new table: all of it
        computed = computed_blocks or [[] for _ in self.groups]
        for g, group in enumerate(self.groups):
            if group.window:
                self._release_skipped(rid, g, tables[g], ids[g], group, request.num_computed_tokens)
        num_total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_blocks = -(-num_total // self.block_size)
        needed = [max(0, num_blocks - len(tables[g]) - len(computed[g])) for g in range(len(self.groups))]
        later = -(-(num_total + num_reserved_tokens) // self.block_size) - num_blocks
        reserved = sum(min(later, -(-group.window // self.block_size) + 1) if group.window else later
                       for group in self.groups)
        reusable = sum(1 for hits in computed for b in hits if b is not None and b.ref_cnt == 0)
        if sum(needed) + reserved > self.pool.num_free_blocks - reusable:
            return False
        events = self.events
        # Every group's hits leave the free queue before any group takes new blocks from it:
        # a free cached block one group is about to reuse must not be handed to another.
        for g in range(len(self.groups)):
            if computed[g]:
                hits = [b for b in computed[g] if b is not None]
                self.pool.touch(hits)
                if events is not None and hits:  # the None entries lead: the hits are the tail
                    first = len(tables[g]) + len(computed[g]) - len(hits)
                    events.append(BlockOp(BlockOpKind.HIT, rid, g, first, [b.block_id for b in hits]))
                _mark(changed, g, len(ids[g]))
                tables[g].extend(computed[g])
                ids[g].extend(NULL_BLOCK_ID if b is None else b.block_id for b in computed[g])
        for g in range(len(self.groups)):
            if needed[g]:
                new_blocks = self.pool.get_new_blocks(needed[g])
                if events is not None:
                    events.append(BlockOp(BlockOpKind.NEW, rid, g, len(tables[g]), [b.block_id for b in new_blocks]))
                _mark(changed, g, len(ids[g]))
                tables[g].extend(new_blocks)
                ids[g].extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            num_known = min(request.num_computed_tokens + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, tables, num_known // self.block_size)
        return True

    def free(self, request: Request) -> None:
        """Return all of a request's blocks, tail first (so its tail is evicted first)."""
        tables = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.req_changed.pop(request.request_id, None)
        self.num_hashed_blocks.pop(request.request_id, None)
        for g, blocks in enumerate(tables):
            if self.events is not None:
                self._record_free(request.request_id, g, 0, blocks)
            self.pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep the blocks holding the first ``num_tokens`` slots; return the rest to the pool.

        Speculative decoding calls this after verification: the blocks that held only
        rejected draft tokens are empty again. They were never cached (only blocks full of
        known tokens are), so they rejoin the free queue without a hash.
        """
        tables = self.req_blocks.get(request.request_id)
        if tables is None:
            return
        keep = -(-num_tokens // self.block_size)
        changed = self.req_changed[request.request_id]
        for g, (blocks, ids) in enumerate(zip(tables, self.req_block_ids[request.request_id])):
            tail = blocks[keep:]
            if tail:
                _mark(changed, g, keep)
            del blocks[keep:], ids[keep:]
            if self.events is not None:
                self._record_free(request.request_id, g, keep, tail)
            self.pool.free_blocks(b for b in reversed(tail) if b is not None)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (live lists; read them, do not keep them)."""
        return self.req_block_ids[request_id]

    def take_block_updates(self, request_id: str) -> list[BlockTableUpdate]:
        """How the request's tables changed since the last call (or since it got them), one
        update per changed group; the next call reports only later changes."""
        changed = self.req_changed[request_id]
        updates = []
        for g, (start, ids) in enumerate(zip(changed, self.req_block_ids[request_id])):
            if start is not None:
                updates.append(BlockTableUpdate(request_id, g, start, ids[start:]))
                changed[g] = None
        return updates

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (released entries not counted)."""
        return [sum(b is not None for b in blocks) for blocks in self.req_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        done = self.pool.reset_prefix_cache()
        if done and self.events is not None:
            self.events.append(BlockOp(BlockOpKind.RESET, "", 0, 0, []))
        return done

    def _looks_up(self, request: Request) -> bool:
        """Whether the request's prefix is looked up in the cache (prompt logprobs need every
        prompt position computed)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def _record_free(self, request_id: str, group: int, first_index: int, blocks: list[KVCacheBlock | None]) -> None:
        """Note the release of ``blocks`` (table indices from ``first_index``; released entries lead)."""
        held = [b.block_id for b in blocks if b is not None]
        if held:
            self.events.append(BlockOp(BlockOpKind.FREE, request_id, group, first_index + len(blocks) - len(held), held))

    def _cached_run(self, hashes: list[bytes], group: int, start: int, end: int) -> int:
        """Index of the first block in ``hashes[start:end]`` not cached in ``group``; ``end`` if none."""
        for i in range(start, end):
            if self.pool.get_cached_block(_group_key(hashes[i], group)) is None:
                return i
        return end

    def _release_skipped(
        self, request_id: str, g: int, blocks: list[KVCacheBlock | None], ids: list[int], group: KVCacheGroup,
        first_query_pos: int,
    ) -> None:
        """Free the blocks wholly before the window of a query at ``first_query_pos``.

        Oldest first, so they are evicted first: a later prefix hit needs the newest ones.
        """
        first = min(group.first_needed_block(first_query_pos, self.block_size), len(blocks))
        skipped = []
        for i in range(first - 1, -1, -1):
            if blocks[i] is None:
                break  # everything before was released already
            skipped.append(blocks[i])
            blocks[i], ids[i] = None, NULL_BLOCK_ID
        if skipped:
            _mark(self.req_changed[request_id], g, first - len(skipped))
        if self.events is not None and skipped:
            self.events.append(
                BlockOp(BlockOpKind.FREE, request_id, g, first - len(skipped), [b.block_id for b in reversed(skipped)])
            )
        self.pool.free_blocks(reversed(skipped))

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else None
            lora = None if request.lora_request is None else request.lora_request.cache_key
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], request.cache_salt, lora))

    def _cache_full_blocks(self, request: Request, tables: list[list[KVCacheBlock | None]], num_full: int) -> None:
        start = self.num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        events = self.events
        for g, blocks in enumerate(tables):
            entered = []
            for i in range(start, num_full):
                block = blocks[i]
                if block is not None and self.pool.cache_block(block, _group_key(request.block_hashes[i], g)):
                    if events is not None:
                        entered.append(block.block_id)
            if entered:  # CACHED names blocks; their positions are known from NEW/HIT already
                events.append(BlockOp(BlockOpKind.CACHED, request.request_id, g, start, entered))
        self.num_hashed_blocks[request.request_id] = num_full


def _mark(changed: list[int | None], group: int, index: int) -> None:
    """Note that ``group``'s table changed from ``index`` on."""
    start = changed[group]
    changed[group] = index if start is None else min(start, index)
