"""Completions and chat completions on the session's shared server, end to end through the
official ``openai`` client (and raw httpx where the client would hide the wire): the answers,
exact usage, logprobs and top logprobs, echo, stop strings, several prompts and samples, seeds,
and the same streamed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_util import CHAT, MODEL, _chat, _completion, _num_tokens


# -- chat completions ----------------------------------------------------------------------
def test_chat_non_streaming_usage_exact(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # Exact counts: the prompt as the server tokenizes it, one logprob entry per output token.
    assert r.usage.prompt_tokens == _num_tokens(http, messages=CHAT)
    assert r.usage.completion_tokens == len(choice.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    top = choice.logprobs.content[0].top_logprobs
    assert len(top) == 2 and top[0].logprob >= top[1].logprob
    assert choice.logprobs.content[0].token == top[0].token  # greedy picks the most likely token


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_content_parts_max_completion_tokens_cache_salt(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True, "cache_salt": "tenant-a"})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


# -- completions ---------------------------------------------------------------------------
def test_completion_n2_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=2, temperature=1.0, seed=3,
                                  logprobs=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == _num_tokens(http, prompt=prompt)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_completion_several_prompts_and_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: the same text for every prompt and sample
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_completion_stop(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3, 4,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]  # a word from inside the greedy output
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert max(top, key=top.get) == token  # greedy


def _sse_choices(r: httpx.Response) -> list[dict]:
    """The choices of every chunk of a stream, in order."""
    assert r.status_code == 200, r.text
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [c for line in lines[:-1] for c in json.loads(line)["choices"]]


@pytest.mark.parametrize("echo", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token_streamed_or_not(http: httpx.Client, echo: bool) -> None:
    """As OpenAI and vLLM: ``top_logprobs`` always holds the sampled token (up to logprobs + 1
    entries; logprobs 0: the sampled token alone), and a stream's ``text_offset`` counts along
    each choice's text across chunks, so streamed logprobs join to the non-streamed ones."""
    body = _completion(prompt="Hello", max_tokens=8, temperature=2.0, seed=3, n=2, ignore_eos=True, echo=echo)
    for logprobs in (0, 1):
        r = http.post("/v1/completions", json={**body, "logprobs": logprobs})
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        for choice in choices:
            lp = choice["logprobs"]
            assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
            for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
                if top is None:  # the echoed prompt's first token: nothing precedes it
                    continue
                assert top[token] == value and len(top) <= logprobs + 1
                assert logprobs or top == {token: value}
        tops = [top for c in choices for top in c["logprobs"]["top_logprobs"] if top is not None]
        assert any(len(top) == logprobs + 1 for top in tops)  # a sampled token outside the top `logprobs`
        streamed: dict[int, dict[str, list]] = {}
        for chunk in _sse_choices(http.post("/v1/completions", json={**body, "logprobs": logprobs, "stream": True})):
            joined = streamed.setdefault(chunk["index"], {k: [] for k in chunk["logprobs"]})
            for key, values in chunk["logprobs"].items():
                joined[key] += values
        assert [streamed[c["index"]] for c in choices] == [c["logprobs"] for c in choices]


def test_completion_echo(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The quick brown fox jumps"
    n_prompt = _num_tokens(http, prompt=prompt)
    # How evaluation harnesses score a text: echo, no new tokens, prompt logprobs.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == n_prompt
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)


def test_completion_streaming_echo_and_usage(client: openai.OpenAI) -> None:
    prompt = "Water boils at"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(http: httpx.Client, path: str) -> None:
    """vLLM's stream_options.continuous_usage_stats (it was refused): every chunk carries its
    choice's usage so far, its prompt's tokens and its own, counting up to the choice's
    tokens; the last chunk (include_usage) has their sum."""
    body = (_completion if path == "/v1/completions" else _chat)(
        max_tokens=5, n=2, temperature=1.0, ignore_eos=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    *chunks, last = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    prompt = last["usage"]["prompt_tokens"]
    so_far = {0: 0, 1: 0}
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]
        for choice in chunk["choices"]:
            assert usage["completion_tokens"] >= so_far[choice["index"]], chunk
            so_far[choice["index"]] = usage["completion_tokens"]
    assert so_far == {0: 5, 1: 5} and not last["choices"] and last["usage"]["completion_tokens"] == 10
    # as vLLM, with include_usage only (every chunk carried usage with include_usage false):
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    lines = http.post(path, json=body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks and all(c.get("usage") is None and c["choices"] for c in chunks)


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # each sample gets its own seed
