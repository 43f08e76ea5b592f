"""Structured outputs through the OpenAI-compatible server: the official ``openai`` client's
``parse`` on varied pydantic schemas, json_object, regex, choice and grammar on both routes,
streamed equal to non-streamed, sampled outputs valid, and every bad constraint a 400 naming
its field. One live server on the default model for the whole module."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from tests.server_util import API_KEY, MODEL, Server, streamed_calls
from tests.structured_models import MODELS


CLIENT_TIMEOUT_S = 300  # seconds the client fixtures (conftest.py) wait for a request here: not 120


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_pydantic_models(server: Server) -> None:
    async def parse(c: openai.AsyncOpenAI, model: type[BaseModel], prompt: str):
        return await c.chat.completions.parse(
            model=MODEL, messages=_messages(prompt), response_format=model, temperature=0, max_tokens=100
        )

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*[parse(c, m, p) for m, p in MODELS])

    assert len(MODELS) >= 20
    for (model, _), completion in zip(MODELS, asyncio.run(run())):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model)
        jsonschema.validate(json.loads(choice.message.content), to_strict_json_schema(model))


def test_json_object_both_routes(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=_messages('Give a JSON object with one key, "name", set to a cat\'s name.'),
        response_format={"type": "json_object"}, temperature=0, max_tokens=60,
    )
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = client.completions.create(model=MODEL, prompt='{"name": "Rex", "kind": "dog"}\n', max_tokens=60,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert text.choices[0].finish_reason == "stop" and isinstance(json.loads(text.choices[0].text), dict)
    plain = client.chat.completions.create(model=MODEL, messages=_messages("Hi"), response_format={"type": "text"},
                                           temperature=0, max_tokens=4)
    assert plain.choices[0].message.content


DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
GBNF = 'root ::= "The answer is " ("red" | "blue") "."'
# (extra body, check of the output text)
CONSTRAINTS = [
    ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
    ({"guided_regex": DATE}, lambda t: re.fullmatch(DATE, t)),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, lambda t: t in ("yes", "no", "maybe")),
    ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
    ({"structured_outputs": {"grammar": GBNF}}, lambda t: re.fullmatch(r"The answer is (red|blue)\.", t)),
    ({"guided_grammar": 'start: "x=" /[0-9]{2}/ ";"'}, lambda t: re.fullmatch(r"x=[0-9]{2};", t)),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                      "required": ["n"], "additionalProperties": False}}}, lambda t: json.loads(t)["n"] <= 9),
    ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     lambda t: len(json.loads(t)) == 2),
]


@pytest.mark.parametrize(("extra", "check"), CONSTRAINTS, ids=[next(iter(e)) for e, _ in CONSTRAINTS])
def test_constraints_both_routes_streamed_equal(client: openai.OpenAI, extra: dict, check) -> None:
    kwargs = dict(model=MODEL, temperature=0, max_tokens=40, extra_body=extra)
    chat = client.chat.completions.create(messages=_messages("Answer, please."), **kwargs)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and check(text), text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(messages=_messages("Answer, please."), stream=True, **kwargs)
        if c.choices
    )
    assert streamed == text
    completion = client.completions.create(prompt="The answer:", **kwargs)
    assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="The answer:", stream=True, **kwargs))
    assert streamed == completion.choices[0].text


def test_sampled_outputs_valid(client: openai.OpenAI) -> None:
    for seed in range(4):
        out = client.completions.create(model=MODEL, prompt="Today is", temperature=1.0, seed=seed, max_tokens=20,
                                        n=2, extra_body={"guided_regex": DATE})
        assert all(re.fullmatch(DATE, c.text) for c in out.choices), [c.text for c in out.choices]
    out = client.chat.completions.create(
        model=MODEL, messages=_messages("Pick."), temperature=1.0, seed=5, n=3, max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
    )
    assert all(c.message.content in ("alpha", "beta", "gamma") for c in out.choices)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "x": 1}}, "response_format.x"),
    # A schema under another type constrained nothing (it was ignored): refused.
    ("/v1/chat/completions", {"response_format": {"type": "text", "json_schema": {"name": "n", "schema": SCHEMA}}},
     "response_format.json_schema"),
    ("/v1/completions", {"response_format": {"type": "json_object", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "y": 2}}},
     "response_format.json_schema.y"),
    # Hints of another type were taken silently ("strict": "yes"): refused as any other field's.
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": 5}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object", "minProperties": "x"}}},
     "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ("/v1/completions", {"guided_regex": "("}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_constraints_are_400_naming_the_field(http: httpx.Client, path: str, fields: dict, param: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": _messages("Hi")}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param, error
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(("value", "param"), [({}, "structured_outputs"), ({"json": None}, "structured_outputs"),
                                              ({"json_object": False}, "structured_outputs.json_object")])
def test_structured_outputs_setting_no_field_is_refused(http: httpx.Client, value: dict, param: str) -> None:
    """As vLLM: exactly one field, never a silently unconstrained request."""
    for path, prompt in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": _messages("Hi")})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 4, "structured_outputs": value} | prompt)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "exactly one of json, regex, choice, grammar, json_object" in error["message"]


# -- tool calling -----------------------------------------------------------------------------
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
ASK = _messages("What's the weather in Paris?")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_choice_constrains_the_arguments(client: openai.OpenAI, tool_choice) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**kwargs).choices[0]
    named = isinstance(tool_choice, dict)
    assert choice.finish_reason == ("stop" if named else "tool_calls")
    assert choice.message.content is None and choice.message.tool_calls
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if named:
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    content, calls, finish = streamed_calls(client, **kwargs)
    assert content == "" and finish == choice.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_choice_auto_and_none_leave_plain_text_as_content(client: openai.OpenAI) -> None:
    for tool_choice in ("auto", "none"):
        kwargs = dict(model=MODEL, messages=_messages("Say hello."), tools=TOOLS, tool_choice=tool_choice,
                      temperature=0, max_tokens=12)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content and not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        content, calls, _ = streamed_calls(client, **kwargs)
        assert content == choice.message.content and not calls


@pytest.mark.parametrize(("call", "is_call"), [
    ('{"name": "get_time", "arguments": {"zone": "UTC"}}', True),
    ('{"name": "rm_rf", "arguments": {}}', False),  # not a declared function
    ('{"name": "get_time", "arguments": "UTC"}', False),  # arguments not an object
    ('{"name": "get_time", "arguments": {"zone": ' + "[" * 130 + "]" * 130 + "}}", False),  # nested too deeply
], ids=["declared", "undeclared", "string-arguments", "deep"])
def test_auto_reports_only_declared_calls_with_object_arguments(client: openai.OpenAI, call: str, is_call: bool) -> None:
    """The output is forced by a regex; "auto" reads a call out of it only where it is one."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=300,
                  extra_body={"guided_regex": re.escape(call)})
    choice = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = streamed_calls(client, **kwargs)
    if is_call:
        assert choice.finish_reason == finish == "tool_calls" and choice.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_time", {"zone": "UTC"})]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        assert choice.finish_reason == finish == "stop" and not choice.message.tool_calls and not calls
        assert choice.message.content == content == call


