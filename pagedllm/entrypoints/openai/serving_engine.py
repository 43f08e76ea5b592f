"""What the completion and chat handlers share: model check, sampling params, logprobs, SSE, fan-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, PreparedRequest
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, RequestModel, SamplingRequest
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_params
from pagedllm.entrypoints.openai.tools import check_tools
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_lora import ServingLoRA

T = TypeVar("T")

logger = logging.getLogger("pagedllm")

# Each sample is an engine request; a cap keeps one HTTP request from flooding the engine.
MAX_N = 256


def sse(payload: BaseModel | dict) -> str:
    """One Server-Sent Events ``data:`` line."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def guard_sse(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The SSE lines of a stream; if making them raises, the stream ends with an OpenAI error
    event (500 InternalServerError, naming the exception's type) and ``[DONE]`` rather than a
    closed connection. Leaving early closes ``lines``."""
    async with contextlib.aclosing(lines):
        try:
            async for line in lines:
                yield line
        except Exception as e:
            logger.exception("internal error in a stream", exc_info=e)
            yield sse(OpenAIError(500, f"internal error: {type(e).__name__}", "InternalServerError").body())
            yield SSE_DONE


class OpenAIServing:
    """Base of the route handlers.

    Args:
        engine: the running engine.
        served_model_names: the base model's names, any of which the ``model`` field may give
            (vLLM's ``--served-model-name a b``); the first answers a request that gives none.
        loras: the LoRA adapters requests may name instead (None: none).
    """

    def __init__(self, engine: AsyncLLM, served_model_names: tuple[str, ...], loras: ServingLoRA | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.loras = loras
        self.tokenizer = engine.tokenizer
        # The model creator's sampling defaults (generation_config.json), for the fields a request leaves unset.
        self.default_sampling: dict[str, float | int] = dict(
            getattr(getattr(engine, "model_config", None), "sampling_defaults", None) or {}
        )

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, None for the base model (also for no name: absent,
        null or "", as vLLM); 404 for anything else."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model and model not in self.served_model_names:
            served = ", ".join(f"`{n}`" for n in self.served_model_names)
            raise OpenAIError(404, f"the model `{model:.200}` does not exist; this server serves {served}",
                              "NotFoundError", "model")
        return None

    def response_model(self, model: str | None) -> str:
        """A response's ``model`` field, as vLLM fills it: the name the request gave (the base
        model's or an adapter's, checked by ``check_model``), else (none, or "") the base model's."""
        return model or self.served_model_names[0]

    def check_request(self, req: RequestModel) -> None:
        """The request's own checks (text, field combinations), its structured output (compiled)
        and tools, then its model.

        Raises:
            OpenAIError: 400 naming the field at fault; 404 for another model.
        """
        try:
            req.check()
            if isinstance(req, SamplingRequest):
                structured_outputs_params(req)
            if isinstance(req, ChatCompletionRequest):
                check_tools(req)
        except ValueError as e:
            raise OpenAIError.bad_request(e) from None
        self.check_model(getattr(req, "model", None))

    def sampling_params(
        self,
        req: SamplingRequest,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        fields: Mapping[str, str] = {},
    ) -> SamplingParams:
        """SamplingParams for one prompt; an unset (or null) field takes the model's
        generation_config.json default where it recommends one (``default_sampling``, as vLLM's
        ``--generation-config auto``), else SamplingParams' default.

        ``max_tokens`` None means all the room the context leaves after the prompt (its kept
        tokens under vLLM's ``truncate_prompt_tokens``, checked by ``SamplingParams``); a
        ``max_new_tokens`` of generation_config.json caps it (vLLM's server-wide limit);
        ``fields`` as ``OpenAIError.bad_request``'s.

        Raises:
            OpenAIError: 400 naming the field, for values outside their ranges.
        """
        if not 1 <= req.n <= MAX_N:
            raise OpenAIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
        if max_tokens is None:
            keep = req.truncate_prompt_tokens
            if isinstance(keep, int) and keep >= 1:  # other values: SamplingParams says what is wrong
                prompt_len = min(prompt_len, keep)
            max_tokens = max(self.engine.max_model_len - prompt_len, 1)
        if "max_tokens" in self.default_sampling:
            max_tokens = min(max_tokens, int(self.default_sampling["max_tokens"]))
        kwargs = {
            name: getattr(req, name) if getattr(req, name) is not None else self.default_sampling[name]
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty")
            if getattr(req, name) is not None or name in self.default_sampling
        }
        try:
            return SamplingParams(
                n=req.n,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                structured_outputs=structured_outputs_params(req),
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                **kwargs,
            )
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from None

    def prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams, cache_salt: str | None,
        model: str | None = None, fields: Mapping[str, str] = {},
    ) -> PreparedRequest:
        """Validate and tokenize one prompt for ``model`` (the base or an adapter): 400 naming
        the field on invalid input (the request's name for it in ``fields``, as
        ``OpenAIError.bad_request``'s: chat's prompt comes from ``messages``), 404 for an
        unknown model."""
        lora = self.check_model(model)
        try:
            return self.engine.prepare(request_id, prompt, params, cache_salt, lora)
        except ValueError as e:
            raise OpenAIError.bad_request(e, fields) from None

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])


def top_n(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    """The ``n`` most likely tokens of one position (the entry also holds the sampled token)."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)[:n]


def num_output_tokens(outputs: list[RequestOutput]) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


async def _last(iterator: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for out in iterator:
        final = out
    assert final is not None
    return final


async def gather_final(iterators: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final output of each non-streaming request, in order.

    If one fails or the caller is cancelled, the others are cancelled (so aborted) too.
    """
    tasks = [asyncio.ensure_future(_last(it)) for it in iterators]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Leaving early (or being cancelled) cancels the pending reads, which aborts the requests.
    """
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
