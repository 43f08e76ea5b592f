"""``POST /v1/chat/completions``: the model's chat template, then one engine request with ``n`` samples."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec

from pagedllm.engine.async_llm import AsyncLLM, PreparedRequest
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.entrypoints.chat_template import chat_prompt, has_chat_template
from pagedllm.entrypoints.generic_tools import generic_conversation, supports_tools
from pagedllm.entrypoints.openai.errors import generation_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool, FunctionCall, ToolCall
from pagedllm.entrypoints.openai.response_bodies import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    gather_final,
    sse,
    top_n,
)
from pagedllm.entrypoints.openai.serving_lora import ServingLoRA
from pagedllm.entrypoints.openai.structured_outputs import structured_outputs_field
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tool_parsers.generic import GenericToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_stream import ToolStream
from pagedllm.entrypoints.openai.tools import (
    check_tool_constraint,
    required_calls,
    template_messages,
    tool_call_id,
    tool_constraint,
)
from pagedllm.outputs import Logprob

logger = logging.getLogger("pagedllm")


class OpenAIServingChat(OpenAIServing):
    """Handles chat completions requests, streaming or not.

    Args:
        engine, served_model_names, loras: as ``OpenAIServing``.
        tool_parser: the format "auto" tool calls are read in (``tool_parsers.TOOL_PARSERS``)
            where the chat template has a tool section. Where it has none, tools, calls and
            results take pagedllm's generic format (``generic_tools``), read by ``GenericToolParser``.
        chat_template: a Jinja template's text to render with instead of the model's.
    """

    def __init__(self, engine: AsyncLLM, served_model_names: tuple[str, ...],
                 tool_parser: type[ToolParser] = HermesToolParser, chat_template: str | None = None,
                 loras: ServingLoRA | None = None) -> None:
        super().__init__(engine, served_model_names, loras)
        self.chat_template = chat_template
        self.generic_tools = not supports_tools(self.tokenizer, chat_template)
        self.tool_parser = GenericToolParser if self.generic_tools else tool_parser
        self.has_template = has_chat_template(self.tokenizer, chat_template)
        if not self.has_template:
            logger.warning("%s has no chat template: chat completions are refused (400) unless the server is started "
                           "with --chat-template", served_model_names[0])
        elif self.generic_tools:
            logger.info("the chat template of %s has no tool section: tools, tool calls and results use pagedllm's "
                        "generic format (a system message; replies constrained to text or a JSON call)",
                        served_model_names[0])

    def _prepare(self, req: ChatCompletionRequest) -> tuple[PreparedRequest, str | None]:
        """Validate and tokenize a request (blocking; 400 naming the field on invalid input);
        also return the request field its output constraint comes from (``tools`` for a tool
        choice's; None: unconstrained), which ``generation_error`` names."""
        self.check_request(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= 20:
                raise OpenAIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        constraint = tool_constraint(req, self.generic_tools)
        if self.generic_tools and req.tool_mode in ("auto", "required"):
            try:  # built from the tools' parameters: 400 naming the tool
                check_tool_constraint(req, constraint)
            except ValueError as e:
                raise OpenAIError.bad_request(e) from None
        # tool_choice "none" keeps the tools out of the prompt too.
        token_ids = self.render(req.messages, req.add_generation_prompt, req.tools if req.tool_mode != "none" else None,
                                req.tool_mode, req.tool_choice.function.name if req.tool_mode == "named" else None)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # The request's names for the engine's parameters where they differ: an error names what the client sent.
        fields = {"prompt": "messages"}
        if req.max_completion_tokens is not None:
            fields["max_tokens"] = "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, len(token_ids), max_tokens, logprobs, fields=fields)
        constraint_field = "tools" if constraint is not None else structured_outputs_field(req)
        if constraint is not None:
            params = msgspec.structs.replace(params, structured_outputs=constraint)
        if req.tool_mode == "auto":  # call markers such as Qwen's <tool_call> are special tokens: the parser needs them
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        prepared = self.prepare(random_id("chatcmpl"), token_ids, params, req.cache_salt, req.model, fields)
        return prepared, constraint_field

    def render(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, tools: list[ChatTool] | None = None,
        tool_mode: str = "auto", tool_name: str | None = None,
    ) -> list[int]:
        """Token ids of a conversation (and the tools offered under ``tool_mode``, ``tool_name``
        for "named") under the chat template, the messages' contents as text
        (``chat_template.chat_prompt``); 400 if the template refuses it. Under a template
        without tool support, the tools and the history's calls and results are written in
        the generic format (``generic_tools.generic_conversation``)."""
        if not self.has_template:
            raise OpenAIError(400, "the model has no chat template: start the server with --chat-template to take chat "
                              "completions (/v1/completions takes prompts)", param="messages")
        conversation = template_messages(messages)
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        kwargs: dict = {"chat_template": self.chat_template}
        if self.generic_tools:
            conversation = generic_conversation(conversation, tool_dicts, tool_mode, tool_name)
        elif tool_dicts:
            kwargs["tools"] = tool_dicts
        try:
            _, token_ids = chat_prompt(self.tokenizer, conversation, add_generation_prompt, **kwargs)
        except Exception as e:  # jinja raises its own errors for conversations a template rejects
            raise OpenAIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return token_ids

    async def create(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        """A response, or the SSE lines of a stream.

        Validation (grammar checks, the chat template, tokenizing) runs in a worker thread, so
        a heavy request never holds the event loop that serves every other client.

        Raises:
            OpenAIError: 404 for another model, 400 for invalid input (before anything runs).
        """
        prepared, constraint_field = await asyncio.to_thread(self._prepare, req)
        if req.stream:
            return self._stream(req, prepared, constraint_field)
        (out,) = await gather_final([self.engine.generate(prepared)])
        if (error := generation_error(out, constraint_field)) is not None:
            raise error
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(req, c.text, c.finish_reason)
            choices.append(ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            ))
        completion = sum(len(c.token_ids) for c in out.outputs)
        prompt = len(prepared.core_requests[0].prompt_token_ids)
        return ChatCompletionResponse(id=prepared.request_id, model=self.response_model(req.model), choices=choices,
                                      usage=UsageInfo.of(prompt, completion))

    def _message(self, req: ChatCompletionRequest, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """The assistant message of one output under the request's tool mode, and its finish
        reason ("tool_calls" where the model called tools; OpenAI keeps "stop" for a named one)."""
        mode = self._parse_mode(req)
        calls: list[tuple[str, str]] | None = None
        content: str | None = text
        if mode == "named":
            calls, content = [(req.tool_choice.function.name, text)], None
        elif mode == "required":
            calls = required_calls(text)  # None: cut off, returned as text
            content = None if calls is not None else text
        elif mode == "auto":
            content, parsed = self.tool_parser(_tool_names(req)).extract(text)
            calls = [(c.name, c.arguments) for c in parsed] or None
            if calls is None:
                content = text
            elif not req.parallel_calls:  # parallel_tool_calls false: the first call, as vLLM
                calls = calls[:1]
        if not calls:
            return ChatResponseMessage(content=content), finish_reason
        tool_calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls]
        if mode != "named" and finish_reason == "stop":
            finish_reason = "tool_calls"
        return ChatResponseMessage(content=content, tool_calls=tool_calls), finish_reason

    def _parse_mode(self, req: ChatCompletionRequest) -> str:
        """How the output's calls are read: the request's tool mode, but "auto" (the generic
        parser) for a generic "required", whose output is one call or a list of them."""
        return "auto" if self.generic_tools and req.tool_mode == "required" else req.tool_mode

    async def _stream(
        self, req: ChatCompletionRequest, prepared: PreparedRequest, constraint_field: str | None
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=prepared.request_id, created=created,
                                           model=self.response_model(req.model), choices=choices, usage=usage))

        n_prompt = len(prepared.prompt_token_ids)
        num_tokens = [0] * req.n  # per choice: its tokens so far

        def usage(index: int) -> UsageInfo | None:
            """A chunk of choice ``index``'s usage so far, with continuous usage stats."""
            return UsageInfo.of(n_prompt, num_tokens[index]) if req.continuous_usage else None

        # OpenAI's streams open each choice with the role and an empty content.
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)], usage(0))
        finished: set[int] = set()
        mode = self._parse_mode(req)
        tool_streams: dict[int, ToolStream] = {}
        if mode != "none":
            name = req.tool_choice.function.name if mode == "named" else None
            max_calls = None if req.parallel_calls else 1
            tool_streams = {i: ToolStream(mode, self.tool_parser(_tool_names(req)), name, max_calls)
                            for i in range(req.n)}
        try:
            async for out in self.engine.generate(prepared, stream=True):
                if (error := generation_error(out, constraint_field)) is not None:
                    yield sse(error.body())
                    yield SSE_DONE
                    return  # leaving the stream aborts the other samples
                events = []  # this output's events (one per choice), sent as one write
                for c in out.outputs:
                    if c.index in finished or not (c.text or c.token_ids or c.finish_reason):
                        continue
                    num_tokens[c.index] += len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    logprobs = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
                    tool_stream = tool_streams.get(c.index)
                    if tool_stream is None:
                        events.append(chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                              logprobs=logprobs, finish_reason=c.finish_reason,
                                                              stop_reason=c.stop_reason)], usage(c.index)))
                        continue
                    deltas = tool_stream.update(c.text, c.finish_reason is not None)
                    finish_reason = c.finish_reason
                    if finish_reason == "stop" and tool_stream.num_calls and tool_stream.mode != "named":
                        finish_reason = "tool_calls"
                    if finish_reason is not None or logprobs is not None:
                        deltas = deltas or [DeltaMessage()]
                    for j, delta in enumerate(deltas):
                        last = j == len(deltas) - 1
                        events.append(chunk([ChatStreamChoice(index=c.index, delta=delta,
                                                              logprobs=logprobs if j == 0 else None,
                                                              finish_reason=finish_reason if last else None,
                                                              stop_reason=c.stop_reason if last else None)],
                                            usage(c.index)))
                if events:
                    yield "".join(events)
            if req.include_usage:
                yield chunk([], UsageInfo.of(n_prompt, sum(num_tokens)))
        except EngineDeadError as e:
            yield sse(OpenAIError(503, str(e), "ServiceUnavailableError").body())
        yield SSE_DONE

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None, n: int) -> ChatLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries or []):
            chosen = entry[tid]
            token = self.token_str(tid, chosen)
            top = [
                TopLogprob(token=self.token_str(t, v), logprob=v.logprob, bytes=_bytes(self.token_str(t, v), v))
                for t, v in top_n(entry, n)
            ]
            content.append(TokenLogprob(token=token, logprob=chosen.logprob, bytes=_bytes(token, chosen),
                                        top_logprobs=top))
        return ChatLogprobs(content=content)


def _tool_names(req: ChatCompletionRequest) -> list[str]:
    """The functions "auto" may call: those the request declares."""
    return [t.function.name for t in req.tools or []]


def _bytes(token: str, logprob: Logprob) -> list[int]:
    """The token's own raw bytes (part of a character for a token that splits one), as OpenAI."""
    return list(logprob.token_bytes if logprob.token_bytes is not None else token.encode())