def test_tool_result_conversation_continues(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    choice = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=12).choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")


# -- the generic tool format: the default model's template has no tool section -------------------
def test_generic_format_is_logged_once(server: Server) -> None:
    assert server.log.read_text().count("has no tool section") == 1


def test_generic_auto_calls_the_tool_then_answers_from_its_result(client: openai.OpenAI) -> None:
    """A weather question with a weather tool: a call whose arguments fit the schema, streamed
    the same; then, given the call's result, a reply in text (the function is not offered again)."""
    tools = TOOLS[:1]
    kwargs = dict(model=MODEL, messages=ASK, tools=tools, temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert arguments["city"] == "Paris"
    content, calls, finish = streamed_calls(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]

    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    kwargs = dict(model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=40)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content and not reply.message.tool_calls and reply.finish_reason != "tool_calls"
    content, calls, _ = streamed_calls(client, **kwargs)
    assert content == reply.message.content and not calls


def test_generic_auto_answers_in_text_when_no_tool_fits(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=_messages("Tell me a joke."), tools=TOOLS[:1], temperature=0, max_tokens=30)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.content and not choice.message.tool_calls and choice.finish_reason != "tool_calls"
    content, calls, _ = streamed_calls(client, **kwargs)
    assert content == choice.message.content and not calls


BAD_TOOLS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # as vLLM: any tool_choice but "none" needs tools
    ({"tool_choice": "auto", "tools": []}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_bad_tools_are_400_naming_the_field(http: httpx.Client, fields: dict, param: str) -> None:
    for stream in (False, True):
        r = http.post("/v1/chat/completions",
                      json={"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": stream, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["param"] == param, error
