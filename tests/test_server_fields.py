"""Every request field honoured or refused on the session's shared server, and one bad request
never takes the server down: NaN, Infinity, out-of-range values, lone surrogates and
unimplemented fields are 400s on a connection that keeps serving, the hint fields are accepted,
logit_bias, allowed_token_ids and bad_words act, and no body hypothesis draws gets a 5xx."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server_util import CHAT, MAX_MODEL_LEN, MODEL, _chat, _check_error, _completion, _num_tokens, metric


# -- every field honoured or refused; one bad request never takes the server down ------------------
def _raw(http: httpx.Client, path: str, body: object, **kwargs) -> httpx.Response:
    """POST ``body`` as Python's json module writes it: NaN/Infinity literals and \\ud800 escapes pass
    through (httpx's own encoder refuses both)."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"}, **kwargs)


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def _greedy(http: httpx.Client) -> str:
    r = http.post("/v1/completions", json=_completion(prompt="The capital of France is", max_tokens=6, temperature=0))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def greedy_before(http: httpx.Client) -> str:
    return _greedy(http)


NAN, INF = math.nan, math.inf
REFUSED = [
    # NaN / Infinity in every kind of numeric field.
    ("/v1/completions", _completion(prompt="hi", max_tokens=2, temperature=NAN), "temperature"),
    ("/v1/completions", _completion(temperature=INF), "temperature"),
    ("/v1/completions", _completion(top_p=NAN), "top_p"),
    ("/v1/completions", _completion(min_p=-INF), "min_p"),
    ("/v1/completions", _completion(max_tokens=NAN), "max_tokens"),
    ("/v1/completions", _completion(n=INF), "n"),
    ("/v1/completions", _completion(seed=NAN), "seed"),
    ("/v1/chat/completions", _chat(frequency_penalty=NAN), "frequency_penalty"),
    ("/v1/chat/completions", _chat(repetition_penalty=INF), "repetition_penalty"),
    ("/v1/chat/completions", _chat(logit_bias={"5": NAN}), "logit_bias.5"),
    # Out of vLLM's ranges.
    ("/v1/completions", _completion(temperature=3), "temperature"),
    ("/v1/completions", _completion(temperature=100), "temperature"),
    ("/v1/completions", _completion(temperature=1e308), "temperature"),
    ("/v1/completions", _completion(repetition_penalty=0), "repetition_penalty"),
    ("/v1/completions", _completion(top_k=2**70), "top_k"),
    ("/v1/completions", _completion(logit_bias={"5": 101}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"abc": 1}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={str(10**9): 1}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"5_0": 1}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"05": 1, "5": -1}), "logit_bias"),
    ("/v1/completions", _completion(allowed_token_ids=[]), "allowed_token_ids"),
    ("/v1/completions", _completion(allowed_token_ids=[10**9]), "allowed_token_ids"),
    # Text that is not Unicode scalar values never reaches the tokenizer.
    ("/v1/completions", _completion(prompt="ab\ud800cd"), "prompt"),
    ("/v1/completions", _completion(prompt=["ok", "x\udfff"]), "prompt.1"),
    ("/v1/completions", _completion(stop=["\ud800"]), "stop.0"),
    ("/v1/completions", _completion(bad_words=["a\udc00"]), "bad_words.0"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "ab\ud800cd"}]), "messages.0.content"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
     "messages.0.content.0.text"),
    ("/tokenize", {"prompt": "ab\ud800cd"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udbff"}]}, "messages.0.content"),
    # Fields pagedllm does not implement, and field combinations it cannot honour.
    ("/v1/completions", _completion(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/chat/completions", _chat(stream_options={"include_usage": True}, stream=False), "stream_options"),
    ("/v1/completions", _completion(suffix="!"), "suffix"),
    ("/v1/completions", _completion(best_of=3), "best_of"),
    ("/v1/completions", _completion(frobnicate=True), "frobnicate"),
    ("/v1/chat/completions", _chat(response_format={"type": "yaml"}), "response_format"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {}}),
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", _chat(tools=[{"type": "retrieval"}]), "tools.0.type"),
    ("/v1/chat/completions", _chat(tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", _chat(echo=True), "echo"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi", "audio": {}}]), "messages.0.audio"),
    ("/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options.x"),
]


def test_refused_fields_keep_the_server_serving(http: httpx.Client, greedy_before: str) -> None:
    for path, body, param in REFUSED:
        r = _raw(http, path, body)
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
        assert error["param"] == param, (body, error)
        assert param.split(".")[0] in error["message"], error
        # The same keep-alive connection serves the next request.
        assert r.headers.get("connection") != "close"
        ok = http.post("/tokenize", json={"prompt": "hi"})
        assert ok.status_code == 200 and _local_port(ok) == _local_port(r)
    assert http.get("/health").status_code == 200 and http.head("/health").status_code == 200
    assert _greedy(http) == greedy_before


def test_nan_temperature_does_not_reach_the_engine(http: httpx.Client, greedy_before: str) -> None:
    before = metric(http, "prompt_tokens_total")
    content = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": NaN}' % MODEL.encode()
    r = http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    _check_error(r, 400, "temperature")
    assert r.json()["error"]["param"] == "temperature"
    assert metric(http, "prompt_tokens_total") == before
    assert _greedy(http) == greedy_before


def test_error_bodies_quote_client_text_briefly(http: httpx.Client) -> None:
    # A model name, a field's name or a logit_bias key of 50,000 characters (this server takes
    # bodies of up to 64 KiB; a default one 16 MiB): the error names it, but its body is not the
    # client's text sent back.
    huge = "f" * 50_000
    for body, status in [(_completion(model=huge), 404), (_completion(**{huge: 1}), 400),
                         (_completion(logit_bias={huge: 1}), 400)]:
        r = _raw(http, "/v1/completions", body)
        assert r.status_code == status, r.text[:300]
        assert len(r.content) < 3000 and "fffff" in r.json()["error"]["message"]


