"""Tool calling for chat templates that have no tool section (SmolLM2's, most small models').

Such a template drops ``tools``, assistant ``tool_calls`` and tool results on the floor. For
them pagedllm uses a format of its own: the tools are listed in the system message (each
function's name, description and JSON-schema parameters), and the user's last turn ends with
the one reply shape that calls them, a JSON object ``{"name": ..., "arguments": {...}}`` or a
JSON list of such objects. The history is rewritten in the same shape (an assistant's calls as
that JSON, tool results as a user turn naming the function), so a conversation round-trips
through any template. The reply is constrained by ``reply_grammar``: plain text, or a call
that fits the tools not yet called since the user's last turn (``callable_tools``).

Tools and messages are OpenAI-shaped dicts (``{"type": "function", "function": {"name",
"description", "parameters"}}``; ``{"role", "content", "tool_calls", "tool_call_id"}``).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from pagedllm.errors import InvalidParamError

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Compact JSON without free whitespace, as every other constraint (structured_output.grammar).
_JSON_OPTIONS = {"whitespace_flexible": False}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_support", "description": "a probe",
                                                "parameters": NO_ARGUMENTS}}
_SUPPORT: weakref.WeakKeyDictionary[Any, dict[str | None, bool]] = weakref.WeakKeyDictionary()


def supports_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether a chat template (``chat_template``, else the tokenizer's) writes ``tools`` into
    the prompt: rendering a conversation with a tool and without gives different text. A
    template that fails with tools has no tool support. Cached per tokenizer and template."""
    cache = _SUPPORT.setdefault(tokenizer, {})
    if chat_template not in cache:
        conversation = [{"role": "user", "content": "What is the weather?"}]

        def render(**kwargs: Any) -> str:
            return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                 chat_template=chat_template, **kwargs)

        try:
            cache[chat_template] = render(tools=[_PROBE_TOOL]) != render()
        except Exception:  # jinja's errors: a template that cannot take tools
            cache[chat_template] = False
    return cache[chat_template]


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a tool without one takes no arguments."""
    return tool["function"].get("parameters") or NO_ARGUMENTS


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` where it lists properties and says nothing
    of others (and combines no other schema): a call then holds only the declared arguments,
    not whatever keys a small model invents; every such call still validates against ``schema``."""
    open_ended = schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
    if open_ended and not schema.keys() & {"allOf", "anyOf", "oneOf", "$ref", "patternProperties", "unevaluatedProperties"}:
        return schema | {"additionalProperties": False}
    return schema


# Keywords whose values are maps of names to schemas, and keywords whose values are data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def _rebased(schema: Any, at: str) -> Any:
    """``schema`` with each JSON-pointer ``$ref`` into itself ("#" or "#/...") pointing at the
    same place once the schema sits at JSON pointer ``at`` of a larger document. Other
    references (anchors, URIs) and data (``const``, ``enum``, ``default``, ``examples``) are
    left as they are."""
    if isinstance(schema, list):
        return [_rebased(s, at) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + at + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, at) for name, s in value.items()}
        elif key in _DATA:
            out[key] = value
        else:
            out[key] = _rebased(value, at)
    return out


