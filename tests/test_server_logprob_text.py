"""Completions' logprobs against the text they score, on the session's shared server: an
echoed prompt's tokens are its shares of the text (``detokenizer.token_shares``), as the
sampled tokens are, so that they join to the choice's text and ``text_offset`` indexes it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server_util import API_KEY, Server


@pytest.fixture(scope="module")
def http(shared_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _text_and_logprobs(http: httpx.Client, body: dict) -> tuple[str, list[str], list[int]]:
    """The choice's text, logprobs tokens and text offsets, a stream's chunks joined."""
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    text, tokens, offsets = "", [], []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("prompt", ["😀🎉 日本語", "Emoji: 👍🏽🇫🇷 family 👨‍👩‍👧 — done."])
def test_echoed_prompt_tokens_join_to_the_text(http: httpx.Client, prompt: str, as_ids: bool, stream: bool) -> None:
    """Characters split over prompt tokens were lost (every piece "" or U+FFFD): the tokens no
    longer spelled the echoed prompt and the offsets after them pointed elsewhere."""
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": ids if as_ids else prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0,
            "stream": stream}
    text, tokens, offsets = _text_and_logprobs(http, body)
    assert text.startswith(prompt)
    assert "".join(tokens) == text and "\ufffd" not in text
    assert all(text[o:o + len(t)] == t for o, t in zip(offsets, tokens, strict=True))
