"""The periodic log line: throughput, queue sizes, KV cache usage, prefix-cache hit rate, and
speculative decoding's acceptance over the interval (when drafts were verified)."""

from __future__ import annotations

import logging
import time

from pagedllm.engine.messages import SchedulerStats
from pagedllm.core.spec_decode_stats import acceptance_rate, mean_acceptance_length

logger = logging.getLogger("pagedllm")


class StatLogger:
    """Accumulates token counts and logs one line per ``interval`` seconds of work.

    ``record`` takes each step's outputs and ``tick`` is also called on a timer (the server's),
    so that a burst's last line comes when its interval ends, with its last tokens and the
    idle engine's stats, not with the next request, averaged over the idle time between. An
    interval starts with its first step: nothing is logged while the engine idles, and idle
    time is no part of a throughput.

    Args:
        interval: seconds between log lines.
    """

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = 0.0  # the start of the interval, set by its first step
        self._recorded = False  # a step recorded since the last line
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._stats: SchedulerStats | None = None  # the latest, which the line shows
        self._last_stats = SchedulerStats()  # cumulative counts at the previous line

    def record(self, stats: SchedulerStats | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Add one step's outputs: token counts and the scheduler's stats (None: unchanged);
        log the line if the interval has ended."""
        if not self._recorded:
            self._last, self._recorded = time.monotonic(), True
        self._prompt_tokens += num_prompt_tokens
        self._generation_tokens += num_generation_tokens
        if stats is not None:
            self._stats = stats
        self.tick()

    def tick(self) -> None:
        """Log the line if a step was recorded and ``interval`` seconds have passed since its
        interval started: throughput over them, the latest stats."""
        now = time.monotonic()
        stats = self._stats
        if not self._recorded or stats is None or now - self._last < self.interval:
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
        self._recorded = False
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
