"""What the engine core reports about each step when the live view is on (msgspec, array-like)."""

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


class ScheduledEntry(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step, in tokens."""

    request_id: str
    prefill: int = 0  # prompt (or recomputed) tokens
    decode: int = 0  # 1 when the step computes the request's newest token
    draft: int = 0  # speculative draft tokens verified
    accepted: int = 0  # of those, accepted
    cached: int = -1  # admitted this step: prefix-cache hit tokens; -1: already running


class StepRecord(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine step. Times are ``time.monotonic()`` seconds (one clock for both processes).

    ``ops`` are every block operation since the previous record, in order: replaying them
    (``block_map.BlockMap``) gives the pool's state after this step.
    """

    index: int
    start: float
    end: float
    scheduled: list[ScheduledEntry] = []
    ops: list[BlockOp] = []
    preempted: list[str] = []
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of blocks referenced, [0, 1]
