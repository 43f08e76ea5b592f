"""Helpers shared by the test modules: a live server subprocess, and the block pool checks.

Test modules import from here, never from one another.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from pagedllm.distributed.parallel_state import free_port

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[1]  # ``python -m`` runs this tree's pagedllm from any cwd


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


def start_server(tmp_path: Path, *extra: str, model: str = MODEL) -> Server:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", model,
        "--port", str(port), "--kv-cache-memory", "512MiB", "--max-model-len", str(MAX_MODEL_LEN),
        "--disable-access-log", *extra,
    ]
    with open(log, "wb") as f:  # a file, not a pipe: nobody drains a pipe while tests run
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
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


def metric(http: httpx.Client, name: str) -> float:
    """A metric's value; for a per-core gauge (label ``engine``), the sum over the cores."""
    text = http.get("/metrics").text
    values = re.findall(rf'^pagedllm:{re.escape(name)}(?:{{engine="\d+"}})? (\S+)$', text, re.MULTILINE)
    assert values, f"pagedllm:{name} not in /metrics"
    return sum(map(float, values))


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(http, "num_requests_running") == 0 and metric(http, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: running={metric(http, 'num_requests_running')}, "
                         f"kv={metric(http, 'kv_cache_usage_perc')}")


def pool_is_whole(llm) -> bool:
    """Every block of an ``LLM``'s KV cache pool is free, no reference held."""
    pool = llm.engine.core.kv_cache.pool
    return pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def assert_pool_whole(sched) -> None:
    """Every block of a scheduler's KV cache pool is free, no reference held."""
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
