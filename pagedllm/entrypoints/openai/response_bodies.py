"""Response bodies of the OpenAI-compatible API (pydantic): what the routes answer, errors
included. The request bodies are in ``protocol``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, ToolCall


def random_id(prefix: str) -> str:
    """A response's id: ``prefix``, a dash and 32 random hex digits (``cmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        """The usage of these token counts, their sum the total."""
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(OpenAIBaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(OpenAIBaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = []


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


def _absent():
    """A field left out of the body when it is None (as OpenAI's and vLLM's later deltas of a call)."""
    return Field(None, exclude_if=lambda value: value is None)


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = _absent()
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A piece of a streamed tool call: the first has ``id``, ``type`` and the name, the rest
    only ``index`` and ``function.arguments``."""

    index: int
    id: str | None = _absent()
    type: Literal["function"] | None = _absent()
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    """A piece of a streamed message: only the keys it carries (as vLLM's and OpenAI's chunks;
    ``"role": null`` beside every piece of content was noise to clients)."""

    role: Literal["assistant"] | None = _absent()
    content: str | None = _absent()
    tool_calls: list[DeltaToolCall] | None = _absent()


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
