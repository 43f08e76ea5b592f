"""Tool-call parsers: calls read out of text whole and in deltas, the two in agreement; only
declared functions with object arguments are calls; text nested at any depth is content, read
in linear time; a stream that fails mid-way still ends with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from pagedllm.entrypoints.openai.model_json import MAX_DEPTH, loads, nesting_depth
from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, guard_sse
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall
from pagedllm.entrypoints.openai.tool_parsers.generic import GenericToolParser
from pagedllm.entrypoints.openai.tool_stream import ToolStream
from pagedllm.entrypoints.openai.tools import required_calls

NAMES = ["get_weather", "f"]

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris"}')
TEXTS = [
    ("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     "Sure.\n", [WEATHER]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>', None, [WEATHER, ParsedToolCall("f", "{}")]),
    ("No call here, just a < and a <tool", "No call here, just a < and a <tool", []),
    ("<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text", []),
    ('Cut: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', "Cut: ", [WEATHER]),
    ("Ünïcode 🙂 text", "Ünïcode 🙂 text", []),
    # A bare call object as the whole reply, as Qwen2.5-Coder-0.5B writes it (no tags).
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    ('  \n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', None, [WEATHER]),
    # JSON that is not (only) a call stays content, tags inside it still parsed.
    ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),
    ('{"a": 1} <tool_call>{"name": "f", "arguments": {}}</tool_call>', '{"a": 1} ', [ParsedToolCall("f", "{}")]),
    # Only a declared function with an object for arguments is a call; anything else stays content.
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": NaN}</tool_call>', '<tool_call>{"name": "f", "arguments": NaN}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
    ('{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": [1]}', []),
    ('{"name": "f"}', None, [ParsedToolCall("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"a": "</tool_call"}}</tool_call>x', "x",
     [ParsedToolCall("f", '{"a": "</tool_call"}')]),
    # Only whitespace outside the calls: no content (streamed, a "\n" was sent between them).
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n',
     None, [ParsedToolCall("f", "{}")] * 2),
    ('\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n Then text.', '\n\n Then text.', [ParsedToolCall("f", "{}")]),
]


def _sent(stream: ToolStream, text: str, step: int) -> tuple[str | None, list[str]]:
    """What a client receives of ``text`` streamed in pieces of ``step``: the content deltas
    joined (None if none), and the names of the calls."""
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.update(text[i : i + step], i + step >= len(text))
    content = "".join(d.content for d in deltas if d.content is not None)
    return content or None, [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name]


@pytest.mark.parametrize(("text", "content", "calls"), TEXTS)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_whole_and_streamed_agree(text: str, content: str | None, calls: list, step: int) -> None:
    parser = TOOL_PARSERS["hermes"]
    assert parser(NAMES).extract(text) == (content, calls)
    streaming, streamed, got = parser(NAMES), "", []
    for i in range(0, len(text), step):
        piece, more = streaming.feed(text[i : i + step])
        streamed += piece
        got += more
    piece, more = streaming.finish()
    streamed += piece
    assert (streamed if streamed.strip() else None, got + more) == (content, calls)
    assert _sent(ToolStream("auto", parser(NAMES)), text, step) == (content, [c.name for c in calls])


def _streamed(text: str, step: int) -> tuple[str, list[ParsedToolCall]]:
    parser, content, calls = TOOL_PARSERS["hermes"](NAMES), "", []
    for i in range(0, len(text), step):
        piece, more = parser.feed(text[i : i + step])
        content += piece
        calls += more
    piece, more = parser.finish()
    return content + piece, calls + more


DEEP = 100_000


@pytest.mark.parametrize("text", [
    "[" * DEEP,
    "[" * DEEP + "]" * DEEP,
    '{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP + "}}",
    '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP + "}}</tool_call>",
    "<tool_call>" + "{" * DEEP,
], ids=["open", "closed", "bare-call", "tagged-call", "unclosed-tag"])
def test_hermes_any_depth_is_content(text: str) -> None:
    """Over-deep JSON, however it is written and split, is content and never a RecursionError."""
    assert TOOL_PARSERS["hermes"](NAMES).extract(text) == (text, [])
    for step in (3, 4096):
        assert _streamed(text, step) == (text, [])


def test_depth_limit_is_exact() -> None:
    inside = '{"name": "f", "arguments": {"a": ' + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2) + "}}"
    assert nesting_depth(inside) == MAX_DEPTH
    assert TOOL_PARSERS["hermes"](NAMES).extract(inside)[1] == [ParsedToolCall("f", json.dumps(loads(inside)["arguments"]))]
    beyond = inside.replace("[", "[[", 1).replace("]", "]]", 1)
    assert TOOL_PARSERS["hermes"](NAMES).extract(beyond) == (beyond, [])
    # Brackets inside strings are text, not nesting.
    text = '{"a": "[[{{\\"", "b": ["]]"]}'
    assert json.loads(text) == {"a": '[[{{"', "b": ["]]"]} and nesting_depth(text) == 2


def test_hermes_long_call_in_small_deltas() -> None:
    """A long call streamed a character at a time is read as one call, the text around it content."""
    arguments = {"text": "x" * 200_000, "nested": [[[1]]]}
    text = "Calling.\n<tool_call>" + json.dumps({"name": "f", "arguments": arguments}) + "</tool_call>\nDone."
    expected = ("Calling.\n\nDone.", [ParsedToolCall("f", json.dumps(arguments))])
    assert _streamed(text, 1) == expected
    assert TOOL_PARSERS["hermes"](NAMES).extract(text) == expected


def test_required_calls_any_depth() -> None:
    deep = '[{"name": "f", "parameters": {"a": ' + "[" * DEEP + "]" * DEEP + "}}]"
    assert required_calls(deep) is None
    assert required_calls('[{"name": "f", "parameters": {"a": [1]}}]') == [("f", '{"a": [1]}')]
    stream = ToolStream("required")
    assert stream.update(deep[:10], False) == []
    assert stream.update(deep[10:], True)[0].content == deep


GENERIC_TEXTS = [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    (' \n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]\n', None,
     [WEATHER, ParsedToolCall("f", "{}")]),
    ('{"name": "f"}', None, [ParsedToolCall("f", "{}")]),
    ("Sunny, 18 degrees.", "Sunny, 18 degrees.", []),
    ('The call: {"name": "f", "arguments": {}}', 'The call: {"name": "f", "arguments": {}}', []),  # text first: text
    # Anything but calls of declared functions, every one of them, is content as it came.
    ('[{"name": "f", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]',
     '[{"name": "f", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]', []),
    ('{"name": "f", "arguments": {}, "extra": 1}', '{"name": "f", "arguments": {}, "extra": 1}', []),
    ('{"name": "f", "arguments": "x"}', '{"name": "f", "arguments": "x"}', []),
    ('{"name": "get_weather", "arguments": {"city": "Par', '{"name": "get_weather", "arguments": {"city": "Par', []),
    ("[]", "[]", []),
    ("[" * DEEP, "[" * DEEP, []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": {}}</tool_call>', []),
]


@pytest.mark.parametrize(("text", "content", "calls"), GENERIC_TEXTS, ids=range(len(GENERIC_TEXTS)))
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_generic_whole_and_streamed_agree(text: str, content: str | None, calls: list, step: int) -> None:
    """pagedllm's generic format: the whole reply is one call or a list of calls, else content."""
    assert GenericToolParser(NAMES).extract(text) == (content, calls)
    streaming, streamed, got = GenericToolParser(NAMES), "", []
    for i in range(0, len(text), step):
        piece, more = streaming.feed(text[i : i + step])
        assert not (more and streamed)  # calls only from a reply that is calls
        streamed += piece
        got += more
    piece, more = streaming.finish()
    streamed += piece
    assert (streamed if streamed.strip() else None, got + more) == (content, calls)
    assert _sent(ToolStream("auto", GenericToolParser(NAMES)), text, step) == (content, [c.name for c in calls])


