"""Connections a hostile or broken client leaves open, over real sockets against a live server
started with short timeouts: a silent connection, an idle keep-alive one and a request head
trickled in a byte at a time are all closed; a request head sent in pieces within the deadline
is served; beyond ``--limit-concurrency`` open connections a request gets 503 and the server
goes on serving once they close."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server_util import MODEL, Server, start_server, stop_server

KEEP_ALIVE_S = 1.0
HEAD_S = 2.0
LIMIT = 3
WAIT_S = 60.0  # a generous bound for a timer of a few seconds on two shared cores
HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("connections"), "--timeout-keep-alive", str(KEEP_ALIVE_S),
                      "--timeout-request-head", str(HEAD_S), "--limit-concurrency", str(LIMIT))
    yield s
    stop_server(s)


def _connect(server: Server) -> socket.socket:
    url = urlsplit(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=WAIT_S)
    return sock


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body (what /health and an error answer)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _closed_by_server(sock: socket.socket) -> bool:
    """Wait for the server to close ``sock``: True on EOF or reset, False if it is still open after WAIT_S."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _health_ok(server: Server) -> bool:
    return httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with _connect(server) as sock:
        assert _closed_by_server(sock)
    assert _health_ok(server)


def test_an_idle_keep_alive_connection_is_closed_after_its_response(server: Server) -> None:
    with _connect(server) as sock:
        sock.sendall(HEALTH)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        assert _closed_by_server(sock)


def test_a_request_head_trickled_past_the_deadline_is_closed(server: Server) -> None:
    """A byte every fraction of the keep-alive timeout keeps that timer from firing: only the
    head deadline ends the connection, with no response."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n")
        deadline = time.monotonic() + WAIT_S
        closed = False
        while not closed and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], KEEP_ALIVE_S / 4)
            if readable:
                closed = _closed_by_server(sock)
                assert closed, "the server answered a request that was never complete"
                break
            try:
                sock.sendall(b"x")  # a header name that never ends
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed


def test_a_request_head_sent_in_pieces_within_the_deadline_is_served(server: Server) -> None:
    with _connect(server) as sock:
        for piece in (HEALTH[:10], HEALTH[10:25], HEALTH[25:]):
            sock.sendall(piece)
            time.sleep(KEEP_ALIVE_S / 4)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


def _open_stream(server: Server) -> socket.socket:
    """A streaming completion, read up to its first event and then left unread (it stays open)."""
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 800, "ignore_eos": True,
                       "stream": True}).encode()
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while b"data: " not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data
    return sock


def test_beyond_the_connection_limit_requests_get_503_and_serving_goes_on(server: Server) -> None:
    streams = [_open_stream(server) for _ in range(LIMIT)]
    try:
        with _connect(server) as sock:  # one connection more than the limit
            sock.sendall(HEALTH)
            assert _read_response(sock).startswith(b"HTTP/1.1 503")
    finally:
        for s in streams:
            s.close()  # the server aborts their requests and drops the connections
    deadline = time.monotonic() + WAIT_S
    while not _health_ok(server):
        assert time.monotonic() < deadline, "still refusing requests after the streams closed"
        time.sleep(0.2)
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert server.proc.poll() is None
