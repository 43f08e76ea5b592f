"""What the engine core reports about each step when the live view is on (msgspec, array-like)."""

from __future__ import annotations

import msgspec

from pagedllm.core.kv_events import BlockOp


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
