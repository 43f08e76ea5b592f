"""Aborts, load and a server's end: a client that hangs up mid-stream or stops waiting,
64 concurrent streams on the session's shared server, SIGTERM with a stream in flight (a server
of its own), and on a second server with a KV cache of 8 blocks, a burst beyond the cache
queued and served, then its engine core killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_util import (
    API_KEY, MODEL, Server, _check_error, _completion, _num_tokens, metric, start_server, stop_server, wait_idle,
)


# -- faults and load -------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts(http: httpx.Client) -> None:
    wait_idle(http)
    body = _completion(prompt="Tell me a long story.", max_tokens=500, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break
    # Hung up after 3 chunks of 500: the request must leave the engine and free its blocks.
    wait_idle(http)
    aborted = metric(http, 'request_success_total{finished_reason="abort"}')
    assert aborted >= 1
    # The same for a client that gives up waiting on a non-streaming request.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=3)
    wait_idle(http)
    assert metric(http, 'request_success_total{finished_reason="abort"}') == aborted + 1


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

    results = asyncio.run(run())  # each stream under the client's own timeout
    assert all(text and finish == "length" for text, finish in results), results
    wait_idle(http)


def test_sigterm_aborts_in_flight_and_exits_cleanly(tmp_path: Path) -> None:
    server = start_server(tmp_path)  # a server of its own: this test stops it
    try:
        engine_pid = server.engine_pid()
        body = _completion(prompt="Tell me a long story.", max_tokens=500, ignore_eos=True, stream=True)
        with httpx.Client(base_url=server.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data:")
                server.proc.send_signal(signal.SIGTERM)
                events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(timeout=30) == 0
        assert not Path(f"/proc/{engine_pid}").exists(), "engine core left behind"
    finally:
        stop_server(server)


# -- a second server, with a KV cache of 8 blocks (128 tokens) ---------------------------------
@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("small"), "--kv-cache-memory", "3MiB")
    yield s
    stop_server(s)


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
        wait_idle(http)


def test_engine_death(small_server: Server) -> None:
    server = small_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = _completion(prompt="Tell me a long story.", max_tokens=100, ignore_eos=True, stream=True)
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(server.engine_pid(), signal.SIGKILL)
            for _ in range(600):  # /health turns 503 once the front end sees the core gone
                if http.get("/health").status_code == 503:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("/health still 200 after the engine core died")
            _check_error(http.get("/health"), 503, "dead")
            # The in-flight stream ends with an error, not a hang.
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert server.proc.wait(timeout=30) != 0
