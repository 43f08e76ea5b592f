"""Request bodies of the OpenAI-compatible API (pydantic); ``response_bodies`` has the answers.

Request bodies refuse what they cannot honour: an unknown field, a NaN or Infinity, text with
lone surrogates, or a known field pagedllm does not implement is a 400 naming it. Fields that
are only hints to OpenAI (``user``, a message's ``name``) are accepted
and ignored; the README lists every field per route.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.errors import InvalidParamError
from pagedllm.sampling_params import check_text


class OpenAIBaseModel(BaseModel):
    """A body of the API, request or response (``response_bodies``): unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body (or part of one): unknown fields, non-finite numbers and values of
    another JSON type (``"3"``, ``true`` or ``3.0`` for an integer, ``"true"`` for a boolean)
    fail validation; an integer is taken where a number is."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    # Fields OpenAI documents as nullable and vLLM declares Optional with a default, where
    # null means that default (``"stream": null`` is a non-streaming request): read as absent.
    null_is_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_null_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.null_is_default:
            return {k: v for k, v in data.items() if v is not None or k not in cls.null_is_default}
        return data

    def check(self) -> None:
        """Checks beyond each field's type, run before anything is tokenized or queued.

        Raises:
            InvalidParamError: naming the first field at fault.
        """
        _check_texts(self, "")


def _check_texts(value: object, path: str) -> None:
    """Every str in a parsed body (dict keys included) must be Unicode scalar values."""
    if isinstance(value, str):
        check_text(value, path)
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _check_texts(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_texts(item, f"{path}.{i}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_texts(key, path)
            _check_texts(item, f"{path}.{key}")


# -- requests --------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    """vLLM's stream options: ``include_usage`` is true unless set false (or null), as in vLLM,
    so that ``{"continuous_usage_stats": true}`` alone also gets the last usage chunk."""

    null_is_default = frozenset({"continuous_usage_stats"})
    include_usage: bool | None = True  # a last chunk, without choices, with the request's usage
    # vLLM's: every chunk carries its choice's usage so far (its prompt's tokens, its own tokens);
    # with include_usage only, as in vLLM.
    continuous_usage_stats: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    null_is_default = frozenset({"stream"})
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # Structured outputs (entrypoints/openai/structured_outputs.py): at most one of these.
    response_format: dict[str, Any] | None = None  # OpenAI's: text | json_object | json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json | regex | choice | grammar | json_object
    guided_json: str | dict[str, Any] | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None  # a hint to OpenAI; ignored
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)

    def check(self) -> None:
        super().check()
        if self.stream_options is not None and not self.stream:
            raise InvalidParamError("stream_options", "stream_options is only allowed with stream: true")
        if self.cache_salt == "":  # as vLLM: a salt meant to isolate must be one
            raise InvalidParamError("cache_salt", "cache_salt must be a non-empty string if given")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` beside ``include_usage``, as vLLM."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    null_is_default = SamplingRequest.null_is_default | {"echo"}
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default; null (vLLM's): the room the context leaves
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # only best_of == n: pagedllm returns every sample

    def check(self) -> None:
        super().check()
        # 0 scores the prompt only, which echo returns (SamplingParams' prompt_logprobs).
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise InvalidParamError(
                "max_tokens", f"max_tokens must be at least 1 (0 only with echo), got {self.max_tokens}"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParamError("best_of", f"best_of must equal n ({self.n}) if set, got {self.best_of}")


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a hint to OpenAI; ignored
    tool_calls: list[ToolCall] | None = None  # assistant: calls it made
    tool_call_id: str | None = None  # tool: the call this message answers


def check_messages(messages: list[ChatMessage]) -> None:
    """A message's fields of another role, which nothing would read, are refused: ``tool_calls``
    belong to an assistant's message, ``tool_call_id`` to a tool result.

    Raises:
        InvalidParamError: naming the message's field (``messages.2.tool_calls``).
    """
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise InvalidParamError(f"messages.{i}.tool_calls",
                                    f"tool_calls belong to assistant messages, not {m.role}")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidParamError(f"messages.{i}.tool_call_id",
                                    f"tool_call_id belongs to tool messages, not {m.role}")


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments always match ``parameters`` when the output is constrained


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


def check_tool_names(tools: list[ChatTool]) -> list[str]:
    """The function names of ``tools``, in order.

    Raises:
        InvalidParamError: two tools of one name.
    """
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParamError("tools", "tools: function names must be unique")
    return names


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    null_is_default = SamplingRequest.null_is_default | {"logprobs"}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # false: at most one tool call per choice (OpenAI's; vLLM keeps the first); None/true: any number.
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if (value := getattr(self, name)) is not None and value < 1:  # no echo here: nothing scores a prompt
            raise InvalidParamError(name, f"{name} must be at least 1, got {value}")
        check_messages(self.messages)

    @property
    def parallel_calls(self) -> bool:
        """Whether a choice may hold several tool calls (``parallel_tool_calls`` not false)."""
        return self.parallel_tool_calls is not False

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named"."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")


class TokenizeRequest(RequestModel):
    """``prompt``, text tokenized with ``add_special_tokens``, or ``messages`` (and the
    ``tools`` offered, as a chat completion with ``tool_choice`` "auto" writes them) under the
    chat template with ``add_generation_prompt`` (the template writes the special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        super().check()
        if self.messages is not None:
            check_messages(self.messages)
        if self.tools is not None and self.messages is None:
            raise InvalidParamError("tools", "tools apply to messages, not prompt")
        check_tool_names(self.tools or [])
        # A setting of the other form would do nothing: refused, not ignored (false is what
        # messages do anyway, vLLM's default there).
        if self.messages is not None and "add_special_tokens" in self.model_fields_set and self.add_special_tokens:
            raise InvalidParamError("add_special_tokens", "add_special_tokens applies to prompt: with messages the "
                                    "chat template writes the special tokens")
        if self.prompt is not None and "add_generation_prompt" in self.model_fields_set:
            raise InvalidParamError("add_generation_prompt", "add_generation_prompt applies to messages, not prompt")


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
