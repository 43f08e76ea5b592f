"""The front end's live view: a ring buffer of step records, request lifecycles and the block map."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Protocol

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.live_view.block_map import BlockMap
from pagedllm.live_view.records import StepRecord


# What the view reads of the engine's messages (engine/messages.py's EngineCoreRequest,
# EngineCoreOutput, EngineCoreOutputs), by shape: the view sits below the engine and never
# builds them.
class ArrivingRequest(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...


class RequestTokens(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...


class CoreMessage(Protocol):
    @property
    def outputs(self) -> Sequence[RequestTokens]: ...
    @property
    def timestamp(self) -> float: ...
    @property
    def step(self) -> StepRecord | None: ...

DEFAULT_STEPS = 4096  # ring buffer length: the last few thousand steps
DEFAULT_REQUESTS = 512  # request timelines kept (finished ones are dropped oldest first)
_MAX_SEGMENTS = 256  # per request; later steps extend the last segment
_RATE_WINDOW_S = 5.0  # tokens/s are averaged over the last this many seconds
_CHANGE_LOG = 1024  # versions whose changes are kept for viewers' deltas (an older viewer gets a snapshot)


@dataclass
class RequestTimeline:
    """One engine-core request's life. Times are ``time.monotonic()`` seconds; None: not yet."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit tokens at (first) admission
    preemptions: list[float] = field(default_factory=list)
    # [start, end, kind ("prefill" | "decode"), last step index]; consecutive decode steps merge.
    segments: list[list[Any]] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def add_step(self, record: StepRecord, kind: str) -> None:
        last = self.segments[-1] if self.segments else None
        mergeable = last is not None and last[2] == kind == "decode" and last[3] == record.index - 1
        if mergeable or len(self.segments) >= _MAX_SEGMENTS:
            last[1], last[3] = record.end, record.index
        else:
            self.segments.append([record.start, record.end, kind, record.index])

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.request_id, "arrival": self.arrival, "prompt": self.num_prompt_tokens,
            "scheduled": self.first_scheduled, "first_token": self.first_token, "last_token": self.last_token,
            "finished": self.finished, "reason": self.finish_reason, "output": self.num_output_tokens,
            "cached": self.cached_tokens, "ttft": self.ttft, "preemptions": self.preemptions,
            "segments": [s[:3] for s in self.segments],
        }


