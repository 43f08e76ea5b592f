"""A conversation as prompt token ids under the model's chat template (or one given with
``--chat-template``), for every front end (``LLM.chat``, ``pagedllm chat``, ``/v1/chat/completions``).

Only the template's own markup becomes special tokens. A message's content is text, even
where it spells one (``<|im_end|><|im_start|>system``): it is tokenized with special tokens
split into ordinary pieces, as llama.cpp tokenizes user input, so no message can open a turn.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import re
import secrets
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pagedllm.engine.malloc_trim import trim_after_text
from pagedllm.entrypoints.openai.model_json import loads

_SPECIALS: weakref.WeakKeyDictionary[Any, re.Pattern[str] | None] = weakref.WeakKeyDictionary()

# How templates pass a content through: as it is, or trimmed (Gemma 3, Llama 3).
_CONTENT_FORMS: list[Callable[[str], str]] = [lambda text: text, str.strip]


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    """``--chat-template``, as vLLM's: read by ``load_chat_template``."""
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template replacing the model's: a file path, or the template itself on one "
                        "line (escapes such as \\n are decoded) (default: the model's own)")


def load_chat_template(value: str | None) -> str | None:
    """A ``--chat-template`` value as template text (None: the model's own).

    A path to a file gives the file's text. Otherwise a value holding ``{``, ``}`` or a
    newline is the template itself, its backslash escapes (``\\n``) decoded. The template must
    parse as Jinja.

    Raises:
        ValueError: a value without template markup that names no readable file, or a
            template Jinja cannot parse (the message opens with ``--chat-template``).
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    else:
        raise ValueError(f"--chat-template: {value!r:.200} is no file, nor a template (it has no {{ }} markup)")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: the template does not parse: {e} (line {e.lineno})") from None
    return text


def has_chat_template(tokenizer: Any, template: str | None) -> bool:
    """Whether a conversation can be rendered: a template given (``load_chat_template``'s), or
    the model's own (its tokenizer's ``chat_template``; a base model often has none)."""
    return template is not None or getattr(tokenizer, "chat_template", None) is not None


def _special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Any of the tokenizer's special tokens, spelled out; None if it has none. Built once per tokenizer."""
    if tokenizer not in _SPECIALS:
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        _SPECIALS[tokenizer] = re.compile("|".join(map(re.escape, specials))) if specials else None
    return _SPECIALS[tokenizer]


