"""Hostile structured-output requests over HTTP (issue: one grammar killed the server): each
gets a 4xx OpenAI error under 4 KB naming the field, the server stays healthy and gives the
same greedy answer to a canary before and after; a grammar worker killed mid-compile fails only
its request; a slow compile holds nobody else up."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_util import MODEL, Server, start_server, stop_server, wait_idle
from tests.utils import lark_chain, many_properties, nested_arrays, ref_chain

CANARY = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A small KV pool, wholly touched by the first requests, so that memory growth is the grammars'.
    s = start_server(tmp_path_factory.mktemp("hostile"), "--max-request-body-size", "20MiB", "--kv-cache-memory", "32MiB")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def canary(http: httpx.Client) -> str:
    r = http.post("/v1/chat/completions", json=CANARY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


HOSTILE = {
    "lark-chain-3000": (_chat(structured_outputs={"grammar": lark_chain(3000)}), "structured_outputs.grammar"),
    "ref-chain-3000": (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}),
        "response_format.json_schema.schema",
    ),
    "ref-chain-tools": (_chat(tools=[_tool(ref_chain(3000))], tool_choice="required"), "tools.0.function.parameters"),
    "self-ref": (_chat(structured_outputs={"json": {"$ref": "#"}}), "structured_outputs.json"),
    "allOf-self": (_chat(structured_outputs={"json": {"allOf": [{"$ref": "#"}]}}), "structured_outputs.json"),
    "left-recursive": (_chat(structured_outputs={"grammar": 'start: a\na: a "x"'}), "structured_outputs.grammar"),
    "gbnf-self": (_chat(structured_outputs={"grammar": "root ::= root"}), "structured_outputs.grammar"),
    "choice-100k": (_chat(structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}), "structured_outputs.choice"),
    "props-10k": (_chat(structured_outputs={"json": many_properties(10_000)}), "structured_outputs.json"),
    "arrays-500": (_chat(guided_json=nested_arrays(500)), "guided_json"),
    # Only the end token (<|im_end|>) is allowed, and min_tokens forbids it: found while generating.
    "no-token-left": (_chat(allowed_token_ids=[2], min_tokens=4, max_tokens=8), "allowed_token_ids"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_is_a_short_400_and_the_server_serves_on(
    http: httpx.Client, canary: str, name: str, stream: bool = False
) -> None:
    body, param = HOSTILE[name]
    r = http.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert len(r.content) < 4096
    error = r.json()["error"]
    assert error["param"] == param, error
    assert http.get("/health").status_code == 200
    again = http.post("/v1/chat/completions", json=CANARY)
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == canary


def test_no_token_left_streamed_ends_with_an_error_event(http: httpx.Client) -> None:
    body, param = HOSTILE["no-token-left"]
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["param"] == param and error["code"] == 400


# Past llguidance's lexer limit after 9 digits (one token each), beyond the 8 bytes the compile
# check walks (which refuses "(a{996}){1000}" alone): found while generating, at the 10th token.
# The first request fails at its token, a repeat at its cached matcher's mask.
LEXER_LIMIT = [
    ({"guided_regex": "[0-9]{9}(a{996}){1000}"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^[0-9]{9}(b{995}){1000}$"}}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[0-9]{9}(c{994}){1000}"}}, "structured_outputs.regex"),
]


@pytest.mark.parametrize(("fields", "param"), LEXER_LIMIT, ids=[p for _, p in LEXER_LIMIT])
def test_a_grammar_failing_while_generating_is_a_400_naming_the_field_every_time(
    http: httpx.Client, canary: str, fields: dict, param: str
) -> None:
    body = {"model": MODEL, "prompt": "aaaa bbbb cccc", "max_tokens": 16} | fields
    for _ in range(2):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text[:500]
        error = r.json()["error"]
        assert error["param"] == param and "the grammar failed while generating" in error["message"], error
    with http.stream("POST", "/v1/chat/completions", json=_chat(**fields, max_tokens=16, stream=True)) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["param"] == param and error["code"] == 400
    wait_idle(http)  # nothing running, no KV block held
    assert http.post("/v1/chat/completions", json=CANARY).json()["choices"][0]["message"]["content"] == canary


# -- a slow grammar, and a grammar worker killed mid-compile ----------------------------------
@pytest.fixture(scope="module")
def loose_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Limits raised so that a 10,000-property schema reaches a grammar worker and compiles for seconds."""
    s = start_server(tmp_path_factory.mktemp("loose"), "--max-request-body-size", "20MiB",
                      "--max-grammar-properties", "100000", "--max-grammar-rules", "100000",
                      "--max-grammar-bytes", "10000000", "--grammar-compile-timeout", "600")
    yield s
    stop_server(s)


