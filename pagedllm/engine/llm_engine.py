"""The synchronous front end: tokenizer, input and output processing over an engine core."""

from __future__ import annotations

import time

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.lora_check import LoRAChecker
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType, prompt_cache_salt
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.live_view.view import LiveView
from pagedllm.models.loader import load_tokenizer, resolve_model
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    """Runs the engine core in this process and steps it on demand.

    Args:
        config: engine settings.
        log_stats: log a throughput line every few seconds while stepping.

    Raises:
        ValueError: ``config.data_parallel_size > 1`` (several cores are served by ``pagedllm serve``).
    """

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size {config.data_parallel_size}: data parallelism runs several engine cores behind "
                "`pagedllm serve --data-parallel-size N`; the offline LLM runs one (use tensor_parallel_size to split it)"
            )
        self.config = config
        self.tokenizer = load_tokenizer(resolve_model(config.model))
        self.core = EngineCore(config)
        model_config = self.core.model_config
        self.max_model_len = self.core.max_model_len
        self.processor = Processor(
            self.tokenizer, self.max_model_len, model_config.vocab_size, model_config.eos_token_ids,
            LoRAChecker(config, model_config), self.core.kv_config.kv_limited, cap_max_tokens=True,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLogger() if log_stats else None
        self.live_view = LiveView.for_engine(config, self.core.kv_config) if config.live_view else None

    def shutdown(self) -> None:
        """Stop the engine core's tensor-parallel workers (if any); idempotent."""
        self.core.shutdown()

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, list[EngineCoreRequest]]:
        """Validate and tokenize a request without queueing it: (prompt text, core requests).

        Raises:
            ValueError: for invalid input.
        """
        text, token_ids = self.processor.tokenize(prompt)
        cache_salt = prompt_cache_salt(prompt, cache_salt)  # a prompt dict's, unless given
        return text, self.processor.process(request_id, token_ids, params, cache_salt, lora_request)

    def submit(self, request_id: str, text: str | None, core_requests: list[EngineCoreRequest], stream: bool = False) -> None:
        """Queue a request made by ``prepare``."""
        self.output_processor.add_request(request_id, text, core_requests, stream)
        if self.live_view is not None:
            self.live_view.on_arrival(core_requests)
        for r in core_requests:
            self.core.add_request(r)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        stream: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate, tokenize and queue a request (ValueError on invalid input)."""
        text, core_requests = self.prepare(request_id, prompt, params, cache_salt, lora_request)
        self.submit(request_id, text, core_requests, stream)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        child_ids = self.output_processor.child_ids(request_id)
        self.core.abort_requests(child_ids)
        if self.live_view is not None:
            self.live_view.on_finish(child_ids, "abort", time.monotonic())
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests) or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_out = self.core.step()
        if self.live_view is not None:
            self.live_view.on_outputs(core_out)
        outputs, to_abort = self.output_processor.process_outputs(core_out.outputs, core_out.timestamp)
        if to_abort:
            self.core.abort_requests(to_abort)
            if self.live_view is not None:
                self.live_view.on_finish(to_abort, "stop", time.monotonic())
        step = self.output_processor.take_metrics()  # taken every step, so none pile up
        if self.stat_logger is not None:
            self.stat_logger.record(core_out.stats, step.num_prompt_tokens, step.num_generation_tokens)
        return outputs
