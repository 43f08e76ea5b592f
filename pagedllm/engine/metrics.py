"""Prometheus metrics of a serving engine, named as vLLM's with the ``pagedllm:`` prefix.

Every series but ``cache_config_info``'s carries vLLM's ``model_name`` label (the served
model's name), by which vLLM's dashboards select their series. As vLLM's, the scheduler gauges
(running, waiting, KV cache usage) carry an ``engine`` label, the data-parallel core's index
("0" alone without data parallelism), so that one dashboard serves any number of cores
(``sum(pagedllm:num_requests_running)``); a dead core's series are removed. Counters and
histograms are the sums over every core: each core reports cumulative counts, and each core's
increments are added.

The per-request series (``request_success``, ``time_to_first_token_seconds``, and the
``e2e_request_latency_seconds``, ``request_*_time_seconds``, ``request_time_per_output_token_seconds``,
``request_prompt_tokens``, ``request_generation_tokens`` and ``request_params_max_tokens``
histograms) count one request per sequence: a request with ``n`` samples is ``n`` engine
requests and counts ``n`` in each of them, as vLLM counts its ``n`` child requests, so that
ratios between the series hold whatever the ``n`` of the requests. ``request_params_n`` and
``request_max_num_generation_tokens`` count the user's request once, when its last sample ends.

The phase intervals are vLLM's, read on the clock of the core that ran the request: queue
(queued in the core to first scheduled), prefill (first scheduled to first token), decode (first
to last token), inference (first scheduled to last token); a phase a request never reached (an
abort while waiting) is not observed, so those histograms may count fewer requests than
``request_success``. Time to first token and end-to-end latency run from the request's arrival in
the front end (before tokenization is done) to its first token or its end there.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.core.kv_cache_config import KVCacheConfig
from pagedllm.core.request import FINISH_REASONS
from pagedllm.engine.messages import SchedulerStats
from pagedllm.engine.output_processor import StepMetrics

# vLLM's bucket edges, so dashboards built for vLLM read these histograms unchanged.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count bucket edges: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (included)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several cores' latest stats as one engine's: counts added, KV cache usage averaged
    (every core has the same number of blocks, so the mean is the fraction of all blocks)."""
    if len(stats) == 1:
        return stats[0]
    fields = [f for f in SchedulerStats.__struct_fields__ if f not in ("kv_cache_usage", "spec_accepted_per_position")]
    total = SchedulerStats(**{f: sum(getattr(s, f) for s in stats) for f in fields})
    total.kv_cache_usage = sum(s.kv_cache_usage for s in stats) / len(stats)
    width = max(len(s.spec_accepted_per_position) for s in stats)
    total.spec_accepted_per_position = [
        sum(s.spec_accepted_per_position[i] for s in stats if i < len(s.spec_accepted_per_position))
        for i in range(width)
    ]
    return total