def test_generic_text_streams_as_it_comes() -> None:
    parser = GenericToolParser(NAMES)
    assert parser.feed("  ") == ("", [])  # undecided
    assert parser.feed("Hel") == ("  Hel", [])
    assert parser.feed("lo {") == ("lo {", [])
    assert parser.finish() == ("", [])


def test_failing_stream_ends_with_error_event_and_done() -> None:
    async def lines() -> AsyncIterator[str]:
        yield "data: {}\n\n"
        raise RecursionError

    async def collect() -> list[str]:
        return [line async for line in guard_sse(lines())]

    first, error, done = asyncio.run(collect())
    assert first == "data: {}\n\n" and done == SSE_DONE
    body = json.loads(error.removeprefix("data: "))["error"]
    assert body["type"] == "InternalServerError" and body["code"] == 500 and "RecursionError" in body["message"]


def test_parallel_tool_calls_false_allows_one_call() -> None:
    """``parallel_tool_calls: false`` (OpenAI's: at most one call; it was ignored): "required"
    and the generic format's replies are constrained to one call, and a parsed "auto" reply
    keeps its first call, whole or streamed (vLLM's ``maybe_filter_parallel_tool_calls``)."""
    import jsonschema

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tools import tool_constraint

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": tools}
    one, two = [{"name": "f", "parameters": {}}], [{"name": "f", "parameters": {}}] * 2
    generic_one, generic_two = {"name": "f", "arguments": {}}, [{"name": "f", "arguments": {}}] * 2
    for parallel in (None, True, False):
        req = ChatCompletionRequest.model_validate(body | {"tool_choice": "required", "parallel_tool_calls": parallel})
        req.check()
        schema = json.loads(tool_constraint(req).json)
        jsonschema.validate(one, schema)
        generic = json.loads(tool_constraint(req, generic=True).json)
        jsonschema.validate(generic_one, generic)
        if parallel is False:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(two, schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(generic_two, generic)
        else:
            jsonschema.validate(two, schema)
            jsonschema.validate(generic_two, generic)
        auto = ChatCompletionRequest.model_validate(body | {"parallel_tool_calls": parallel})
        grammar = tool_constraint(auto, generic=True).grammar
        assert ('"type": "array"' in grammar) == (parallel is not False)
    text = TEXTS[1][0]  # two tagged calls
    for step in (1, 7, 1000):
        stream, deltas = ToolStream("auto", TOOL_PARSERS["hermes"](NAMES), max_calls=1), []
        for i in range(0, len(text), step):
            deltas += stream.update(text[i : i + step], i + step >= len(text))
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert {c.index for c in calls} == {0} and calls[0].function.name == "get_weather"
        assert "".join(c.function.arguments or "" for c in calls) == WEATHER.arguments
        assert stream.num_calls == 1


@pytest.mark.parametrize("mode", ["auto", "named"])
def test_streamed_call_deltas_after_the_first_carry_only_index_and_arguments(mode: str) -> None:
    """A call's first delta has its id, type and name; the later ones leave those keys out (as
    OpenAI's and vLLM's streams do), where they carried ``"id": null, "type": null``."""
    stream = ToolStream(mode, TOOL_PARSERS["hermes"](NAMES) if mode == "auto" else None, name="get_weather")
    text = TEXTS[1][0] if mode == "auto" else WEATHER.arguments
    deltas = []
    for i in range(0, len(text), 3):
        deltas += stream.update(text[i : i + 3], i + 3 >= len(text))
    pieces = [json.loads(d.model_dump_json())["tool_calls"][0] for d in deltas if d.tool_calls]
    firsts = [p for p in pieces if "id" in p]
    assert firsts and all(p["type"] == "function" and p["function"]["name"] for p in firsts)
    later = [p for p in pieces if "id" not in p]
    assert later and all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in later)


