"""The server and command-line subprocesses under test: a live ``pagedllm`` server (start, stop,
reach), the request bodies and error check its tests share, its metrics, a streamed tool-call
reader, and the command line tests' flags of a small engine.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from pagedllm.config import MODEL_RUNNER_CLS_ENV
from pagedllm.distributed.parallel_state import free_port
from tests.fault_injection import FAULTY_RUNNER

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 240
API_KEY = "test-key"
MAX_BODY = 64 * 1024
# The session's shared server (conftest.py, ``shared_server``): float32, so that outputs do not
# depend on batching or prefix-cache hits (streamed equals non-streamed); an API key and a small
# body limit, which the tests of both check; the fault-injection hook, which acts only on
# requests that ask for a fault (``cache_salt="fault:..."``).
SHARED_SERVER_FLAGS = ("--dtype", "float32", "--api-key", API_KEY, "--max-request-body-size", str(MAX_BODY))
SHARED_SERVER_ENV = {MODEL_RUNNER_CLS_ENV: FAULTY_RUNNER}  # the fault-injection hook (tests/fault_injection.py)
ROOT = Path(__file__).resolve().parents[1]  # ``python -m`` runs this tree's pagedllm from any cwd
# The ``pagedllm`` command's flags for a small float32 engine (the test_cli_* modules).
CLI_SMALL = ["--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--dtype", "float32"]


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


def start_server(tmp_path: Path, *extra: str, model: str = MODEL, env: dict[str, str] | None = None) -> Server:
    """``pagedllm serve`` of ``model`` with the test defaults and ``extra`` flags (later flags
    win), its log in ``tmp_path``; ``env``: variables added to this process's environment.
    Returns once ``/health`` answers 200; AssertionError (with the log's tail) if it exits or
    does not start in ``STARTUP_TIMEOUT_S``."""
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", model,
        "--port", str(port), "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
        "--disable-access-log", *extra,
    ]
    with open(log, "wb") as f:  # a file, not a pipe: nobody drains a pipe while tests run
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **env} if env else None)
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


def streamed_calls(client: openai.OpenAI, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """A streamed chat completion's (content, index -> {id, name, arguments}, finish reason),
    joined from its deltas; each call's id and name must come before its arguments."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None and call["arguments"] == ""  # id and name come first
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
    return content, calls, finish


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def metric_value(text: str, name: str) -> float:
    """A metric's value in a Prometheus text exposition, summed over its series (a per-core
    gauge's cores); ``name`` may end in labels its series must have, e.g.
    ``'request_success_total{finished_reason="stop"}'``."""
    base, _, wanted = name.partition("{")
    labels = re.compile(r'(\w+)="([^"]*)"')
    want = set(labels.findall(wanted))
    values = [float(value) for series, found, value in re.findall(r"^pagedllm:(\S+?)(?:\{(.*)\})? (\S+)$", text, re.M)
              if series == base and want <= set(labels.findall(found))]
    assert values, f"pagedllm:{name} not in /metrics"
    return sum(values)


def metric(http: httpx.Client, name: str) -> float:
    """``metric_value`` of the server's /metrics."""
    return metric_value(http.get("/metrics").text, name)


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(http, "num_requests_running") == 0 and metric(http, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: running={metric(http, 'num_requests_running')}, "
                         f"kv={metric(http, 'kv_cache_usage_perc')}")


# The OpenAI-compatible server's request bodies and error answers (the test_server_* modules).
CHAT = [{"role": "user", "content": "Name three colors."}]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}


def _num_tokens(http: httpx.Client, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


def _check_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert needle in error["message"], error
