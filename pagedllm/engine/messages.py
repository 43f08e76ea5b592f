"""Messages between the front end and the engine core: plain msgspec structs, never pickle."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pagedllm.live_view.records import StepRecord
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestError, TokenLogprobs
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # with finish_reason "error": what failed, for logs and the client
    # On a request's first output only (its core's time.monotonic(), seconds): when the core
    # queued it and when it first scheduled it (None: never scheduled, e.g. failed while being
    # admitted). With ``EngineCoreOutputs.timestamp`` they give vLLM's queue, prefill, decode
    # and inference intervals, every end of them read on the same core's clock.
    queued_time: float | None = None
    scheduled_time: float | None = None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, [0, 1]
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    resident_memory_bytes: int = 0  # the core process's resident set size
    # Speculative decoding, cumulative (pagedllm.core.spec_decode_stats.SpecDecodingStats).
    spec_num_drafts: int = 0  # verifications: request-steps with draft tokens
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # [k]: acceptances of draft position i


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    timestamp: float = 0.0  # the core's time.monotonic() when the step ended: when its tokens came
    utility_call_id: int | None = None  # set on the reply to a utility call
    utility_result: Any = None
    step: StepRecord | None = None  # with the live view on: what this step (or idle moment) did


class RequestType(enum.IntEnum):
    """First frame of each front end → core message."""

    ADD = 0
    ABORT = 1
    UTILITY = 2  # (call_id, method name, args): e.g. reset_prefix_cache
    SHUTDOWN = 3
