"""The offline ``LLM``'s arguments as its engine takes them, checked before anything is queued:
``prompt_list`` (one prompt or a list of them, as a list), ``per_prompt`` (one value for every
prompt, or one per prompt), ``check_one_adapter_per_id`` (a batch's adapters) and
``render_chats`` (``LLM.chat``'s conversations and template arguments, rendered to prompts).

Each refusal is an ``InvalidParamError`` naming the field; none of these queues or runs
anything, so a refused call leaves the engine as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.chat_template import chat_prompt
from pagedllm.errors import InvalidParamError
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import check_text

Message = dict[str, Any]


def prompt_list(prompts: PromptType | Sequence[PromptType]) -> Sequence[PromptType]:
    """``LLM.generate``'s ``prompts`` as a list of prompts: a str, a token-id list or a prompt
    dict is one prompt; any other sequence is taken as a list of them (the engine checks each).

    Raises:
        InvalidParamError (param "prompt"): neither a prompt nor a sequence (None, a generator).
    """
    if isinstance(prompts, Mapping):  # one prompt dict
        prompts = [prompts]
    if not isinstance(prompts, Sequence):  # None, a generator: not a prompt nor a list of them
        raise InvalidParamError(
            "prompt", f"prompts must be a prompt (a str, a list of token ids or a prompt dict) or a list of them, "
            f"got {type(prompts).__name__}"
        )
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return prompts


def per_prompt(value: object, kind: type, field: str, num_prompts: int) -> list:
    """``value`` for each of ``num_prompts`` prompts: one ``kind`` (or None) for all, or a list
    or tuple of exactly one per prompt (its items are checked by the engine).

    Raises:
        InvalidParamError (param ``field``): anything else, or a list of another length.
    """
    if value is None or isinstance(value, kind):
        return [value] * num_prompts
    if not isinstance(value, (list, tuple)):
        raise InvalidParamError(
            field, f"{field} must be a {kind.__name__} or a list of one per prompt, got {type(value).__name__}"
        )
    if len(value) != num_prompts:
        raise InvalidParamError(field, f"got {num_prompts} prompts but {len(value)} {field}")
    return list(value)


def check_one_adapter_per_id(loras: list) -> None:
    """Raise InvalidParamError (``lora_request``) if two adapters of a batch share an id but
    not their name and path: a step loads one adapter per id, so the requests of one would run
    with the other's weights. Items that are not ``LoRARequest``s are left to the engine."""
    seen: dict[int, LoRARequest] = {}
    for i, lora in enumerate(loras):
        if not isinstance(lora, LoRARequest):
            continue
        first = seen.setdefault(lora.id, lora)
        if first != lora:
            raise InvalidParamError(
                "lora_request", f"lora_request {i} ({lora.name!r}, {lora.path!r}) has the id {lora.id} of another "
                f"adapter of the batch ({first.name!r}, {first.path!r}): an id names one adapter"
            )


def render_chats(
    tokenizer: Any,
    messages: list[Message] | list[list[Message]],
    *,
    chat_template: str | None,
    content_format: str,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> list[tuple[str, list[int]]]:
    """``LLM.chat``'s prompts: each conversation of ``messages`` (one conversation, or a list of
    them) as (the template's text, its token ids) under ``chat_template.chat_prompt``. The
    arguments are ``LLM.chat``'s (``content_format``: its ``chat_template_content_format``);
    every one is checked before any conversation is rendered.

    Raises:
        InvalidParamError: naming the field (``messages.0.content``): ``messages`` that are not
            a conversation or a list of them, a message without a str role, a content that is
            not text, a ``chat_template`` that is not a str, a ``content_format`` other than
            "auto", "string" or "openai", ``tools`` that are not a list of dicts, a flag that is
            not a bool or both flags set,
            ``chat_template_kwargs`` that are not a dict of names other than the arguments'; or,
            naming the conversation, the template's own error for one it cannot render.
    """
    if not isinstance(messages, list):
        raise InvalidParamError("messages", "messages must be a list of messages or a list of conversations, "
                                f"got {type(messages).__name__}")
    single = bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if single else messages
    paths = ["messages"] if single else [f"messages.{i}" for i in range(len(conversations))]
    for conv, path in zip(conversations, paths, strict=True):
        _check_conversation(conv, path)
    if content_format not in ("auto", "string", "openai"):
        raise InvalidParamError("chat_template_content_format", 'chat_template_content_format must be "auto", '
                                f'"string" or "openai", got {content_format!r:.80}')
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidParamError("chat_template", f"chat_template must be a template's text, got {chat_template!r:.80}")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidParamError("tools", f"tools must be a list of tool dicts, got {tools!r:.80}")
    for flag, value in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):  # a truthy "false" would render the opposite prompt
            raise InvalidParamError(flag, f"{flag} must be a bool, got {value!r:.80}")
    if continue_final_message and add_generation_prompt:
        raise InvalidParamError(
            "continue_final_message", "continue_final_message needs add_generation_prompt=False: the prompt "
            "either opens a new assistant turn or continues the last message"
        )
    extra = {} if chat_template_kwargs is None else chat_template_kwargs
    named = {"chat_template", "tools", "add_generation_prompt", "continue_final_message", "conversation",
             "tokenize", "content_format"}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra) or named & set(extra):
        raise InvalidParamError(
            "chat_template_kwargs", f"chat_template_kwargs must be a dict of template variables other than "
            f"{sorted(named)}, got {extra!r:.80}"
        )
    rendered = []
    for conv, path in zip(conversations, paths, strict=True):
        try:
            rendered.append(
                chat_prompt(
                    tokenizer, conv, add_generation_prompt, chat_template=chat_template, tools=tools,
                    continue_final_message=continue_final_message, content_format=content_format, **extra,
                )
            )
        except Exception as e:  # jinja's own errors, or a TypeError, for what a template refuses
            raise InvalidParamError(path, f"the chat template cannot render {path}: {e}") from e
    return rendered


def _check_conversation(conversation: object, path: str) -> None:
    """Raise InvalidParamError unless ``conversation`` is a list of messages with valid text."""
    if not isinstance(conversation, list):
        raise InvalidParamError(path, f"{path} must be a list of messages, got {type(conversation).__name__}")
    for i, message in enumerate(conversation):
        where = f"{path}.{i}"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidParamError(where, f"{where} must be a dict with a str role, got {message!r:.80}")
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise InvalidParamError(f"{where}.content.{j}", f'{where}.content.{j} must be a '
                                            f'{{"type": "text", "text": str}} part, got {type(part).__name__}')
                if part.get("type") != "text":  # images, audio: this engine serves text models only
                    raise InvalidParamError(f"{where}.content.{j}.type", f'{where}.content.{j}.type must be "text", '
                                            f'got {part.get("type")!r:.80}')
                check_text(part.get("text"), f"{where}.content.{j}.text")
        elif content is not None:
            check_text(content, f"{where}.content")