def call_objects(functions: list[tuple[str, dict[str, Any]]], key: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One call's JSON schema per (function name, parameters schema): ``{"name": <the name>,
    <key>: <the parameters>}`` and nothing else; and the ``$defs`` the document holding them must
    have at its root. Parameters that refer into themselves ("#", "#/$defs/...", as a nested
    pydantic model's do) would resolve against that document's root instead: they move under
    its ``$defs``, their references rebased, and a ``$ref`` takes their place.

    Raises:
        InvalidParamError: parameters nested past Python's recursion limit (``tools``).
    """
    calls, defs = [], {}
    for i, (name, schema) in enumerate(functions):
        at = f"parameters_{i}"
        try:
            moved = _rebased(schema, f"/$defs/{at}")
            if moved != schema:
                defs[at], schema = moved, {"$ref": f"#/$defs/{at}"}
        except RecursionError:
            raise InvalidParamError(f"tools.{i}.function.parameters",
                                    f"tools.{i}.function.parameters: the schema nests too deeply") from None
        calls.append({"type": "object", "properties": {"name": {"const": name}, key: schema},
                      "required": ["name", key], "additionalProperties": False})
    return calls, defs


def calls_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a reply that calls: one call object ``{"name": <a tool's name>,
    "arguments": <its parameters>}``, or a non-empty list of them; one call object only unless
    ``parallel`` (OpenAI's ``parallel_tool_calls: false``)."""
    calls, defs = call_objects([(t["function"]["name"], _closed(parameters(t))) for t in tools], "arguments")
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = call if not parallel else {"anyOf": [call, {"type": "array", "minItems": 1, "items": call}]}
    return schema | {"x-guidance": _JSON_OPTIONS} | ({"$defs": defs} if defs else {})


def reply_grammar(tools: list[dict[str, Any]], parallel: bool = True) -> str:
    """The Lark grammar of a ``tool_choice: "auto"`` reply: either text whose first non-space
    character is neither ``{`` nor ``[``, or a call of one of ``tools`` (``calls_schema``, one
    call only unless ``parallel``) and nothing after it; text only if ``tools`` is empty."""
    text = "TEXT: /\\s*[^\\s{\\[][\\s\\S]*/\n"
    if not tools:
        return "start: TEXT\n" + text
    return "start: TEXT | calls\n" + text + "calls: %json " + json.dumps(calls_schema(tools, parallel)) + "\n"


def callable_tools(conversation: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools an "auto" reply may call: those not called since the user's last turn. Small
    models, shown a call and its result, call the same function again and again; a function
    already answered for this turn is offered no more (the reply is text once all have been)."""
    last_user = max((i for i, m in enumerate(conversation) if m.get("role") == "user"), default=-1)
    called = {c["function"]["name"] for m in conversation[last_user + 1 :] if m.get("role") == "assistant"
              for c in m.get("tool_calls") or []}
    return [t for t in tools if t["function"]["name"] not in called]


def system_text(tools: list[dict[str, Any]]) -> str:
    """The system message that lists the tools: each function's name, description and
    parameters, as one JSON list."""
    functions = [{k: t["function"][k] for k in ("name", "description") if t["function"].get(k)}
                 | {"parameters": parameters(t)} for t in tools]
    return "Functions you can call (JSON):\n" + json.dumps(functions, ensure_ascii=False)


def instruction(mode: str, name: str | None = None) -> str:
    """The reply shape a tool mode expects ("auto", "required", or "named" for the function
    ``name``), as appended to the user's last turn."""
    shape = '{"name": ..., "arguments": {...}}'
    if mode == "named":
        return f"(Call the function {name} above: reply only with its arguments, a JSON object {{...}}.)"
    if mode == "required":
        return f"(Call the function above that answers this: reply only with the JSON call {shape}.)"
    return f"(If a function above answers this, reply only with the JSON call {shape}; otherwise reply in text.)"


def rewrite_history(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without tool markup a template could drop: an assistant's
    ``tool_calls`` become its content (the calls as JSON, after any text), and each run of
    tool results becomes one user turn ("Result of <function>: <content>"), the function
    named by the call its ``tool_call_id`` answers."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn holding the current run of tool results
    for message in conversation:
        if message.get("role") == "tool":
            name = names.get(message.get("tool_call_id"), "the function")
            result = f"Result of {name}: {message.get('content') or ''}"
            if results is None:
                results = {"role": "user", "content": result}
                out.append(results)
            else:
                results["content"] += "\n" + result
            continue
        results = None
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            names |= {c.get("id"): c["function"]["name"] for c in message["tool_calls"]}
            text = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            content = message.get("content")
            message = {"role": "assistant", "content": f"{content}\n{text}" if content else text}
        out.append(message)
    return out


def generic_conversation(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None, mode: str, name: str | None = None
) -> list[dict[str, Any]]:
    """The conversation to render under a template without tool support.

    The history is rewritten (``rewrite_history``) whatever the tools. With ``tools`` (and a
    ``mode`` other than "none") they are listed in the system message (``system_text``, after
    the conversation's own system text if it has one), and the reply shape (``instruction``)
    ends the user's last turn: a small model follows the instruction nearest its reply, and
    reads a tool result, a later user turn of its own, as the data to answer from.
    """
    if not tools or mode == "none":
        return rewrite_history(conversation)
    conversation = list(conversation)
    last_user = next((i for i in range(len(conversation) - 1, -1, -1) if conversation[i].get("role") == "user"), None)
    if last_user is not None:
        content = conversation[last_user].get("content") or ""
        conversation[last_user] = conversation[last_user] | {"content": f"{content}\n\n{instruction(mode, name)}"}
    out = rewrite_history(conversation)
    text = system_text(tools)
    first = out[0] if out else {}
    if first.get("role") in ("system", "developer") and isinstance(first.get("content"), str):
        out[0] = first | {"content": f"{first['content']}\n\n{text}" if first["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
