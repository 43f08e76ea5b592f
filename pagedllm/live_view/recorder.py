"""The engine-core side of the live view: block operations as they happen, one record per step.

Only built when the live view is on; it turns on the KV cache manager's block events (what
the manager allocates, shares, caches and frees) and takes them into each record, and
``EngineCore.step`` brackets each step.
"""

from __future__ import annotations

import time

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.live_view.records import ScheduledEntry, StepRecord


class StepRecorder:
    """Assembles ``StepRecord``s, each with the block events of ``kv_cache`` since the last one.

    Args:
        kv_cache: the manager whose block events this recorder turns on and drains.
    """

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self._kv_cache = kv_cache
        kv_cache.events = []
        self._index = 0
        self._start = 0.0
        self._running: set[str] = set()

    def begin(self, scheduler: Scheduler) -> None:
        """Call before ``schedule()``: the step's start time and who was running already."""
        self._start = time.monotonic()
        self._running = {r.request_id for r in scheduler.running}

    def entries(self, out: SchedulerOutput) -> list[ScheduledEntry]:
        """Each scheduled request's tokens by kind; call after ``schedule()``, before the update."""
        entries = []
        for s in out.scheduled:
            request = s.request
            num_drafts = len(s.spec_token_ids)
            num_known = s.num_new_tokens - num_drafts
            # A step that reaches the last token of a request that has output already is its decode.
            decode = 1 if s.samples and request.num_output_tokens > 0 else 0
            cached = -1 if request.request_id in self._running else s.num_computed_before
            entries.append(ScheduledEntry(request.request_id, num_known - decode, decode, num_drafts, 0, cached))
        return entries

    def finish(
        self, scheduler: Scheduler, kv_usage: float, entries: list[ScheduledEntry] | None = None,
        out: SchedulerOutput | None = None, sampled: list[list[int]] | None = None,
    ) -> StepRecord:
        """The record of the step begun last (or of an idle moment: no ``entries``), taking the ops so far.

        Args:
            sampled: per scheduled request, the tokens it accepted (accepted drafts, then one sampled).
        """
        entries = entries or []
        if sampled is not None:
            for entry, tokens in zip(entries, sampled):
                if entry.draft:
                    entry.accepted = max(0, min(entry.draft, len(tokens) - 1))
        end = time.monotonic()
        record = StepRecord(
            self._index,
            self._start if entries else end,
            end,
            entries,
            self._kv_cache.events,
            [r.request_id for r in out.preempted] if out is not None else [],
            len(scheduler.running),
            len(scheduler.waiting),
            kv_usage,
        )
        self._kv_cache.events = []
        self._index += 1
        return record