ITEM = {"type": "object", "properties": {"qty": {"type": "integer"}}, "required": ["qty"]}
NESTED = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"], "$defs": {"Item": ITEM}}
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "child"], "additionalProperties": False}


def test_tool_parameters_that_refer_into_themselves_keep_their_meaning() -> None:
    """Parameters with ``$ref``s into themselves (a nested pydantic model's ``$defs``, a tree's
    "#") resolve inside their own schema once embedded in a "required" or generic call schema
    (they resolved against the call schema's root: "Pointer '/$defs/Item' does not exist", or a
    tree's child constrained to be a whole call); each compiles, and the calls validate as the
    functions' own arguments do."""
    import jsonschema

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tools import tool_constraint
    from pagedllm.structured_output import StructuredOutputsParams, backend

    tools = [{"type": "function", "function": {"name": "order", "parameters": NESTED}},
             {"type": "function", "function": {"name": "tree", "parameters": TREE}},
             {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "go"}], "tools": tools}
    order = {"item": {"qty": 2}}
    tree = {"v": 1, "child": {"v": 2, "child": None}}
    wrong = [{"item": {"qty": "two"}}, {"v": 1, "child": {"name": "tree", "arguments": {"v": 2, "child": None}}}]
    for mode, key, generic in (("required", "parameters", False), ("required", "arguments", True)):
        req = ChatCompletionRequest.model_validate(body | {"tool_choice": mode})
        constraint = tool_constraint(req, generic=generic)
        backend.check(constraint)
        schema = json.loads(constraint.json)
        for name, args in (("order", order), ("tree", tree), ("f", {})):
            jsonschema.validate([{"name": name, key: args}], schema)
        for name, args in zip(("order", "tree"), wrong):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate([{"name": name, key: args}], schema)
    auto = tool_constraint(ChatCompletionRequest.model_validate(body), generic=True)
    backend.check(auto)
    backend.check(StructuredOutputsParams(json=NESTED))  # named: the parameters alone, as before


def test_tool_parameters_must_describe_an_object() -> None:
    """A function's arguments are a JSON object (OpenAI refuses other parameter types): a
    "required" constraint allowed an array the call parser then dropped (no call came back)."""
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.tools import check_tools
    from pagedllm.errors import InvalidParamError

    for parameters in ({"type": "array"}, {"type": "string"}, {"type": ["object", "null"]}):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "g", "parameters": parameters}}]})
        with pytest.raises(InvalidParamError, match='a function\'s arguments are a JSON object') as e:
            check_tools(req)
        assert e.value.param == "tools.1.function.parameters"
    for parameters in ({"type": "object"}, {"properties": {"a": {"type": "string"}}}, None):
        check_tools(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "go"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": parameters}}]}))


def test_parameters_nested_past_the_recursion_limit_are_refused_by_name() -> None:
    """Rebasing a tool's ``$ref``s walks its parameters; parameters deeper than Python's
    recursion limit (one HTTP body can nest that deep) are a 400 naming the tool, not a 500."""
    from pagedllm.entrypoints.generic_tools import call_objects
    from pagedllm.errors import InvalidParamError
    from pagedllm.structured_output import StructuredOutputsParams

    deep: dict = {"type": "object"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(InvalidParamError, match="nests too deeply") as e:
        call_objects([("f", {"type": "object"}), ("g", deep)], "arguments")
    assert e.value.param == "tools.1.function.parameters"
    with pytest.raises(InvalidParamError, match="nests too deeply"):
        StructuredOutputsParams(json=deep)
