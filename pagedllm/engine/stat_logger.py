"""The periodic log line: throughput, queue sizes, KV cache usage, prefix-cache hit rate."""

from __future__ import annotations

import logging
import time

from pagedllm.engine.messages import SchedulerStats

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
        self._last = now
        self._prompt_tokens = self._generation_tokens = 0
