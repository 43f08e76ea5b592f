"""Bad requests on the session's shared server: each gets its status and an error body
(``message``, ``type``, ``param``, ``code``) naming what is wrong: out-of-range and mistyped
fields, an unknown model, a prompt past the context, malformed, empty-typed and oversized
bodies, and a missing or wrong API key (every route but the probes)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_util import (
    API_KEY, CHAT, MAX_BODY, MAX_MODEL_LEN, MODEL, Server, _chat, _check_error, _completion, _num_tokens,
)


BAD_REQUESTS = [
    ("/v1/completions", _completion(temperature=-1), 400, "temperature"),
    ("/v1/completions", _completion(top_p=1.5), 400, "top_p"),
    ("/v1/completions", _completion(n=0), 400, "n"),
    ("/v1/completions", _completion(max_tokens=0), 400, "max_tokens must be at least 1 (0 only with echo), got 0"),
    ("/v1/completions", _completion(max_tokens=-1, echo=True), 400, "at least 1 (0 only with echo), got -1"),
    ("/v1/chat/completions", _chat(max_tokens=0), 400, "max_tokens must be at least 1, got 0"),
    ("/v1/chat/completions", _chat(max_completion_tokens=0), 400, "max_completion_tokens must be at least 1, got 0"),
    ("/v1/completions", _completion(max_tokens=5000), 400, str(MAX_MODEL_LEN)),
    ("/v1/completions", _completion(prompt=""), 400, "empty"),
    ("/v1/completions", _completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", _completion(prompt=[1, 10**9]), 400, "vocabulary"),
    ("/v1/completions", _completion(logprobs=50), 400, "logprobs"),
    ("/v1/completions", _completion(seed=2**70), 400, "seed"),
    ("/v1/completions", _completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("/v1/completions", _completion(n="two"), 400, "n"),
    # Another JSON type is refused, not coerced: "3", true and 3.0 are not integers.
    ("/v1/completions", _completion(max_tokens="3"), 400, "max_tokens"),
    ("/v1/completions", _completion(max_tokens=True), 400, "max_tokens"),
    ("/v1/completions", _completion(max_tokens=3.0), 400, "max_tokens"),
    ("/v1/completions", _completion(stream="true"), 400, "stream"),
    ("/v1/chat/completions", _chat(logprobs="true"), 400, "logprobs"),
    ("/v1/chat/completions", _chat(temperature="0"), 400, "temperature"),
    # n is capped per request, not per prompt: 20 tiny prompts at n=256 would queue 5,120 sequences.
    ("/v1/completions", _completion(prompt=[[1]] * 20, n=256), 400, "20 x 256"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", _completion(model="gpt-4"), 404, "gpt-4"),
    ("/v1/chat/completions", _chat(model="gpt-4"), 404, "gpt-4"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("/v1/chat/completions", _chat(max_tokens=-3), 400, "max_tokens"),
    ("/v1/chat/completions", _chat(presence_penalty=3), 400, "presence_penalty"),
    ("/detokenize", {"tokens": [10**9]}, 400, "vocabulary"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "messages": CHAT}, 400, "not both"),  # was: prompt silently ignored
]


def test_context_overflow_names_the_field_at_fault(http: httpx.Client) -> None:
    """A prompt longer than the context is the input's fault (``messages``, ``prompt``), whether
    or not max_tokens was sent; max_tokens is at fault only when the prompt fits without it."""
    messages = [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]
    n_chat, n_prompt = _num_tokens(http, messages=messages), _num_tokens(http, prompt="hello " * MAX_MODEL_LEN)
    for path, body, param, n in [
        ("/v1/chat/completions", {"model": MODEL, "messages": messages}, "messages", n_chat),
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}, "messages", n_chat),
        ("/v1/completions", _completion(prompt="hello " * MAX_MODEL_LEN, max_tokens=None), "prompt", n_prompt),
    ]:
        r = http.post(path, json=body)
        _check_error(r, 400, f"the prompt is {n} tokens, longer than this model's maximum context length of "
                             f"{MAX_MODEL_LEN} tokens")
        assert r.json()["error"]["param"] == param and "max_tokens" not in r.json()["error"]["message"]
    for field in ("max_tokens", "max_completion_tokens"):  # the field the client sent
        r = http.post("/v1/chat/completions", json=_chat(**{field: MAX_MODEL_LEN}))
        _check_error(r, 400, f"prompt tokens + {MAX_MODEL_LEN} max_tokens")
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_REQUESTS)
def test_bad_request(http: httpx.Client, path: str, body: dict, status: int, needle: str) -> None:
    _check_error(http.post(path, json=body), status, needle)


def test_malformed_and_oversized_bodies(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    _check_error(http.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers), 400, "JSON")
    # where it went wrong, not only what (the message stopped at "starting at"):
    _check_error(http.post("/v1/completions", content=b'{"prompt": "hi', headers=headers), 400,
                 "malformed JSON body: Unterminated string starting at (at character 11)")
    _check_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400, "must be a JSON object")
    # What FastAPI answers only "There was an error parsing the body" for, said:
    _check_error(http.post("/v1/completions", content=b'{"prompt": "h\xffi"}', headers=headers), 400,
                 "the request body is not UTF-8: byte 0xff at offset 13")
    # a UTF-16 byte order mark: json's guess of the encoding must not move the offset (was 28)
    _check_error(http.post("/v1/completions", content=b'\xff\xfe{"model":"x","prompt":"hi"}', headers=headers), 400,
                 "the request body is not UTF-8: byte 0xff at offset 0")
    # UTF-8, but a NUL byte first: json reads it as UTF-16 and fails on its odd length (was
    # "not UTF-8: byte 0x7d at offset 16")
    _check_error(http.post("/v1/completions", content=b'\x00{"max_tokens":1}', headers=headers), 400,
                 "the request body is not JSON: a NUL byte among its first bytes")
    _check_error(http.post("/v1/completions", content=b"[" * 5000 + b"]" * 5000, headers=headers), 400,
                 "nests JSON arrays or objects too deeply")
    _check_error(http.post("/v1/completions", content=b'{"max_tokens": ' + b"9" * 5000 + b"}", headers=headers), 400,
                 "an integer of more digits")
    text = {"Content-Type": "text/plain"}
    _check_error(http.post("/v1/completions", content=b"hello", headers=text), 400, "must be a JSON object")
    _check_error(http.post("/v1/completions", json=_completion(prompt="x " * MAX_BODY)), 413, str(MAX_BODY))
    _check_error(http.get("/v1/nowhere"), 404, "")


def test_auth(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        _check_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401, "API key")
        _check_error(httpx.post(f"{server.url}/v1/completions", json=_completion(), headers=headers), 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_api_key_guards_every_route_but_probes(server: Server) -> None:
    for path in ("/reset_prefix_cache", "/tokenize", "/detokenize"):
        _check_error(httpx.post(f"{server.url}{path}", json={}), 401, "API key")
    assert httpx.post(f"{server.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {API_KEY}"}).json() == {
        "success": True}
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    assert httpx.post(f"{server.url}/ping").status_code == 200  # vLLM's probe takes both methods
