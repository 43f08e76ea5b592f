"""vLLM's ``truncate_prompt_tokens`` on the session's shared server: a completions or chat
request keeping only its prompt's last k tokens (it was a 400, "Extra inputs are not
permitted", though ``SamplingParams`` honours it offline and vLLM's server takes it)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server_util import API_KEY, Server


@pytest.fixture(scope="module")
def http(shared_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def test_completion_keeps_the_prompts_last_tokens(http: httpx.Client) -> None:
    body = {"prompt": "The capital of France is Paris, and the capital of Spain is", "max_tokens": 2}
    whole = http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    r = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 3})
    assert r.status_code == 200, r.text
    assert whole > 3 and r.json()["usage"]["prompt_tokens"] == 3


def test_chat_without_max_tokens_counts_the_kept_tokens(http: httpx.Client) -> None:
    """max_tokens unset: the room left after the kept tokens, not after the whole prompt (a
    prompt past max_model_len left max_tokens 1, below min_tokens: a 400)."""
    body = {"messages": [{"role": "user", "content": "Say hi " * 600}], "truncate_prompt_tokens": 5,
            "temperature": 0.0, "min_tokens": 3, "stop": ["\n", "."]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] >= 3


@pytest.mark.parametrize("value", [0, -2, 1.5, True, 10**9])
def test_bad_values_are_400s_naming_the_field(http: httpx.Client, value) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": value})
    assert r.status_code == 400, r.text
    assert "truncate_prompt_tokens" in r.text