def _grammar_workers(server_pid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"grammar_worker" in cmdline:
            pids.append(int(entry.name))
    return pids


def _cpu_ticks(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
    except OSError:
        return 0


def test_slow_compile_blocks_nobody_and_sigkill_fails_only_its_request(loose_server: Server) -> None:
    events: list[str] = []
    slow: dict = {}

    def send_slow() -> None:
        with httpx.Client(base_url=loose_server.url, timeout=600) as c:
            slow["response"] = c.post("/v1/chat/completions", json=_chat(structured_outputs={"json": many_properties(10_000)}))
        events.append("slow done")

    with httpx.Client(base_url=loose_server.url, timeout=300) as http:
        expected = http.post("/v1/chat/completions", json=CANARY).json()["choices"][0]["message"]["content"]
        thread = threading.Thread(target=send_slow)
        thread.start()
        busy = None
        for _ in range(1200):  # until a grammar worker is spending CPU on the slow schema
            busy = next((p for p in _grammar_workers(loose_server.proc.pid) if _cpu_ticks(p) > 20), None)
            if busy is not None or not thread.is_alive():
                break
            time.sleep(0.05)
        assert busy is not None and thread.is_alive(), "the slow schema never reached a grammar worker"
        assert http.get("/health").status_code == 200
        events.append("health")
        r = http.post("/v1/chat/completions", json=CANARY)
        assert r.json()["choices"][0]["message"]["content"] == expected
        events.append("canary")
        os.kill(busy, signal.SIGKILL)
        thread.join(300)
        assert events == ["health", "canary", "slow done"], events
        response = slow["response"]
        assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.json"
        assert "too complex" in response.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json=CANARY)
        assert r.json()["choices"][0]["message"]["content"] == expected


def test_engine_core_memory_is_bounded_after_many_distinct_grammars(server: Server, http: httpx.Client) -> None:
    """200 distinct 40 KB schemas: the core's compiled-grammar cache is bounded by bytes, and
    its resident memory is reported in /metrics."""

    def rss() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("pagedllm:engine_core_resident_memory_bytes"):
                return float(line.split()[-1])
        raise AssertionError("no engine core RSS in /metrics")

    http.post("/v1/chat/completions", json=CANARY)
    before = rss()
    assert before > 0

    def send(i: int) -> None:
        schema = many_properties(200) | {"description": f"schema {i} " + "x" * 30_000}
        r = http.post("/v1/chat/completions", json=_chat(structured_outputs={"json": schema}, max_tokens=1))
        assert r.status_code == 200, r.text[:300]

    threads = [threading.Thread(target=lambda k=k: [send(8 * i + k) for i in range(25)]) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    http.post("/v1/chat/completions", json=CANARY)
    # The stated bound: 150 MB over the core's RSS before them (the compiled-grammar cache holds
    # at most 64 matchers, about 1 MB each for these schemas; the 32 MiB KV pool; the allocator's slack).
    assert rss() - before < 150e6


def test_many_tools_required_are_refused_as_tools(http: httpx.Client, canary: str) -> None:
    """Each tool fits the limits; the constraint of "required" over all of them does not."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": many_properties(3)}} for i in range(1500)]
    r = http.post("/v1/chat/completions", json=_chat(tools=tools, tool_choice="required"))
    assert r.status_code == 400 and len(r.content) < 4096
    assert r.json()["error"]["param"] == "tools"
    again = http.post("/v1/chat/completions", json=CANARY)
    assert again.json()["choices"][0]["message"]["content"] == canary
