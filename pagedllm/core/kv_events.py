"""What the KV cache manager changed: block events, and block-table updates.

Block events (``BlockOp``): what happened to which blocks of which request's table. The manager
appends them to ``KVCacheManager.events`` when a consumer (the live view's step recorder) has
asked for them, and the consumer drains that list; the manager knows nothing of who reads them.

Block-table updates (``BlockTableUpdate``): how a request's table changed since the scheduler
last took its updates (``KVCacheManager.take_block_updates``); the workers apply them to their
copies of the tables.
"""

from __future__ import annotations

import enum

import msgspec


class BlockOpKind(enum.IntEnum):
    """What happened to the blocks of one ``BlockOp``."""

    NEW = 0  # taken from the free queue: reference count 1, any cached hash evicted
    HIT = 1  # prefix-cache hit: one more reference (a free block leaves the queue)
    FREE = 2  # one reference dropped; at zero the block is free (cached if it keeps a hash)
    CACHED = 3  # the block, now full, is entered in the prefix cache under a hash
    RESET = 4  # every cached hash is dropped (reset_prefix_cache); no blocks listed


class BlockOp(msgspec.Struct, array_like=True, frozen=True):
    """Blocks of one request's table in one KV cache group, at consecutive table positions.

    ``block_ids[i]`` sits at table index ``first_index + i``, so it holds token positions
    ``[(first_index + i) * block_size, (first_index + i + 1) * block_size)``.
    """

    kind: int  # BlockOpKind
    request_id: str
    group: int
    first_index: int
    block_ids: list[int]


class BlockTableUpdate(msgspec.Struct, array_like=True, frozen=True):
    """Replace ``table[group][start:]`` of request ``req_id`` by ``block_ids`` (appended blocks,
    a sliding-window group's released head, blocks of rejected drafts given back, a new table)."""

    req_id: str
    group: int
    start: int
    block_ids: list[int]