def test_hint_fields_are_accepted(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=_chat(user="u-1", parallel_tool_calls=False, tool_choice="none",
                                                      tools=[], response_format={"type": "text"},
                                                      messages=[{"role": "user", "content": "Hi", "name": "ann"}]))
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json=_completion(user="u-1", best_of=2, n=2))
    assert r.status_code == 200, r.text


def _token_id(http: httpx.Client, text: str) -> int:
    (token,) = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return token


def test_logit_bias_allowed_token_ids_bad_words(http: httpx.Client) -> None:
    blue = _token_id(http, " blue")
    body = _completion(prompt="The sky is", max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)

    def tokens(**fields) -> list[str]:
        r = http.post("/v1/completions", json={**body, **fields})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    assert tokens(logit_bias={str(blue): 100}) == [" blue"] * 4
    plain = tokens()
    first = _token_id(http, plain[0])
    assert tokens(logit_bias={str(first): -100})[0] != plain[0]
    assert set(tokens(allowed_token_ids=[blue], temperature=1.0)) == {" blue"}
    assert tokens(bad_words=[plain[0].strip()])[0] != plain[0]


def test_max_tokens_unset_is_16_and_null_the_room_left(http: httpx.Client) -> None:
    # vLLM's: an unset max_tokens is 16; an explicit null runs to the end of the context.
    body = _completion(prompt="Count: one two", ignore_eos=True, temperature=0)
    body.pop("max_tokens", None)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    text = "hello " * 1012
    for prompt, n in (([33, 34, 30] * 339 + [33, 34], 1019), (text, _num_tokens(http, prompt=text))):
        r = http.post("/v1/completions", json=_completion(prompt=prompt, max_tokens=None, ignore_eos=True,
                                                          temperature=0))
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": n, "completion_tokens": MAX_MODEL_LEN - n,
                                     "total_tokens": MAX_MODEL_LEN}
        assert r.json()["choices"][0]["finish_reason"] == "length"


# Values of every kind a client might send, including JSON numbers Python's parser turns into
# NaN/Infinity, huge integers and text with lone surrogates.
# Subnormals off: a native library built with -ffast-math may have set flush-to-zero in this
# process, and hypothesis refuses to draw subnormal floats then.
_FLOATS = st.floats(allow_subnormal=False)
_ODD_TEXT = st.text(st.characters(categories=["Cs", "Lu", "Ll", "Nd", "Zs", "So", "Cc", "Mn"]), max_size=12)
_TEXT = st.one_of(st.text(max_size=12), _ODD_TEXT)
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), _FLOATS, _TEXT)
_ANY = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                    max_leaves=6)
_SMALL_INT = st.one_of(st.integers(-1, 3), st.integers(-1, 3), st.sampled_from([2**64, 1.5, NAN, INF, "2", None]))


def _number(low: float, high: float) -> st.SearchStrategy:
    """Mostly in [low, high], else any float (NaN, Infinity, huge, negative) or another type."""
    in_range = st.floats(low, high, allow_subnormal=False)
    return st.one_of(in_range, in_range, _FLOATS, _SCALAR)


_FIELDS = {
    "prompt": st.one_of(_TEXT, st.lists(_TEXT, min_size=1, max_size=2), st.lists(st.integers(-5, 60000), max_size=4),
                        _ANY),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "wizard"]),
                                                "content": st.one_of(_TEXT, _TEXT, _ANY)}), max_size=2),
    "temperature": _number(0, 2), "top_p": _number(0, 1), "top_k": _SMALL_INT, "min_p": _number(0, 1),
    "presence_penalty": _number(-2, 2), "repetition_penalty": _number(0.5, 2), "n": _SMALL_INT,
    "seed": st.one_of(st.integers(-(2**70), 2**70), _SCALAR), "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=2)),
    "logprobs": _SMALL_INT, "min_tokens": _SMALL_INT, "stream": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(_TEXT, st.integers(-5, 10**6).map(str)), _number(-100, 100),
                                  max_size=3),
    "allowed_token_ids": st.lists(st.integers(-5, 60000), max_size=3), "bad_words": st.lists(_TEXT, max_size=2),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True}), _ANY), "echo": _SCALAR,
    "response_format": st.one_of(st.just({"type": "text"}), _ANY),
}


@st.composite
def _bodies(draw: st.DrawFn) -> tuple[str, dict]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = {"model": MODEL, "max_tokens": draw(_SMALL_INT)}
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=6))
    for name in names:
        body[name] = draw(_FIELDS[name])
    if draw(st.integers(0, 3)) == 0:  # an unknown field
        body[draw(_TEXT)] = draw(_ANY)
    body.setdefault("prompt" if path == "/v1/completions" else "messages", "Hi" if path == "/v1/completions" else CHAT)
    return path, body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies())
def test_property_no_request_body_gets_a_5xx(http: httpx.Client, request_body: tuple[str, dict]) -> None:
    path, body = request_body
    if body["max_tokens"] is None or (isinstance(body["max_tokens"], int) and body["max_tokens"] > 3):
        body["max_tokens"] = 2  # chat's null runs to the end of the context: keep each example short
    r = _raw(http, path, body)
    event(f"status {r.status_code}")
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_healthy_after_the_property_test(http: httpx.Client, greedy_before: str) -> None:
    assert http.get("/health").status_code == 200
    assert _greedy(http) == greedy_before
