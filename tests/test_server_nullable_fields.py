"""Fields left empty, on the session's shared server: where OpenAI documents a field as
nullable and vLLM declares it Optional with a default, null is that default, not a 400; other
nulls (``n``, vLLM's own booleans) stay refused, as vLLM refuses them. An empty ``model``
names the base model, an empty ``cache_salt`` is refused, and ``stream_options`` without
``include_usage`` includes the usage, as in vLLM."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server_util import API_KEY, MODEL, Server

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http(shared_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "stream": None, "echo": None}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": None, "logprobs": None}),
])
def test_null_is_the_default(http: httpx.Client, path: str, body: dict) -> None:
    """These nulls were 400s ("Input should be a valid boolean"): now a plain non-streaming,
    unechoed answer without logprobs."""
    r = http.post(path, json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None
    assert "text" not in choice or not choice["text"].startswith("Hi")  # not echoed


def test_null_stream_options_members_are_false(http: httpx.Client) -> None:
    """As vLLM reads them (its ``include_usage`` defaults to true, but null is false)."""
    body = {"prompt": "Hi", "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert '"usage":null' in r.text and '"prompt_tokens"' not in r.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "Hi", "n": None}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "ignore_eos": None}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": CHAT, "add_generation_prompt": None}, "add_generation_prompt"),
    ("/v1/completions", {"prompt": "Hi", "cache_salt": ""}, "cache_salt"),  # was taken as a salt, vLLM refuses it
    ("/v1/chat/completions", {"messages": CHAT, "cache_salt": ""}, "cache_salt"),
])
def test_other_nulls_stay_refused(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    ("/tokenize", {"prompt": "Hi"}),
])
def test_empty_model_is_the_base_model(http: httpx.Client, path: str, body: dict) -> None:
    """``"model": ""`` was a 404 ("the model `` does not exist"); vLLM serves it with the base
    model, and names the base model in the response."""
    r = http.post(path, json={**body, "model": ""})
    assert r.status_code == 200, r.text
    if path != "/tokenize":
        assert r.json()["model"] == MODEL


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
@pytest.mark.parametrize(("options", "last_usage"), [
    ({}, True), ({"continuous_usage_stats": False}, True), ({"include_usage": False}, False),
])
def test_include_usage_is_true_unless_set_false(
    http: httpx.Client, path: str, body: dict, options: dict, last_usage: bool
) -> None:
    """vLLM's ``include_usage`` defaults to true: stream options that leave it out got no last
    usage chunk here (its default was false)."""
    r = http.post(path, json={**body, "max_tokens": 2, "stream": True, "stream_options": options})
    assert r.status_code == 200, r.text
    chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
    assert ('"choices":[]' in chunks[-1] and '"completion_tokens":2' in chunks[-1]) == last_usage
