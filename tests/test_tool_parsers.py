"""Tool-call parsers: calls read out of text whole and in deltas, the two in agreement."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall

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
]


@pytest.mark.parametrize(("text", "content", "calls"), TEXTS)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_whole_and_streamed_agree(text: str, content: str | None, calls: list, step: int) -> None:
    parser = TOOL_PARSERS["hermes"]
    assert parser().extract(text) == (content, calls)
    streaming, streamed, got = parser(), "", []
    for i in range(0, len(text), step):
        piece, more = streaming.feed(text[i : i + step])
        streamed += piece
        got += more
    piece, more = streaming.finish()
    assert (streamed + piece or None, got + more) == (content, calls)
