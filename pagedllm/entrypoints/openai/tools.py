"""Tool calling on ``/v1/chat/completions``: request checks, the output constraint of
``tool_choice`` "required" and named, and the tool calls a constrained output holds.

On a chat template with tool support, "auto" leaves the output free and reads the calls out
of the text with a tool parser (``tool_parsers``); "required" and a named function constrain
the output with a JSON schema built from the tools' parameters, so the arguments always fit
the function, on any model. On a template without (``generic_tools``), "auto" is constrained
to text or a generic call, and "required" to a generic call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pagedllm.entrypoints import generic_tools
from pagedllm.entrypoints.chat_template import call_arguments, joined_text
from pagedllm.entrypoints.openai.model_json import loads
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool, check_tool_names
from pagedllm.errors import InvalidParamError
from pagedllm.structured_output import StructuredOutputsParams, backend

_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else generic_tools.NO_ARGUMENTS


def check_tools(req: ChatCompletionRequest) -> None:
    """``tool_choice`` against ``tools``, and the tools' parameters where they will constrain.

    Raises:
        InvalidParamError: ``tool_choice`` other than "none" without ``tools`` (as vLLM), a named
            function not in ``tools``, two tools of one name, parameters whose ``type`` is not
            "object" (OpenAI's rule: the arguments are an object), a tool choice that constrains
            together with another structured output field, parameters that are not a
            JSON schema the grammar engine compiles (``tools.i.function.parameters``), or
            tools whose union is beyond the grammar limits (``tools``).
    """
    tools = req.tools or []
    names = check_tool_names(tools)
    for i, tool in enumerate(tools):
        kind = _parameters(tool).get("type", "object")
        if kind != "object":
            raise InvalidParamError(
                f"tools.{i}.function.parameters",
                f"tools.{i}.function.parameters: a function's arguments are a JSON object (\"type\": \"object\"), "
                f"got \"type\": {json.dumps(kind)}",
            )
    mode = req.tool_mode
    if mode != "none" and not tools:
        raise InvalidParamError("tool_choice", f"tool_choice {mode!r} needs tools")
    if mode == "named" and req.tool_choice.function.name not in names:
        raise InvalidParamError(
            "tool_choice", f"tool_choice names the function {req.tool_choice.function.name!r}, which is not in tools"
        )
    if mode in ("required", "named"):
        if any(getattr(req, f) is not None for f in _STRUCTURED_FIELDS):
            raise InvalidParamError(
                "tool_choice", f"tool_choice {mode!r} constrains the output: no other structured output field with it"
            )
        check_tool_constraint(req, tool_constraint(req))


def check_tool_constraint(req: ChatCompletionRequest, constraint: StructuredOutputsParams | None) -> None:
    """The tools' parameters, then ``constraint`` (built from them), through the grammar check.

    Raises:
        InvalidParamError: ``tools.i.function.parameters`` that are not a JSON schema the
            grammar engine compiles, or tools whose union is beyond the grammar limits (``tools``).
    """
    if constraint is None:
        return
    for i, tool in enumerate(req.tools or []):
        try:
            backend.check(StructuredOutputsParams(json=_parameters(tool)))
        except InvalidParamError as e:
            raise InvalidParamError(f"tools.{i}.function.parameters", f"tools.{i}.function.parameters: {e}") from None
    try:  # the tools together (each fits, but their union can be beyond the limits)
        backend.check(constraint)
    except InvalidParamError as e:
        raise InvalidParamError("tools", f"tools: {e}") from None


def tool_constraint(req: ChatCompletionRequest, generic: bool = False) -> StructuredOutputsParams | None:
    """The output constraint of a tool mode.

    With the template's own tool format: "required" is a JSON array of calls, each ``{"name",
    "parameters"}`` fitting one tool; named is that function's arguments object; "auto" and
    "none" are free. With the generic format (``generic``): "required" is a generic call
    (``generic_tools.calls_schema``), "auto" text or such a call of a function not called since
    the user's last turn (``generic_tools.reply_grammar``, ``callable_tools``) unless another
    structured output field constrains the output, named as above. With
    ``parallel_tool_calls: false`` "required" and the generic "auto" allow one call only.
    """
    mode = req.tool_mode
    if mode == "named":
        tool = next(t for t in req.tools if t.function.name == req.tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if generic and mode in ("auto", "required"):
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if mode == "required":
            return StructuredOutputsParams(json=generic_tools.calls_schema(tools, req.parallel_calls))
        if all(getattr(req, f) is None for f in _STRUCTURED_FIELDS):
            callable_tools = generic_tools.callable_tools(template_messages(req.messages), tools)
            return StructuredOutputsParams(grammar=generic_tools.reply_grammar(callable_tools, req.parallel_calls))
        return None
    if mode != "required":
        return None
    calls, defs = generic_tools.call_objects([(t.function.name, _parameters(t)) for t in req.tools], "parameters")
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({"$defs": defs} if defs else {})
    return StructuredOutputsParams(json=array if req.parallel_calls else array | {"maxItems": 1})


def required_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a "required" output; None if it is cut off (or
    nested deeper than ``model_json.MAX_DEPTH``: then it is content too)."""
    try:
        calls = loads(text)
    except ValueError:
        return None
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as HF chat templates take it: text content, assistant ``tool_calls``
    with their arguments as objects (templates serialize them), ``tool_call_id`` on tool results."""
    conversation = []
    for m in messages:
        message: dict[str, Any] = {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else joined_text(p.text for p in m.content or []),
        }
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": call_arguments(c.function.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        conversation.append(message)
    return conversation