class EngineMetrics:
    """Owns a private registry (so several engines in one process do not collide).

    Args:
        num_engines: the data-parallel cores (each gets its gauges' series from the start).
        max_model_len: the context length: the token-count histograms' buckets go up to it.
        model_name: the served model's name, every series' ``model_name`` label (as vLLM's: the
            first served name), by which vLLM's dashboards select their series.
        kv_config: one core's KV cache (every core's is alike), stated as vLLM's
            ``cache_config_info``: a gauge of 1 whose labels are the cache's dtype, block size,
            block count and bytes per block; None: not stated.
    """

    def __init__(
        self, num_engines: int, max_model_len: int, model_name: str, kv_config: KVCacheConfig | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, ["model_name"], registry=r).labels(model_name)

        def histogram(name: str, documentation: str, buckets: list[float]) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        def per_engine_gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, ["model_name", "engine"], registry=r)

        if kv_config is not None:
            labels = {"cache_dtype": kv_config.dtype, "block_size": str(kv_config.block_size),
                      "num_gpu_blocks": str(kv_config.num_blocks), "bytes_per_block": str(kv_config.bytes_per_block)}
            Gauge("pagedllm:cache_config_info", "The KV cache's configuration (labels); always 1.", list(labels),
                  registry=r).labels(**labels).set(1)
        self.running = per_engine_gauge("pagedllm:num_requests_running", "Requests in the running batch.")
        self.waiting = per_engine_gauge("pagedllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = per_engine_gauge("pagedllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.resident_memory = per_engine_gauge(
            "pagedllm:engine_core_resident_memory_bytes", "Resident memory of the engine core process, in bytes."
        )
        self._gauges = (self.running, self.waiting, self.kv_usage, self.resident_memory)
        for engine in range(num_engines):
            for gauge in self._gauges:
                gauge.labels(model_name, str(engine))
        self.preemptions = counter("pagedllm:num_preemptions", "Preemptions of running requests.")
        self.prompt_tokens = counter(
            "pagedllm:prompt_tokens",
            "Prompt tokens of requests whose prefill completed, prefix-cache hits included; each of n samples "
            "counts its prompt."
        )
        self.prompt_tokens_cached = counter(
            "pagedllm:prompt_tokens_cached", "Of prompt_tokens, those found in the prefix cache (not computed)."
        )
        self.generation_tokens = counter(
            "pagedllm:generation_tokens", "Output tokens the requests got (their usage's completion_tokens)."
        )
        self.prefix_queries = counter(
            "pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, once per request."
        )
        self.prefix_hits = counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter(
            "pagedllm:spec_decode_num_drafts", "Speculative drafts verified (request-steps with draft tokens)."
        )
        self.spec_draft_tokens = counter(
            "pagedllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "pagedllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."
        )
        self.spec_accepted_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos", "Speculative draft tokens accepted, by draft position.",
            ["model_name", "position"], registry=r,
        )
        self.ttft = histogram(
            "pagedllm:time_to_first_token_seconds", "Arrival to first token, in seconds.", buckets=_TTFT_BUCKETS
        )
        self.itl = histogram(
            "pagedllm:inter_token_latency_seconds", "Time between a request's successive output steps, in seconds.",
            buckets=_ITL_BUCKETS
        )
        self.e2e = histogram(
            "pagedllm:e2e_request_latency_seconds", "Arrival to the end of the request, in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "pagedllm:request_queue_time_seconds", "Time from queued in an engine core to first scheduled, in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "pagedllm:request_prefill_time_seconds", "Time from first scheduled to the first token, in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "pagedllm:request_decode_time_seconds", "Time from the first token to the last, in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "pagedllm:request_inference_time_seconds", "Time from first scheduled to the last token, in seconds.",
            buckets=_REQUEST_LATENCY_BUCKETS
        )
        self.request_tpot = histogram(
            "pagedllm:request_time_per_output_token_seconds",
            "A request's decode time per output token after the first (0 with one token or none), in seconds.",
            buckets=_ITL_BUCKETS
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "pagedllm:request_prompt_tokens", "Prompt tokens of a finished request.", buckets=token_buckets
        )
        self.request_prefill_kv_computed = histogram(
            "pagedllm:request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request's prefill computed (its prefix-cache hits excluded).",
            buckets=token_buckets,
        )
        self.request_generation_tokens = histogram(
            "pagedllm:request_generation_tokens", "Output tokens a finished request got.", buckets=token_buckets
        )
        self.request_max_tokens = histogram(
            "pagedllm:request_params_max_tokens", "The max_tokens parameter of a finished request (when set, above 0).",
            buckets=token_buckets
        )
        self.request_n = histogram(
            "pagedllm:request_params_n", "The n parameter of a finished request.", buckets=_N_BUCKETS
        )
        self.request_max_generation_tokens = histogram(
            "pagedllm:request_max_num_generation_tokens",
            "The most output tokens one of a finished request's n samples got.", buckets=token_buckets
        )
        self.iteration_tokens = histogram(
            "pagedllm:iteration_tokens_total",
            "Tokens of an engine step with outputs: prompt tokens of the prefills it completed plus output tokens.",
            buckets=_ITERATION_TOKENS_BUCKETS
        )
        self.success = Counter(
            "pagedllm:request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:  # exported from the start at 0, as vLLM does, so rates need no first request
            self.success.labels(model_name, reason)
        # Each core reports cumulative counts; counters take the increments.
        self._last = [SchedulerStats() for _ in range(num_engines)]

    def record(self, m: StepMetrics) -> None:
        """Apply what the front end measured of one core step's outputs (or of an abort)."""
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.prompt_tokens_cached.inc(m.num_cached_prompt_tokens)
        self.generation_tokens.inc(m.num_generation_tokens)
        if m.num_outputs:  # as vLLM, a step that returned outputs
            self.iteration_tokens.observe(m.num_prompt_tokens + m.num_generation_tokens)
        for latency in m.time_to_first_tokens:
            self.ttft.observe(latency)
        for latency in m.inter_token_latencies:
            self.itl.observe(latency)
        for f in m.finished_samples:
            self.success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            if f.num_cached_tokens is not None:
                self.request_prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            if f.max_tokens:
                self.request_max_tokens.observe(f.max_tokens)
            for histogram, interval in ((self.queue_time, f.queue_time), (self.prefill_time, f.prefill_time),
                                        (self.decode_time, f.decode_time), (self.inference_time, f.inference_time)):
                if interval is not None:
                    histogram.observe(interval)
            if f.decode_time is not None:
                decode_steps = f.num_generation_tokens - 1
                self.request_tpot.observe(f.decode_time / decode_steps if decode_steps > 0 else 0.0)
        for req in m.finished_requests:
            self.request_n.observe(req.n)
            self.request_max_generation_tokens.observe(req.max_num_generation_tokens)

    def record_stats(self, engine: int, stats: SchedulerStats | None) -> None:
        """Apply core ``engine``'s scheduler stats (None: a message without them)."""
        if stats is None:
            return
        labels = self.model_name, str(engine)
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
        self.resident_memory.labels(*labels).set(stats.resident_memory_bytes)
        last = self._last[engine]
        self.preemptions.inc(max(stats.num_preemptions - last.num_preemptions, 0))
        self.prefix_queries.inc(max(stats.prefix_cache_queries - last.prefix_cache_queries, 0))
        self.prefix_hits.inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        self.spec_drafts.inc(max(stats.spec_num_drafts - last.spec_num_drafts, 0))
        self.spec_draft_tokens.inc(max(stats.spec_num_draft_tokens - last.spec_num_draft_tokens, 0))
        self.spec_accepted_tokens.inc(max(stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens, 0))
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            before = last.spec_accepted_per_position[position] if position < len(last.spec_accepted_per_position) else 0
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(max(accepted - before, 0))
        self._last[engine] = stats

    def remove_engine(self, engine: int) -> None:
        """Drop a dead core's gauge series (its counts stay in the counters)."""
        for gauge in self._gauges:
            gauge.remove(self.model_name, str(engine))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
