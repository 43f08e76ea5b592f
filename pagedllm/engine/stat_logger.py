"""The periodic log line: throughput, queue sizes, KV cache usage, prefix-cache hit rate, and
speculative decoding's acceptance over the interval (when drafts were verified)."""

from __future__ import annotations

import logging
import time

from pagedllm.engine.messages import SchedulerStats
from pagedllm.core.spec_decode_stats import acceptance_rate, mean_acceptance_length

logger = logging.getLogger("pagedllm")


class StatLogger:
    """Accumulates token counts and logs one line every ``interval`` seconds.

    Args:
        interval: seconds between log lines.
    """

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_stats = SchedulerStats()  # cumulative counts at the previous line

    def record(self, stats: SchedulerStats | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self._prompt_tokens += num_prompt_tokens
        self._generation_tokens += num_generation_tokens
        now = time.monotonic()
        if stats is None or now - self._last < self.interval:
            return
        elapsed = now - self._last
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, "
            "waiting: %d, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%, preemptions: %d",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hit_rate,
            stats.num_preemptions,
        )
        self._log_spec_decoding(stats)
        self._last = now
        self._prompt_tokens = self._generation_tokens = 0

    def _log_spec_decoding(self, stats: SchedulerStats) -> None:
        """Acceptance of the drafts verified since the previous line; nothing if there were none."""
        last = self._last_stats
        self._last_stats = stats
        num_drafts = stats.spec_num_drafts - last.spec_num_drafts
        if num_drafts <= 0:
            return
        draft_tokens = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
        accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
        before = last.spec_accepted_per_position
        per_position = [
            (n - (before[i] if i < len(before) else 0)) / num_drafts
            for i, n in enumerate(stats.spec_accepted_per_position)
        ]
        logger.info(
            "speculative decoding: drafts: %d, draft tokens: %d, accepted tokens: %d, acceptance rate: %.1f%%, "
            "mean acceptance length: %.2f, acceptance per position: %s",
            num_drafts,
            draft_tokens,
            accepted,
            100 * acceptance_rate(accepted, draft_tokens),
            mean_acceptance_length(accepted, num_drafts),
            "[" + ", ".join(f"{a:.3f}" for a in per_position) + "]",
        )
