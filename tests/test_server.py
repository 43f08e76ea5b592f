"""The OpenAI-compatible server, end to end: a live ``pagedllm serve`` on the default model,
driven by the official ``openai`` client (and raw httpx where the client would hide the wire)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
MAX_BODY = 64 * 1024
STARTUP_TIMEOUT_S = 240


class Server:
    """A server subprocess and how to reach it."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def engine_pid(self) -> int:
        """The engine-core process: the server's spawned child (not multiprocessing's resource tracker)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(pid)
        raise AssertionError(f"no engine-core child among {children}")

    def log_tail(self) -> str:
        return self.log.read_text()[-4000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(tmp_path: Path, *extra: str) -> Server:
    port = _free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", MODEL,
        "--port", str(port), "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
        "--disable-access-log", *extra,
    ]
    with open(log, "wb") as f:  # a file, not a pipe: nobody drains a pipe while tests run
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"server did not start in {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _start_server(tmp_path_factory.mktemp("server"), "--api-key", API_KEY, "--max-request-body-size",
                      str(MAX_BODY))
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf"^pagedllm:{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"pagedllm:{name} not in /metrics"
    return float(match.group(1))


def _num_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


CHAT = [{"role": "user", "content": "Name three colors."}]


# -- basics ----------------------------------------------------------------------------------
def test_models_health_version(client: openai.OpenAI, http: httpx.Client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


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


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # each sample gets its own seed


# -- bad input -------------------------------------------------------------------------------
def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


BAD_REQUESTS = [
    ("/v1/completions", _completion(temperature=-1), 400, "temperature"),
    ("/v1/completions", _completion(top_p=1.5), 400, "top_p"),
    ("/v1/completions", _completion(n=0), 400, "n"),
    ("/v1/completions", _completion(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", _completion(max_tokens=5000), 400, str(MAX_MODEL_LEN)),
    ("/v1/completions", _completion(prompt=""), 400, "empty"),
    ("/v1/completions", _completion(prompt=[]), 400, "prompt"),
    ("/v1/completions", _completion(prompt=[1, 10**9]), 400, "vocabulary"),
    ("/v1/completions", _completion(logprobs=50), 400, "logprobs"),
    ("/v1/completions", _completion(seed=2**70), 400, "seed"),
    ("/v1/completions", _completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("/v1/completions", _completion(n="two"), 400, "n"),
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
]


def _check_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert needle in error["message"], error


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD_REQUESTS)
def test_bad_request(http: httpx.Client, path: str, body: dict, status: int, needle: str) -> None:
    _check_error(http.post(path, json=body), status, needle)


def test_malformed_and_oversized_bodies(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    _check_error(http.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers), 400, "JSON")
    _check_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400, "")
    _check_error(http.post("/v1/completions", json=_completion(prompt="x " * MAX_BODY)), 413, str(MAX_BODY))
    _check_error(http.get("/v1/nowhere"), 404, "")


def test_auth(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        _check_error(httpx.get(f"{server.url}/v1/models", headers=headers), 401, "API key")
        _check_error(httpx.post(f"{server.url}/v1/completions", json=_completion(), headers=headers), 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_tokenize_detokenize(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"


# -- faults and load -------------------------------------------------------------------------
def _wait_idle(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _metric(http, "num_requests_running") == 0 and _metric(http, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: running={_metric(http, 'num_requests_running')}, "
                         f"kv={_metric(http, 'kv_cache_usage_perc')}")


def test_disconnect_mid_stream_aborts(http: httpx.Client) -> None:
    _wait_idle(http)
    body = _completion(prompt="Tell me a long story.", max_tokens=500, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break
    # Hung up after 3 chunks of 500: the request must leave the engine and free its blocks.
    _wait_idle(http)
    aborted = _metric(http, 'request_success_total{finished_reason="abort"}')
    assert aborted >= 1
    # The same for a client that gives up waiting on a non-streaming request.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=3)
    _wait_idle(http)
    assert _metric(http, 'request_success_total{finished_reason="abort"}') == aborted + 1


def test_64_concurrent_streams(server: Server, http: httpx.Client) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await c.completions.create(model=MODEL, prompt=f"Request {i}: count to ten.", max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    start = time.monotonic()
    results = asyncio.run(run())
    assert all(text and finish == "length" for text, finish in results), results
    assert time.monotonic() - start < 60
    _wait_idle(http)


def test_metrics(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"pagedllm:{name}" in text, name
    assert _metric(http, 'request_success_total{finished_reason="length"}') >= 64
    assert _metric(http, "generation_tokens_total") >= 64 * 4
    assert _metric(http, "time_to_first_token_seconds_count") >= 64


def test_reset_prefix_cache(http: httpx.Client) -> None:
    _wait_idle(http)
    assert http.post("/reset_prefix_cache").json() == {"success": True}


def test_sigterm_aborts_in_flight_and_exits_cleanly(server: Server, http: httpx.Client) -> None:
    engine_pid = server.engine_pid()
    body = _completion(prompt="Tell me a long story.", max_tokens=500, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        server.proc.send_signal(signal.SIGTERM)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert server.proc.wait(timeout=30) == 0
    assert not Path(f"/proc/{engine_pid}").exists(), "engine core left behind"


# -- a second server, with a KV cache of 8 blocks (128 tokens) ---------------------------------
@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = _start_server(tmp_path_factory.mktemp("small"), "--kv-cache-memory", "3MiB")
    yield s
    _stop(s)


def test_burst_beyond_kv_cache_is_queued_and_served(small_server: Server) -> None:
    with httpx.Client(base_url=small_server.url, timeout=120) as http:
        capacity = http.get("/v1/models").json()["data"][0]["max_model_len"]  # capped by the cache
        prompt = "Count: one two three"
        num, max_tokens = 8, 16
        assert num * (_num_tokens(http, prompt=prompt) + max_tokens) > capacity

        async def run() -> list[dict]:
            async with httpx.AsyncClient(base_url=small_server.url, timeout=120) as c:
                body = _completion(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
                responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(num)))
            return [r.json() for r in responses]

        for r in asyncio.run(run()):
            assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == max_tokens
        _wait_idle(http)


def test_engine_death(small_server: Server) -> None:
    server = small_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = _completion(prompt="Tell me a long story.", max_tokens=100, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(server.engine_pid(), signal.SIGKILL)
            killed = time.monotonic()
            while http.get("/health").status_code != 503:
                assert time.monotonic() - killed < 2, "/health still 200 after the engine core died"
                time.sleep(0.05)
            _check_error(http.get("/health"), 503, "dead")
            # The in-flight stream ends with an error, not a hang.
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert server.proc.wait(timeout=30) != 0