def _texts(message: dict[str, Any]) -> list[str]:
    """The text of a message's content: a str, or the ``text`` of each part of a list."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def joined_text(texts: Iterable[str]) -> str:
    """A content's text parts as one string, for a template that takes contents as strings
    (vLLM's "string" content format: the parts joined by newlines)."""
    return "\n".join(texts)


@functools.lru_cache(maxsize=16)
def _takes_content_parts(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``{% for p in message['content'] %}``),
    as vLLM detects its "openai" content format; False for a template that does not parse
    (rendering it will say why)."""
    import jinja2
    import jinja2.nodes

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return any(
        isinstance(loop.iter, jinja2.nodes.Getattr) and loop.iter.attr == "content"
        or isinstance(loop.iter, jinja2.nodes.Getitem) and isinstance(loop.iter.arg, jinja2.nodes.Const)
        and loop.iter.arg.value == "content"
        for loop in ast.find_all(jinja2.nodes.For)
    )


def call_arguments(arguments: Any) -> Any:
    """A tool call's arguments as templates take them (they serialize them): JSON text as its
    value, as vLLM hands them over; anything else (parsed already, not JSON, or too deep to
    hand to a template) as it came."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return loads(arguments)
    except ValueError:
        return arguments


def _template_message(message: dict[str, Any], parts: bool) -> dict[str, Any]:
    """``message`` as vLLM hands it to the template: its content a list of parts if the
    template takes ``parts`` (a str content as one text part), else a str (the parts' texts
    joined); None or no content no parts, or ""; the arguments of its ``tool_calls`` parsed
    (``call_arguments``)."""
    content = message.get("content")
    if content is None:
        message = message | {"content": [] if parts else ""}
    elif isinstance(content, str) and parts:
        message = message | {"content": [{"type": "text", "text": content}]}
    elif isinstance(content, list) and not parts:
        message = message | {"content": joined_text(_texts(message))}
    if isinstance(calls := message.get("tool_calls"), list):
        message = message | {"tool_calls": [_parsed_call(c) for c in calls]}
    return message


def _parsed_call(call: Any) -> Any:
    """A ``tool_calls`` entry with its function's arguments parsed; any other shape as it came."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    return call | {"function": function | {"arguments": call_arguments(function["arguments"])}}


def _with_texts(message: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """``message`` with its content's texts replaced, in ``_texts``' order."""
    content = message.get("content")
    if isinstance(content, str):
        return message | {"content": texts[0]}
    pieces = iter(texts)
    parts = [p | {"text": next(pieces)} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
             for p in content]
    return message | {"content": parts}


def chat_prompt(
    tokenizer: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
    content_format: str = "auto", **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The prompt of a conversation: (the template's text, its token ids).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        conversation: messages as templates take them ({"role", "content", ...}; a content is
            a str, a list of {"type": "text", "text": str} parts, or None). A template that
            does not loop over a content gets its parts' texts joined by newlines, and None as
            "" (vLLM's "string" content format; one that does, vLLM's "openai" one, gets the
            parts, a str as one text part, and None as no parts). Tool calls' arguments given as JSON text are parsed
            (``call_arguments``).
        add_generation_prompt: end with the opening of the assistant's turn.
        content_format: "auto" (as above: the template decides), or vLLM's "string" or
            "openai" to give every template contents in that form.
        **template_kwargs: passed to ``apply_chat_template`` (``chat_template``, ``tools``,
            ``continue_final_message``, the template's own variables).

    Where no content spells a special token, the ids are the template's text tokenized as it
    stands. Otherwise the text is cut where each content begins and ends (the template is
    rendered once more with a placeholder for each); the template's pieces are tokenized as
    usual and the contents with special tokens split, so the ids hold special tokens only
    where the template wrote them. A content is taken as the template passes it on, verbatim
    or trimmed; where a template changes it otherwise, the content is tokenized as it came.

    Raises:
        Exception: whatever the template raises for a conversation it refuses (jinja's errors).
    """
    template = template_kwargs.get("chat_template")
    template = tokenizer.chat_template if template is None else template
    if content_format == "auto":
        parts = isinstance(template, str) and _takes_content_parts(template)
    else:
        parts = content_format == "openai"
    conversation = [_template_message(m, parts) for m in conversation]
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    specials = _special_pattern(tokenizer)
    contents = [t for m in conversation for t in _texts(m)]
    if specials is None or not any(specials.search(c) for c in contents):
        # The template already wrote any special tokens the model expects.
        ids = tokenizer.encode(text, add_special_tokens=False)
        trim_after_text(len(text))
        return text, ids

    mark = f"PAGEDLLM{secrets.token_hex(8)}X"  # letters and digits: no template filter changes it
    numbers = iter(range(len(contents)))
    marked = [_with_texts(m, [f"{mark}{next(numbers)}X" for _ in _texts(m)]) for m in conversation]
    rendered = tokenizer.apply_chat_template(
        marked, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    pieces = re.split(f"{mark}(\\d+)X", rendered)  # template text, content number, template text, ...
    # The form the template gave each content, if one of the usual ones rebuilds its text exactly.
    form = next((f for f in _CONTENT_FORMS if text == "".join(
        f(contents[int(p)]) if i % 2 else p for i, p in enumerate(pieces))), _CONTENT_FORMS[0])
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            content = form(contents[int(piece)])
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"] if content else []
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    trim_after_text(len(text))
    return text, ids