class LiveView:
    """Everything the dashboard and the trace export show, fed with every message from the core.

    Args:
        num_blocks: blocks in the KV cache pool.
        block_size: token slots per block.
        group_windows: per KV cache group, its sliding window in tokens (0: global attention).
        max_num_batched_tokens: the scheduler's token budget per step.
        max_steps: step records kept (a ring buffer: the oldest are dropped).
        max_requests: request timelines kept; finished ones are dropped oldest first.
        cache_dtype: the K/V cache's dtype by name ("bfloat16", "int8", ...), shown beside the
            block map; "": not stated.
    """

    def __init__(
        self, num_blocks: int, block_size: int, group_windows: list[int], max_num_batched_tokens: int,
        max_steps: int = DEFAULT_STEPS, max_requests: int = DEFAULT_REQUESTS, cache_dtype: str = "",
    ) -> None:
        if max_steps < 1 or max_requests < 1:
            raise ValueError(f"max_steps and max_requests must be at least 1, got {max_steps}, {max_requests}")
        self.block_size = block_size
        self.cache_dtype = cache_dtype
        self.group_windows = group_windows
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = BlockMap(num_blocks)
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        # The latest record, a step's or an idle moment's (after aborts): the queues and KV usage now.
        self.latest: StepRecord | None = None
        # Per step in ``steps``: (prompt tokens computed, tokens emitted).
        self.step_tokens: deque[tuple[int, int]] = deque(maxlen=max_steps)
        self.requests: OrderedDict[str, RequestTimeline] = OrderedDict()
        self.max_requests = max_requests
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens of admitted requests (first admission)
        self.prefix_hits = 0
        self.version = 0  # one more with every change fed in
        # One entry per version, the latest _CHANGE_LOG: the blocks and request rows it changed.
        self._changes: deque[tuple[set[int], set[str]]] = deque(maxlen=_CHANGE_LOG)

    @classmethod
    def for_engine(cls, config: EngineConfig, kv: KVCacheConfig) -> LiveView:
        """The view of an engine built from ``config`` with the KV cache ``kv``."""
        windows = [g.window for g in kv.groups]
        return cls(kv.num_blocks, kv.block_size, windows, config.max_num_batched_tokens, config.live_view_steps,
                   cache_dtype=kv.dtype)

    # -- feeding -------------------------------------------------------------------------
    def on_arrival(self, requests: Sequence[ArrivingRequest]) -> None:
        """Start the timelines of newly queued engine-core requests."""
        for r in requests:
            self.requests[r.request_id] = RequestTimeline(r.request_id, r.arrival_time, len(r.prompt_token_ids))
        self._trim_requests()
        self._changed(set(), {r.request_id for r in requests})

    def on_finish(self, request_ids: list[str], reason: str, now: float) -> None:
        """Finish requests the front end ended (abort, stop string): the core reports nothing for them."""
        finished = set()
        for rid in request_ids:
            timeline = self.requests.get(rid)
            if timeline is not None and timeline.finished is None:
                timeline.finished, timeline.finish_reason = now, reason
                finished.add(rid)
        if finished:
            self._changed(set(), finished)

    def on_outputs(self, out: CoreMessage) -> None:
        """Apply one message from the core: its step record (if any) and its new tokens."""
        record = out.step
        blocks: set[int] = set()
        requests: set[str] = set()
        if record is not None:
            blocks = self._on_step(record)
            requests.update(e.request_id for e in record.scheduled)
            requests.update(record.preempted)
        num_output = 0
        for o in out.outputs:
            timeline = self.requests.get(o.request_id)
            num_output += len(o.new_token_ids)
            if timeline is None or timeline.finished is not None:
                continue  # tokens of a step in flight when the front end ended it: nobody gets them
            requests.add(o.request_id)
            if o.new_token_ids:
                if timeline.first_token is None:
                    timeline.first_token = out.timestamp
                timeline.last_token = out.timestamp
                timeline.num_output_tokens += len(o.new_token_ids)
            if o.finish_reason is not None and timeline.finished is None:
                timeline.finished, timeline.finish_reason = out.timestamp, o.finish_reason
        if record is not None and record.scheduled:
            self.step_tokens.append((sum(e.prefill for e in record.scheduled), num_output))
        if record is not None or requests:
            self._changed(blocks, requests)

    def _on_step(self, record: StepRecord) -> set[int]:
        """Apply a step record; return the blocks its operations touched."""
        blocks = self.blocks.apply(record.ops)
        record.ops = []  # applied; the ring keeps the step's shape only
        self.latest = record
        for rid in record.preempted:
            self.num_preemptions += 1
            timeline = self.requests.get(rid)
            if timeline is not None:
                timeline.preemptions.append(record.start)
        if not record.scheduled:
            return blocks  # an idle moment (aborts): blocks only, no step to show
        self.steps.append(record)
        for entry in record.scheduled:
            timeline = self.requests.get(entry.request_id)
            if timeline is None or timeline.finished is not None:
                continue  # a step in flight when the front end ended the request: no longer its row's
            if timeline.first_scheduled is None:
                timeline.first_scheduled = record.start
                timeline.cached_tokens = max(entry.cached, 0)
                self.prefix_queries += timeline.num_prompt_tokens
                self.prefix_hits += max(entry.cached, 0)
            timeline.add_step(record, "prefill" if entry.prefill else "decode")
        return blocks

    def _changed(self, blocks: set[int], requests: set[str]) -> None:
        self.version += 1
        self._changes.append((blocks, requests))

    def _trim_requests(self) -> None:
        excess = len(self.requests) - self.max_requests
        if excess <= 0:
            return
        for rid in [rid for rid, t in self.requests.items() if t.finished is not None][:excess]:
            del self.requests[rid]

    # -- reading -------------------------------------------------------------------------
    def changes_since(self, version: int) -> tuple[set[int], set[str]] | None:
        """The blocks and requests whose rows changed after ``version``; None when the changes
        kept no longer reach back that far (the caller needs a snapshot)."""
        behind = self.version - version
        if behind > len(self._changes):
            return None
        blocks: set[int] = set()
        requests: set[str] = set()
        for i in range(len(self._changes) - behind, len(self._changes)):
            b, r = self._changes[i]
            blocks |= b
            requests |= r
        return blocks, requests

    def headline(self, now: float) -> dict[str, Any]:
        """Queue lengths and KV usage as of the latest record (a step, or the idle moment after
        aborts), prefix hit rate, tokens/s in and out, preemptions, steps run.

        The rates are those of the steps that ended in the last ``_RATE_WINDOW_S`` seconds
        before ``now`` (``time.monotonic()`` seconds), over the time from the first one's
        start (or the window's, if earlier) to ``now``: they fall to 0 when the engine idles.
        """
        last = self.steps[-1] if self.steps else None
        latest = self.latest
        prefill = output = 0
        since = now - _RATE_WINDOW_S
        start = now
        for record, (num_in, num_out) in zip(reversed(self.steps), reversed(self.step_tokens)):
            if record.end <= since:
                break
            prefill += num_in
            output += num_out
            start = max(record.start, since)
        span = now - start
        return {
            "running": latest.num_running if latest else 0,
            "waiting": latest.num_waiting if latest else 0,
            "kv_usage": latest.kv_usage if latest else 0.0,
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
            "tokens_in_per_s": prefill / span if span > 0 else 0.0,
            "tokens_out_per_s": output / span if span > 0 else 0.0,
            "preemptions": self.num_preemptions,
            "steps": last.index + 1 if last else 0,
        }

    def step_rows(self, after: int = -1, num_steps: int = 300) -> list[list[Any]]:
        """The last ``num_steps`` steps with an index above ``after``, oldest first, each
        ``[index, start, end, prefill, decode, draft, preempted, running, waiting]``."""
        records = []
        for r in reversed(self.steps):
            if r.index <= after or len(records) == num_steps:
                break
            records.append(r)
        return [
            [r.index, r.start, r.end, sum(e.prefill for e in r.scheduled), sum(e.decode for e in r.scheduled),
             sum(e.draft for e in r.scheduled), len(r.preempted), r.num_running, r.num_waiting]
            for r in reversed(records)
        ]

    def shown_requests(self, num_requests: int = 40) -> list[RequestTimeline]:
        """The requests the page lists, ``num_requests`` at most: the unfinished ones (running
        or waiting) in order of arrival, then the finished ones, the latest to finish first.
        When there are more unfinished ones than that, the latest to arrive are left out."""
        unfinished = [t for t in self.requests.values() if t.finished is None]
        unfinished.sort(key=lambda t: t.arrival)
        shown = unfinished[:num_requests]
        if len(shown) < num_requests:
            finished = [t for t in self.requests.values() if t.finished is not None]
            finished.sort(key=lambda t: t.finished, reverse=True)
            shown += finished[: num_requests - len(shown)]
        return shown

    def config_json(self) -> dict[str, Any]:
        """The pool's and the scheduler's fixed sizes, for the page."""
        return {
            "num_blocks": self.blocks.num_blocks, "block_size": self.block_size, "cache_dtype": self.cache_dtype,
            "group_windows": self.group_windows, "max_num_batched_tokens": self.max_num_batched_tokens,
        }

    def snapshot(self, num_steps: int = 300, num_requests: int = 40) -> dict[str, Any]:
        """What the page draws: the last ``num_steps`` steps (``step_rows``), the requests of
        ``shown_requests``, the block map (``BlockMap.snapshot``), as of ``version``."""
        now = time.monotonic()
        return {
            "version": self.version,
            "now": now,
            "config": self.config_json(),
            "headline": self.headline(now),
            "steps": self.step_rows(num_steps=num_steps),
            "requests": [t.to_json() for t in self.shown_requests(num_requests)],
            "blocks": self.blocks.snapshot(),
        }
