"""A live server with the fault-injection test hook on: a request that fails inside the engine
gets an OpenAI error (a 500 body, or an SSE error event then ``[DONE]``), the requests beside it
are answered as usual, the server stays healthy, and no block is left behind. Also: outputs cut
inside a character carry no U+FFFD, and chat logprobs join to the text and carry raw bytes.
On the session's shared server (conftest.py's ``server`` and ``http``), its fault-injection hook on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_util import MODEL, Server, wait_idle

PROMPTS = [f"Fact number {i} about the ocean:" for i in range(8)]
EMOJI_CHAT = [{"role": "user", "content": "Reply with three emoji that describe happiness."}]


def _greedy(http: httpx.Client, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _sse(lines: Iterator[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _check_internal_error(error: dict) -> None:
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert "engine failed this request" in error["message"]


@pytest.mark.parametrize("fault", ["sample", "token"])
def test_failing_request_alone_gets_500(server: Server, http: httpx.Client, fault: str) -> None:
    before = {p: _greedy(http, p) for p in PROMPTS}
    bad = {"model": MODEL, "prompt": "Tell me about dragons.", "max_tokens": 12, "cache_salt": f"fault:{fault}"}
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        failing = pool.submit(http.post, "/v1/completions", json=bad)
        others = {p: pool.submit(_greedy, http, p) for p in PROMPTS}
        r = failing.result()
        assert {p: f.result() for p, f in others.items()} == before
    assert r.status_code == 500, r.text
    _check_internal_error(r.json()["error"])
    assert http.get("/health").status_code == 200
    assert _greedy(http, PROMPTS[0]) == before[PROMPTS[0]]
    wait_idle(http)  # no running request, no block in use
    assert server.proc.poll() is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_failing_stream_ends_with_error_event(http: httpx.Client, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 12, "stream": True, "cache_salt": "fault:logits"}
    body |= {"messages": EMOJI_CHAT} if "chat" in path else {"prompt": "Tell me about dragons."}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    _check_internal_error(events[-2]["error"])
    assert http.get("/health").status_code == 200
    wait_idle(http)


@pytest.mark.parametrize("max_tokens", [2, 4, 5])
def test_chat_cut_mid_character(http: httpx.Client, max_tokens: int) -> None:
    """The greedy reply is emoji of 3 tokens each: these limits end 2/3, 3/3 and 1/3 into one."""
    body = {"model": MODEL, "messages": EMOJI_CHAT, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text, content = choice["message"]["content"], choice["logprobs"]["content"]
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as s:
        chunks = [e for e in _sse(s.iter_lines()) if e != "[DONE]" and e["choices"]]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    # Deltas carry only their keys (they sent "role": null and "tool_calls": null beside content).
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and all(None not in d.values() for d in deltas)
    streamed_lp = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]

    assert choice["finish_reason"] == "length" and len(content) == max_tokens
    assert "\ufffd" not in text and streamed == text
    assert max_tokens != 4 or text == "🌱"  # sanity: the reply really is emoji
    for entries in (content, streamed_lp):
        assert "".join(e["token"] for e in entries) == text
        raw = b"".join(bytes(e["bytes"]) for e in entries)
        assert raw.decode(errors="ignore") == text  # the raw bytes, the unfinished character's included
        for e in entries:
            assert "\ufffd" not in e["token"]
            assert all(isinstance(t["bytes"], list) and t["bytes"] for t in e["top_logprobs"])
