"""The asyncio front end of a serving engine whose core runs in its own process.

Tokenization, incremental detokenization and stop strings run here, in the API process; the
core sees token ids only. One output-handler task reads every step's outputs from the core,
turns them into ``RequestOutput``s and hands each to the queue of the request it belongs to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import AsyncMPClient, EngineDeadError
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.live_view.view import LiveView
from pagedllm.models.loader import load_tokenizer, resolve_model
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass
class PreparedRequest:
    """A validated, tokenized request, not yet queued."""

    request_id: str
    prompt: str | None
    core_requests: list[EngineCoreRequest]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.core_requests[0].prompt_token_ids


class AsyncLLM:
    """Serves requests from an engine core in a spawned process.

    Construction starts the core process and blocks until its model is loaded; ``start()``
    must then run inside the event loop before the first ``generate``.

    Args:
        config: engine settings.
        log_stats: log a throughput line every few seconds while serving.

    Raises:
        RuntimeError: the engine core failed to start.
    """

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        self.config = config
        self.client = AsyncMPClient(config)
        try:
            # The core loads the model meanwhile.
            self.tokenizer = load_tokenizer(resolve_model(config.model))
            ready = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        assert ready.model_config is not None
        self.model_config = ready.model_config
        assert ready.kv_cache_config is not None
        self.kv_config = ready.kv_cache_config
        self.max_model_len = self.kv_config.max_model_len
        self.num_blocks = self.kv_config.num_blocks
        self.block_size = self.kv_config.block_size
        self.processor = Processor(
            self.tokenizer, self.max_model_len, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        self.stat_logger = StatLogger() if log_stats else None
        self.live_view = LiveView.for_engine(config, self.kv_config) if config.live_view else None
        self.dead_error: EngineDeadError | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._dead_callbacks: list[Callable[[], None]] = []
        self._handler: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start reading core outputs (call inside the running event loop)."""
        self.client.start()
        self._handler = asyncio.create_task(self._output_loop(), name="pagedllm-output-handler")

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the loop) once, when the core process dies unexpectedly."""
        self._dead_callbacks.append(callback)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.client.is_alive

    def shutdown(self) -> None:
        """Abort what is in flight, stop the output handler, stop the core process."""
        self.abort_all()
        if self._handler is not None:
            self._handler.cancel()
        self.client.shutdown()

    # -- requests ------------------------------------------------------------------------
    def prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams, cache_salt: str | None = None
    ) -> PreparedRequest:
        """Validate and tokenize without queueing, so a batch can be checked before any of it runs.

        Raises:
            ValueError: for invalid input; the message says what and the allowed range.
        """
        text, token_ids = self.processor.tokenize(prompt)
        return PreparedRequest(request_id, text, self.processor.process(request_id, token_ids, params, cache_salt))

    async def generate(self, request: PreparedRequest, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """Queue a prepared request and yield its outputs: deltas if ``stream``, else one final output.

        Closing or cancelling the iterator early aborts the request in the core.

        Raises:
            EngineDeadError: the core process has died.
        """
        if self.dead_error is not None:
            raise self.dead_error
        rid = request.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self.output_processor.add_request(rid, request.prompt, request.core_requests, stream)
        if self.live_view is not None:
            self.live_view.on_arrival(request.core_requests)
        try:
            self.client.add_requests(request.core_requests)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if rid in self.output_processor.requests:  # the consumer left before the end
                self.abort(rid)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in the core and the front end; return its final (aborted) output."""
        child_ids = self.output_processor.child_ids(request_id)
        out = self.output_processor.abort(request_id)
        self.client.abort_requests(child_ids)
        if self.live_view is not None:
            self.live_view.on_finish(child_ids, "abort", time.monotonic())
        if out is not None:
            self.metrics.record_finished(out, time.monotonic())
        return out

    def abort_all(self) -> None:
        """Abort every in-flight request; each consumer receives a final output ("abort")."""
        for rid, queue in list(self._queues.items()):
            out = self.abort(rid)
            if out is not None:
                queue.put_nowait(out)

    async def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache's unused blocks; False if blocks are still in use."""
        if self.dead_error is not None:
            raise self.dead_error
        return bool(await self.client.call_utility("reset_prefix_cache"))

    # -- the output handler ----------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                self._process(await self.client.get_output())
        except EngineDeadError as e:
            self._fail(e)
        except Exception as e:
            # A bug here would leave every request waiting forever: fail loudly instead.
            logger.exception("output handler failed")
            self._fail(EngineDeadError(f"output handler failed: {e}"))

    def _process(self, core_out: EngineCoreOutputs) -> None:
        if self.live_view is not None:
            self.live_view.on_outputs(core_out)
        outputs, to_abort = self.output_processor.process_outputs(core_out.outputs)
        self.client.abort_requests(to_abort)  # stop strings found here end requests the core still runs
        now = time.monotonic()
        if self.live_view is not None:
            self.live_view.on_finish(to_abort, "stop", now)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
            if out.finished:
                self.metrics.record_finished(out, now)
        timings = list(self.output_processor.timings)
        self.output_processor.timings.clear()
        num_gen = sum(len(o.new_token_ids) for o in core_out.outputs)
        num_batched = core_out.stats.num_batched_tokens if core_out.stats else 0
        num_prompt = max(num_batched - num_gen, 0)
        self.metrics.record_step(core_out.stats, num_prompt, num_gen, timings)
        if self.stat_logger is not None:
            self.stat_logger.record(core_out.stats, num_prompt, num_gen)

    def _fail(self, error: EngineDeadError) -> None:
        logger.error("engine core is dead: %s; failing %d in-flight requests", error, len(self._queues))
        self.dead_error = error
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self._dead_callbacks:
            callback()
