"""The asyncio front end of a serving engine whose core runs in its own process (or whose
``data_parallel_size`` cores run in as many processes).

Tokenization, incremental detokenization and stop strings run here, in the API process; the
cores see token ids only. One output-handler task per core reads every step's outputs from
it, turns them into ``RequestOutput``s and hands each to the queue of the request it belongs
to. A core that dies fails the requests it held; the engine is dead when no core is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.dp_client import DPAsyncMPClient
from pagedllm.engine.lora_check import LoRAChecker
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.engine.metrics import EngineMetrics, sum_stats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, PromptType, prompt_cache_salt
from pagedllm.engine.stat_logger import StatLogger
from pagedllm.live_view.view import LiveView
from pagedllm.models.loader import load_tokenizer, resolve_model
from pagedllm.lora_request import LoRARequest
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
    """Serves requests from ``config.data_parallel_size`` engine cores in spawned processes.

    Construction starts the core processes and blocks until their models are loaded;
    ``start()`` must then run inside the event loop before the first ``generate``.

    Args:
        config: engine settings.
        model_name: the served model's name, which labels the metrics' series (vLLM's
            ``model_name``: the first served name).
        log_stats: log a throughput line every few seconds while serving.

    Raises:
        RuntimeError: an engine core failed to start.
        ValueError: a setting data parallelism cannot serve (the live view).
    """

    def __init__(self, config: EngineConfig, model_name: str, log_stats: bool = True) -> None:
        self.config = config
        self.num_engines = config.data_parallel_size
        self.client = DPAsyncMPClient(config)
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
            self.tokenizer, self.max_model_len, self.model_config.vocab_size, self.model_config.eos_token_ids,
            LoRAChecker(config, self.model_config), self.kv_config.kv_limited,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(self.num_engines, self.max_model_len, model_name, self.kv_config)
        self.stat_logger = StatLogger() if log_stats else None
        self.live_view = LiveView.for_engine(config, self.kv_config) if config.live_view else None
        self.dead_error: EngineDeadError | None = None  # set once no core is left
        self.dead_cores: dict[int, EngineDeadError] = {}
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._engine_of: dict[str, int] = {}  # in-flight request id -> the core serving it
        self._core_stats: dict[int, SchedulerStats] = {}  # each live core's latest, for the log line
        self._dead_callbacks: list[Callable[[], None]] = []
        self._handlers: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start reading core outputs, and the log line's timer (call inside the running event loop)."""
        self.client.start()
        self._handlers = [
            asyncio.create_task(self._output_loop(i), name=f"pagedllm-output-handler-{i}")
            for i in range(self.num_engines)
        ]
        if self.stat_logger is not None:
            self._handlers.append(asyncio.create_task(self._stat_log_loop(), name="pagedllm-stat-logger"))

    def on_dead(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (in the loop) once, when the last core process dies unexpectedly."""
        self._dead_callbacks.append(callback)

    @property
    def is_healthy(self) -> bool:
        """Every core is alive (with data parallelism the others may still serve when one is not)."""
        return self.dead_error is None and all(self.client.is_alive(i) for i in range(self.num_engines))

    def health_error(self) -> str:
        """Why the engine is not healthy: which cores are dead, and why, as far as known yet."""
        dead = [i for i in range(self.num_engines) if not self.client.is_alive(i)]
        if self.num_engines == 1:
            return f"engine core is dead: {self.dead_error or self.dead_cores.get(0) or 'its process exited'}"
        why = "; ".join(f"{self.dead_cores[i]}" if i in self.dead_cores else f"engine core {i} exited" for i in dead)
        return (f"engine core{'s' * (len(dead) > 1)} {', '.join(map(str, dead))} of {self.num_engines} dead "
                f"({why}); {self.num_engines - len(dead)} serving")

    def shutdown(self) -> None:
        """Abort what is in flight, stop the output handlers, stop the core processes."""
        self.abort_all()
        for handler in self._handlers:
            handler.cancel()
        self.client.shutdown()

    # -- requests ------------------------------------------------------------------------
    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> PreparedRequest:
        """Validate and tokenize without queueing, so a batch can be checked before any of it runs.

        Raises:
            ValueError: for invalid input; the message says what and the allowed range.
        """
        text, token_ids = self.processor.tokenize(prompt)
        cache_salt = prompt_cache_salt(prompt, cache_salt)  # a prompt dict's, unless given
        return PreparedRequest(
            request_id, text, self.processor.process(request_id, token_ids, params, cache_salt, lora_request)
        )

    async def generate(self, request: PreparedRequest, stream: bool = False) -> AsyncIterator[RequestOutput]:
        """Queue a prepared request and yield its outputs: deltas if ``stream``, else one final output.

        The request goes to one core (``DPRouter``'s choice). Closing or cancelling the iterator
        early aborts the request in the core.

        Raises:
            EngineDeadError: the core serving it has died, or every core has.
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
            self._engine_of[rid] = self.client.add_requests(request.core_requests)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self._engine_of.pop(rid, None)
            if rid in self.output_processor.requests:  # the consumer left before the end
                self.abort(rid)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in the core and the front end; return its final (aborted) output."""
        child_ids = self.output_processor.child_ids(request_id)
        out = self.output_processor.abort(request_id)
        self.client.abort_requests(child_ids)
        if self.live_view is not None:
            self.live_view.on_finish(child_ids, "abort", time.monotonic())
        self.metrics.record(self.output_processor.take_metrics())
        return out

    def abort_all(self) -> None:
        """Abort every in-flight request; each consumer receives a final output ("abort")."""
        for rid, queue in list(self._queues.items()):
            out = self.abort(rid)
            if out is not None:
                queue.put_nowait(out)

    async def reset_prefix_cache(self) -> bool:
        """Drop every live core's prefix cache's unused blocks; False if blocks are still in use on one.

        Raises:
            EngineDeadError: every core has died, or one died during the call.
        """
        if self.dead_error is not None:
            raise self.dead_error
        return all(await self.client.call_utility("reset_prefix_cache"))

    async def _stat_log_loop(self) -> None:
        """The log line's timer: a burst's last line comes when its interval ends."""
        while True:
            await asyncio.sleep(self.stat_logger.interval)
            self.stat_logger.tick()

    # -- the output handlers ---------------------------------------------------------------
    async def _output_loop(self, engine: int) -> None:
        try:
            while True:
                self._process(engine, await self.client.get_output(engine))
        except EngineDeadError as e:
            self._fail_core(engine, e)
        except Exception as e:
            # A bug here would leave every request waiting forever: fail loudly instead.
            logger.exception("output handler failed")
            self._fail(EngineDeadError(f"output handler failed: {e}"))

    def _process(self, engine: int, core_out: EngineCoreOutputs) -> None:
        if self.live_view is not None:
            self.live_view.on_outputs(core_out)
        outputs, to_abort = self.output_processor.process_outputs(core_out.outputs, core_out.timestamp)
        self.client.abort_requests(to_abort)  # stop strings found here end requests the core still runs
        now = time.monotonic()
        if self.live_view is not None:
            self.live_view.on_finish(to_abort, "stop", now)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        step = self.output_processor.take_metrics()
        self.metrics.record(step)
        self.metrics.record_stats(engine, core_out.stats)
        if self.stat_logger is not None:
            stats = core_out.stats
            if stats is not None:
                self._core_stats[engine] = stats
                stats = sum_stats(list(self._core_stats.values()))
            self.stat_logger.record(stats, step.num_prompt_tokens, step.num_generation_tokens)

    def _fail_core(self, engine: int, error: EngineDeadError) -> None:
        """Core ``engine`` died: fail the requests it held; the engine is dead if it was the last."""
        self.dead_cores[engine] = error
        self.client.fail_core(engine)
        self._core_stats.pop(engine, None)
        self.metrics.remove_engine(engine)
        if len(self.dead_cores) == self.num_engines:
            self._fail(error)
            return
        held = [rid for rid, e in self._engine_of.items() if e == engine]
        logger.error("%s; failing its %d in-flight requests; %d of %d engine cores serving", error, len(held),
                     self.num_engines - len(self.dead_cores), self.num_engines)
        for rid in held:
            self._queues[rid].put_nowait(error)

    def _fail(self, error: EngineDeadError) -> None:
        logger.error("engine core is dead: %s; failing %d in-flight requests", error, len(self._queues))
        self.dead_error = error
        for queue in self._queues.values():
            queue.put_nowait(error)
        for callback in self._dead_callbacks:
            callback()
